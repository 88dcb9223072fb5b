"""The 3 a.m. read (issue 35): the first three lines of every `summary` say what happened and
since when, the likely cause, the first fix for the recorded engine, and where. Checked on every
sample by their shape; their exact text is the snapshot tests/snapshots/summary-first-lines.txt
(scripts/make-docs writes it; tests/test_docs.py fails while it is stale)."""
from __future__ import annotations

import re

import pytest

import kvdoctor
from conftest import ROOT
from kvdoctor.diagnosis import diagnose
from kvdoctor.engines.labels import ENGINE_LABEL
from kvdoctor.report.summary import summary_text

SAMPLES = sorted(p.name for p in (ROOT / "samples").iterdir() if (p / "meta.json").exists())


@pytest.mark.parametrize("name", SAMPLES)
def test_first_three_lines_say_what_when_cause_and_fix(name):
    diag = diagnose(kvdoctor.load(ROOT / "samples" / name))
    l1, l2, l3 = summary_text(diag).split("\n")[:3]
    assert l3.startswith(f"kvdoctor · {ROOT / 'samples' / name}") or l3.startswith("kvdoctor · "), l3
    engine = next((label for key, label in ENGINE_LABEL.items() if key != "any" and f" · {label}" in l3), None)
    pages = [i for i in diag.incidents if not i.observation]
    if pages:
        assert re.match(r"^(CRITICAL|WARNING) since \S+ \(", l1), l1  # severity, since when
        assert " — likely cause: " in l1 and re.search(r"\([\w-]+(?: \[[^]]+\])?, \d+%\)$", l1), l1  # cause, rule
        if engine:  # the recorded engine's own knob, never the others'
            assert l2.startswith((f"First fix for {engine}: ", "First step", "No fix to add for this engine")), l2
            others = [lbl for key, lbl in ENGINE_LABEL.items() if key != "any" and lbl != engine]
            assert not any(f"{o}:" in l2 for o in others), l2
        else:
            assert l2.startswith(("First fix (engine unknown", "First step")), l2
    else:
        assert l1.startswith(("OK: ", "NOTHING TO DIAGNOSE: ")), l1
        assert l2.startswith(("Observations", "No rule fired", "Check the range")), l2
