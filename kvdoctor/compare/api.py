"""The library entry point: two sides in, a :class:`Comparison` out (rendered by render.py:
``text``, ``markdown``, ``to_json``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..diagnosis import Diagnosis, Options, Rule, diagnose, load_rules
from ..signals import Prepared, Window
from . import bootstrap as B
from .measures import Ctx, SignalDiff, correct_family, headline
from .sides import Side, SideSpec, load_side
from .verdict import Overall, RuleStatus, overall, rule_impacts, rule_statuses
from .workload import Workload, guard


@dataclass
class Comparison:
    before: Side
    after: Side
    before_diag: Diagnosis
    after_diag: Diagnosis
    before_prep: Prepared
    after_prep: Prepared
    workload: Workload
    signals: list[SignalDiff]
    rules: list[RuleStatus]
    overall: Overall
    resamples: int
    seed: int

    @property
    def lines(self) -> list[str]:
        """The opening lines: the workload warning (when the workloads differ), then the verdict."""
        first = self.workload.first_line()
        return ([first] if first else []) + [self.overall.headline]

    def window(self, side: str) -> Window:
        prep = self.before_prep if side == "before" else self.after_prep
        return prep.window(prep.start_s, prep.end_s)


def compare_sides(before: Side, after: Side, rules: list[Rule] | None = None, options: Options | None = None,
                  resamples: int = B.DEFAULT_RESAMPLES, seed: int = B.DEFAULT_SEED) -> Comparison:
    rules = rules if rules is not None else load_rules()
    options = (options or Options()).resolve(before.capture.meta.model or after.capture.meta.model)
    if resamples < 1000:
        raise ValueError("resamples: at least 1000")
    diag_b = diagnose(before.capture, rules, options)
    diag_a = diagnose(after.capture, rules, options)
    prep_b, prep_a = Prepared(before.capture, options.targets, options.stated), Prepared(after.capture, options.targets, options.stated)
    wl = guard(prep_b, prep_a)
    ctx = Ctx(prep_b, prep_a, prep_b.window(prep_b.start_s, prep_b.end_s), prep_a.window(prep_a.start_s, prep_a.end_s),
              wl, resamples, seed)
    sigs = headline(ctx)
    impacts = rule_impacts(diag_b, diag_a, ctx, sigs)
    correct_family(sigs + list(impacts.values()))  # Holm over every signal judged (docs/compare.md)
    statuses = rule_statuses(diag_b, diag_a, ctx, impacts)
    return Comparison(before, after, diag_b, diag_a, prep_b, prep_a, wl, sigs, statuses, overall(sigs, statuses, wl),
                      resamples, seed)


def compare(before: str | Path | SideSpec | Side, after: str | Path | SideSpec | Side, rules: list[Rule] | None = None,
            options: Options | None = None, resamples: int = B.DEFAULT_RESAMPLES, seed: int = B.DEFAULT_SEED) -> Comparison:
    """Compare two captures (or time ranges of captures, ``CAPTURE@T1..T2``)::

        from kvdoctor.compare import compare
        c = compare("before/", "after/")
        print(c.lines[0])
    """
    b = before if isinstance(before, Side) else load_side(before, "BEFORE")
    a = after if isinstance(after, Side) else load_side(after, "AFTER")
    return compare_sides(b, a, rules, options, resamples, seed)
