import csv
import io
import json

import pyarrow.parquet as pq

from conftest import CASES, ROOT


def test_export_requests_csv_matches_capture(run_cli):
    r = run_cli("export", CASES / "multi-turn", "--what", "requests", "--format", "csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 400
    assert {"request_id", "ttft_s", "tpot_s", "session_id", "turn"} <= set(rows[0])


def test_export_jsonl_and_parquet(run_cli, tmp_path):
    r = run_cli("export", CASES / "concurrency", "--what", "gpu", "--format", "jsonl")
    first = json.loads(r.stdout.splitlines()[0])
    assert first["gpu_index"] == 0 and first["mem_total_bytes"] == 80 * 2**30
    out = tmp_path / "e.parquet"
    r = run_cli("export", CASES / "preemption", "--what", "engine", "--format", "parquet", "-o", out)
    assert r.returncode == 0, r.stderr
    t = pq.read_table(out)
    assert "kv_usage_frac" in t.column_names and t.num_rows > 10


def test_export_lists_as_json_in_csv(run_cli):
    r = run_cli("export", ROOT / "samples" / "mooncake-conversation", "--format", "csv")
    row = next(csv.DictReader(io.StringIO(r.stdout)))
    assert json.loads(row["prefix_block_hashes"])  # a list survives the CSV cell
