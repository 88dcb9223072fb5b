"""`kvdoctor advise`: chunked prefill, PD disaggregation or length tiering, from a capture."""
from __future__ import annotations

import click
import orjson

from .common import format_option, load_capture, output_option, since_until_options, write_out


@click.command("advise")
@click.argument("capture", metavar="CAPTURE")
@since_until_options
@click.option("--model", metavar="CONFIG_OR_NAME",
              help="A Hugging Face config.json or built-in name (kvdoctor plan --list-models): sizes the KV "
                   "transferred per request and each tier's KV cache.")
@click.option("--gpu-mem", metavar="SIZE|GPU", help="Memory per GPU (80GiB or a GPU name) for each tier's "
              "concurrency; needs --model.")
@format_option()
@output_option
def command(capture, since, until, model, gpu_mem, fmt, output) -> None:
    """Is prefill/decode interference or a long-prompt tail hurting this workload, and what
    would chunked prefill, PD disaggregation or length tiering buy? Estimates come from the
    capture's measured phase split and decode gaps, as ranges with their assumptions.

    \b
    Examples:
      kvdoctor advise cap/
      kvdoctor advise cap/ --model Llama-3.1-8B --gpu-mem H100 --format json
      kvdoctor advise cap/ --since +10m --format markdown -o advice.md
    """
    from ..advise import advise, render_text
    from ..errors import InputError, NothingToDiagnose

    if gpu_mem and not model:
        raise InputError("--gpu-mem: needs --model (the KV per token to size each tier with)")
    if model:
        from ..plan.models import resolve_model
        from ..plan.planner import resolve_gpu

        resolve_model(model)  # a bad --model or --gpu-mem is said before the capture is read
        if gpu_mem:
            resolve_gpu(gpu_mem)
    cap = load_capture(capture, since, until)
    if not len(cap.requests):
        where = f" in {cap.range_text}" if cap.range_text else ""
        raise NothingToDiagnose(f"{capture}: no request records{where}; advise needs per-request times")
    result = advise(cap, model=model, gpu_mem=gpu_mem)
    if fmt == "json":
        text = orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    elif fmt == "markdown":
        text = fenced(f"kvdoctor advise · {capture}", render_text(result))
    else:
        text = render_text(result)
    write_out(text, output)


def fenced(title: str, text: str) -> str:
    """A plain-text result as Markdown: a heading and the text as written, in a fence (its
    columns line up only in monospace)."""
    return f"# {title}\n\n```text\n{text.rstrip()}\n```\n"
