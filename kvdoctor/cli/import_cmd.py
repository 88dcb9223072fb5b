"""``kvdoctor import FORMAT SRC... -o CAPTURE``: another tool's files as a capture."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

import click

from .. import __version__, importers
from ..errors import InputError
from ..importers.base import write_capture
from . import params as P

#: record type -> (singular, plural), in the order the summary names them
_KIND_LABELS = {"RequestRecord": ("request", "requests"), "EngineSample": ("engine sample", "engine samples"),
                "GpuSample": ("GPU sample", "GPU samples"), "HostSample": ("host sample", "host samples"),
                "Event": ("event", "events")}


def _pairs(values: Iterable[str], flag: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        key, sep, val = v.partition("=")
        if not sep or not key.strip():
            raise InputError(f"{flag} {v}: expected {what}")
        out[key.strip()] = val.strip()
    return out


def _expand(srcs: tuple[Path, ...], glob: str | tuple[str, ...] | None, fmt: str) -> list[Path]:
    """Files named on the command line; a folder gives the files matching the format's first
    GLOB pattern that matches anything there."""
    patterns = (glob,) if isinstance(glob, str) else tuple(glob or ())
    paths: list[Path] = []
    for src in srcs:
        if src.is_dir():
            if not patterns:
                raise InputError(f"{src}: is a folder; give the {fmt} files themselves")
            found: list[Path] = []
            for pattern in patterns:
                found = sorted(p for p in src.glob(pattern) if p.is_file())
                if found:
                    break
            if not found:
                raise InputError(f"{src}: no {' or '.join(patterns)} files in this folder for format {fmt}")
            paths.extend(found)
        elif src.is_file():
            paths.append(src)
        elif src.exists():
            raise InputError(f"{src}: not a regular file")
        else:
            raise InputError(f"{src}: no such file")
    return paths


def _check_output(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"--output {out}: exists and is not a folder; -o names the capture folder to create")
    if not any(out.iterdir()):
        return
    is_capture = (out / "meta.json").exists() or any(out.glob("*-*.jsonl"))
    if not is_capture:
        raise InputError(f"--output {out}: exists and is not empty (and not a capture); choose a new folder for -o")
    if not force:
        raise InputError(f"--output {out}: a capture is already there; choose a new folder or pass --force to replace it")


def _counted(records: Iterable[Any], counts: Counter) -> Iterator[Any]:
    for r in records:
        counts[type(r).__name__] += 1
        yield r


def _summary(counts: Counter, out: Path) -> str:
    order = list(_KIND_LABELS)
    parts = []
    for kind in sorted(counts, key=lambda k: order.index(k) if k in order else len(order)):
        one, many = _KIND_LABELS.get(kind, (kind, kind))
        parts.append(f"{counts[kind]} {one if counts[kind] == 1 else many}")
    return f"wrote {', '.join(parts) or '0 requests'} to {out}"


HELP = """Turn another tool's files into a capture that `diagnose`, `summary` and `report` read.

\b
FORMAT is one of:
  vllm-bench  JSON from `vllm bench serve --save-result --save-detailed`
  llmperf     llmperf's *_individual_responses.json
  csv         any CSV, one request a row; map columns with --col FIELD=COLUMN
  mooncake    Mooncake trace JSONL (timestamp, input_length, output_length, hash_ids)
  otlp-json   OTLP/JSON traces from the OpenTelemetry Collector file exporter
              (vLLM/SGLang llm_request spans)
  prometheus  Prometheus text-format scrapes of an engine's /metrics
  aiperf      NVIDIA AIPerf profile_export.jsonl (per-request records; 499 = cancelled)
  guidellm    GuideLLM benchmarks.json / .yaml (per-request rows of each benchmark)

\b
Examples:
  kvdoctor import vllm-bench vllm-4.0qps-Llama-3.1-8B-20250101-120000.json -o cap/
  kvdoctor import llmperf result_outputs/ -o cap/          # every *_individual_responses.json
  kvdoctor import csv naive_output_4.1.csv -o cap/ --col arrival_s=launch_time \\
      --col finish_s=finish_time --col ttft_s=ttft --col prompt_tokens=prompt_tokens \\
      --col output_tokens=generation_tokens --col session_id=user_id
  kvdoctor import csv AzureLLMInferenceTrace_code.csv -o cap/ --col arrival_s=TIMESTAMP \\
      --col prompt_tokens=ContextTokens --col output_tokens=GeneratedTokens
  kvdoctor import mooncake conversation_trace.jsonl -o cap/ --opt block_tokens=512
  kvdoctor import otlp-json traces.jsonl -o cap/ --engine vllm
  kvdoctor import aiperf artifacts/my-run/profile_export.jsonl -o cap/
  kvdoctor import guidellm benchmarks.json -o cap/
  kvdoctor import prometheus scrape-*.prom -o cap/
  kvdoctor import prometheus-range http://prom:9090 -o cap/ --opt selector='{job="vllm"}' --opt since=2h

\b
csv FIELDs: request_id arrival_s first_token_s finish_s ttft_s tpot_s itl_s e2e_s queue_s
  prompt_tokens output_tokens cached_prompt_tokens session_id turn status error model ...
  (instants: epoch seconds/ms, relative seconds or ISO date-times; durations in seconds).
--opt KEY=VALUE passes format options (csv: delimiter, time_unit, duration_unit, clock;
mooncake: block_tokens, time_unit; vllm-bench, aiperf: itl=false); --opt attribution=TEXT records
where the data came from, for any format. A SRC folder takes the format's usual files.
"""


@click.command("import", help=HELP, short_help="Turn another tool's files into a capture.")
@click.argument("fmt", metavar="FORMAT")
@click.argument("src", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=P.OutputFolder(), metavar="CAPTURE",
              help="Capture folder to create (not an existing file or a folder holding other files).")
@click.option("--col", "cols", multiple=True, metavar="FIELD=COLUMN", help="csv: request field <- CSV column (repeat).")
@click.option("--opt", "opts", multiple=True, metavar="KEY=VALUE", help="Format option (repeat).")
@click.option("--model", default=None, help="Model name to record in the capture (the KV and bandwidth rules size "
              "from it; an SLO file's per-model objectives select by it).")
@click.option("--engine", default=None, type=P.ENGINE,
              help="Engine the server ran (vllm, sglang, tgi, llamacpp, trtllm): fixes name its flags; without it they "
                   "list every engine's.")
@click.option("--gpu", default=None, type=P.GPU,
              help="GPU the server ran on (e.g. A100-80GB): decode's bandwidth bound comes from it.")
@click.option("--force", is_flag=True, help="Replace an existing capture at CAPTURE.")
def command(fmt: str, src: tuple[Path, ...], out: Path, cols: tuple[str, ...], opts: tuple[str, ...],
            model: str | None, engine: str | None, gpu: str | None, force: bool) -> None:
    out = Path(out)
    if model is not None and (not model.strip() or len(model) > 256 or not model.isprintable()):
        raise InputError(f"--model {model[:60]!r}: expected a model name such as Llama-3.1-8B (printable, at most 256 "
                         "characters)")
    module = importers.get(fmt)
    options: dict[str, Any] = _pairs(opts, "--opt", "KEY=VALUE")
    attribution = options.pop("attribution", None)
    columns = _pairs(cols, "--col", "FIELD=COLUMN, e.g. --col ttft_s=ttft")
    if columns:
        if fmt != "csv":
            raise InputError(f"--col maps CSV columns and applies to format csv only, not {fmt}")
        options["columns"] = columns
    urls = [str(x) for x in src if str(x).startswith(("http:/", "https:/"))]
    if urls:  # a server to read from, not files (prometheus-range): click's Path folds '//' to '/'
        if fmt != "prometheus-range":
            raise InputError(f"{urls[0]}: format {fmt} reads files; only prometheus-range reads from a URL")
        options.setdefault("prometheus", urls[0].replace(":/", "://", 1) if "://" not in urls[0] else urls[0])
        src = tuple(x for x in src if str(x) not in urls)
    paths = _expand(src, getattr(module, "GLOB", None), fmt)
    _check_output(out, force)
    from ..importers import sniff

    for p in paths:
        if sniff.empty(p):
            raise InputError(f"{p}: empty; expected {sniff.LABELS.get(fmt, fmt)}")
    try:
        _import(module, fmt, paths, options, out, model, engine, gpu, attribution)
    except InputError as e:
        # a file of another format: say which, not the wrong importer's complaint about it
        for p in paths:
            if str(p) in str(e):
                hint = sniff.wrong_format(p, fmt)
                if hint:
                    raise InputError(hint) from None
                break
        raise


def _import(module, fmt: str, paths: list[Path], options: dict[str, Any], out: Path, model: str | None,
            engine: str | None, gpu: str | None, attribution: str | None) -> None:
    imported = module.read(paths, options)
    meta = dataclasses.replace(imported.meta, model=model or imported.meta.model,
                               engine=engine or imported.meta.engine, gpu=gpu or imported.meta.gpu,
                               attribution=attribution or imported.meta.attribution,
                               tool_version=imported.meta.tool_version or __version__)
    counts: Counter = Counter()
    imported = dataclasses.replace(imported, meta=meta, records=_counted(imported.records, counts))

    created = out.parent
    while not created.parent.exists():  # the first folder this import creates: removed if it fails
        created = created.parent
    created = None if created.exists() else created
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    from tqdm import tqdm

    bar = tqdm(desc=f"importing {fmt}", unit=" records", disable=not sys.stderr.isatty(), leave=False)
    try:
        try:
            write_capture(imported, tmp, progress=lambda n: bar.update(n - bar.n))
        finally:
            bar.close()
        if not counts:
            from ..importers.sniff import LABELS

            where = ", ".join(str(p) for p in paths) or options.get("prometheus", "")
            raise InputError(f"{where}: no records found; expected {LABELS.get(fmt, 'format ' + fmt)} with at least one "
                             "request")
        if out.exists():
            if any(out.iterdir()):
                shutil.rmtree(out)  # only reached for a capture with --force (checked above)
            else:
                out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if not meta.engine:
        from ..capture.reader import ENGINE_UNKNOWN

        imported.notes.append(ENGINE_UNKNOWN)
    for note in imported.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(_summary(counts, out))
