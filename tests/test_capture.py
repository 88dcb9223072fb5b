"""Capture format: round trip, crash safety (a real SIGKILL mid-write), torn lines, rotation."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import orjson
import pytest

import kvdoctor
from kvdoctor.capture import CaptureWriter
from kvdoctor.errors import InputError
from kvdoctor.model import CaptureMeta, EngineSample, Event, GpuSample, RequestRecord, derive_request


def test_round_trip_and_derivation(tmp_path):
    with CaptureWriter(tmp_path / "c", CaptureMeta(engine="vllm", model="m")) as w:
        w.write(RequestRecord(request_id="a", arrival_s=10.0, first_token_s=10.25, finish_s=12.25, output_tokens=21))
        w.write(RequestRecord(request_id="b", arrival_s=11.0, ttft_s=0.5, e2e_s=1.5, output_tokens=11, error="boom"))
        w.write(GpuSample(time_s=10.5, gpu_index=0, mem_used_bytes=5, mem_total_bytes=10))
        w.write(EngineSample(time_s=10.5, engine="vllm", values={"kv_usage_frac": 0.5},
                             histograms={"ttft_seconds": {"le": [0.1, 1.0], "cum": [1, 2], "sum": 0.6, "count": 2}}))
        w.write(Event(time_s=11.0, kind="server-restart"))
    cap = kvdoctor.load(tmp_path / "c")
    assert cap.meta.engine == "vllm" and cap.warnings == []
    np.testing.assert_allclose(cap.requests.num("ttft_s"), [0.25, 0.5])
    np.testing.assert_allclose(cap.requests.num("e2e_s"), [2.25, 1.5])
    # TPOT = decode time / (output_tokens - 1)
    np.testing.assert_allclose(cap.requests.num("tpot_s"), [2.0 / 20, 1.0 / 10])
    np.testing.assert_allclose(cap.requests.num("finish_s"), [12.25, 12.5])
    assert cap.requests.strings("status") == ["ok", "error"]
    assert cap.gpu.num("mem_used_bytes").tolist() == [5.0]
    assert cap.engine.values["kv_usage_frac"].tolist() == [0.5]
    assert cap.events[0]["kind"] == "server-restart"


def test_engine_identity_round_trips_through_meta(tmp_path):
    """engine, engine_version and model: written at start, changed later (as attach does once the
    server is identified), read back; a capture written before engine_version existed reads as None."""
    with CaptureWriter(tmp_path / "c", CaptureMeta(origin="attach")) as w:
        w.write(RequestRecord(request_id="a", arrival_s=1.0, ttft_s=0.1))
        w.update_meta(engine="vllm", engine_version="0.32.0", model="smollm2")
    meta = kvdoctor.load(tmp_path / "c").meta
    assert (meta.engine, meta.engine_version, meta.model) == ("vllm", "0.32.0", "smollm2")
    raw = json.loads((tmp_path / "c" / "meta.json").read_text())
    del raw["engine_version"]
    (tmp_path / "c" / "meta.json").write_text(json.dumps(raw))
    assert kvdoctor.load(tmp_path / "c").meta.engine_version is None
    raw["engine_version"] = 32
    (tmp_path / "c" / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="field engine_version: expected str, got int"):
        kvdoctor.load(tmp_path / "c")


def _every_field_set(record: type, i: int = 0):
    """An instance of a record dataclass with every field set to a value of its declared type (the
    declaration in kvdoctor.model is the one list of fields: a field added there is covered here)."""
    import dataclasses

    values = {"str": lambda name: f"{name}-{i}", "float": lambda name: 1.25 + i, "int": lambda name: 3 + i,
              "bool": lambda name: True, "list[float]": lambda name: [0.5 + i, 0.25], "list[int]": lambda name: [7 + i, 8],
              "dict[str, float]": lambda name: {"kv_usage_frac": 0.5 + i / 10, "requests_running": 2.0 + i},
              "dict[str, Any]": lambda name: {"reason": f"r{i}", "n": i},
              "dict[str, dict[str, Any]]": lambda name: {"ttft_seconds": {"le": [0.1, 1.0], "cum": [1 + i, 2 + i],
                                                                          "sum": 0.5, "count": 2 + i}}}
    kw = {}
    for f in dataclasses.fields(record):
        kw[f.name] = values[f.type.split(" | ")[0]](f.name)
    return record(**kw)


def test_every_field_written_is_read_back(tmp_path):
    """Each record kind with every declared field set, written and loaded: every field comes back
    with its value (text, written only when asked, from the raw reader: it is never a column), and
    the writer writes no field the records do not declare, the counts of capped lists included
    (itl_count, prefix_blocks_count: once written, dropped on read)."""
    import dataclasses
    import math

    from kvdoctor.capture import read_dicts
    from kvdoctor.capture.columns import SCHEMAS
    from kvdoctor.capture.writer import MAX_LIST_ITEMS
    from kvdoctor.model import KINDS, RECORD_TYPES, to_dict

    for kind in SCHEMAS:  # the columns are the declared fields, in order, less those never loaded
        fields = [f.name for f in dataclasses.fields(RECORD_TYPES[kind]) if f.metadata.get("column", "auto") is not None]
        assert SCHEMAS[kind].names == fields, kind
    written = {kind: [_every_field_set(RECORD_TYPES[kind], i) for i in range(2)] for kind in KINDS}
    long = dataclasses.replace(written["requests"][0], request_id="long", itl_s=[0.01] * (MAX_LIST_ITEMS + 5),
                               itl_count=None, prefix_block_hashes=list(range(MAX_LIST_ITEMS + 3)), prefix_blocks_count=None)
    with CaptureWriter(tmp_path / "c", CaptureMeta(text_stored=True)) as w:
        for records in written.values():
            for r in records:
                w.write(r)
        w.write(long)
    cap = kvdoctor.load(tmp_path / "c")
    assert cap.warnings == []
    for kind in KINDS:
        raw = read_dicts(tmp_path / "c", kind, [])
        declared = {f.name for f in dataclasses.fields(RECORD_TYPES[kind])}
        for row in raw:
            assert set(row) <= declared, f"{kind}: written but not declared: {set(row) - declared}"
        for rec, row in zip(written[kind], raw):
            assert row == to_dict(rec), kind  # every field set was written as it was
    assert raw_long(tmp_path)["itl_count"] == MAX_LIST_ITEMS + 5 and raw_long(tmp_path)["prefix_blocks_count"] == MAX_LIST_ITEMS + 3
    # and read back through the columns the analysis uses
    for kind, cols in (("requests", cap.requests), ("gpu", cap.gpu), ("host", cap.host)):
        for f in dataclasses.fields(RECORD_TYPES[kind]):
            if f.metadata.get("column", "auto") is None:
                continue
            want = [getattr(r, f.name) for r in written[kind]]
            kind_of = f.type.split(" | ")[0] if f.metadata.get("column", "auto") == "auto" else f.metadata["column"]
            if kind_of == "str":
                got = cols.strings(f.name)[:2]
            elif kind_of.startswith("list"):
                offsets, values = cols.lists(f.name)
                got = [values[offsets[j]:offsets[j + 1]].tolist() for j in range(2)]
            else:
                got = cols.num(f.name)[:2].tolist()
                want = [float(x) for x in want]
            assert got == want, (kind, f.name, got, want)
    assert cap.requests.num("itl_count").tolist()[2] == MAX_LIST_ITEMS + 5
    assert cap.requests.num("prefix_blocks_count").tolist()[2] == MAX_LIST_ITEMS + 3
    assert [e["detail"] for e in cap.events] == [r.detail for r in written["events"]]
    assert cap.engine.time_s.tolist() == [r.time_s for r in written["engine"]]
    for name in written["engine"][0].values:
        assert cap.engine.values[name].tolist() == [r.values[name] for r in written["engine"]]
    assert cap.engine.servers == [r.server for r in written["engine"]]
    assert [h[1] for h in cap.engine.histograms["ttft_seconds"]] == [r.histograms["ttft_seconds"] for r in written["engine"]]
    assert not any(math.isnan(x) for x in cap.requests.num("itl_count")[:2])


def raw_long(tmp_path):
    """The capped request as written."""
    return next(orjson.loads(ln) for ln in (tmp_path / "c" / "requests-000001.jsonl").read_bytes().splitlines()
                if b'"long"' in ln)


def test_derive_request_never_overwrites():
    r = derive_request(RequestRecord(request_id="x", arrival_s=0, first_token_s=1, ttft_s=0.7, itl_s=[0.1, 0.3]))
    assert r.ttft_s == 0.7 and r.itl_max_s == 0.3 and r.tpot_s == pytest.approx(0.2)


def test_no_text_stored_by_default(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="a", prompt_tokens=3))
    raw = (tmp_path / "c" / "requests-000001.jsonl").read_text()
    assert "prompt_text" not in raw and json.loads((tmp_path / "c" / "meta.json").read_text())["text_stored"] is False


def test_sigkill_mid_write_leaves_every_complete_record(tmp_path):
    """A real writer process is killed with SIGKILL while writing as fast as it can."""
    folder = tmp_path / "c"
    code = textwrap.dedent(f"""
        import sys
        from kvdoctor.capture import CaptureWriter
        from kvdoctor.model import RequestRecord
        w = CaptureWriter({str(folder)!r}, segment_bytes=1 << 16)
        i = 0
        while True:
            w.write(RequestRecord(request_id=str(i), arrival_s=float(i), ttft_s=0.1, itl_s=[0.01] * 50))
            i += 1
            if i == 2000:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cap = kvdoctor.load(folder)
    n = len(cap.requests)
    assert n >= 2000
    ids = [int(x) for x in cap.requests.strings("request_id")]
    assert sorted(ids) == list(range(n)), "records lost or duplicated"
    assert len(list(folder.glob("requests-*.jsonl"))) > 1, "expected rotation to several segments"
    for w in cap.warnings:
        assert "torn last line" in w


def test_torn_last_line_is_reported_not_fatal(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="a", ttft_s=0.1))
    with open(tmp_path / "c" / "requests-000001.jsonl", "ab") as f:
        f.write(b'{"request_id": "b", "ttft')
    cap = kvdoctor.load(tmp_path / "c")
    assert len(cap.requests) == 1
    assert "line 2: torn last line" in cap.warnings[0]


def test_bad_line_in_the_middle_is_skipped_with_file_and_line(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="a"))
    seg = tmp_path / "c" / "requests-000001.jsonl"
    seg.write_bytes(seg.read_bytes() + b"not json\n" + b'{"request_id": "c"}\n')
    cap = kvdoctor.load(tmp_path / "c")
    assert cap.requests.strings("request_id") == ["a", "c"]
    assert any("requests-000001.jsonl: line 2: not a whole JSON object" in w for w in cap.warnings)


def test_segment_of_nothing_but_garbage_is_an_error(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "requests-000001.jsonl").write_bytes(b"not json\nnor this\n")
    with pytest.raises(InputError, match=r"requests-000001.jsonl: no line is a capture record"):
        kvdoctor.load(tmp_path / "c")


def test_budget_drops_oldest_segments(tmp_path):
    w = CaptureWriter(tmp_path / "c", segment_bytes=4096, max_bytes=20_000)
    for i in range(2000):
        w.write(RequestRecord(request_id=str(i), arrival_s=float(i)))
    w.close()
    total = sum(p.stat().st_size for p in (tmp_path / "c").glob("*.jsonl"))
    assert total <= 20_000 + 4096
    ids = [int(x) for x in kvdoctor.load(tmp_path / "c").requests.strings("request_id")]
    assert ids[-1] == 1999 and ids[0] > 0  # newest kept, oldest dropped


def test_not_a_capture(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(InputError, match="a capture is a folder"):
        kvdoctor.load(tmp_path / "x.json")
    with pytest.raises(InputError, match="no such capture"):
        kvdoctor.load(tmp_path / "missing")


def test_time_slice(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        for i in range(10):
            w.write(RequestRecord(request_id=str(i), arrival_s=100.0 + i, ttft_s=0.1))
    cap = kvdoctor.load(tmp_path / "c", since_s=103, until_s=105)
    assert cap.requests.num("arrival_s").tolist() == [103.0, 104.0, 105.0]
