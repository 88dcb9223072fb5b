"""Output quality under KV quantisation: the same long prompts, greedy decoding, against a
baseline server (e.g. f16 KV) and a candidate (e.g. q4_0 KV); per prompt, how early the
outputs diverge and how repetitive each is, by context length. No text is kept."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from .capture.jsonl import json_lines
from .collect.textstats import repetition
from .diagnosis.rules import builtin_params
from .errors import InputError


@dataclass(frozen=True)
class Comparison:
    index: int
    prompt_tokens: int | None
    baseline_tokens: int
    candidate_tokens: int
    #: share of the longer output before the first differing word (1 = identical)
    agreement_frac: float
    baseline_repetition: float | None
    candidate_repetition: float | None
    baseline_s: float
    candidate_s: float
    started_s: float = 0.0
    candidate_output_tokens: int | None = None


def read_prompts(path: Path) -> list[list[dict[str, str]]]:
    """JSON Lines of {"messages": [...]} or {"prompt": "..."}, or a plain text file whose
    paragraphs (blank-line separated) are prompts."""
    if not path.exists():
        raise InputError(f"{path}: no such prompts file")
    text = path.read_text()
    prompts: list[list[dict[str, str]]] = []
    if path.suffix in (".jsonl", ".json"):
        for n, obj in json_lines(path, '{"prompt": ...} or {"messages": [...]}'):
            if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                prompts.append(obj["messages"])
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                prompts.append([{"role": "user", "content": obj["prompt"]}])
            else:
                raise InputError(f"{path}: line {n}: expected a \"prompt\" string or a \"messages\" list")
    else:
        prompts = [[{"role": "user", "content": p.strip()}] for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise InputError(f"{path}: no prompts found")
    return prompts


def complete(url: str, messages: list[dict[str, str]], max_tokens: int, timeout_s: float) -> tuple[str, int | None, float, int | None]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "top_k": 1, "seed": 0, "stream": False}
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            data = orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise InputError(f"{url}: HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise InputError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
    text = data["choices"][0]["message"].get("content") or ""
    usage = data.get("usage") or {}
    return text, usage.get("prompt_tokens"), time.perf_counter() - t, usage.get("completion_tokens")


def agreement(a: str, b: str) -> float:
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    n = 0
    for x, y in zip(wa, wb):
        if x != y:
            break
        n += 1
    return n / max(len(wa), len(wb))


def compare(baseline: str, candidate: str, prompts: list[list[dict[str, str]]], max_tokens: int = 128,
            timeout_s: float = 300.0, progress=None) -> list[Comparison]:
    out = []
    for i, messages in enumerate(prompts):
        a, n_prompt, ta, _ = complete(baseline, messages, max_tokens, timeout_s)
        started = time.time()
        b, _, tb, n_out = complete(candidate, messages, max_tokens, timeout_s)
        out.append(Comparison(i, n_prompt, len(a.split()), len(b.split()), agreement(a, b), repetition(a), repetition(b),
                              ta, tb, started, n_out))
        if progress:
            progress(i + 1, len(prompts))
    return out


def by_context(results: list[Comparison], buckets: int = 4) -> list[dict[str, Any]]:
    """Per prompt-length bucket: median agreement and repetition, baseline vs candidate."""
    lengths = np.array([r.prompt_tokens or 0 for r in results], dtype=float)
    edges = np.unique(np.quantile(lengths, np.linspace(0, 1, buckets + 1)))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [r for r, L in zip(results, lengths) if lo <= L <= hi]
        if not sel:
            continue

        def med(xs):
            xs = [x for x in xs if x is not None]
            return float(np.median(xs)) if xs else None

        rows.append({"prompt_tokens_from": int(lo), "prompt_tokens_to": int(hi), "prompts": len(sel),
                     "agreement_p50": med([r.agreement_frac for r in sel]),
                     "baseline_repetition_p50": med([r.baseline_repetition for r in sel]),
                     "candidate_repetition_p50": med([r.candidate_repetition for r in sel])})
    return rows


def verdict(rows: list[dict[str, Any]], params: dict[str, float] | None = None) -> str:
    """Degraded when, at the longest contexts, the candidate repeats itself much more than the
    baseline or stops agreeing with it much earlier than at the shortest contexts. The margins
    are the kv-quant-quality rule's (``min_repetition_gap``, ``min_agreement_drop``), so this
    verdict and `kvdoctor diagnose` on the --capture judge alike; ``params`` overrides them."""
    if not rows:
        return "no data"
    p = {**builtin_params("kv-quant-quality"), **(params or {})}
    long_, short = rows[-1], rows[0]
    rep_gap = (long_["candidate_repetition_p50"] or 0) - (long_["baseline_repetition_p50"] or 0)
    agree_drop = (short["agreement_p50"] or 0) - (long_["agreement_p50"] or 0)
    if rep_gap >= p["min_repetition_gap"] or agree_drop >= p["min_agreement_drop"]:
        return (f"DEGRADED at long context: candidate repetition {long_['candidate_repetition_p50']:.2f} vs baseline "
                f"{long_['baseline_repetition_p50']:.2f}; agreement {long_['agreement_p50']:.2f} vs {short['agreement_p50']:.2f} at short context")
    return "no degradation beyond noise"


def write_capture(results: list[Comparison], out: Path, candidate: str, config: dict[str, Any]) -> None:
    """The candidate's requests as a capture, each carrying its baseline comparison, so that
    `kvdoctor diagnose` can judge kv-quant-quality against the baseline."""
    from .capture import CaptureWriter
    from .model import CaptureMeta, RequestRecord

    meta = CaptureMeta(created_unix_s=time.time(), server=candidate, origin="quality", config=dict(config))
    with CaptureWriter(out, meta) as w:
        for r in results:
            w.write(RequestRecord(request_id=f"q{r.index}", arrival_s=r.started_s, e2e_s=r.candidate_s,
                                  prompt_tokens=r.prompt_tokens, output_tokens=r.candidate_output_tokens,
                                  output_repetition=r.candidate_repetition, baseline_agreement_frac=r.agreement_frac,
                                  baseline_output_repetition=r.baseline_repetition, server=candidate, status="ok"))
