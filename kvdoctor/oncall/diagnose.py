"""One alert's instance diagnosed through Prometheus: the fleet path (kvdoctor/prometheus, kvdoctor/fleet) narrowed to
one instance, over the alert's window, rendered with the on-call summary (report/summary.py)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..fleet import engine_rules
from ..prometheus import PromClient, Selectors, capture_for, fetch


@dataclass
class Setup:
    """What every diagnosis shares: where Prometheus is and how to read it."""
    prometheus: str
    rules: list
    lookback_s: float = 300.0
    #: how far before the alert's start the window opens (the lead-up is part of the story)
    before_s: float = 900.0
    #: seconds between evaluations; None: the window over 300, at least 2 s
    step_s: float | None = None
    slo: dict[str, float] = field(default_factory=dict)
    #: the rest of the objectives (--workload, --slo-file, --no-default-slo), as Options takes them
    workload: str | None = None
    slo_file: str | None = None
    default_objectives: bool = True
    bearer_token: str | None = None
    timeout_s: float = 30.0
    group_by: str = "instance"


@dataclass
class Result:
    text: str | None = None          # the summary (summary_text), None when no diagnosis
    html: str | None = None          # the HTML report page
    top_rule: str | None = None
    error: str | None = None         # why there is no diagnosis (Prometheus unreachable, no metrics)
    warnings: list[str] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0


def _quote(v: str) -> str:
    return json.dumps(v)  # a PromQL string literal: Go escaping, which JSON's is a subset of


def selectors(instance: str, label: str = "instance") -> Selectors:
    """The engine's series by its label; DCGM exporter and sidecar series on the same host (they
    are other targets: other ports), which fleet mode joins to the engine by address."""
    host = instance.rsplit(":", 1)[0] if ":" in instance else instance
    near = f"{label}=~{_quote(re.escape(host) + '(:.*)?')}"
    return Selectors(engine=f"{label}={_quote(instance)}", gpu=near, sidecar=near)


def diagnose_instance(setup: Setup, instance: str, since_s: float, now_s: float) -> Result:
    """Fetch one instance's series over [since - before, now] and diagnose them like
    ``kvdoctor diagnose --prometheus``; never raises for an unreachable Prometheus."""
    from ..diagnosis import Options, diagnose
    from ..report.summary import summary_text

    start = min(since_s, now_s) - setup.before_s
    span = now_s - start
    step = setup.step_s or max(2.0, round(span / 300))
    client = PromClient(setup.prometheus, bearer_token=setup.bearer_token, timeout_s=setup.timeout_s)
    data = fetch(client, start, now_s, step, selectors(instance, setup.group_by), (setup.group_by,), workers=2)
    res = Result(warnings=list(data.warnings), start_s=start, end_s=now_s)
    if instance not in data.samples:
        why = data.warnings[0].removeprefix("warning: ") if data.warnings else \
            f"no engine metrics for {setup.group_by}={instance!r} in the window"
        res.error = f"Prometheus {setup.prometheus}: {why}"
        return res
    opts = Options(lookback_s=min(setup.lookback_s, span), step_s=step, slo=setup.slo, workload=setup.workload,
                   slo_file=setup.slo_file, default_objectives=setup.default_objectives)
    diag = diagnose(capture_for(data, instance), engine_rules(setup.rules), opts)
    res.text = summary_text(diag)
    res.top_rule = diag.incidents[0].causes[0].rule.id if diag.incidents else None
    try:
        from ..report.html import render_html

        res.html = render_html(diag, title=f"kvdoctor on-call: {instance}")
    except ImportError:  # plotly is an optional extra; the summary stands without the page
        res.html = None
    return res
