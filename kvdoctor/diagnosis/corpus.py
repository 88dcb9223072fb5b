"""Precision and recall of each rule over a labelled corpus (`kvdoctor rules test --corpus`).

The corpus file (tests/labels.yaml, written by scripts/label-corpus from the raw source files)
lists captures (a capture folder, or a public file with the import that reads it) and, for
each, its true causes by rule id. A rule is counted as reporting a cause when it is among the
causes of any incident of the capture diagnosed with the whole rule set, as a user would see
it. Label ids with no rule (a cause no rule covers yet) count only as misses. An import: spec
carries what `kvdoctor import` would be told: format, src, columns, options, model, engine,
gpu (decode's bandwidth bound is estimated from it) and attribution.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..capture import load
from ..errors import InputError
from .api import diagnose
from .evaluate import Options
from .rules import Rule


@dataclass
class Case:
    name: str
    causes: dict[str, str]
    capture: Path | None = None
    importing: dict[str, Any] | None = None
    #: the server's context limit where the capture lacks it (diagnose --max-model-len)
    max_model_len: int | None = None
    #: labels whose criterion restates the rule's own signal and threshold: they agree with the
    #: rule by construction, so a hit on them is consistency, not evidence
    circular: frozenset[str] = frozenset()
    fired: set[str] = field(default_factory=set)
    error: str = ""


@dataclass
class Score:
    rule: str
    has_rule: bool
    experimental: bool = False
    tp: list[str] = field(default_factory=list)
    fp: list[str] = field(default_factory=list)
    fn: list[str] = field(default_factory=list)
    #: the true positives whose label is circular (Case.circular)
    tp_circular: list[str] = field(default_factory=list)

    @property
    def precision(self) -> float | None:
        n = len(self.tp) + len(self.fp)
        return len(self.tp) / n if n else None

    @property
    def recall(self) -> float | None:
        n = len(self.tp) + len(self.fn)
        return len(self.tp) / n if n else None


def read_corpus(path: Path) -> list[Case]:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"{path}: cannot read the corpus ({e}); expected YAML with a corpus: list") from None
    entries = raw.get("corpus") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise InputError(f"{path}: expected a top-level 'corpus:' list of captures with their causes")
    bases = [path.resolve().parent, path.resolve().parent.parent, Path.cwd()]

    def at(rel: str) -> Path:  # relative to the corpus file's folder, its parent, or here
        return next((b / rel for b in bases if (b / rel).exists()), bases[1] / rel)

    cases = []
    for i, e in enumerate(entries):
        where = f"{path}: corpus[{i}]"
        if not isinstance(e, dict) or "name" not in e or not isinstance(e.get("causes", {}), dict):
            raise InputError(f"{where}: expected name:, causes: {{rule: figure}} and capture: or import:")
        if ("capture" in e) == ("import" in e):
            raise InputError(f"{where} ({e['name']}): give exactly one of capture: (a folder) or import: (a file and format)")
        if "import" in e:
            _check_gpu(e["import"], f"{where} ({e['name']})")
        circ = e.get("circular") or []
        if not isinstance(circ, list) or not set(circ) <= set(e.get("causes") or {}):
            raise InputError(f"{where} ({e['name']}): circular: must list labels among its causes")
        cases.append(Case(e["name"], dict(e.get("causes") or {}),
                          capture=at(e["capture"]) if "capture" in e else None,
                          importing={**e["import"], "src": str(at(e["import"]["src"]))} if "import" in e else None,
                          max_model_len=e.get("max_model_len"), circular=frozenset(circ)))
    return cases


def _check_gpu(spec: Any, where: str) -> None:
    """import: gpu: names the GPU the public file's server ran on (as `kvdoctor import --gpu`):
    decode's bandwidth bound is estimated from it, so it must be one the plan tables know."""
    from ..plan.models import GPU_MEM_BW, gpu_bandwidth

    gpu = spec.get("gpu") if isinstance(spec, dict) else None
    if gpu is None:
        return
    if not isinstance(gpu, str) or gpu_bandwidth(gpu) is None:
        raise InputError(f"{where}: import: gpu: {gpu!r} is not a GPU with a known memory bandwidth; "
                         f"expected one of {', '.join(GPU_MEM_BW)}")


def _import(spec: dict[str, Any], out: Path) -> Path:
    """A public file read by its importer into a capture folder, as `kvdoctor import` would."""
    from .. import importers
    from ..importers.base import write_capture

    module = importers.get(spec["format"])
    options = dict(spec.get("options") or {})
    if spec.get("columns"):
        options["columns"] = dict(spec["columns"])
    imported = module.read([Path(spec["src"])], options)
    meta = dataclasses.replace(imported.meta, model=spec.get("model") or imported.meta.model,
                               engine=spec.get("engine") or imported.meta.engine,
                               gpu=spec.get("gpu") or imported.meta.gpu,
                               attribution=spec.get("attribution") or imported.meta.attribution)
    write_capture(dataclasses.replace(imported, meta=meta), out)
    return out


def evaluate(cases: list[Case], rules: list[Rule]) -> list[Score]:
    """Diagnose every case and score each rule (and each label id without a rule)."""
    with tempfile.TemporaryDirectory(prefix="kvdoctor-corpus-") as tmp:
        for k, case in enumerate(cases):
            try:
                path = case.capture if case.capture is not None else _import(case.importing, Path(tmp) / str(k))
                diag = diagnose(load(path), rules, Options(max_model_len_tokens=case.max_model_len))
                case.fired = {c.rule.id for inc in diag.incidents for c in inc.causes}
            except Exception as e:  # a broken case is reported, not a crash
                case.error = f"{type(e).__name__}: {e}"
    ids = [r.id for r in rules]
    labels_only = sorted({c for case in cases for c in case.causes} - set(ids))
    status = {r.id: r.experimental for r in rules}
    scores = {rid: Score(rid, rid in ids, status.get(rid, False)) for rid in ids + labels_only}
    for case in cases:
        if case.error:
            continue
        for rid, s in scores.items():
            fired, true = rid in case.fired, rid in case.causes
            if fired and true:
                s.tp.append(case.name)
                if rid in case.circular:
                    s.tp_circular.append(case.name)
            elif fired:
                s.fp.append(case.name)
            elif true:
                s.fn.append(case.name)
    return list(scores.values())


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def table(scores: list[Score], cases: list[Case]) -> str:
    """The Markdown table docs/rules.md carries (GitHub renders it; it reads as text too)."""
    out = [f"Over {sum(not c.error for c in cases)} labelled captures "
           f"({sum(1 for c in cases if c.capture)} real-server captures, {sum(1 for c in cases if c.importing)} public files).",
           "", "| rule | labelled | fired | TP | of them circular | FP | FN | precision | recall | false positives / misses |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s in scores:
        name = f"`{s.rule}`" + (" (no rule)" if not s.has_rule else " (experimental)" if s.experimental else "")
        wrong = ", ".join([f"+{n}" for n in s.fp] + [f"−{n}" for n in s.fn]) or ""
        circ = f"**{len(s.tp_circular)}** (circular)" if s.tp_circular else "0"
        out.append(f"| {name} | {len(s.tp) + len(s.fn)} | {len(s.tp) + len(s.fp)} | {len(s.tp)} | {circ} | {len(s.fp)} | "
                   f"{len(s.fn)} | {_pct(s.precision)} | {_pct(s.recall)} | {wrong} |")
    n_tp, n_circ = sum(len(s.tp) for s in scores), sum(len(s.tp_circular) for s in scores)
    out += ["", f"{n_circ} of {n_tp} true positives are circular: their label restates the rule's own signal and "
                "threshold (`circular:` in the labels), so they agree by construction. A consistency check on the "
                "data the rules were tuned on, not an accuracy measure (that is docs/accuracy.md, from benchmarks/faults)."]
    errors = [c for c in cases if c.error]
    if errors:
        out += ["", *[f"could not diagnose {c.name}: {c.error}" for c in errors]]
    return "\n".join(out) + "\n"


def to_json(scores: list[Score], cases: list[Case]) -> dict[str, Any]:
    return {
        "rules": [{"rule": s.rule, "has_rule": s.has_rule, "experimental": s.experimental, "tp": s.tp, "tp_circular": s.tp_circular, "fp": s.fp, "fn": s.fn,
                   "precision": s.precision, "recall": s.recall} for s in scores],
        "captures": [{"name": c.name, "labels": sorted(c.causes), "fired": sorted(c.fired), "error": c.error or None}
                     for c in cases],
    }
