"""The labelled corpus's import spec (kvdoctor/diagnosis/corpus.py): what `kvdoctor import`
options it carries into the imported capture."""
import math

import pytest
import yaml

import kvdoctor
from kvdoctor.diagnosis.corpus import _import, read_corpus
from kvdoctor.errors import InputError
from kvdoctor.signals import Prepared

from conftest import ROOT

AIBRIX = {"format": "csv", "src": str(ROOT / "tests/data/traces/aibrix/naive_output_0.5.csv"),
          "columns": {"arrival_s": "launch_time", "finish_s": "finish_time", "ttft_s": "ttft",
                      "prompt_tokens": "prompt_tokens", "output_tokens": "generation_tokens"},
          "model": "Llama-3.1-8B", "engine": "vllm"}
#: Llama-3.1-8B's bf16 weights (8.03e9 parameters) read once per decode step at the A100-80GB's
#: 2.039 TB/s: no decode step is faster than this, whatever the batch
A100_WEIGHTS_ONLY_S = 8.03e9 * 2 / 2.039e12


def _write(tmp_path, entries):
    path = tmp_path / "labels.yaml"
    path.write_text(yaml.safe_dump({"corpus": entries}))
    return path


def test_corpus_import_gpu_sets_the_bandwidth_bound(tmp_path):
    """import: gpu: becomes the capture's meta.gpu, as `kvdoctor import --gpu` sets it, so decode's
    bandwidth bound is estimated (at least the weights' read time); without it there is none."""
    cases = read_corpus(_write(tmp_path, [
        {"name": "with-gpu", "import": {**AIBRIX, "gpu": "A100-80GB"}, "causes": {}},
        {"name": "without", "import": AIBRIX, "causes": {}},
    ]))
    bound = {}
    for k, case in enumerate(cases):
        cap = kvdoctor.load(_import(case.importing, tmp_path / str(k)))
        prep = Prepared(cap)
        bound[case.name] = (cap.meta.gpu, prep.window(prep.start_s - 1, prep.end_s + 1).value("decode_bw_bound_tpot_s"))
    gpu, with_gpu = bound["with-gpu"]
    assert gpu == "A100-80GB" and with_gpu >= A100_WEIGHTS_ONLY_S
    assert bound["without"][0] is None and math.isnan(bound["without"][1])


@pytest.mark.parametrize("gpu", ["A100", "Z9000", 80])
def test_corpus_bad_gpu_names_the_entry(tmp_path, run_cli, gpu):
    """A GPU the bandwidth tables do not know (ambiguous, unknown, not a name) is a one-line
    error naming the corpus entry and field, exit code 2, before anything is diagnosed."""
    path = _write(tmp_path, [
        {"name": "fine", "import": {**AIBRIX, "gpu": "A100-80GB"}, "causes": {}},
        {"name": "aibrix-bad", "import": {**AIBRIX, "gpu": gpu}, "causes": {}},
    ])
    with pytest.raises(InputError, match=r"corpus\[1\] \(aibrix-bad\): import: gpu: .*A100-80GB"):
        read_corpus(path)
    r = run_cli("rules", "test", "--format", "table", "--corpus", path)
    assert r.returncode == 2 and "corpus[1] (aibrix-bad)" in r.stderr and "gpu" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
