"""Rules as data: schema checks with located errors, safe conditions, every shipped rule's cases."""
import math
import shutil
from pathlib import Path

import pytest
import yaml

from kvdoctor.diagnosis import conditions as C
from kvdoctor.diagnosis.rules import builtin_rules_dir, load_rule, load_rules, parse_overrides
from kvdoctor.errors import InputError, RuleError
from kvdoctor.signals import REGISTRY

REQUIRED_IDS = {"prefill-bound", "decode-bandwidth-bound", "kv-growth-per-turn", "kv-oom", "kv-quant-quality",
                "tail-latency", "unsafe-concurrency", "prompt-length-tail", "prefix-cache-ineffective",
                "kv-pressure-preemption", "long-prompt-hol-blocking", "queueing-saturation", "kv-fragmentation",
                "gpu-memory-leak", "error-burst"}


def test_catalog_covers_required_ids_and_every_rule_has_cases():
    rules = load_rules()
    assert REQUIRED_IDS <= {r.id for r in rules}
    for r in rules:
        assert r.tests_fire and r.tests_no_fire, r.id
        assert all(k in ("vllm", "sglang", "tgi", "llamacpp", "trtllm", "any") for f in r.fixes for k in f.knobs)


def _rule_file(tmp_path, mutate):
    src = builtin_rules_dir() / "prefill-bound.yaml"
    data = yaml.safe_load(src.read_text())
    mutate(data)
    d = tmp_path / "rules"
    d.mkdir(exist_ok=True)
    p = d / f"{data.get('id', 'prefill-bound')}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_unknown_signal_names_file_rule_and_path(tmp_path):
    p = _rule_file(tmp_path, lambda d: d["symptom"]["when"]["all"].__setitem__(0, "ttft_prompt_corelation >= 0.5"))
    with pytest.raises(RuleError) as e:
        load_rule(p)
    msg = str(e.value)
    assert str(p) in msg and "rule prefill-bound" in msg and "symptom.when.all[0]" in msg
    assert "unknown signal 'ttft_prompt_corelation'" in msg


def test_every_shipped_rule_passes_the_schema():
    """The shipped rules are loaded without the schema check at run time (jsonschema costs a
    diagnosis ~0.1 s): this is where they are checked, each one."""
    for path in sorted(builtin_rules_dir().glob("*.yaml")):
        load_rule(path)  # schema_checked=True: a RuleError names the file and field


def test_a_rules_folder_is_schema_checked_even_over_a_shipped_id(tmp_path):
    p = _rule_file(tmp_path, lambda d: d.__setitem__("severity", "urgent"))
    with pytest.raises(RuleError, match=r"rule prefill-bound: severity: 'urgent' is not one of"):
        load_rules([p.parent])


def test_schema_error_names_field(tmp_path):
    p = _rule_file(tmp_path, lambda d: d.__setitem__("severity", "urgent"))
    with pytest.raises(RuleError, match=r"rule prefill-bound: severity: 'urgent' is not one of"):
        load_rule(p)


def test_fleet_block_is_checked(tmp_path):
    """A rule's fleet block (what it means on every replica, its peer outlier) is schema-checked
    and its outlier signal must exist, like any condition's."""
    good = {"signal": "ttft_p99_s", "direction": "high", "min_diff": 0.5, "min_ratio": 2.0, "meaning": "m", "check": "c"}
    rule = load_rule(_rule_file(tmp_path, lambda d: d.__setitem__("fleet", {"on_every_replica": "capacity", "outlier": good})))
    assert rule.fleet_everywhere == "capacity" and rule.fleet_outlier.signal == "ttft_p99_s"
    assert load_rule(_rule_file(tmp_path, lambda d: d.pop("fleet", None))).fleet_everywhere == "shared"
    with pytest.raises(RuleError, match=r"fleet\.outlier\.direction: 'up' is not one of"):
        load_rule(_rule_file(tmp_path, lambda d: d.__setitem__("fleet", {"outlier": {**good, "direction": "up"}})))
    with pytest.raises(RuleError, match=r"fleet\.outlier\.signal: unknown signal 'ttft_p999_s'"):
        load_rule(_rule_file(tmp_path, lambda d: d.__setitem__("fleet", {"outlier": {**good, "signal": "ttft_p999_s"}})))


def test_quality_verdict_judges_by_the_rules_margins():
    """`kvdoctor quality`'s verdict and kv-quant-quality share their margins (the rule's params)."""
    from kvdoctor.diagnosis.rules import builtin_params
    from kvdoctor.quality import verdict

    p = builtin_params("kv-quant-quality")
    row = {"prompt_tokens_from": 0, "prompt_tokens_to": 1, "prompts": 2, "baseline_repetition_p50": 0.1,
           "candidate_repetition_p50": 0.1}
    drop = p["min_agreement_drop"]
    assert verdict([{**row, "agreement_p50": 0.9}, {**row, "agreement_p50": 0.9 - drop}]).startswith("DEGRADED")
    assert verdict([{**row, "agreement_p50": 0.9}, {**row, "agreement_p50": 0.9 - drop + 0.01}]).startswith("no degr")
    assert verdict([{**row, "agreement_p50": 0.9}, {**row, "agreement_p50": 0.9 - drop}],
                   {"min_agreement_drop": drop + 0.05}).startswith("no degr")

    # teacher-forced agreement decides where the servers gave it: the word-prefix drop no longer does
    from kvdoctor.quality import Comparison

    def forced(f):
        return [Comparison(i, 100 * i, 48, 48, 0.1, 0.1, 0.1, 1.0, 1.0, forced_agreement_frac=f, forced_positions=48)
                for i in range(8)]

    m = p["min_forced_agreement"]
    rows = [{**row, "agreement_p50": 0.9}, {**row, "agreement_p50": 0.9 - drop}]
    assert verdict(rows, results=forced(m - 0.01)).startswith("DEGRADED")
    assert verdict(rows, results=forced(m)).startswith("no degr")
    assert verdict(rows, {"min_forced_agreement": m + 0.02}, results=forced(m)).startswith("DEGRADED")
    assert verdict(rows, results=forced(None)).startswith("DEGRADED")  # not measured: the word-prefix drop judges


def test_rule_names_its_report_charts_and_an_unknown_chart_is_refused(tmp_path):
    assert load_rule(builtin_rules_dir() / "prefill-bound.yaml").charts == ("ttft-prompt", "prompt-lengths", "latency")
    p = _rule_file(tmp_path, lambda d: d.__setitem__("charts", ["latency", "ttft-vs-prompt"]))
    with pytest.raises(RuleError, match=r"rule prefill-bound: charts\.1: unknown chart 'ttft-vs-prompt'; known: latency, "):
        load_rule(p)
    p = _rule_file(tmp_path, lambda d: d.pop("charts"))
    assert load_rule(p).charts == ()  # none named: the report picks by symptom


def test_unparseable_condition(tmp_path):
    p = _rule_file(tmp_path, lambda d: d["causes"][0].__setitem__("when", "__import__('os').system('true')"))
    with pytest.raises(RuleError, match=r"causes\[0\]\.when: cannot read condition"):
        load_rule(p)


def test_yaml_cannot_build_objects(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("id: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(RuleError, match="not valid YAML"):
        load_rule(p)
    assert not (tmp_path / "pwned").exists()


def test_id_must_match_file_name(tmp_path):
    p = _rule_file(tmp_path, lambda d: None)
    p2 = p.with_name("other.yaml")
    shutil.move(p, p2)
    with pytest.raises(RuleError, match="must match the file name"):
        load_rule(p2)


def test_user_rules_folder_overrides_and_params(tmp_path):
    _rule_file(tmp_path, lambda d: d.__setitem__("title", "My own prefill rule"))
    rules = {r.id: r for r in load_rules([tmp_path / "rules"], parse_overrides(["prefill-bound.min_corr=0.9"]))}
    assert rules["prefill-bound"].title == "My own prefill rule"
    assert rules["prefill-bound"].params["min_corr"] == 0.9
    # a bad --set is bad input (exit 2), not a bad rule file (exit 3)
    with pytest.raises(InputError, match="has no parameter 'nope'"):
        load_rules(overrides=parse_overrides(["prefill-bound.nope=1"]))
    with pytest.raises(InputError, match="expected RULE.PARAM=NUMBER"):
        parse_overrides(["prefill-bound.min_corr"])
    with pytest.raises(InputError, match="no rule with id"):
        load_rules(overrides=parse_overrides(["no-such-rule.x=1"]))


def test_conditions_evaluate_and_unknown_is_false():
    known = set(REGISTRY)
    cond = C.parse({"all": ["ttft_p99_s > 2 * ttft_p50_s", {"not": "errors >= 1"}]}, "x", known, {})
    vals = {"ttft_p99_s": 5.0, "ttft_p50_s": 2.0, "errors": 0.0}
    assert C.evaluate(cond, vals.__getitem__, {}, {})
    vals["ttft_p99_s"] = 3.0
    assert not C.evaluate(cond, vals.__getitem__, {}, {})
    nan_cond = C.parse("ttft_p99_s > 1", "x", known, {})
    assert not C.evaluate(nan_cond, lambda n: math.nan, {}, {})
    slo_cond = C.parse("ttft_p99_s > slo.ttft_p99_s", "x", known, {})
    assert not C.evaluate(slo_cond, lambda n: 9.0, {}, {})  # no SLO given: never fires
    assert C.evaluate(slo_cond, lambda n: 9.0, {"ttft_p99_s": 2.0}, {})


def test_every_signal_documented_with_unit():
    for s in REGISTRY.values():
        assert s.unit and s.doc, s.name


def test_rules_test_command_passes(run_cli):
    """Every shipped rule fires on its must-fire captures and not on its must-not-fire ones."""
    r = run_cli("rules", "test", "-v")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout


def test_bad_rule_folder_is_exit_3_one_line(run_cli, tmp_path):
    _rule_file(tmp_path, lambda d: d.__setitem__("for", "soon"))
    r = run_cli("rules", "list", "--rules", tmp_path / "rules")
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "rule prefill-bound: for:" in r.stderr


def test_signal_percentile_matches_numpy():
    """The one-partition percentile signals use gives numpy's linear method, NaNs ignored."""
    import numpy as np

    from kvdoctor.signals.registry import percentile

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 4000):
        a = rng.lognormal(size=n)
        a[::5] = np.nan
        v = a[~np.isnan(a)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            if len(v):
                assert percentile(a, q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12, abs=0)
    assert math.isnan(percentile(np.array([np.nan, 1.0]), 50, min_n=2))


def test_fix_unless_leaves_out_a_fix_the_evidence_rules_out(tmp_path, run_cli):
    """kv-growth-per-turn's first fix (prefix caching) is left out where the capture shows the
    history already served from the cache (real llama.cpp multi-turn run, 87% of prompt tokens
    cached), and kept where that is unknown (simulated case without cache figures)."""
    rule = next(r for r in load_rules() if r.id == "kv-growth-per-turn")
    first = rule.fixes[0]
    assert first.unless is not None and "prefix_hit_rate_achieved" in rule.signals()
    assert rule.fixes_for(lambda s: 0.87)[0] is rule.fixes[1]
    assert rule.fixes_for(lambda s: 0.2)[0] is first
    assert rule.fixes_for(lambda s: math.nan)[0] is first  # unknown keeps the fix
    def first_fix(out: str) -> str:  # the first fix listed under kv-growth-per-turn in the full text
        block = out.split("kv-growth-per-turn (", 1)[1]
        return next(ln.strip() for ln in block.splitlines() if ln.strip().startswith("fix:"))

    real = run_cli("diagnose", "samples/multi-turn")
    sim = run_cli("diagnose", "tests/rulecases/multi-turn")
    assert first_fix(real.stdout).startswith("fix: Bound the history"), real.stdout
    assert first_fix(sim.stdout).startswith("fix: Keep the history's KV between turns"), sim.stdout
    bad = tmp_path / "r"
    bad.mkdir()
    text = (builtin_rules_dir() / "kv-growth-per-turn.yaml").read_text().replace(
        'unless: "prefix_hit_rate_achieved >= 0.5"', 'unless: "prefix_hit_rate_achieved >= lots"')
    (bad / "kv-growth-per-turn.yaml").write_text(text)
    with pytest.raises(RuleError, match=r"fixes\[0\]\.unless"):
        load_rules([bad])


def test_prefill_bound_offers_the_prefix_cache_only_where_prompts_share_prefixes(run_cli):
    """A prefix cache saves only prompt blocks an earlier request already computed. On real
    llama.cpp captures whose prompts share no block (samples/long-prompts: an ideal cache would
    serve 0% of their tokens) prefill-bound's first fix is not the prefix cache; on the shared
    1,000-token prefix of samples/prefix-cache-off (92% servable) it is kept, as where unknown."""
    rule = next(r for r in load_rules() if r.id == "prefill-bound")
    cache = rule.fixes[0]
    assert "prefix" in cache.title.lower() and cache.unless is not None
    assert rule.fixes_for(lambda s: 0.0)[0] is not cache
    assert rule.fixes_for(lambda s: 0.916)[0] is cache
    assert rule.fixes_for(lambda s: math.nan)[0] is cache  # no block hashes: unknown keeps it
    lead = run_cli("summary", "samples/long-prompts").stdout.splitlines()
    assert "(prefill-bound" in lead[0] and "prefix" not in lead[1].lower(), lead[:2]
    # the TTFT objective's own fix for slow prefills splits the same way: the cache where it can serve
    ttft = next(r for r in load_rules() if r.id == "objective-ttft")
    reuse = next(f for f in ttft.fixes if "prefix" in f.title.lower())
    values = {"ttft_slow_prefill_frac": 0.75, "ttft_slow_wait_share": 0.0, "objective_defaults_only": 1.0}
    for servable, offered in ((0.0, False), (0.916, True), (math.nan, True)):
        got = ttft.fixes_for(lambda s: {**values, "prefix_hit_rate_achievable": servable}.get(s, math.nan))
        assert (reuse in got) is offered and any("shorter prompts" in f.title for f in got)


def test_not_of_unknown_is_unknown():
    """Kleene's three-valued logic: `not` of a NaN signal stays unknown, so a rule cannot fire
    on the absence of data; all/any are decided by a known false/true child alone."""
    known = set(REGISTRY)
    nan = {"ttft_p99_s": math.nan, "ttft_p50_s": 1.0, "errors": 0.0}.__getitem__
    neg = C.parse({"not": "ttft_p99_s > 2 * ttft_p50_s"}, "x", known, {})
    assert C.evaluate3(neg, nan, {}, {}) is None
    assert not C.evaluate(neg, nan, {}, {})
    assert C.evaluate3(neg, {"ttft_p99_s": 1.0, "ttft_p50_s": 1.0}.__getitem__, {}, {}) is True
    both = C.parse({"all": ["errors >= 1", "ttft_p99_s > 1"]}, "x", known, {})
    assert C.evaluate3(both, nan, {}, {}) is False  # a known false decides an all
    either = C.parse({"any": ["errors < 1", "ttft_p99_s > 1"]}, "x", known, {})
    assert C.evaluate3(either, nan, {}, {}) is True  # a known true decides an any
    undecided = C.parse({"any": ["errors >= 1", "ttft_p99_s > 1"]}, "x", known, {})
    assert C.evaluate3(undecided, nan, {}, {}) is None
    assert C.unknown_signals(undecided, nan, {}, {}) == ["ttft_p99_s"]
    assert C.unknown_signals(either, nan, {}, {}) == []


def _shifted(cap, dt_s):
    from kvdoctor.model import RequestRecord

    rows = cap.requests.table.to_pylist()
    for r in rows:
        for k in ("arrival_s", "first_token_s", "finish_s"):
            if r.get(k) is not None:
                r[k] += dt_s
    return [RequestRecord(**{k: v for k, v in r.items() if v is not None}) for r in rows]


def test_suppression_only_between_overlapping_incidents():
    """tail-latency is suppressed by queueing-saturation only where both hold at once: a heavy
    tail early in a capture and a queue an hour later are two incidents, not one rule hiding
    the other across the whole capture."""
    import kvdoctor
    from kvdoctor.capture.memory import from_records
    from kvdoctor.diagnosis import diagnose

    from conftest import CASES

    tail, queue = kvdoctor.load(CASES / "tail"), kvdoctor.load(CASES / "queueing")
    rules = load_rules()
    fired = lambda d: {c.rule.id for i in d.incidents for c in i.causes}  # noqa: E731
    assert "queueing-saturation" in fired(diagnose(queue, rules))
    assert "tail-latency" in fired(diagnose(tail, rules))
    gap_s = 3600.0
    later = _shifted(queue, _shifted(tail, 0)[-1].finish_s + gap_s - queue.requests.num("arrival_s")[0])
    both = diagnose(from_records(tail.meta, requests=_shifted(tail, 0) + later), rules)
    by_rule = {c.rule.id: i for i in both.incidents for c in i.causes}
    assert {"tail-latency", "queueing-saturation"} <= set(by_rule)
    assert by_rule["tail-latency"].end_s < by_rule["queueing-saturation"].start_s
    # where they overlap, the specific cause hides the generic one
    assert "tail-latency" not in fired(diagnose(queue, [r for r in rules if r.id in ("tail-latency", "queueing-saturation")]))


def _rule_cases():
    from kvdoctor.diagnosis.selftest import resolve_case

    rules = load_rules()
    return sorted({(str(resolve_case(r, c)), *c.split()[1:]) for r in rules for c in (*r.tests_fire, *r.tests_no_fire)
                   if resolve_case(r, c) is not None})


@pytest.mark.parametrize("case", _rule_cases(), ids=lambda c: " ".join([Path(c[0]).parent.name + "/" + Path(c[0]).name, *c[1:]]))
def test_live_and_offline_give_the_same_incidents(case):
    """attach's live path, replayed at diagnose's evaluation instants over a rule case, opens
    the same incidents (symptom and rules) as diagnose finds offline."""
    import kvdoctor
    from kvdoctor.diagnosis import diagnose
    from kvdoctor.diagnosis.live import replay
    from kvdoctor.diagnosis.selftest import split_case

    rules = load_rules()
    path, opts = split_case(" ".join(case))
    cap = kvdoctor.load(path)
    offline = sorted((i.symptom, sorted(c.rule.id for c in i.causes)) for i in diagnose(cap, rules, opts).incidents)
    live = sorted((i.symptom, sorted(i.rules_seen)) for i in replay(cap, rules, opts))
    assert live == offline


def test_every_rule_proven_on_real_data_or_marked_experimental():
    """A rule with no must-fire case from a real server or public real data carries
    `status: experimental`, and a proven one does not. What is real is read from each capture's
    meta.json (origin, server, attribution), not from a list here; `kvdoctor rules test`
    checks that those cases do fire."""
    from kvdoctor.diagnosis.selftest import proof

    for r in load_rules():
        assert bool(proof(r)) != r.experimental, (
            f"{r.id}: " + (f"proven by {proof(r)}: drop `status: experimental`" if proof(r) else
                           "no real must-fire case: add one to tests.fire or mark it `status: experimental`"))


def test_case_source_reads_where_a_capture_came_from(tmp_path):
    from kvdoctor.diagnosis.selftest import PUBLIC_DATA, REAL_SERVER, SIMULATED, UNKNOWN, case_source

    from conftest import CASES, ROOT

    assert case_source(CASES / "queueing") == SIMULATED
    assert case_source(ROOT / "samples" / "healthy") == REAL_SERVER
    assert case_source(ROOT / "samples" / "aibrix-qps-4.1") == PUBLIC_DATA
    shutil.copytree(ROOT / "samples" / "aibrix-qps-4.1", tmp_path / "c")
    meta = tmp_path / "c" / "meta.json"
    meta.write_text(meta.read_text().replace('"attribution"', '"x_attribution"'))
    assert case_source(tmp_path / "c") == UNKNOWN  # an import without attribution proves nothing


def test_experimental_rule_is_marked_wherever_it_is_named(run_cli, tmp_path):
    """tail-latency (simulated cases only) is named with 'proven only on simulated data' in the
    summary, the full text, Markdown, JSON, the HTML report and the live incident text."""
    from conftest import CASES

    from kvdoctor.report.summary import live_incident_text

    rules = tmp_path / "r"
    rules.mkdir()
    text = (builtin_rules_dir() / "tail-latency.yaml").read_text()
    if "status: experimental" not in text:
        text = text.replace("severity: info\n", "severity: info\nstatus: experimental\n")
    (rules / "tail-latency.yaml").write_text(text)
    note = "proven only on simulated data"
    for args in (["summary"], ["diagnose"], ["diagnose", "--format", "markdown"]):
        r = run_cli(*args, CASES / "tail", "--rules", rules)
        assert r.returncode == 0, r.stderr
        assert "tail-latency" in r.stdout and note in r.stdout, (args, r.stdout)
    js = run_cli("diagnose", CASES / "tail", "--rules", rules, "--format", "json")
    cause = next(c for i in __import__("json").loads(js.stdout)["incidents"] for c in i["causes"] if c["rule"] == "tail-latency")
    assert cause["status"] == "experimental"
    html = run_cli("report", CASES / "tail", "--rules", rules, "-o", tmp_path / "r.html")
    assert html.returncode == 0 and note in (tmp_path / "r.html").read_text()
    import kvdoctor
    from kvdoctor.diagnosis.live import replay

    inc = next(i for i in replay(kvdoctor.load(CASES / "tail"), load_rules([rules])) if i.top.rule.id == "tail-latency")
    assert note in live_incident_text(inc, "opened", None) and note in live_incident_text(inc, "closed", None)
    # a stable rule is not marked
    plain = run_cli("summary", CASES / "queueing")
    assert "queueing-saturation" in plain.stdout and note not in plain.stdout


def test_rules_that_cannot_fire_are_listed_with_what_they_lack(run_cli):
    """An import without the context limit (Mooncake trace) cannot run prompt-length-tail: the
    text, Markdown and JSON say so and name the fix (--max-model-len); with it, the rule is
    evaluated. Engine info in a capture wins over the option, with a warning."""
    import json

    from conftest import ROOT

    cap = ROOT / "samples" / "mooncake-conversation"
    js = json.loads(run_cli("diagnose", cap, "--format", "json").stdout)
    ne = {n["rule"]: n for n in js["not_evaluated"]}
    assert ne["prompt-length-tail"]["missing"] == ["prompt_p99_over_limit"]
    assert "--max-model-len" in ne["prompt-length-tail"]["needs"][0]
    assert js["capture"]["context_limit"] is None
    for args in (["diagnose"], ["summary", "--verbose"], ["diagnose", "--format", "markdown"]):
        out = run_cli(*args, cap).stdout
        assert "not evaluated:" in out and "prompt-length-tail" in out.split("not evaluated:")[1], (args, out)
    short = run_cli("summary", cap).stdout  # one short line, pointing at where the list is
    line = next(ln for ln in short.splitlines() if "not evaluated" in ln)
    assert len(line) <= 200 and "--verbose" in line and "--max-model-len" in line, line
    given = json.loads(run_cli("diagnose", cap, "--format", "json", "--max-model-len", "131072").stdout)
    assert "prompt-length-tail" not in {n["rule"] for n in given["not_evaluated"]}
    assert given["capture"]["context_limit"] == {"tokens": 131072, "source": "--max-model-len"}
    # the model table stands in for an import that names its model (AIBrix: Llama-3.1-8B)
    aibrix = json.loads(run_cli("diagnose", ROOT / "samples" / "aibrix-qps-4.1", "--format", "json").stdout)
    assert aibrix["capture"]["context_limit"]["tokens"] == 131072
    assert "model table" in aibrix["capture"]["context_limit"]["source"]
    assert "prompt-length-tail" not in {n["rule"] for n in aibrix["not_evaluated"]}
    # a real llama.cpp capture records its n_ctx: that wins
    real = json.loads(run_cli("diagnose", ROOT / "samples" / "healthy", "--format", "json", "--max-model-len", "99").stdout)
    assert real["capture"]["context_limit"]["tokens"] == 2048
    assert any("--max-model-len 99 ignored" in w for w in real["capture"]["warnings"])


def test_not_evaluated_only_where_a_source_is_missing():
    """A rule whose symptom could still hold on the signals present is evaluated (queueing on a
    simulated capture without the engine's waiting gauge); one whose every path needs an absent
    source is listed (kv-fragmentation without KV usage); fired rules never are."""
    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    from conftest import CASES

    d = diagnose(kvdoctor.load(CASES / "leak"), load_rules())
    listed = {n.rule: n for n in d.not_evaluated}
    assert "queueing-saturation" not in listed
    assert listed["kv-fragmentation"].needs == ("KV cache usage (engine /metrics)",)
    frag = diagnose(kvdoctor.load(CASES / "fragmentation"), load_rules())
    assert "kv-fragmentation" not in {n.rule for n in frag.not_evaluated}


def test_corpus_labels_are_written_from_the_raw_files(tmp_path):
    """tests/labels.yaml is exactly what scripts/label-corpus computes from the source files
    (client timings, public CSV/JSON), so no label was edited by hand or read off kvdoctor."""
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "labels.yaml"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "label-corpus"), "--out", str(out), "--no-docs"],
                   check=True, capture_output=True, cwd=tmp_path)
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((ROOT / "tests" / "labels.yaml").read_text())
    corpus = yaml.safe_load(out.read_text())["corpus"]
    assert all(e["figures"] and all(isinstance(v, str) and v for v in e["causes"].values()) for e in corpus)


def test_rules_test_table_scores_rules_against_labels(run_cli, tmp_path):
    """Precision and recall come from the labels and what fired: a label no rule covers is a
    miss; a rule firing on an unlabelled capture is a false positive; an imported public file
    is read as `kvdoctor import` would."""
    import json

    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    from conftest import CASES, ROOT

    corpus = tmp_path / "labels.yaml"
    corpus.write_text(yaml.safe_dump({"corpus": [
        {"name": "q", "capture": str(CASES / "queueing"), "causes": {"queueing-saturation": "sim"}},
        {"name": "h", "capture": str(CASES / "healthy"), "causes": {"no-such-rule": "x"}},
        {"name": "a", "import": {"format": "csv", "src": str(ROOT / "tests/data/traces/aibrix/naive_output_4.1.csv"),
                                 "columns": {"arrival_s": "launch_time", "finish_s": "finish_time", "ttft_s": "ttft",
                                             "prompt_tokens": "prompt_tokens", "output_tokens": "generation_tokens"},
                                 "model": "Llama-3.1-8B", "attribution": "aibrix"},
         "causes": {}},
    ]}))
    r = run_cli("rules", "test", "--format", "json", "--corpus", corpus)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    rules = {x["rule"]: x for x in got["rules"]}
    fired = {c["name"]: set(c["fired"]) for c in got["captures"]}
    assert fired["q"] == {c.rule.id for i in diagnose(kvdoctor.load(CASES / "queueing")).incidents for c in i.causes}
    assert fired["a"], "the imported AIBrix 4.1 QPS run fires something"
    for rid, s in rules.items():
        labelled = {n for n, lab in (("q", {"queueing-saturation"}), ("h", {"no-such-rule"}), ("a", set())) if rid in lab}
        hit = {n for n, f in fired.items() if rid in f}
        assert set(s["tp"]) == labelled & hit and set(s["fp"]) == hit - labelled and set(s["fn"]) == labelled - hit
        if hit:
            assert s["precision"] == pytest.approx(len(labelled & hit) / len(hit))
    assert rules["no-such-rule"]["has_rule"] is False and rules["no-such-rule"]["recall"] == 0
    table = run_cli("rules", "test", "--format", "table", "--corpus", corpus).stdout
    assert "`no-such-rule` (no rule)" in table and "| precision | recall |" in table
    assert run_cli("rules", "test", "--corpus", corpus).stdout == table  # a corpus alone is scored as a table
    r = run_cli("rules", "test", "--format", "cases", "--corpus", corpus)
    assert r.returncode == 2 and "--corpus" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("corpus: [{name: x, causes: {}}]\n")
    r = run_cli("rules", "test", "--format", "table", "--corpus", bad)
    assert r.returncode == 2 and "corpus[0]" in r.stderr and "Traceback" not in r.stderr


def test_docs_rules_table_is_current(run_cli):
    """docs/rules.md carries today's table; after changing rules or labels, run scripts/label-corpus."""
    from conftest import ROOT

    doc = (ROOT / "docs" / "rules.md").read_text()
    table = doc.split("<!-- rules-table:start -->\n", 1)[1].split("<!-- rules-table:end -->", 1)[0]
    assert table == run_cli("rules", "test", "--format", "table").stdout, "stale: run scripts/label-corpus"


def test_rule_cases_are_what_the_server_model_writes(tmp_path):
    """The simulated rule cases are exactly make_cases.py's output (deterministic): none was
    edited by hand, so every engine, GPU and quality number in them comes from its mechanism."""
    import filecmp
    import subprocess
    import sys

    from conftest import CASES

    subprocess.run([sys.executable, str(CASES / "make_cases.py"), str(tmp_path)], check=True, capture_output=True)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made and made == sorted(p.relative_to(CASES) for p in CASES.rglob("*") if p.is_file() and p.parent != CASES)
    differ = [str(p) for p in made if not filecmp.cmp(tmp_path / p, CASES / p, shallow=False)]
    assert not differ, f"regenerate with python tests/rulecases/make_cases.py: {differ}"


def test_a_case_can_give_the_context_limit(run_cli, tmp_path):
    """A rule case may name --max-model-len for an import without the limit: the Mooncake trace
    (public real data) then proves prompt-length-tail; a malformed option fails the case."""
    from kvdoctor.diagnosis.selftest import PUBLIC_DATA, proof

    from conftest import ROOT

    d = tmp_path / "r"
    d.mkdir()
    text = (builtin_rules_dir() / "prompt-length-tail.yaml").read_text().replace(
        "  fire: [", "  fire: [samples/mooncake-conversation --max-model-len 131072, ")
    (d / "prompt-length-tail.yaml").write_text(text)
    rule = next(r for r in load_rules([d]) if r.id == "prompt-length-tail")
    assert ("samples/mooncake-conversation --max-model-len 131072", PUBLIC_DATA) in proof(rule)
    ok = run_cli("rules", "test", "--rules", d, "--rule", "prompt-length-tail", "-v", cwd=ROOT)
    assert ok.returncode == 0 and "ok   prompt-length-tail: samples/mooncake-conversation --max-model-len 131072" in ok.stdout
    (d / "prompt-length-tail.yaml").write_text(text.replace("131072", "lots"))
    bad = run_cli("rules", "test", "--rules", d, "--rule", "prompt-length-tail", cwd=ROOT)
    assert bad.returncode == 1 and "expected PATH [--max-model-len N] [--slo NAME=VALUE ...]" in bad.stdout


def test_source_signals_named_for_not_evaluated_exist():
    """The signals coverage.py names as needing a source are real signals (a rename shows here)."""
    from kvdoctor.diagnosis.coverage import SOURCE_NEEDS

    assert set(SOURCE_NEEDS) <= set(REGISTRY), sorted(set(SOURCE_NEEDS) - set(REGISTRY))
