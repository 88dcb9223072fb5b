"""`kvdoctor rules test`: every rule against the captures it names as must-fire and must-not-fire.

A case passes when, diagnosing the capture with the whole rule set (so suppression and
ranking apply as for a user), the rule is (fire) or is not (no_fire) among the causes of an
incident. Each capture is diagnosed once however many rules name it.

A rule is *proven* when one of its must-fire captures is real: recorded by kvdoctor against a
running server (``attach``, ``quality``: meta.origin with a server URL) or imported from public
real data with its attribution (``import:*``). The capture's own meta says which, so adding a
real case to a rule's ``tests.fire`` is what proves it; a rule that is not proven carries
``status: experimental`` (checked by tests/test_rules.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..capture import load
from ..capture import load_meta
from .api import diagnose
from .evaluate import Options
from .rules import Rule


@dataclass(frozen=True)
class CaseResult:
    rule: str
    capture: str
    expect_fire: bool
    fired: bool | None  # None: the capture could not be found or read
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.fired is not None and self.fired == self.expect_fire


def split_case(case: str) -> tuple[str, Options]:
    """A case is a capture path, optionally followed by ``--max-model-len N`` (for an import
    that does not record the server's context limit) and any number of ``--slo NAME=VALUE``
    (objectives the case is judged against, beside the workload's defaults)."""
    from ..objectives import parse_slo

    path, *opts = case.split()
    max_len, slo = None, []
    while opts:
        if len(opts) >= 2 and opts[0] == "--max-model-len" and opts[1].isdigit() and int(opts[1]) > 0:
            max_len = int(opts[1])
        elif len(opts) >= 2 and opts[0] == "--slo":
            slo.append(opts[1])
        else:
            raise ValueError(f"case {case!r}: expected PATH [--max-model-len N] [--slo NAME=VALUE ...]")
        opts = opts[2:]
    return path, Options(max_model_len_tokens=max_len, slo=parse_slo(slo))


def resolve_case(rule: Rule, case: str) -> Path | None:
    p = Path(case.split()[0]) if case.strip() else Path(case)
    bases = [Path.cwd()]
    if rule.path is not None:
        bases = [rule.path.parent, rule.path.parent.parent, *bases]
    for base in bases:
        cand = p if p.is_absolute() else base / p
        if cand.exists():
            return cand
    return None


REAL_SERVER, PUBLIC_DATA, SIMULATED, UNKNOWN = "real server", "public real data", "simulated", "unknown"


def case_source(path: Path) -> str:
    """Where a test capture's numbers came from, read from its meta.json."""
    try:
        meta = load_meta(path)
    except Exception:  # unreadable: proves nothing (the case itself fails in run())
        return UNKNOWN
    origin = meta.origin or ""
    if origin in ("attach", "quality") and meta.server:
        return REAL_SERVER
    if origin.startswith("import:") and meta.attribution:
        return PUBLIC_DATA
    if origin == "simulate":
        return SIMULATED
    return UNKNOWN


def proof(rule: Rule) -> list[tuple[str, str]]:
    """(case, source) for each must-fire case that is real: empty for an unproven rule."""
    out = []
    for case in rule.tests_fire:
        path = resolve_case(rule, case)
        src = case_source(path) if path is not None else UNKNOWN
        if src in (REAL_SERVER, PUBLIC_DATA):
            out.append((case, src))
    return out


def run(rules: list[Rule], only: set[str] | None = None) -> list[CaseResult]:
    fired_by_capture: dict[str, set[str] | str] = {}
    results = []
    for rule in rules:
        if only and rule.id not in only:
            continue
        for case, expect in [(c, True) for c in rule.tests_fire] + [(c, False) for c in rule.tests_no_fire]:
            path = resolve_case(rule, case)
            if path is None:
                results.append(CaseResult(rule.id, case, expect, None, "capture not found"))
                continue
            key = " ".join([str(path), *case.split()[1:]])
            if key not in fired_by_capture:
                try:
                    diag = diagnose(load(path), rules, split_case(case)[1])
                    fired_by_capture[key] = {c.rule.id for inc in diag.incidents for c in inc.causes}
                except Exception as e:  # a broken case is a failed case, not a crash
                    fired_by_capture[key] = f"{type(e).__name__}: {e}"
            fired = fired_by_capture[key]
            if isinstance(fired, str):
                results.append(CaseResult(rule.id, case, expect, None, fired))
            else:
                results.append(CaseResult(rule.id, case, expect, rule.id in fired,
                                          "fired: " + (", ".join(sorted(fired)) or "nothing")))
    return results
