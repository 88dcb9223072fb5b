"""The segment index: a time range reads only the segments it meets, and reads exactly what a
whole load cut to the range holds."""
from __future__ import annotations

import shutil

import numpy as np
import orjson
import pytest

import kvdoctor
from kvdoctor.capture import CaptureWriter, time_slice
from kvdoctor.capture.segment_index import INDEX_NAME, read_index
from kvdoctor.capture.segment_reader import segments
from kvdoctor.model import CaptureMeta, EngineSample, Event, GpuSample, RequestRecord

T0 = 1_767_000_000.0


def _write(folder, n=600, segment_bytes=8_000, close=True):
    """Requests over 10 minutes (finishing up to 20 s after arriving, so the writer's finish order
    differs from arrival order), a GPU and an engine sample and an event every 2 s, in small segments."""
    rng = np.random.default_rng(1)
    arrival = T0 + np.sort(rng.uniform(0, 600, n))
    dur = rng.uniform(0.1, 20, n)
    w = CaptureWriter(folder, CaptureMeta(clock="unix", engine="vllm"), segment_bytes=segment_bytes)
    order = np.argsort(arrival + dur)  # written as they finish
    for i in order:
        w.write(RequestRecord(request_id=f"r{i}", arrival_s=float(arrival[i]), ttft_s=0.05,
                              finish_s=float(arrival[i] + dur[i]), prompt_tokens=100, output_tokens=20))
    for k in range(300):
        t = T0 + 2 * k
        w.write(GpuSample(time_s=t, gpu_index=0, mem_used_bytes=k, mem_total_bytes=1000))
        w.write(EngineSample(time_s=t, engine="vllm", values={"kv_usage_frac": k / 300}))
        w.write(Event(time_s=t, kind="note", detail={"k": k}))
    if close:
        w.close()
    else:
        w.flush()
    return w


def _same(a, b):
    ra, rb = a.requests, b.requests
    ka = np.argsort(ra.num("arrival_s"), kind="stable")
    kb = np.argsort(rb.num("arrival_s"), kind="stable")
    assert len(ra) == len(rb)
    for col in ("arrival_s", "finish_s", "ttft_s", "e2e_s"):
        np.testing.assert_array_equal(ra.num(col)[ka], rb.num(col)[kb])
    np.testing.assert_array_equal(np.sort(a.gpu.num("time_s")), np.sort(b.gpu.num("time_s")))
    np.testing.assert_array_equal(np.sort(a.engine.time_s), np.sort(b.engine.time_s))
    assert sorted(e["time_s"] for e in a.events) == sorted(e["time_s"] for e in b.events)


def test_writer_indexes_every_closed_segment_with_its_records_span(tmp_path):
    _write(tmp_path)
    idx = read_index(tmp_path)
    segs = [p for k in ("requests", "gpu", "host", "engine", "events") for p in segments(tmp_path, k)]
    assert len(segs) > 10 and {p.name for p in segs} == set(idx)
    for p in segs:
        times = []
        for line in p.read_bytes().splitlines():
            rec = orjson.loads(line)
            times += [rec[f] for f in ("arrival_s", "finish_s", "time_s") if f in rec]
        assert idx[p.name] == (min(times), max(times)), p.name


@pytest.mark.parametrize("lo_s, hi_s", [(100, 160), (0, 30), (580, 650), (None, 200), (300, None), (-50, -10)])
def test_a_range_reads_what_a_whole_load_cut_to_it_holds(tmp_path, lo_s, hi_s):
    _write(tmp_path)
    lo = None if lo_s is None else T0 + lo_s
    hi = None if hi_s is None else T0 + hi_s
    _same(kvdoctor.load(tmp_path, since_s=lo, until_s=hi), time_slice(kvdoctor.load(tmp_path), lo, hi))


def test_segments_outside_the_range_are_not_read(tmp_path):
    """Overwrite every segment wholly outside the range with garbage of the same size (the index
    still vouches for it): the ranged load neither reads nor warns about them."""
    good = tmp_path / "good"
    _write(good)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    lo, hi = T0 + 200, T0 + 260
    outside = [name for name, (a, b) in read_index(bad).items() if b < lo or a > hi]
    assert len(outside) > 5
    for name in outside:
        p = bad / name
        p.write_bytes(b"x" * (p.stat().st_size - 1) + b"\n")
    cap = kvdoctor.load(bad, since_s=lo, until_s=hi)
    assert not cap.warnings, cap.warnings
    _same(cap, time_slice(kvdoctor.load(good), lo, hi))
    with pytest.raises(kvdoctor.errors.InputError):
        kvdoctor.load(bad)  # read whole, the garbage is there


def test_the_index_only_ever_saves_work(tmp_path):
    """A segment that changed size since it was indexed, a torn index line and the open segment
    of a running writer (not indexed yet) are read in full."""
    w = _write(tmp_path, close=False)
    lo, hi = T0 + 300, T0 + 330
    assert len(read_index(tmp_path)) < sum(len(segments(tmp_path, k)) for k in ("requests", "gpu", "engine", "events"))
    _same(kvdoctor.load(tmp_path, since_s=lo, until_s=hi), time_slice(kvdoctor.load(tmp_path), lo, hi))
    # a record appended by hand to an indexed segment outside the range, inside it by its time
    first = segments(tmp_path, "requests")[0]
    with open(first, "ab") as f:
        f.write(orjson.dumps({"request_id": "late", "arrival_s": T0 + 310, "finish_s": T0 + 311}) + b"\n")
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(b'{"segment": "requests-000002.jsonl", "bytes": 1, "min_s": 0, "ma')  # torn
    cap = kvdoctor.load(tmp_path, since_s=lo, until_s=hi)
    assert "late" in cap.requests.table.column("request_id").to_pylist()
    _same(cap, time_slice(kvdoctor.load(tmp_path), lo, hi))
    w.close()


def test_relative_ranges_resolve_against_the_captures_own_span(tmp_path, run_cli):
    """`diagnose --since 2m` (before the capture's end) and `--until +1m` (after its start): the
    same output as on the whole capture cut by hand, the span read from the index."""
    _write(tmp_path / "cap")
    whole = kvdoctor.load(tmp_path / "cap")
    r = run_cli("export", str(tmp_path / "cap"), "--what", "requests", "--since", "2m", "--format", "csv",
                "-o", str(tmp_path / "last.csv"))
    assert r.returncode == 0, r.stderr
    want = time_slice(whole, whole.end_s - 120, None)
    assert len((tmp_path / "last.csv").read_text().splitlines()) == len(want.requests) + 1
    r = run_cli("export", str(tmp_path / "cap"), "--what", "requests", "--until", "+1m", "--format", "csv",
                "-o", str(tmp_path / "first.csv"))
    assert r.returncode == 0, r.stderr
    want = time_slice(whole, None, whole.start_s + 60)
    assert len((tmp_path / "first.csv").read_text().splitlines()) == len(want.requests) + 1
