"""Harm on a real llama-server (issue 31): a healthy server at light load with mixed prompt sizes
pages nobody, a stated objective it breaks always pages, and a ramp's incident starts where the
queue formed, offline and live alike. The same checks run on real vLLM in tests/test_vllm.py."""
from __future__ import annotations

import pytest

from harm_checks import check_healthy_mixed, check_ramp

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture(scope="module")
def scenario_run(tmp_path_factory):
    from harness import scenarios

    results = {}

    def run(name):
        if name not in results:
            out = tmp_path_factory.mktemp("harm") / name
            agents = []
            timings = scenarios.run(scenarios.SCENARIOS[name], out, on_attach=agents.append)
            results[name] = (out, timings, agents[0])
        return results[name]

    return run


def test_healthy_mixed_prompts_pages_nobody(scenario_run):
    out, timings, _ = scenario_run("healthy-mixed")
    check_healthy_mixed(out, timings)


def test_ramp_onset_is_where_the_queue_formed(scenario_run):
    from harness.scenarios import SCENARIOS

    out, timings, agent = scenario_run("ramp")
    n_first = len(SCENARIOS["ramp"].phases[0].requests())
    check_ramp(out, timings, agent, n_first, hold_s=30.0)
