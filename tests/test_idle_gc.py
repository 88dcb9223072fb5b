"""kvdoctor.idle_gc: the sidecar's garbage collections run between relayed requests, not in them."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from kvdoctor.idle_gc import IdleCollector


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def gc_state():
    """Thresholds and the automatic collector as they were, whatever a test does."""
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if was else gc.disable)()


def _allocate(n: int) -> list:
    return [[] for _ in range(n)]  # n tracked containers: the young count goes up by n


def test_a_collection_due_waits_while_a_request_is_in_flight_and_runs_in_the_gap(gc_state):
    busy = [True]
    c = IdleCollector(lambda: busy[0], force_factor=1000)
    gc.disable()
    gc.set_threshold(100, 10, 10)
    keep = _allocate(500)
    assert c.collect_if_due() is None and gc.get_count()[0] >= 500  # in flight: not now
    busy[0] = False
    assert c.collect_if_due() == 0 and gc.get_count()[0] < 100
    assert c.collect_if_due() is None  # nothing due any more
    assert c.collections == [1, 0, 0] and c.forced == 0
    del keep


def test_far_past_the_threshold_it_collects_while_busy_and_a_full_collection_only_far_past_its_own(gc_state):
    busy = [True]
    c = IdleCollector(lambda: busy[0], force_factor=2)
    gc.disable()
    gc.set_threshold(100, 1, 5)
    keep: list = []

    def step() -> int | None:
        keep.append(_allocate(300))  # 3x the young threshold: past the force factor
        return c.collect_if_due()

    gens = [step() for _ in range(18)]  # a middle collection every third
    assert set(gens) == {0, 1} and c.forced == 18  # young and middle while busy...
    assert gc.get_count()[2] > 5  # ...though a full collection is due
    busy[0] = False
    assert step() == 2  # it runs in the first gap
    busy[0] = True
    gens = [step() for _ in range(40)]
    assert 2 in gens  # and, with no gap, once far past its own threshold (cycles never stay for ever)


def test_the_timer_collects_garbage_cycles_and_close_gives_the_automatic_collector_back(gc_state):
    async def main() -> tuple[bool, bool, bool]:
        gc.enable()
        gc.set_threshold(100, 10, 10)
        c = IdleCollector(lambda: False, tick_s=0.01)
        c.start(asyncio.get_running_loop())
        off = not gc.isenabled()
        cycle = _Cycle()
        ref = weakref.ref(cycle)
        del cycle
        _allocate(300)
        for _ in range(100):
            if ref() is None:
                break
            await asyncio.sleep(0.01)
        c.close()
        return off, ref() is None, gc.isenabled()

    off, collected, back_on = asyncio.run(main())
    assert off and collected and back_on
