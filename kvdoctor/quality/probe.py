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
    #: teacher-forced: over the baseline's own greedy continuation, the share of positions where
    #: both servers pick the same next token (1 = identical; None where the server cannot say)
    forced_agreement_frac: float | None = None
    forced_positions: int = 0


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
    t = time.perf_counter()
    data = _request(url, "/v1/chat/completions", body, timeout_s)
    text = data["choices"][0]["message"].get("content") or ""
    usage = data.get("usage") or {}
    return text, usage.get("prompt_tokens"), time.perf_counter() - t, usage.get("completion_tokens")


def _request(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    """POST ``body`` as JSON (GET without one) to the server; the answer's JSON."""
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", data=None if body is None else orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return orjson.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise InputError(f"{url}{path}: HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise InputError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None


def _dialect(url: str, timeout_s: float) -> tuple[str, str | None] | None:
    """How the server takes token ids: ("llamacpp", None) for llama.cpp's /apply-template,
    /tokenize and /completion; ("openai", MODEL) for vLLM's /tokenize (chat messages in) and
    /v1/completions with a token-id prompt and ``return_token_ids``; None for neither."""
    try:
        if "prompt" in _request(url, "/apply-template", {"messages": [{"role": "user", "content": "x"}]}, timeout_s):
            return "llamacpp", None
    except (InputError, orjson.JSONDecodeError):
        pass
    try:
        models = _request(url, "/v1/models", None, timeout_s).get("data") or []
        model = models[0]["id"] if models else None
        if model and isinstance(_request(url, "/tokenize", {"model": model, "prompt": "x"}, timeout_s).get("tokens"), list):
            return "openai", model
    except (InputError, orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        pass
    return None


def prompt_ids(url: str, messages: list[dict[str, str]], timeout_s: float,
               d: tuple[str, str | None] | None) -> list[int] | None:
    """The chat prompt as the server's own token ids (its chat template applied), or None where
    the server cannot say (neither llama.cpp nor vLLM). ``d``: the server's :func:`_dialect`."""
    if d is None:
        return None
    try:
        if d[0] == "llamacpp":
            prompt = _request(url, "/apply-template", {"messages": messages}, timeout_s).get("prompt")
            ids = _request(url, "/tokenize", {"content": prompt, "add_special": True}, timeout_s).get("tokens")
        else:
            ids = _request(url, "/tokenize", {"model": d[1], "messages": messages, "add_generation_prompt": True},
                        timeout_s).get("tokens")
    except InputError:
        return None
    return [int(t) for t in ids] if isinstance(ids, list) and ids else None


def greedy_ids(url: str, ids: list[int], n: int, timeout_s: float, d: tuple[str, str | None] | None) -> list[int]:
    """The server's greedy continuation of ``ids``, ``n`` tokens at most, as token ids."""
    if d is not None and d[0] == "openai":
        got = _request(url, "/v1/completions", {"model": d[1], "prompt": ids, "max_tokens": n, "temperature": 0, "seed": 0,
                                             "return_token_ids": True}, timeout_s)
        choices = got.get("choices") or [{}]
        return [int(t) for t in choices[0].get("token_ids") or ()]
    got = _request(url, "/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "seed": 0,
                                     "cache_prompt": True, "return_tokens": True}, timeout_s)
    return [int(t) for t in got.get("tokens") or ()]


def forced_ids(url: str, ids: list[int], continuation: list[int], timeout_s: float,
               d: tuple[str, str | None] | None) -> list[int]:
    """Teacher forcing: at every position of ``continuation``, the token the server would pick
    next given the prompt and the continuation so far (not its own earlier picks). One request a
    position, each a one-token step on the cached prefix (llama.cpp's prompt cache, vLLM's prefix
    cache), so every position attends to the context through the KV cache the server stores (a
    whole-sequence prefill could attend to unquantised keys). An early difference does not carry
    into later positions, as it does when two free-running outputs are compared word by word."""
    out = []
    for i in range(len(continuation)):
        got = greedy_ids(url, ids + continuation[:i], 1, timeout_s, d)
        out.append(got[0] if got else -1)
    return out


def forced_agreement(baseline: str, candidate: str, messages: list[dict[str, str]], max_tokens: int,
                     timeout_s: float) -> tuple[float | None, int]:
    """(share of the baseline's greedy continuation where both servers, teacher-forced, pick the
    same next token; positions compared). The baseline is forced the same way, so the two differ
    only by the server (its KV format), not by how each position was computed; (None, 0) where
    the servers cannot tokenise or return token ids (neither llama.cpp nor vLLM), or tokenise the
    prompt differently (not the same model). Each server's dialect is asked once a call (a port
    may serve another engine later, so it is not remembered)."""
    da, db = _dialect(baseline, timeout_s), _dialect(candidate, timeout_s)
    ids = prompt_ids(baseline, messages, timeout_s, da)
    if ids is None or prompt_ids(candidate, messages, timeout_s, db) != ids:
        return None, 0
    cont = greedy_ids(baseline, ids, max_tokens, timeout_s, da)
    if not cont:
        return None, 0
    a = forced_ids(baseline, ids, cont, timeout_s, da)
    b = forced_ids(candidate, ids, cont, timeout_s, db)
    return sum(x == y for x, y in zip(a, b)) / len(cont), len(cont)


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
            timeout_s: float = 300.0, progress=None, forced: bool = True) -> list[Comparison]:
    """Each prompt, greedy, on both servers; with ``forced``, also the teacher-forced agreement
    (:func:`forced_agreement`) where the servers support it."""
    out = []
    for i, messages in enumerate(prompts):
        a, n_prompt, ta, _ = complete(baseline, messages, max_tokens, timeout_s)
        started = time.time()
        b, _, tb, n_out = complete(candidate, messages, max_tokens, timeout_s)
        f, n_f = forced_agreement(baseline, candidate, messages, max_tokens, timeout_s) if forced else (None, 0)
        out.append(Comparison(i, n_prompt, len(a.split()), len(b.split()), agreement(a, b), repetition(a), repetition(b),
                              ta, tb, started, n_out, f, n_f))
        if progress:
            progress(i + 1, len(prompts))
    return out
