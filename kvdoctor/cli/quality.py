"""`kvdoctor quality`: does quantised KV degrade long-context outputs? Compare two servers."""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from . import params as P
from .common import format_option, output_option, progress_callback, write_out


@click.command("quality")
@click.option("--baseline", required=True, type=P.URL, help="Server with the reference KV format (e.g. -ctk f16 -ctv f16).")
@click.option("--candidate", required=True, type=P.URL, help="Server under test (e.g. -ctk q4_0 -ctv q4_0).")
@click.option("--prompts", "prompts_path", required=True, type=P.InputFile(), help="JSON Lines ({\"prompt\"} or {\"messages\"}) or text paragraphs.")
@click.option("--max-tokens", default=128, show_default=True, type=P.Count(1, 1_000_000, "of tokens"),
              help="Tokens to generate per prompt (greedy).")
@click.option("--buckets", default=4, show_default=True, type=P.Count(1, 100), help="Context-length buckets in the table.")
@format_option()
@output_option
@click.option("--capture", "capture_dir", type=P.OutputFolder(), help="Also write the candidate's requests with their baseline comparison as a capture (for diagnose/report).")
@click.option("--candidate-config", multiple=True, metavar="KEY=VALUE", help="The candidate's KV settings for the capture, e.g. cache_type_k=q4_0.")
@click.option("--teacher-forced/--no-teacher-forced", "forced", default=True, show_default=True,
              help="Also read, at every position of the baseline's own continuation, whether both servers pick the same "
                   "next token (llama.cpp and vLLM: one short request a position on each; skipped where unsupported).")
def command(baseline, candidate, prompts_path, max_tokens, buckets, fmt, output, capture_dir, candidate_config, forced):
    """Same long prompts, greedy decoding, against both servers: divergence and repetition per
    context length. Exit 0 with a verdict line; no prompt or output text is kept.

    Two agreements are shown. "agreement": how much of the free-running outputs match before the
    first differing word (one early difference carries into everything after it, so this is
    noisy). "same next": teacher-forced over the baseline's own continuation, the share of
    positions where the candidate picks the baseline's next token (llama-perplexity's "same top
    p"); it decides the verdict where the servers can give it (llama.cpp, vLLM).

    \b
    Example:
      llama-server -m model.gguf -c 16384 -fa on --port 8081                       # baseline
      llama-server -m model.gguf -c 16384 -fa on -ctk q4_0 -ctv q4_0 --port 8082   # candidate
      kvdoctor quality --baseline http://127.0.0.1:8081 --candidate http://127.0.0.1:8082 --prompts long.jsonl \\
          --capture q4cap/ --candidate-config cache_type_k=q4_0 --candidate-config cache_type_v=q4_0
      kvdoctor diagnose q4cap/      # kv-quant-quality, judged against the baseline
      # vLLM: `vllm serve MODEL --port 8081` against `vllm serve MODEL --kv-cache-dtype fp8 --port 8082`,
      # with --candidate-config kv_cache_dtype=fp8
    """
    from ..quality import by_context, compare, read_prompts, verdict, write_capture
    from .attach import _engine_config

    kv_config = _engine_config(candidate_config, "--candidate-config")  # a bad KEY=VALUE is said before any prompt is sent
    prompts = read_prompts(Path(prompts_path))
    with progress_callback("prompts", unit="prompt") as progress:
        results = compare(baseline, candidate, prompts, max_tokens, progress=progress, forced=forced)
    rows = by_context(results, buckets)
    summary = verdict(rows, results=results)
    if capture_dir:
        write_capture(results, Path(capture_dir), candidate, kv_config)
    if fmt == "json":
        write_out(orjson.dumps({"verdict": summary, "by_context": rows, "prompts": [r.__dict__ for r in results]},
                               option=orjson.OPT_INDENT_2).decode() + "\n", output)
        return
    lines = [f"{'prompt tokens':>16}  {'n':>3}  {'agreement':>9}  {'same next':>9}  {'repetition base':>15}  {'repetition cand':>15}"]
    for r in rows:
        f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{r['prompt_tokens_from']:>7}-{r['prompt_tokens_to']:<8}  {r['prompts']:>3}  {f(r['agreement_p50']):>9}  "
                     f"{f(r['forced_agreement_p50']):>9}  {f(r['baseline_repetition_p50']):>15}  {f(r['candidate_repetition_p50']):>15}")
    text = "\n".join(lines + [summary]) + "\n"
    if fmt == "markdown":
        from .advise import fenced

        text = fenced(f"kvdoctor quality · {candidate} against {baseline}", text)
    write_out(text, output)
