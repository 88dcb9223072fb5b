"""`kvdoctor quality`: does quantised KV degrade long-context outputs? Compare two servers."""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from .common import progress_callback


@click.command("quality")
@click.option("--baseline", required=True, metavar="URL", help="Server with the reference KV format (e.g. -ctk f16 -ctv f16).")
@click.option("--candidate", required=True, metavar="URL", help="Server under test (e.g. -ctk q4_0 -ctv q4_0).")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(), help="JSON Lines ({\"prompt\"} or {\"messages\"}) or text paragraphs.")
@click.option("--max-tokens", default=128, show_default=True, help="Tokens to generate per prompt (greedy).")
@click.option("--buckets", default=4, show_default=True, help="Context-length buckets in the table.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(baseline, candidate, prompts_path, max_tokens, buckets, fmt):
    """Same long prompts, greedy decoding, against both servers: divergence and repetition per
    context length. Exit 0 with a verdict line; no prompt or output text is kept.

    \b
    Example:
      llama-server -m model.gguf -c 16384 -fa on --port 8081                       # baseline
      llama-server -m model.gguf -c 16384 -fa on -ctk q4_0 -ctv q4_0 --port 8082   # candidate
      kvdoctor quality --baseline http://127.0.0.1:8081 --candidate http://127.0.0.1:8082 --prompts long.jsonl
    """
    from ..quality import by_context, compare, read_prompts, verdict

    prompts = read_prompts(Path(prompts_path))
    with progress_callback("prompts", unit="prompt") as progress:
        results = compare(baseline, candidate, prompts, max_tokens, progress=progress)
    rows = by_context(results, buckets)
    summary = verdict(rows)
    if fmt == "json":
        click.echo(orjson.dumps({"verdict": summary, "by_context": rows,
                                 "prompts": [r.__dict__ for r in results]}, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"{'prompt tokens':>16}  {'n':>3}  {'agreement':>9}  {'repetition base':>15}  {'repetition cand':>15}")
    for r in rows:
        f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        click.echo(f"{r['prompt_tokens_from']:>7}-{r['prompt_tokens_to']:<8}  {r['prompts']:>3}  {f(r['agreement_p50']):>9}  "
                   f"{f(r['baseline_repetition_p50']):>15}  {f(r['candidate_repetition_p50']):>15}")
    click.echo(summary)
