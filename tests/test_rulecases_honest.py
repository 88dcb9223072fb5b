"""Every must-not-fire rule case is one its rule could fire on (issue 34.6): on the windows
`diagnose` evaluates, some run as long as the rule's ``for:`` has enough requests for its
``min_requests``, a symptom condition whose signals are known, and a cause that can hold. Only
the thresholds keep the rule silent there, so the case tests them. (`tests/rule_gates.py`.)"""
import kvdoctor
import pytest
from kvdoctor.diagnosis import diagnose, load_rules
from kvdoctor.diagnosis.selftest import resolve_case, split_case

from rule_gates import could_fire

RULES = load_rules()
_DIAG: dict[str, object] = {}


def _diagnosed(rule, case):
    key = " ".join([str(resolve_case(rule, case)), *case.split()[1:]])
    if key not in _DIAG:
        _DIAG[key] = diagnose(kvdoctor.load(resolve_case(rule, case)), RULES, split_case(case)[1])
    return _DIAG[key]


def test_every_no_fire_case_passes_its_rules_gates():
    bad = []
    for rule in RULES:
        for case in rule.tests_no_fire:
            why = could_fire(rule, _diagnosed(rule, case))
            if why is not None:
                bad.append(f"{rule.id}: {case}: {why}")
    assert not bad, "no_fire cases the rule could not fire on whatever its thresholds:\n" + "\n".join(bad)


def test_the_gate_check_can_fail():
    """The check is not vacuous: a capture under a rule's min_requests, and one lacking the
    source a rule's every symptom branch needs, are refused; every must-fire case passes."""
    by_id = {r.id: r for r in RULES}
    diag = _diagnosed(by_id["prefill-bound"], "tests/rulecases/healthy")
    import dataclasses

    huge = dataclasses.replace(by_id["prefill-bound"], min_requests=10**9)
    assert "under its min_requests" in could_fire(huge, diag)
    frag = by_id["kv-fragmentation"]
    no_engine = diagnose(kvdoctor.load(resolve_case(frag, "samples/healthy")), RULES)
    assert could_fire(frag, no_engine) is not None
    for rule in RULES:
        for case in rule.tests_fire:
            assert could_fire(rule, _diagnosed(rule, case)) is None, (rule.id, case)


def test_circular_labels_are_marked_and_counted_apart(tmp_path):
    """Labels whose criterion restates the rule (scripts/label-corpus CIRCULAR) are marked
    `circular:` on every entry that carries them, and the table counts their true positives apart
    and says it is not an accuracy measure."""
    import importlib.machinery
    import importlib.util

    import yaml
    from kvdoctor.diagnosis.corpus import Case, evaluate, read_corpus, table

    from conftest import ROOT

    loader = importlib.machinery.SourceFileLoader("label_corpus", str(ROOT / "scripts" / "label-corpus"))
    spec = importlib.util.spec_from_loader("label_corpus", loader)
    lc = importlib.util.module_from_spec(spec)
    loader.exec_module(lc)
    entries = yaml.safe_load((ROOT / "tests" / "labels.yaml").read_text())["corpus"]
    for e in entries:
        assert set(e.get("circular") or []) == set(e["causes"]) & set(lc.CIRCULAR), e["name"]
    assert {c for e in entries for c in e.get("circular") or []}, "no circular label: CIRCULAR or the labels changed"
    # the table counts them apart (a fake case: one circular label fired, one independent one fired)
    case = Case("x", {"queueing-saturation": "f", "prefill-bound": "f"}, capture=ROOT / "tests/rulecases/queueing",
                circular=frozenset({"prefill-bound"}))
    scores = {s.rule: s for s in evaluate([case], RULES)}
    fired = case.fired
    assert scores["prefill-bound"].tp_circular == (["x"] if "prefill-bound" in fired else [])
    assert scores["queueing-saturation"].tp_circular == []
    text = table(list(scores.values()), [case])
    assert "not an accuracy measure" in text and "docs/accuracy.md" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("corpus: [{name: y, capture: x, causes: {a: b}, circular: [c]}]\n")
    with pytest.raises(Exception, match="circular"):
        read_corpus(bad)


def test_no_rule_case_contradicts_the_labels():
    """No rule's must-fire case is a labelled capture whose labels lack that rule, and no
    must-not-fire case is one labelled with it: the suite never enforces a verdict the labels
    (tests/labels.yaml) call wrong (samples/concurrency is compute-bound, not bandwidth-bound)."""
    import yaml

    from conftest import ROOT

    labelled = {e["capture"]: set(e["causes"]) for e in yaml.safe_load((ROOT / "tests" / "labels.yaml").read_text())["corpus"]
                if "capture" in e}
    bad = []
    for rule in (r for r in RULES if r.kind != "objective"):  # labels name causes; objectives are harm
        for case in rule.tests_fire:
            path = case.split()[0]
            if path in labelled and rule.id not in labelled[path]:
                bad.append(f"{rule.id} must fire on {path}, labelled {sorted(labelled[path]) or 'healthy'}")
        for case in rule.tests_no_fire:
            path = case.split()[0]
            if rule.id in labelled.get(path, ()):
                bad.append(f"{rule.id} must not fire on {path}, labelled with it")
    assert not bad, "\n".join(bad)
