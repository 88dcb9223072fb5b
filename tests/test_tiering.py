"""Request tiering on two real llama-servers (issue 17): the same mixed-length load through a real
nginx, spread round-robin (samples/tiering-round-robin) and routed by length
(samples/tiering-by-length), kvdoctor's proxy in front of nginx (harness/tiering.py).

`kvdoctor advise` on the round-robin capture predicts what routing by length buys the short
requests; the routed capture measures it. The ground truth is the client's own timings in each
sample's client-timings.jsonl, which kvdoctor never reads."""
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kvdoctor
from kvdoctor.advise import advise
from kvdoctor.cli import cli

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
SPREAD, ROUTED = SAMPLES / "tiering-round-robin", SAMPLES / "tiering-by-length"


def _timings(sample: Path) -> list[dict]:
    return [json.loads(line) for line in (sample / "client-timings.jsonl").read_text().splitlines()]


def short_ttft_s(sample: Path) -> tuple[np.ndarray, np.ndarray]:
    """Short requests' TTFT from the client's clock: (those that arrived while a long prompt was
    in prefill, i.e. between its send and its first token; the others)."""
    rows = _timings(sample)
    prefills = [(r["send_s"], r["first_token_s"] or r["finish_s"]) for r in rows if r["session_id"].startswith("long")]
    behind, clear = [], []
    for r in rows:
        if r["session_id"].startswith("short") and r["ttft_s"] is not None:
            (behind if any(a < r["send_s"] < b for a, b in prefills) else clear).append(r["ttft_s"])
    return np.array(behind), np.array(clear)


def test_advise_predicts_what_routing_by_length_bought():
    """advise on the round-robin run: tiering worth it, split between the two prompt sizes, and a
    short-TTFT change whose low end (short requests get the TTFT of those no long prefill
    delayed) is what the routed run measured for the short requests that had been delayed."""
    t = advise(kvdoctor.load(SPREAD))["tiering"]
    assert t["verdict"] == "worth it"
    rows = _timings(SPREAD)
    longest_short = max(r["prompt_tokens"] or 0 for r in rows if r["session_id"].startswith("short"))
    shortest_long = min(r["prompt_tokens"] or 1e9 for r in rows if r["session_id"].startswith("long"))
    assert longest_short < t["split_tokens"] <= shortest_long
    assert t["long_frac"] == pytest.approx(0.2)
    tokens = {k: sum(r["prompt_tokens"] or 0 for r in rows if r["session_id"].startswith(k)) for k in ("short", "long")}
    assert t["long_prompt_token_share"] == pytest.approx(tokens["long"] / (tokens["long"] + tokens["short"]), abs=0.02)

    behind, clear = short_ttft_s(SPREAD)
    routed_behind, routed_clear = short_ttft_s(ROUTED)
    after = np.concatenate([routed_behind, routed_clear])  # on their own pool, no long one delays them
    measured = float(np.median(after) / np.median(behind) - 1)
    low, high = t["short_ttft_change"]
    assert low - 0.05 <= measured <= high, (measured, t["short_ttft_change"])
    assert measured - low <= 0.05  # near the low end: the assumption held
    # and that assumption itself: on their own pool short requests start as fast as the unblocked
    # ones did on the shared pools, within 1.5x (one server now takes all of them)
    assert np.median(after) <= 1.5 * np.median(clear)

    # TPOT the same way: short decodes that overlapped a long request in flight, then on their own pool
    flights = [(r["send_s"], r["finish_s"]) for r in rows if r["session_id"].startswith("long")]
    overlapped = [r["tpot_s"] for r in rows if r["session_id"].startswith("short") and r["tpot_s"]
                  and any(a < r["finish_s"] and b > r["first_token_s"] for a, b in flights)]
    routed_tpot = [r["tpot_s"] for r in _timings(ROUTED) if r["session_id"].startswith("short") and r["tpot_s"]]
    measured = float(np.median(routed_tpot) / np.median(overlapped) - 1)
    low, high = t["short_tpot_change"]
    assert low - 0.05 <= measured <= high + 0.05, (measured, t["short_tpot_change"])


def test_compare_shows_the_trade_off_routing_made():
    """compare round-robin -> by length: head-of-line blocking resolved and the median TTFT far
    lower, while the long pool (every long prefill on one server) is where the cost went."""
    res = CliRunner().invoke(cli, ["compare", str(SPREAD), str(ROUTED), "--format", "json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    status = {r["rule"]: r["status"] for r in d["rules"]}
    assert status["long-prompt-hol-blocking"] == "resolved"
    sig = {s["name"]: s for s in d["signals"]}
    assert sig["ttft_p50_s"]["rel"] < -0.5
    assert status["prefill-decode-interference"] in ("new", "unchanged", "worse")
    # the cost, from the client's clock: on the long pool every long decode can meet another
    # long prompt's whole prefill (~6 s over 16 tokens), so the long requests' TPOT tail grows;
    # the short ones' does not
    rows = {s: _timings(s) for s in (SPREAD, ROUTED)}

    def tpot_p90(sample, kind):
        return np.percentile([r["tpot_s"] for r in rows[sample] if r["session_id"].startswith(kind) and r["tpot_s"]], 90)
    assert tpot_p90(ROUTED, "long") > 2 * tpot_p90(SPREAD, "long")
    assert tpot_p90(ROUTED, "short") <= 1.1 * tpot_p90(SPREAD, "short")


@pytest.mark.server
@pytest.mark.slow
def test_routing_by_length_on_two_real_servers(tmp_path):
    """Records both runs afresh (two llama-servers behind nginx) and checks the direction: the
    short requests no longer wait behind long prefills. Two thirds of the shipped samples' load
    (8 long prompts and 32 short, 80 s a run; the samples' 2 min runs took ~5 min in all): about
    half the short requests still arrive during a long prefill."""
    from harness import tiering

    spread, routed = tmp_path / "spread", tmp_path / "routed"
    for route, out in (("round-robin", spread), ("by-length", routed)):
        if tiering.record(out, route, n_long=8) is None:
            pytest.skip("nginx is not installed")
    behind, _ = short_ttft_s(spread)
    after = np.concatenate(short_ttft_s(routed))
    assert len(behind) >= 10
    assert np.median(after) < 0.5 * np.median(behind)
    assert advise(kvdoctor.load(spread))["tiering"]["verdict"] == "worth it"
