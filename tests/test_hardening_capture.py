"""Hardening of the capture (issue 14, points 1, 2 and 9): what the writer writes the reader
reads, whatever the size of one record; a full or read-only disk (a real small tmpfs) never
leaves a torn record mid-file; torn or absurd lines are skipped with a located warning."""
import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import kvdoctor
from kvdoctor.capture import CaptureWriter
from kvdoctor.capture.writer import MAX_LIST_ITEMS
from kvdoctor.model import CaptureMeta, Event, RequestRecord


# -- 1. one large record ----------------------------------------------------------------------
def test_a_multi_megabyte_record_is_read_back(tmp_path):
    """--store-text with a 3 MB prompt: the line is larger than Arrow's default block."""
    prompt = "why is the sky blue? " * 150_000
    with CaptureWriter(tmp_path / "c", CaptureMeta(text_stored=True)) as w:
        w.write(RequestRecord(request_id="a", arrival_s=1.0, ttft_s=0.1))
        w.write_dict("requests", {"request_id": "big", "arrival_s": 2.0, "ttft_s": 0.2, "prompt_text": prompt})
        w.write(RequestRecord(request_id="c", arrival_s=3.0, ttft_s=0.3))
    assert (tmp_path / "c" / "requests-000001.jsonl").stat().st_size > 3_000_000
    cap = kvdoctor.load(tmp_path / "c")
    assert cap.requests.strings("request_id") == ["a", "big", "c"] and cap.warnings == []


def test_per_request_lists_are_capped_where_written_with_full_summaries(tmp_path):
    """A 500k-ITL request and a ~50 MB prompt's prefix-block hashes: capped, summaries from all."""
    itl = [0.01] * 499_999 + [2.5]
    hashes = list(range(200_000))
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="long", arrival_s=1.0, ttft_s=0.1, itl_s=itl, prefix_block_hashes=hashes,
                              prefix_block_tokens=64))
    line = (tmp_path / "c" / "requests-000001.jsonl").read_bytes()
    assert len(line) < 1_000_000
    raw = orjson.loads(line)
    assert len(raw["itl_s"]) == MAX_LIST_ITEMS and raw["itl_count"] == 500_000
    assert raw["itl_max_s"] == 2.5  # the slow gap lies beyond the cap: the summary saw it
    assert raw["prefix_block_hashes"] == hashes[:MAX_LIST_ITEMS] and raw["prefix_blocks_count"] == 200_000
    cap = kvdoctor.load(tmp_path / "c")
    assert cap.requests.num("itl_max_s").tolist() == [2.5]
    offsets, _values = cap.requests.lists("prefix_block_hashes")
    assert offsets[-1] == MAX_LIST_ITEMS


def test_unsigned_64_bit_hash_ids_stay_readable_and_distinct(tmp_path):
    top = (1 << 64) - 1
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="a", prefix_block_hashes=[top, 7], prefix_block_tokens=512))
        w.write(RequestRecord(request_id="b", prefix_block_hashes=[top, 8], prefix_block_tokens=512))
        w.write(RequestRecord(request_id="c", prefix_block_hashes=[(1 << 63) - 1], prefix_block_tokens=512))
    cap = kvdoctor.load(tmp_path / "c")
    offsets, values = cap.requests.lists("prefix_block_hashes")
    assert values[0] == values[2] and values[1] != values[3]  # equal ids equal, distinct ids distinct
    assert values[0] != values[4]


def _mooncake(tmp_path: Path, hash_ids) -> tuple[object, Path]:
    from kvdoctor.cli import cli

    src = tmp_path / "trace.jsonl"
    src.write_text(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}) + "\n"
                   + json.dumps({"timestamp": 5, "input_length": 1024, "output_length": 8, "hash_ids": hash_ids}) + "\n")
    out = tmp_path / "cap"
    return CliRunner().invoke(cli, ["import", "mooncake", str(src), "-o", str(out)]), out


def test_mooncake_hash_id_2_64_minus_1_imports_and_reads(tmp_path):
    res, out = _mooncake(tmp_path, [1, (1 << 64) - 1])
    assert res.exit_code == 0, res.output
    cap = kvdoctor.load(out)
    assert len(cap.requests) == 2


def test_mooncake_hash_id_beyond_64_bits_is_a_located_error(tmp_path):
    res, _ = _mooncake(tmp_path, [1, 1 << 64])
    assert res.exit_code == 2, res.output
    assert "trace.jsonl: line 2: field hash_ids: expected a list of 64-bit integers" in res.output


def test_a_number_beyond_64_bits_never_stops_the_writer(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(Event(time_s=1.0, kind="config", detail={"n_ctx": 10 ** 24, "big": 1e300}))
    assert kvdoctor.load(tmp_path / "c").events[0]["detail"]["n_ctx"] == pytest.approx(1e24)


# -- 9. absurd nesting --------------------------------------------------------------------------
def test_requests_nested_20000_deep_is_skipped_not_a_crash(tmp_path):
    """Arrow's JSON parser recurses without bound (a segfault): the reader checks depth first.
    Run in a child process, so that a crash fails this test rather than the whole run."""
    cap = tmp_path / "c"
    with CaptureWriter(cap) as w:
        w.write(RequestRecord(request_id="a", ttft_s=0.1))
    with open(cap / "requests-000001.jsonl", "ab") as f:
        f.write(b'{"request_id": "deep", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}\n")
        f.write(b'{"request_id": "b", "ttft_s": 0.2}\n')
    code = textwrap.dedent(f"""
        import kvdoctor
        cap = kvdoctor.load({str(cap)!r})
        print(cap.requests.strings("request_id"))
        print(cap.warnings)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "['a', 'b']" in res.stdout and "requests-000001.jsonl: line 2: " in res.stdout and "skipped" in res.stdout


# -- 2. full disk, read-only disk ---------------------------------------------------------------
@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "64k"):
    """A real filesystem of ``size`` bytes (needs root and mount; skipped elsewhere)."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> Path:
    """Take every free byte of the filesystem with a filler file; returns it."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    with open(filler, "ab", buffering=0) as f:  # the last partial page too
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")
    return filler


def test_full_disk_drops_whole_records_counts_them_and_recovers(tmp_path):
    with small_tmpfs(tmp_path / "fs") as fs:
        w = CaptureWriter(fs / "cap", drop_on_error=True, fsync_every_s=0)
        for i in range(5):
            w.write(RequestRecord(request_id=f"before-{i}", arrival_s=float(i), ttft_s=0.1))
        filler = _fill(fs)
        for i in range(50):  # records of varied sizes: some would fit partly (a short write)
            w.write(RequestRecord(request_id=f"full-{i}" + "x" * (i * 37), arrival_s=10.0 + i, ttft_s=0.1))
        assert w.dropped["requests"] > 0 and w.last_error
        filler.unlink()  # space returns
        for i in range(5):
            w.write(RequestRecord(request_id=f"after-{i}", arrival_s=100.0 + i, ttft_s=0.1))
        w.close()
        cap = kvdoctor.load(fs / "cap")
        ids = cap.requests.strings("request_id")
        assert cap.warnings == []  # no torn line anywhere
        assert ids[:5] == [f"before-{i}" for i in range(5)] and ids[-5:] == [f"after-{i}" for i in range(5)]
        assert len(ids) == w.counts["requests"] == 10 + 50 - w.dropped["requests"]
        dropped = [e for e in cap.events if e["kind"] == "capture-dropped"]
        assert len(dropped) == 1 and dropped[0]["detail"]["by_kind"] == {"requests": w.dropped["requests"]}


def test_full_disk_in_raise_mode_rolls_back_then_raises(tmp_path):
    """Import writes with errors raised: still no fragment left in the segment."""
    with small_tmpfs(tmp_path / "fs") as fs:
        w = CaptureWriter(fs / "cap", fsync_every_s=0)
        w.write(RequestRecord(request_id="a", ttft_s=0.1))
        filler = _fill(fs)
        with pytest.raises(OSError):
            w.write(RequestRecord(request_id="b" * 5000, ttft_s=0.1))
        seg = fs / "cap" / "requests-000001.jsonl"
        assert seg.read_bytes().endswith(b"\n") and seg.read_bytes().count(b"\n") == 1
        filler.unlink()
        w.close()


def test_read_only_capture_dir_drops_and_counts_without_raising(tmp_path):
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        (fs / "cap").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        w = CaptureWriter(fs / "cap", drop_on_error=True)  # meta.json cannot be written: kept for later
        w.write(RequestRecord(request_id="a"))
        w.source_status("scrape", False, "server down")
        w.close()
        assert w.dropped["requests"] == 1 and "Read-only" in w.last_error
        subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)
        w2 = CaptureWriter(fs / "cap", drop_on_error=True)  # writable again: everything works
        w2.write(RequestRecord(request_id="b"))
        w2.close()
        assert kvdoctor.load(fs / "cap").requests.strings("request_id") == ["b"]


def test_reader_keeps_the_record_an_old_writer_glued_to_a_torn_fragment(tmp_path):
    """What writers before the rollback left after a full disk: a fragment, then whole records."""
    seg_dir = tmp_path / "c"
    with CaptureWriter(seg_dir) as w:
        w.write(RequestRecord(request_id="a", ttft_s=0.1))
    with open(seg_dir / "requests-000001.jsonl", "ab") as f:
        f.write(b'{"request_id": "torn", "ttf')
        f.write(b'{"request_id": "b", "ttft_s": 0.2}\n{"request_id": "c", "ttft_s": 0.3}\n')
    cap = kvdoctor.load(seg_dir)
    assert cap.requests.strings("request_id") == ["a", "b", "c"]
    assert any("requests-000001.jsonl: line 2: torn record" in w for w in cap.warnings)


def test_torn_lines_in_event_streams_are_skipped_too(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(Event(time_s=1.0, kind="note"))
    with open(tmp_path / "c" / "events-000001.jsonl", "ab") as f:
        f.write(b'{"time_s": 2.0, "ki\n{"time_s": 3.0, "kind": "note"}\n')
    cap = kvdoctor.load(tmp_path / "c")
    assert [e["time_s"] for e in cap.events] == [1.0, 3.0]
    assert any("events-000001.jsonl: line 2" in w for w in cap.warnings)


# -- 7. the writer's own thread ------------------------------------------------------------------------
def test_queued_writer_never_blocks_the_caller_on_a_stalled_disk(tmp_path):
    """The disk stalls (the writer's lock held, as during a long fsync): writes return at once,
    what does not fit the queue is dropped and counted, the rest is written in order."""
    import time

    from kvdoctor.capture.queued import QueuedWriter

    dropped = []
    qw = QueuedWriter(CaptureWriter(tmp_path / "c"), max_queue=10, on_drop=lambda k, n: dropped.append((k, n)))
    qw.writer._lock.acquire()
    try:
        t0 = time.monotonic()
        for i in range(100):
            qw.write(RequestRecord(request_id=str(i), ttft_s=0.1))
        assert time.monotonic() - t0 < 0.5
    finally:
        qw.writer._lock.release()
    qw.close()
    lost = qw.queue_dropped["requests"]
    assert 85 <= lost <= 90 and sum(n for _, n in dropped) == lost
    ids = kvdoctor.load(tmp_path / "c").requests.strings("request_id")
    assert len(ids) == 100 - lost and ids == sorted(ids, key=int)  # in order, none torn
