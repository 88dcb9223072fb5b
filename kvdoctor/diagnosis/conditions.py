"""Rule conditions: a small declarative language, parsed into a tree and evaluated over a
window. Nothing in a rule file is ever executed as code.

A leaf is ``SIGNAL OP VALUE`` where OP is one of > >= < <= == != and VALUE is a number,
``[FACTOR *] SIGNAL``, ``slo.NAME`` (only true when that SLO was given) or ``param.NAME``
(a rule parameter a user can override). Leaves combine with ``all``, ``any`` and ``not``.
A signal the window cannot compute (NaN) makes its leaf *unknown*, and unknown propagates by
Kleene's three-valued logic: ``not`` unknown is unknown; ``all`` is false if any child is false,
else unknown if any is; ``any`` is true if any child is true, else unknown if any is. A rule
acts only on a condition that is *true*, so it never fires on data it does not have. A leaf
against ``slo.NAME`` with no such SLO given is false (no objective, nothing violated).
"""
from __future__ import annotations

import functools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Union

OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne,
}
_NAME = r"[a-z_][a-z0-9_]*"
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_LEAF = re.compile(
    rf"^\s*(?P<lhs>{_NAME})\s*(?P<op>>=|<=|==|!=|>|<)\s*"
    rf"(?:(?P<factor>{_NUM})\s*\*\s*)?(?P<rhs>{_NUM}|(?:slo|param)\.{_NAME}|{_NAME})\s*$"
)


class ConditionError(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class Leaf:
    lhs: str
    op: str
    rhs: str  # a number as text, a signal name, slo.X or param.X
    factor: float = 1.0
    text: str = ""

    def signals(self) -> set[str]:
        out = {self.lhs}
        if _is_signal(self.rhs):
            out.add(self.rhs)
        return out


@dataclass(frozen=True)
class Node:
    kind: str  # all | any | not
    children: tuple["Cond", ...]

    def signals(self) -> set[str]:
        return set().union(*(c.signals() for c in self.children))


Cond = Union[Leaf, Node]


def _is_signal(rhs: str) -> bool:
    return not re.fullmatch(_NUM, rhs) and not rhs.startswith(("slo.", "param."))


def parse(spec: Any, path: str, known_signals: set[str], params: dict[str, float]) -> Cond:
    """Parse a condition, checking every signal and parameter name it uses."""
    if isinstance(spec, str):
        m = _LEAF.match(spec)
        if not m:
            raise ConditionError(path, f"cannot read condition {spec!r}; expected 'SIGNAL OP VALUE', "
                                       "e.g. 'ttft_prompt_corr >= 0.6' or 'tpot_p99_s > 2 * tpot_p50_s'")
        leaf = Leaf(m["lhs"], m["op"], m["rhs"], float(m["factor"]) if m["factor"] else 1.0, spec.strip())
        for name in leaf.signals():
            if name not in known_signals:
                close = [s for s in known_signals if s.split("_")[0] == name.split("_")[0]][:6]
                hint = f"; similar: {', '.join(sorted(close))}" if close else "; `kvdoctor signals` lists them"
                raise ConditionError(path, f"unknown signal {name!r}{hint}")
        if leaf.rhs.startswith("param.") and leaf.rhs[6:] not in params:
            raise ConditionError(path, f"unknown parameter {leaf.rhs!r}; declare it under params:")
        return leaf
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, body), = spec.items()
        if kind in ("all", "any") and isinstance(body, list) and body:
            return Node(kind, tuple(parse(c, f"{path}.{kind}[{i}]", known_signals, params) for i, c in enumerate(body)))
        if kind == "not":
            return Node("not", (parse(body, f"{path}.not", known_signals, params),))
    raise ConditionError(path, "expected a condition string, or {all: [...]}, {any: [...]} or {not: ...}")


def evaluate(cond: Cond, value: Callable[[str], float], slo: dict[str, float], params: dict[str, float]) -> bool:
    """True only when the condition holds on known values."""
    return evaluate3(cond, value, slo, params) is True


def evaluate3(cond: Cond, value: Callable[[str], float], slo: dict[str, float],
              params: dict[str, float]) -> bool | None:
    """True, False, or None (unknown: the answer depends on a signal the window lacks)."""
    if isinstance(cond, Node):
        if cond.kind == "not":
            got = evaluate3(cond.children[0], value, slo, params)
            return None if got is None else not got
        decisive = cond.kind == "any"  # True decides an any, False decides an all
        unknown = False
        for c in cond.children:  # in order, stopping at the first decisive answer: signals are costly
            got = evaluate3(c, value, slo, params)
            if got is decisive:
                return decisive
            unknown = unknown or got is None
        return None if unknown else not decisive
    if cond.rhs.startswith("slo.") and cond.rhs[4:] not in slo:
        return False
    lhs = value(cond.lhs)
    rhs = resolve(cond.rhs, value, slo, params)
    if rhs is None or math.isnan(lhs) or math.isnan(rhs):
        return None
    return OPS[cond.op](lhs, cond.factor * rhs)


def can_hold(cond: Cond, value: Callable[[str], float], slo: dict[str, float]) -> bool:
    """Whether the condition could be true on some window of this data: a leaf whose signal is
    unknown (or whose SLO was not given) never can; a leaf on known signals might."""
    if isinstance(cond, Leaf):
        if cond.rhs.startswith("slo.") and cond.rhs[4:] not in slo:
            return False
        return not any(math.isnan(value(s)) for s in cond.signals())
    if cond.kind == "not":  # not(unknown) stays unknown: possible only on fully known input
        return all(not math.isnan(value(s)) for s in cond.signals())
    parts = (can_hold(c, value, slo) for c in cond.children)  # the first decisive child ends it: signals are costly
    return all(parts) if cond.kind == "all" else any(parts)


def unknown_signals(cond: Cond, value: Callable[[str], float], slo: dict[str, float],
                    params: dict[str, float]) -> list[str]:
    """The signals whose unknown values leave the condition unknown, in rule order: those of
    undecided leaves under undecided nodes (a decided branch needs nothing more)."""
    if evaluate3(cond, value, slo, params) is not None:
        return []
    if isinstance(cond, Leaf):
        return [s for s in (cond.lhs, cond.rhs) if _is_signal(s) and math.isnan(value(s))]
    out: list[str] = []
    for c in cond.children:
        out += [s for s in unknown_signals(c, value, slo, params) if s not in out]
    return out


def resolve(rhs: str, value: Callable[[str], float], slo: dict[str, float], params: dict[str, float]) -> float | None:
    if rhs.startswith("slo."):
        return slo.get(rhs[4:])
    if rhs.startswith("param."):
        return params.get(rhs[6:])
    number = _constant(rhs)
    return number if number is not None else value(rhs)


@functools.lru_cache(maxsize=1024)
def _constant(rhs: str) -> float | None:
    """The number a right-hand side spells, else None (a signal): read once per text, not at
    every evaluation (a diagnosis evaluates ~10,000 leaves)."""
    return float(rhs) if re.fullmatch(_NUM, rhs) else None


def leaves(cond: Cond) -> list[Leaf]:
    if isinstance(cond, Leaf):
        return [cond]
    return [leaf for c in cond.children for leaf in leaves(c)]
