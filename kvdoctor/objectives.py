"""Service-level objectives: what "harm" means for a diagnosis.

An objective bounds one latency percentile or the error rate (``ttft_p99 <= 2 s``). Objectives
come from three places, later ones winning per name: the workload class's defaults (published
practice, docs/slo.md), an SLO file (``kvdoctor.yaml``: defaults, then per served model), and
``--slo NAME=VALUE`` on the command line. A diagnosis judges every objective it was given and
says which were defaults.

Units are in the names: a target of ``ttft_p99_s`` is seconds, of ``error_rate`` a fraction.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import InputError

#: what an objective can bound: NAME -> (symptom its breach is, the per-request column each
#: request is judged on, label people read). A percentile suffix _p50/_p90/_p99 is added to the
#: latency ones (their signals are PREFIX_pNN_s, kvdoctor/signals/latency.py).
LATENCY_OBJECTIVES: dict[str, tuple[str, str, str]] = {
    "ttft": ("ttft", "ttft_s", "TTFT"),
    "tpot": ("tpot", "tpot_s", "TPOT"),
    "itl": ("tpot", "itl_p99_s", "ITL"),
    "e2e": ("latency", "e2e_s", "E2E latency"),
    "queue": ("ttft", "queue_s", "queue time"),
}
PERCENTILES = (50, 90, 99)
#: the error rate: failed requests over all (cancellations and client-side flags are not failures)
ERROR_RATE = "error_rate"

#: default objectives per workload class (docs/slo.md cites each). "chat" is MLPerf Inference's
#: Server scenario for Llama-3.1-8B (TTFT P99 2 s, TPOT P99 100 ms); "interactive" its interactive
#: scenario (500 ms, 30 ms); "batch" its Offline scenario, which bounds no latency. The error rate
#: (1%: 99% of requests succeed) is kvdoctor's own default for every class.
WORKLOADS: dict[str, dict[str, float]] = {
    "chat": {"ttft_p99_s": 2.0, "tpot_p99_s": 0.100, ERROR_RATE: 0.01},
    "interactive": {"ttft_p99_s": 0.5, "tpot_p99_s": 0.030, ERROR_RATE: 0.01},
    "batch": {ERROR_RATE: 0.01},
}
DEFAULT_WORKLOAD = "chat"

_SLO = re.compile(r"^([a-z][a-z0-9_]*)\s*(?:=|<=|<)\s*(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(ms|s|%)?$")


#: a target key for one route's objective: SIGNAL@ROUTE (``ttft_p99_s@/v1/chat/completions``)
ROUTE_SEP = "@"


@dataclass(frozen=True)
class Objective:
    #: the signal it bounds (``ttft_p99_s``, ``error_rate``): the value must stay at or below target
    signal: str
    target: float
    #: where it came from: "--slo", "kvdoctor.yaml", "default (chat)", ...
    source: str
    #: the API path whose requests it judges (``/v1/chat/completions``); None: every request
    route: str | None = None

    @property
    def key(self) -> str:
        """The target's key: the signal, or SIGNAL@ROUTE for one route's objective."""
        return self.signal if self.route is None else f"{self.signal}{ROUTE_SEP}{self.route}"

    @property
    def stated(self) -> bool:
        return not self.source.startswith("default")

    @property
    def kind(self) -> str:
        """``ttft``, ``tpot``, ``itl``, ``e2e``, ``queue`` or ``error_rate``."""
        return self.signal if self.signal == ERROR_RATE else self.signal.split("_")[0]

    @property
    def percentile(self) -> int | None:
        return None if self.signal == ERROR_RATE else int(self.signal.split("_")[1][1:])

    @property
    def symptom(self) -> str:
        return "errors" if self.signal == ERROR_RATE else LATENCY_OBJECTIVES[self.kind][0]

    @property
    def column(self) -> str | None:
        """The per-request column each request is judged on (None for the error rate)."""
        return None if self.signal == ERROR_RATE else LATENCY_OBJECTIVES[self.kind][1]

    @property
    def label(self) -> str:
        """``TTFT P99``, ``error rate``, ``TTFT P99 of /v1/chat/completions``."""
        what = "error rate" if self.signal == ERROR_RATE else f"{LATENCY_OBJECTIVES[self.kind][2]} P{self.percentile}"
        return what if self.route is None else f"{what} of {self.route}"

    @property
    def unit(self) -> str:
        return "fraction" if self.signal == ERROR_RATE else "s"

    def to_json(self) -> dict[str, Any]:
        out = {"signal": self.signal, "target": self.target, "unit": self.unit, "source": self.source}
        return out | ({"route": self.route} if self.route is not None else {})


def objective_signals() -> list[str]:
    """Every signal an objective can bound."""
    return [f"{k}_p{q}_s" for k in LATENCY_OBJECTIVES for q in PERCENTILES] + [ERROR_RATE]


def _canonical(name: str) -> str | None:
    """``ttft_p99`` or ``ttft_p99_s`` -> ``ttft_p99_s``; ``error_rate`` stays; None if unknown."""
    if name == ERROR_RATE:
        return name
    base = name.removesuffix("_s")
    m = re.fullmatch(r"([a-z0-9]+)_p(\d+)", base)
    if m and m[1] in LATENCY_OBJECTIVES and int(m[2]) in PERCENTILES:
        return f"{base}_s"
    return None


def parse_one(name: str, value: Any, where: str) -> tuple[str, float]:
    """One objective as written (``ttft_p99``, ``"2s"``) -> (signal, target); InputError naming
    ``where`` (the option or the file and key) otherwise."""
    signal = _canonical(str(name).strip())
    if signal is None:
        known = ", ".join(f"{k}_p{{{','.join(map(str, PERCENTILES))}}}" for k in LATENCY_OBJECTIVES)
        raise InputError(f"{where}: no objective {name!r}; objectives bound {known} or error_rate")
    text = str(value).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(ms|s|%)?", text)
    if not m:
        raise InputError(f"{where}: {name} = {value!r}: expected a number with a unit, e.g. 2s, 80ms or 1%")
    num, unit = float(m[1]), m[2]
    if signal == ERROR_RATE:
        if unit in ("s", "ms"):
            raise InputError(f"{where}: error_rate = {value!r}: an error rate is a share, e.g. 1% or 0.01")
        target = num / 100 if unit == "%" else num
        if not 0 <= target <= 1:
            raise InputError(f"{where}: error_rate = {value!r}: expected 0% to 100%")
        return signal, target
    if unit == "%":
        raise InputError(f"{where}: {name} = {value!r}: a latency objective is a time, e.g. 2s or 80ms")
    if unit is None:
        raise InputError(f"{where}: {name} = {value!r}: give the unit, e.g. {text}s or {text}ms")
    target = num / 1000 if unit == "ms" else num
    if not (0 < target < 86400 * 7) or not math.isfinite(target):
        raise InputError(f"{where}: {name} = {value!r}: expected a time above 0 and under a week")
    return signal, target


def parse_slo(items: Iterable[str]) -> dict[str, float]:
    """``--slo ttft_p99=2s --slo error_rate=1%`` -> {"ttft_p99_s": 2.0, "error_rate": 0.01}."""
    out: dict[str, float] = {}
    for item in items:
        m = _SLO.match(str(item).strip())
        if not m:
            raise InputError(f"--slo {item!r}: expected NAME=VALUE with a unit, e.g. ttft_p99=2s, tpot_p99=80ms "
                             "or error_rate=1%")
        signal, target = parse_one(m[1], m[2] + (m[3] or ""), f"--slo {item!r}")
        out[signal] = target
    return out


def load_slo_file(path: str | Path, model: str | None = None) -> tuple[dict[str, float], str | None]:
    """Objectives from an SLO file, and the workload class it names (None: not named). A key of the
    returned targets is a signal, or SIGNAL@ROUTE for one route's objective (``Objective.key``).

    .. code-block:: yaml

        workload: chat            # chat | interactive | batch: the defaults under what follows
        slo:                      # every model
          ttft_p99: 2s
          error_rate: 1%
        models:                   # per served model (the capture's model name), over the above
          llama-3.1-8b:
            slo: {ttft_p99: 1s}
            workload: interactive
        routes:                   # per API path: judged on that route's requests only
          /v1/completions:
            slo: {ttft_p99: 10s}
    """
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read the SLO file ({e.strerror or e})") from None
    try:
        raw = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise InputError(f"{p}: line {mark.line + 1 if mark else '?'}: not valid YAML") from None
    if not isinstance(raw, dict):
        raise InputError(f"{p}: expected a mapping with slo: (and optionally workload:, models:)")
    unknown = set(raw) - {"slo", "workload", "models", "routes"}
    if unknown:
        raise InputError(f"{p}: unknown key {sorted(unknown)[0]!r}; expected slo, workload, models, routes")
    targets, workload = _section(raw, str(p))
    models = raw.get("models") or {}
    if not isinstance(models, dict):
        raise InputError(f"{p}: models: expected a mapping of model name -> {{slo: ..., workload: ...}}")
    if model is not None:
        for name, section in models.items():
            if str(name).lower() == model.lower() or str(name).lower() == model.lower().rsplit("/", 1)[-1]:
                if not isinstance(section, dict) or set(section) - {"slo", "workload"}:
                    raise InputError(f"{p}: models.{name}: expected slo: and/or workload:")
                more, wl = _section(section, f"{p}: models.{name}")
                targets |= more
                workload = wl or workload
                break
    routes = raw.get("routes") or {}
    if not isinstance(routes, dict):
        raise InputError(f"{p}: routes: expected a mapping of API path -> {{slo: ...}}")
    for route, section in routes.items():
        if not isinstance(route, str) or not route.startswith("/"):
            raise InputError(f"{p}: routes: {route!r}: a route is an API path such as /v1/chat/completions")
        if not isinstance(section, dict) or set(section) - {"slo"}:
            raise InputError(f"{p}: routes.{route}: expected slo:")
        more, _ = _section(section, f"{p}: routes.{route}")
        targets |= {f"{sig}{ROUTE_SEP}{route}": t for sig, t in more.items()}
    return targets, workload


def _section(raw: Mapping[str, Any], where: str) -> tuple[dict[str, float], str | None]:
    slo = raw.get("slo") or {}
    if not isinstance(slo, dict):
        raise InputError(f"{where}: slo: expected a mapping such as {{ttft_p99: 2s, error_rate: 1%}}")
    targets = dict(parse_one(k, v, f"{where}: slo.{k}") for k, v in slo.items())
    workload = raw.get("workload")
    if workload is not None:
        workload = check_workload(str(workload), f"{where}: workload")
    return targets, workload


def check_workload(name: str, where: str = "--workload") -> str:
    if name not in WORKLOADS:
        raise InputError(f"{where}: {name!r}: expected one of {', '.join(WORKLOADS)}")
    return name


def resolve(stated: Mapping[str, float] | None = None, workload: str | None = None,
            file_targets: Mapping[str, float] | None = None, file_name: str = "SLO file",
            defaults: bool = True) -> tuple[Objective, ...]:
    """The objectives a diagnosis judges: the workload's defaults (unless ``defaults`` is False),
    then the file's, then the command line's, later ones winning per signal."""
    workload = workload or DEFAULT_WORKLOAD
    out: dict[str, Objective] = {}
    if defaults:
        for sig, target in WORKLOADS[check_workload(workload)].items():
            out[sig] = Objective(sig, target, f"default ({workload})")
    for key, target in (file_targets or {}).items():
        sig, _, route = key.partition(ROUTE_SEP)
        out[key] = Objective(sig, target, file_name, route or None)
    for sig, target in (stated or {}).items():
        out[sig] = Objective(sig, target, "--slo")
    return tuple(out[k] for k in sorted(out, key=lambda k: (_order(k.partition(ROUTE_SEP)[0]), k)))


def _order(signal: str) -> tuple[int, str]:
    kinds = [*LATENCY_OBJECTIVES, ERROR_RATE]
    kind = signal if signal == ERROR_RATE else signal.split("_")[0]
    return kinds.index(kind) if kind in kinds else len(kinds), signal


def targets(objectives: Iterable[Objective]) -> dict[str, float]:
    """key -> target (``Objective.key``: the signal, or SIGNAL@ROUTE), as rule conditions read the
    capture-wide ones (``slo.ttft_p99_s``) and the harm signals judge all of them."""
    return {o.key: o.target for o in objectives}
