"""The fault benchmark (benchmarks/faults/): its scoring on hand-made records, its zoo's shape,
docs/accuracy.md current with the committed results, and (server, slow) the quick run on real
llama.cpp and vLLM, asserting only that every run ran and was scored."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults import score as S
from benchmarks.faults import zoo

ROOT = Path(__file__).resolve().parents[1]


def _inc(rule, title="", severity="warning", start=100.0, observation=False, kind="cause"):
    return {"start_s": start, "end_s": start + 60, "severity": severity, "observation": observation, "symptom": "ttft",
            "opened_s": None, "causes": [{"rule": rule, "kind": kind, "title": title, "confidence": 0.8}]}


def _rec(cls, expect, offline, live=None, opened=(), engine="llamacpp", fault_start=90.0, **kw):
    return {"class": cls, "setting": kw.pop("setting", "s"), "engine": engine, "what": "w", "expect": expect,
            "offline": offline, "live": live if live is not None else offline, "opened": list(opened),
            "fault_start_s": fault_start, **kw}


def test_top1_counts_the_most_severe_page_and_skips_objectives():
    rec = _rec("queueing", [["queueing-saturation", ""]], [
        _inc("prefill-bound", start=95.0),
        _inc("objective-ttft", severity="critical", kind="objective", start=96.0),
        {**_inc("queueing-saturation", severity="critical", start=99.0)},
    ])
    j = S.judge(rec)
    assert j["top1"] and j["verdict"] == ("queueing-saturation", "")
    # the same causes with the queue only a warning that starts later: prefill-bound leads
    rec["offline"][2]["severity"] = "warning"
    assert not S.judge(rec)["top1"] and S.judge(rec)["top3"]


def test_the_lead_is_the_incident_kvdoctor_leads_with():
    """Equally severe pages: the surer one leads though it starts later (kvdoctor's own order,
    which its summary's first line reads), on hand-made records and on a real capture's."""
    sure = {**_inc("host-cpu-contention", start=300.0)}
    sure["causes"][0]["confidence"] = 0.9
    rec = _rec("host-contention", [["host-cpu-contention", ""]], [_inc("queueing-saturation", start=100.0), sure])
    assert S.judge(rec)["verdict"] == ("host-cpu-contention", "")

    import kvdoctor
    from benchmarks.faults.runner import _incident_json
    from kvdoctor.diagnosis import diagnose

    diag = diagnose(kvdoctor.load(ROOT / "samples/fault-host-contention"))
    pages = [i for i in diag.incidents if not i.observation]
    assert len(pages) >= 2 and pages[0].start_s > min(i.start_s for i in pages)  # the case the order decides
    shuffled = [_incident_json(i) for i in reversed(diag.incidents)]
    lead = next(c for c in pages[0].causes if c.rule.kind != "objective")
    assert S.ranked_causes(shuffled)[0] == (lead.rule.id, lead.cause)


def test_info_observations_do_not_page_and_controls_need_silence():
    quiet = _rec("control", [], [_inc("tail-latency", severity="info", observation=True)])
    loud = _rec("control", [], [_inc("tail-latency", severity="warning")], setting="t")
    assert S.judge(quiet)["top1"] and not S.judge(loud)["top1"]
    s = S.score([quiet, loud])
    assert s["false_incident_rate"] == 0.5 and s["control_runs"] == 2


def test_cause_words_tell_one_rules_causes_apart():
    rec = _rec("rate-limit", [["error-burst", "rate-limited"]], [_inc("error-burst", "Rate-limited (HTTP 429) by a quota")])
    crash = _rec("crash", [["error-burst", "went down"]], [_inc("error-burst", "Rate-limited (HTTP 429) by a quota")])
    assert S.judge(rec)["top1"] and not S.judge(crash)["top1"]
    s = S.score([rec, crash])
    # the crash run's verdict names the rate-limit class: the confusion matrix says so
    assert s["confusion"]["crash"] == {"rate-limit": 1}
    assert s["per_class"]["rate-limit"]["precision"] == 0.5 and s["per_class"]["crash"]["recall"] == 0.0


def test_onset_offline_and_live_and_disagreements():
    offline = [_inc("queueing-saturation", severity="critical", start=120.0)]
    opened = [{"what": "opened", "t": 150.0, **_inc("queueing-saturation", severity="critical", start=120.0)}]
    rec = _rec("queueing", [["queueing-saturation", ""]], offline, live=[], opened=opened)
    assert S.onset_s(rec) == 30.0 and S.onset_s(rec, "live") == 60.0
    s = S.score([rec])
    assert s["live_offline_agreement"] == 0.0 and s["disagreements"][0]["live"] == S.NONE
    assert s["top1"] == 1.0 and s["live_top1"] == 0.0


def test_runs_whose_fault_did_not_take_effect_are_left_out_and_named():
    bad = _rec("crash", [["error-burst", "went down"]], [], injected=False)
    err = {"class": "queueing", "setting": "x", "engine": "vllm", "what": "w", "expect": [["queueing-saturation", ""]],
           "error": "RuntimeError: boom"}
    good = _rec("crash", [["error-burst", "went down"]], [_inc("error-burst", "The server went down or restarted")])
    s = S.score([bad, err, good])
    assert s["valid_runs"] == 1 and s["top1"] == 1.0 and len(s["invalid"]) == 2
    assert "boom" in " ".join(s["invalid"])


def test_zoo_classes_settings_and_controls():
    classes = {}
    for f in zoo.FAULTS:
        classes.setdefault(f.cls, []).append(f)
    faults = [c for c in classes if c != "control"]  # the 14, slow or disconnecting clients among them
    assert len(faults) >= 14, sorted(faults)
    for cls, fs in classes.items():
        assert len(fs) >= 3, f"{cls}: fewer than three settings"
        # the leak rule holds 10 min: a leak run (~12 min) does not fit the quick run
        assert sum(f.quick for f in fs) == (cls != "memory-leak"), f"{cls}: not one quick setting"
        assert len({f.setting for f in fs}) == len(fs), f"{cls}: settings share a name"
    assert {f.setting for f in classes["control"]} >= {"light", "medium", "heavier", "more-load-within-objectives"}
    assert len({f.id for f in zoo.FAULTS}) == len(zoo.FAULTS)
    quick = zoo.select(quick=True)
    assert {f.cls for f, _ in quick} == {f.cls for f in zoo.FAULTS if f.quick}
    # a crash kills the shared vLLM server: only crashes (each on a fresh server) follow it there
    order = [(e, f.vllm, f.kind) for f, e in zoo.select()]
    for i, (e, key, kind) in enumerate(order):
        if e == zoo.VLLM and kind == "crash":
            assert all(k3 == "crash" for e2, k2, k3 in order[i + 1:] if (e2, k2) == (e, key))


def test_labels_come_from_construction_not_from_kvdoctor():
    """The zoo, which holds the labels, imports nothing of kvdoctor's: a label cannot be a verdict."""
    tree = ast.parse((ROOT / "benchmarks/faults/zoo.py").read_text())
    mods = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in mods if m.startswith("kvdoctor")], mods


def test_accuracy_doc_is_current():
    """docs/accuracy.md is generated from benchmarks/faults/results.json (and NOTES.md)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "faults"))
    from benchmarks.faults.run import DOC, RESULTS, render_doc

    results = json.loads(RESULTS.read_text())
    assert results["score"] == S.score(results["runs"]), "results.json's score is stale: run.py --rescore it"
    assert DOC.read_text() == render_doc(results), "docs/accuracy.md is stale: python benchmarks/faults/run.py " \
                                                  "--rescore benchmarks/faults/results.json --write-docs"


def test_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/faults/run.py"), "--class", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no class" in r.stderr
    bad = tmp_path / "r.json"
    bad.write_text("{")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/faults/run.py"), "--rescore", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(bad) in r.stderr


def test_help_teaches_the_two_sizes():
    # its help once failed with a traceback (a bare % in an option's help)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/faults/run.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr, r.stderr[-500:]
    assert "--quick" in r.stdout and f"{zoo.QUICK_SHARE * 100:.0f}% of each load" in r.stdout


def test_the_quick_run_cuts_loads_but_keeps_conversations_whole():
    """The quick run sends the first QUICK_SHARE of a load (at least QUICK_MIN_REQUESTS); chained
    conversations are kept or dropped whole, so a kept one still grows turn by turn."""
    from harness import loadgen

    shorts = loadgen.short_prompts(100, max_tokens=8, seed=1)
    assert zoo.cut(shorts, 1.0) is shorts
    assert zoo.cut(shorts, 0.4) == shorts[:40]
    assert zoo.cut(shorts[:12], 0.4) == shorts[:zoo.QUICK_MIN_REQUESTS]
    conv = loadgen.conversations(5, 6, max_tokens=8, seed=2)
    kept = zoo.cut(conv, 0.4)
    by_session = {}
    for r in kept:
        by_session.setdefault(r.session_id, []).append(r.turn)
    assert len(by_session) == 2 and all(turns == list(range(6)) for turns in by_session.values())


@pytest.mark.server
@pytest.mark.slow
def test_quick_run_runs_and_scores(tmp_path):
    """The quick run on both real engines: every quick setting ran (no run failed) and was scored.
    No accuracy threshold: the benchmark is a measurement (docs/accuracy.md has the figures)."""
    results = tmp_path / "quick.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/faults/run.py"), "--quick", "--results", str(results),
                        "--captures", str(tmp_path / "captures")], capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(results.read_text())
    ran = {(x["class"], x["setting"], x["engine"]) for x in got["runs"]}
    assert ran == {(f.cls, f.setting, e) for f, e in zoo.select(quick=True)}
    errors = [f"{x['class']}/{x['engine']}: {x['error']}" for x in got["runs"] if "error" in x]
    assert not errors, errors
    s = got["score"]
    assert s == S.score(got["runs"])
    # every valid run is counted once: a fault that hurt (scored top-1), one that hurt nobody, a
    # control, or a class that expects silence at the server (client-disconnects)
    silent = {f.cls for f in zoo.FAULTS if not f.expect and f.cls != "control"}
    assert s["fault_runs"] + s["harmless_fault_runs"] + s["control_runs"] + sum(
        c["runs"] for k, c in s["per_class"].items() if k in silent) == s["valid_runs"]
    assert "top-1" in r.stdout


def test_a_fault_that_hurt_nobody_must_not_page_and_is_right_when_observed():
    obs = _inc("prefix-cache-ineffective", severity="info", observation=True)
    quiet = _rec("prefix-cache-off", [["prefix-cache-ineffective", ""]], [obs], client={"broken": []})
    loud = _rec("prefix-cache-off", [["prefix-cache-ineffective", ""]], [_inc("prefix-cache-ineffective")],
                client={"broken": []}, setting="t")
    silent = _rec("prefix-cache-off", [["prefix-cache-ineffective", ""]], [], client={"broken": []}, setting="u")
    hurt = _rec("prefix-cache-off", [["prefix-cache-ineffective", ""]], [obs], client={"broken": ["ttft_p99_s"]},
                setting="v")
    assert S.judge(quiet)["top1"] and not S.judge(loud)["top1"] and not S.judge(silent)["top1"]
    assert not S.judge(hurt)["top1"]  # it hurt: an observation is not enough, it had to page
    s = S.score([quiet, loud, silent, hurt])
    assert s["fault_runs"] == 1 and s["harmless_fault_runs"] == 3
    assert s["harmless_paged"] == round(1 / 3, 3) and s["harmless_observed"] == round(1 / 3, 3)


def test_client_harm_is_measured_from_the_clients_timings():
    from benchmarks.faults.runner import client_harm

    t = [{"status": "ok", "ttft_s": 0.1 * i, "tpot_s": 0.01} for i in range(1, 31)]
    assert client_harm(t, {})["broken"] == ["ttft_p99_s"]  # P99 of 0.1..3.0 s over the 2 s default
    assert client_harm(t, {"ttft_p99_s": 5.0})["broken"] == []
    gave_up = [{"status": "error", "error": "client gave up after 1.0s", "http_status": 200}] * 5
    assert client_harm(t[:10] + gave_up, {})["error_rate"] == 0.0  # the client's own give-ups are not errors
    cut = [{"status": "error", "error": "cancelled: run exceeded 900s", "http_status": None}] * 5
    assert client_harm(t[:10] + cut, {})["error_rate"] == 0.0  # nor the load generator's deadline
    failed = [{"status": "error", "error": "HTTP 500", "http_status": 500}]
    assert client_harm(t[:10] + failed, {})["broken"] == ["error_rate"]


def test_live_onset_reads_when_the_live_diagnosis_first_named_the_cause():
    offline = [_inc("queueing-saturation", severity="critical", start=120.0)]
    rec = _rec("queueing", [["queueing-saturation", ""]], offline,
               live_first_s=[["objective-ttft", "", True, 100.0], ["queueing-saturation", "", False, 110.0],
                             ["queueing-saturation", "", True, 135.0]])
    assert S.onset_s(rec, "live") == 45.0  # the paging naming, not the earlier observation


def test_onset_goal_is_the_naming_rules_hold_plus_30_s():
    """Issue 34's goal, per run: named within the ``for:`` of the rule that named it, plus 30 s."""
    holds = S._holds()
    assert holds["queueing-saturation"] == 30.0 and holds["gpu-memory-leak"] == 600.0
    rec = _rec("queueing", [["queueing-saturation", ""]], [_inc("queueing-saturation", start=150.0)],
               live_first_s=[["queueing-saturation", "", True, 151.0]])
    assert S.onset(rec) == (60.0, "queueing-saturation") and S.onset_in_goal(rec, "offline", holds)
    assert S.onset(rec, "live") == (61.0, "queueing-saturation") and S.onset_in_goal(rec, "live", holds) is False
    leak = _rec("memory-leak", [["gpu-memory-leak", ""]], [_inc("gpu-memory-leak", start=700.0)])
    assert S.onset_in_goal(leak, "offline", holds)  # 610 s: within its 10-minute hold + 30 s
    silent = _rec("queueing", [["queueing-saturation", ""]], [])
    assert S.onset_in_goal(silent, "offline", holds) is None
    s = S.score([rec, leak, silent])
    # live: only the queue was announced (the leak record has no live naming), 1 s late
    assert s["onset_offline"]["in_goal"] == 1.0 and s["onset_live"]["in_goal"] == 0.0
