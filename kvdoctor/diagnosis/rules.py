"""Rule files: load (YAML as data, never code), validate against the published schema, and
turn into frozen :class:`Rule` objects. A bad file is a :class:`RuleError` naming the file,
the rule id, the field path and what to change."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from ..errors import InputError, RuleError
from ..signals import REGISTRY
from ..timeparse import parse_duration
from . import conditions as C

SEVERITY_RANK = {"critical": 3, "warning": 2, "info": 1}

#: what every output that names an experimental rule says about it
EXPERIMENTAL_NOTE = "experimental: proven only on simulated data"

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Cause:
    title: str
    confidence: float
    when: C.Cond | None
    #: a cause the data cannot confirm (a hypothesis): what to measure before changing anything.
    #: When it is the top cause, this is the first step printed, ahead of the fixes.
    measure: str = ""


@dataclass(frozen=True)
class Fix:
    title: str
    why: str
    knobs: dict[str, str]
    #: leave this fix out where the condition holds on the incident's window (e.g. "turn prefix
    #: caching on" where the evidence shows it on); unknown values keep the fix
    unless: C.Cond | None = None
    #: the fix is already in effect on the recorded server where its condition holds (over the
    #: engine's effective configuration: reported, declared or the version's default, signals
    #: config_*), by engine key ("any" for every engine without its own): it is then not advised
    #: but said to be on, with ``if_in_effect`` (what to look at instead)
    in_effect: dict[str, C.Cond] | None = None
    if_in_effect: str = ""
    #: an engine feature the fix needs (kvdoctor/engines/capabilities.py FEATURES, e.g.
    #: pd_disaggregation): engines known not to have it never see the fix
    needs: str = ""

    def possible_on(self, engine: str | None) -> bool:
        """False only where the engine is known and known to lack what the fix needs."""
        if not self.needs or not engine:
            return True
        from ..engines.capabilities import has_feature

        return has_feature(engine, self.needs) is not False

    def in_effect_on(self, engine: str | None) -> C.Cond | None:
        """The in-effect condition for this engine (its own, else the one for any engine)."""
        if not self.in_effect:
            return None
        return self.in_effect.get(engine or "", self.in_effect.get("any"))


@dataclass(frozen=True)
class FleetOutlier:
    """A replica far from its peers on ``signal`` (rule file's ``fleet.outlier``): by at least
    ``min_diff`` in the signal's unit and ``min_ratio`` times (kvdoctor/fleet/outliers.py)."""
    signal: str
    direction: str  # "high" | "low"
    min_diff: float
    min_ratio: float
    #: completes "One replica ...", and "... check <check>"
    meaning: str
    check: str


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    severity: str
    symptom: str
    when: C.Cond
    impact: str | None
    min_requests: int
    for_s: float
    causes: tuple[Cause, ...]
    evidence: tuple[str, ...]
    fixes: tuple[Fix, ...]
    references: tuple[str, ...]
    tests_fire: tuple[str, ...]
    tests_no_fire: tuple[str, ...]
    suppressed_by: tuple[str, ...]
    params: dict[str, float] = field(default_factory=dict)
    description: str = ""
    path: Path | None = None
    #: "stable", or "experimental" while no real capture or public real data proves it fires
    status: str = "stable"
    #: fired on every replica of a fleet: "capacity" (add replicas or shed load) or "shared"
    fleet_everywhere: str = "shared"
    fleet_outlier: FleetOutlier | None = None
    #: ids of the report charts that show its finding, best first (one of chart_ids()); empty:
    #: the report picks by symptom
    charts: tuple[str, ...] = ()
    #: when users are hurt by what the rule sees (an objective broken, or the capture's own
    #: baseline says they pay): where it does not hold on a window, the rule is an observation
    #: (info) there, not an incident. None: the rule's finding is harm itself (errors, OOM)
    harm: C.Cond | None = None
    #: where this holds, the finding is critical whatever its ``severity`` (a breach's size)
    critical_when: C.Cond | None = None
    #: "cause" (names why), or "objective" (says a service-level objective is broken: harm, not
    #: a cause; scored and ranked after the causes that explain it)
    kind: str = "cause"
    #: its incident takes no other finding as a cause: the harm it names has none upstream among
    #: kvdoctor's findings (an answer cut at the context limit is not explained by capacity), so
    #: a turn-growth, capacity or quality finding beside it joins a harm incident it can explain
    standalone: bool = False

    @property
    def experimental(self) -> bool:
        return self.status == "experimental"

    @property
    def tag(self) -> str:
        """Text to put after the rule's id wherever it is named: '' or ' [experimental: ...]'."""
        return f" [{EXPERIMENTAL_NOTE}]" if self.experimental else ""

    def signals(self) -> set[str]:
        out = set(self.when.signals()) | set(self.evidence)
        conds = [self.harm, self.critical_when, *(c.when for c in self.causes),
                 *(f.unless for f in self.fixes), *(c for f in self.fixes for c in (f.in_effect or {}).values())]
        for cond in conds:
            if cond is not None:
                out |= cond.signals()
        return out

    def severity_on(self, value: Callable[[str], float], slo: dict[str, float]) -> str:
        """The severity of this rule's finding on a window where it is active: ``info`` where its
        harm does not hold (an observation), ``critical`` where ``critical_when`` holds."""
        if self.harm is not None and not C.evaluate(self.harm, value, slo, self.params):
            return "info"
        if self.critical_when is not None and C.evaluate(self.critical_when, value, slo, self.params):
            return "critical"
        return self.severity

    def fixes_in_effect(self, value: Callable[[str], float], slo: dict[str, float] | None = None,
                        engine: str | None = None) -> tuple[Fix, ...]:
        """The fixes already in effect on the recorded server (their ``in_effect`` holds for its engine)."""
        out = []
        for f in self.fixes:
            cond = f.in_effect_on(engine)
            if cond is not None and C.evaluate(cond, value, slo or {}, self.params):
                out.append(f)
        return tuple(out)

    def fixes_for(self, value: Callable[[str], float], slo: dict[str, float] | None = None,
                  engine: str | None = None) -> tuple[Fix, ...]:
        """The fixes that apply given these signal values, in order: those whose ``unless``
        holds are left out (all of them kept when every one would be), and those already in
        effect are never advised (:meth:`fixes_in_effect` lists them)."""
        slo = slo or {}
        on = set(map(id, self.fixes_in_effect(value, slo, engine)))
        candidates = tuple(f for f in self.fixes if id(f) not in on)
        keep = tuple(f for f in candidates if f.unless is None or not C.evaluate(f.unless, value, slo, self.params))
        return keep or candidates


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(resources.files("kvdoctor").joinpath("schema/rule.schema.json").read_text())


def chart_ids() -> tuple[str, ...]:
    """The charts a rule may name under ``charts:``: those ``kvdoctor report`` draws (the
    schema lists them; the report's builders are checked against it by a test)."""
    return tuple(schema()["properties"]["charts"]["items"]["enum"])


def builtin_rules_dir() -> Path:
    """The shipped rules: inside the installed package, else the repository's rules/."""
    packaged = Path(str(resources.files("kvdoctor"))) / "_rules"
    if packaged.is_dir() and any(packaged.glob("*.yaml")):
        return packaged
    return Path(__file__).resolve().parents[2] / "rules"


def check_schema(path: Path, rule_id: str, raw: Any) -> None:
    """RuleError (located) at the first place the rule file breaks the rule schema."""
    import jsonschema

    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        msg = e.message if len(e.message) < 200 else e.message[:200] + "..."
        if e.validator == "enum" and list(e.absolute_path)[:1] == ["charts"]:
            msg = f"unknown chart {e.instance!r}; known: {', '.join(chart_ids())}"
        raise _fail(path, rule_id, where, f"{msg}; see kvdoctor/schema/rule.schema.json")


def _fail(path: Path, rule_id: str, where: str, message: str) -> RuleError:
    return RuleError(f"{path}: rule {rule_id}: {where}: {message}")


#: a rule file is a page of YAML: these bound what a hostile one can cost (a 619-byte
#: "billion laughs" alias tree otherwise expands to minutes of validation, or memory)
MAX_RULE_BYTES = 256 << 10
MAX_RULE_NODES = 50_000  # scalars, lists and maps, with every alias expanded
MAX_RULE_DEPTH = 40  # nesting of lists and maps, conditions included


def read_rule_yaml(path: Path) -> Any:
    """The rule file's YAML as plain data, refused (RuleError, located) when too large, too
    deep, or expanding through aliases to more than MAX_RULE_NODES nodes. The node graph is
    checked before anything is built from it, so the check costs the file's size, not the
    expansion's."""
    try:
        size = path.stat().st_size
        if size > MAX_RULE_BYTES:
            raise RuleError(f"{path}: {size} bytes; a rule file is at most {MAX_RULE_BYTES >> 10} KiB")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RuleError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RuleError(f"{path}: cannot read ({e.strerror or e})") from None
    # the safe loader (libyaml's when present: 8x faster): tags that build objects are refused
    loader = _SAFE_LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_nodes(path, node, 0, {})
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise RuleError(f"{path}: {where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    finally:
        loader.dispose()


def _expanded_nodes(path: Path, node: yaml.Node, depth: int, done: dict[int, int]) -> int:
    """Nodes under ``node`` with aliases expanded; memoised per node, so linear in the file."""
    hit = done.get(id(node))
    if hit is not None:
        return hit
    if depth > MAX_RULE_DEPTH:  # also ends a recursive alias (a node inside itself)
        raise RuleError(f"{path}: line {node.start_mark.line + 1}: nested deeper than {MAX_RULE_DEPTH} levels "
                        "(or an alias that refers to itself)")
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_expanded_nodes(path, c, depth + 1, done) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(_expanded_nodes(path, k, depth + 1, done) + _expanded_nodes(path, v, depth + 1, done)
                 for k, v in node.value)
    if n > MAX_RULE_NODES:
        raise RuleError(f"{path}: line {node.start_mark.line + 1}: expands to more than {MAX_RULE_NODES} values "
                        "(YAML aliases); write the rule out instead")
    done[id(node)] = n
    return n


def load_rule(path: Path, overrides: dict[str, float] | None = None, *, schema_checked: bool = True) -> Rule:
    """A rule file as a Rule. ``schema_checked=False`` for the shipped rules only: the test suite
    checks each against the schema (tests/test_rules.py), and jsonschema costs a diagnosis ~0.1 s
    to import and run; a rule from a --rules folder is always checked."""
    raw = read_rule_yaml(path)
    rule_id = raw.get("id", path.stem) if isinstance(raw, dict) else path.stem
    if schema_checked:
        check_schema(path, rule_id, raw)
    if raw["id"] != path.stem:
        raise _fail(path, rule_id, "id", f"must match the file name ({path.stem!r}): one rule a file, named by its id")
    params = dict(raw.get("params") or {})
    for key, value in (overrides or {}).items():
        if key not in params:
            # a bad --set is bad input (exit 2), not a bad rule file
            raise InputError(f"--set {rule_id}.{key}: rule {rule_id} has no parameter {key!r}; known: {', '.join(params) or 'none'}")
        params[key] = value
    known = set(REGISTRY)

    def cond(spec, where):
        try:
            return C.parse(spec, where, known, params)
        except C.ConditionError as e:
            raise _fail(path, rule_id, e.path, e.message) from None

    for i, name in enumerate(raw["evidence"]):
        if name not in known:
            raise _fail(path, rule_id, f"evidence[{i}]", f"unknown signal {name!r}; `kvdoctor signals` lists them")
    impact = raw["symptom"].get("impact")
    if impact and impact not in known:
        raise _fail(path, rule_id, "symptom.impact", f"unknown signal {impact!r}")
    fleet = raw.get("fleet") or {}
    outlier = FleetOutlier(**fleet["outlier"]) if "outlier" in fleet else None
    if outlier and outlier.signal not in known:
        raise _fail(path, rule_id, "fleet.outlier.signal", f"unknown signal {outlier.signal!r}")
    try:
        for_s = parse_duration(raw.get("for", "0s"))
    except ValueError as e:
        raise _fail(path, rule_id, "for", str(e)) from None
    return Rule(
        id=raw["id"], title=raw["title"], severity=raw["severity"], description=raw.get("description", ""),
        symptom=raw["symptom"]["name"], when=cond(raw["symptom"]["when"], "symptom.when"),
        impact=impact, min_requests=int(raw["symptom"].get("min_requests", 0)), for_s=for_s,
        causes=tuple(Cause(c["title"], float(c["confidence"]), cond(c["when"], f"causes[{i}].when") if "when" in c else None,
                           c.get("measure", ""))
                     for i, c in enumerate(raw["causes"])),
        evidence=tuple(raw["evidence"]),
        fixes=tuple(Fix(f["title"], f.get("why", ""), dict(f["knobs"]),
                        cond(f["unless"], f"fixes[{i}].unless") if "unless" in f else None,
                        _in_effect(f, i, cond),
                        f.get("if_in_effect", ""), _needs(path, rule_id, f, i))
                    for i, f in enumerate(raw["fixes"])),
        harm=cond(raw["harm"], "harm") if "harm" in raw else None, kind=raw.get("kind", "cause"),
        critical_when=cond(raw["critical_when"], "critical_when") if "critical_when" in raw else None,
        references=tuple(raw.get("references", [])),
        tests_fire=tuple(raw["tests"]["fire"]), tests_no_fire=tuple(raw["tests"]["no_fire"]),
        suppressed_by=tuple(raw.get("suppressed_by", [])), params=params, path=path,
        status=raw.get("status", "stable"), fleet_everywhere=fleet.get("on_every_replica", "shared"),
        fleet_outlier=outlier, charts=tuple(raw.get("charts", ())), standalone=bool(raw.get("standalone", False)),
    )


ENGINE_KEYS = ("vllm", "sglang", "tgi", "llamacpp", "trtllm", "any")


def _needs(path: Path, rule_id: str, fix: dict, i: int) -> str:
    need = fix.get("needs", "")
    if need:
        from ..engines.capabilities import FEATURES

        if need not in FEATURES:
            raise _fail(path, rule_id, f"fixes[{i}].needs", f"unknown engine feature {need!r}; known: {', '.join(FEATURES)}")
    return need


def _in_effect(fix: dict, i: int, cond) -> dict | None:
    """A fix's ``in_effect``: one condition for every engine, or a mapping engine key -> condition."""
    spec = fix.get("in_effect")
    if spec is None:
        return None
    where = f"fixes[{i}].in_effect"
    if isinstance(spec, dict) and spec and set(spec) <= set(ENGINE_KEYS):
        return {eng: cond(c, f"{where}.{eng}") for eng, c in spec.items()}
    return {"any": cond(spec, where)}


@lru_cache(maxsize=None)
def _builtin_rule(rule_id: str) -> Rule:
    return load_rule(builtin_rules_dir() / f"{rule_id}.yaml", schema_checked=False)


def builtin_params(rule_id: str) -> dict[str, float]:
    """A shipped rule's params, for code that judges the same thing outside the rule engine
    (`kvdoctor quality`'s verdict, the plan's KV warnings): rules/ID.yaml is the one source of
    the thresholds, so the two cannot drift apart."""
    return dict(_builtin_rule(rule_id).params)


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, dict[str, float]]:
    """``RULE.PARAM=VALUE`` strings from the command line, by rule id."""
    out: dict[str, dict[str, float]] = {}
    for item in items:
        m = re.fullmatch(r"([a-z][a-z0-9-]*)\.([a-z_][a-z0-9_]*)=(-?\d+(?:\.\d+)?)", item.strip())
        if not m:
            raise InputError(f"--set {item!r}: expected RULE.PARAM=NUMBER, e.g. prefill-bound.min_corr=0.5")
        out.setdefault(m[1], {})[m[2]] = float(m[3])
    return out


def load_rules(extra_dirs: list[Path] | tuple[Path, ...] = (), overrides: dict[str, dict[str, float]] | None = None,
               include_builtin: bool = True) -> list[Rule]:
    """Shipped rules plus each ``--rules DIR``; a later rule with the same id replaces one before."""
    overrides = overrides or {}
    builtin = builtin_rules_dir()
    dirs = ([builtin] if include_builtin else []) + [Path(d) for d in extra_dirs]
    by_id: dict[str, Rule] = {}
    for d in dirs:
        if not d.is_dir():
            raise RuleError(f"{d}: no such rules folder; expected a folder of *.yaml rule files")
        for path in sorted(d.glob("*.yaml")):
            rule = load_rule(path, overrides.get(path.stem), schema_checked=d != builtin)
            by_id[rule.id] = rule
    unknown = set(overrides) - set(by_id)
    if unknown:
        raise InputError(f"--set: no rule with id {', '.join(sorted(unknown))}")
    for rule in by_id.values():
        for other in rule.suppressed_by:
            if other not in by_id:
                raise _fail(rule.path, rule.id, "suppressed_by", f"no rule with id {other!r}")
    return sorted(by_id.values(), key=lambda r: r.id)
