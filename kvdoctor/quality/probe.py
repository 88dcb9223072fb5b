"""The probe: each prompt sent, greedy, to the baseline server and then to the candidate; per
prompt, how early the two outputs diverge and how repetitive each is. No text is kept."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson

from ..capture.jsonl import json_lines
from ..collect.textstats import repetition
from ..errors import InputError


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
