"""`kvdoctor advise`: chunked prefill, PD disaggregation or length tiering, from a capture."""
from __future__ import annotations

import click
import orjson


@click.command("advise")
@click.argument("capture", metavar="CAPTURE")
@click.option("--model", metavar="CONFIG_OR_NAME",
              help="A Hugging Face config.json or built-in name (kvdoctor plan --list-models): sizes the KV "
                   "transferred per request and each tier's KV cache.")
@click.option("--gpu-mem", metavar="SIZE|GPU", help="Memory per GPU (80GiB or a GPU name) for each tier's "
              "concurrency; needs --model.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(capture, model, gpu_mem, fmt) -> None:
    """Is prefill/decode interference or a long-prompt tail hurting this workload, and what
    would chunked prefill, PD disaggregation or length tiering buy? Estimates come from the
    capture's measured phase split and decode gaps, as ranges with their assumptions.

    \b
    Examples:
      kvdoctor advise cap/
      kvdoctor advise cap/ --model Llama-3.1-8B --gpu-mem H100 --format json
    """
    from ..capture import load
    from ..errors import InputError
    from ..advise import advise, render_text

    if gpu_mem and not model:
        raise InputError("--gpu-mem: needs --model (the KV per token to size each tier with)")
    result = advise(load(capture), model=model, gpu_mem=gpu_mem)
    if fmt == "json":
        click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    else:
        click.echo(render_text(result), nl=False)
