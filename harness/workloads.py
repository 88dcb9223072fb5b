"""Workloads for the load generator: what to send, as :class:`ChatRequest` lists.

``short_prompts``, ``long_prompts`` (no shared prefix), ``conversations`` (multi-turn, chained),
``shared_prefix`` (one long system prompt) and ``filler_text``. :mod:`harness.loadgen`
sends them and re-exports every name here.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    max_tokens: int = 32
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""
    turn: int = 0
    chain: bool = False          # append to the session's history (multi-turn)
    think_s: float = 0.0         # pause after the previous turn of the session finished
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    model: str = "default"
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers, e.g. a W3C traceparent
    #: "chat" (/v1/chat/completions) or "completions" (/v1/completions, the messages joined as one prompt)
    api: str = "chat"
    #: this request's own total timeout (the client gives up and disconnects), else the run's
    timeout_s: float | None = None


_WORDS = ("the a of and to in is that it for on with as was at by this be from or have an are "
          "not but had his they you were her she which their all there one been has we when who "
          "will more if no out so said what up its about into than them can only other new some "
          "time could these two may then do first any my now such like our over man me even most "
          "made after also did many before must through back years where much your way well down "
          "should because each just those people how too little state good very make world still "
          "own see men work long get here between both life being under never day same another "
          "know while last might us great old year off come since against go came right used take "
          "three house water city river light music paper garden window story table market road").split()

_TOPICS = ("rivers", "bread", "clocks", "bicycles", "volcanoes", "owls", "libraries", "trains",
           "tea", "bridges", "honey", "comets", "maps", "violins", "glaciers", "lanterns")


def filler_text(n_tokens: int, seed: int = 0) -> str:
    """About ``n_tokens`` tokens of filler (one common word ~ one token for SmolLM2's BPE)."""
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(max(0, n_tokens))]
    return " ".join(words)


def short_prompts(n: int, max_tokens: int = 32, seed: int = 0) -> list[ChatRequest]:
    return [ChatRequest(messages=[{"role": "user", "content":
                                   f"In one sentence, tell me something about {_TOPICS[(i + seed) % len(_TOPICS)]} (#{i})."}],
                        max_tokens=max_tokens, session_id=f"short-{i}")
            for i in range(n)]


def long_prompts(n: int, tokens: int, max_tokens: int = 32, seed: int = 0) -> list[ChatRequest]:
    """``n`` distinct prompts of about ``tokens`` tokens each (no shared prefix)."""
    out = []
    for i in range(n):
        body = filler_text(max(0, tokens - 20), seed=seed * 100003 + i)
        out.append(ChatRequest(messages=[{"role": "user", "content":
                                          f"Document {i}-{seed}: {body}\n\nSummarize the document above in one sentence."}],
                               max_tokens=max_tokens, session_id=f"long-{i}"))
    return out


def conversations(n_conv: int, turns: int, max_tokens: int = 48, user_tokens: int = 24,
                  system_prompt: str = "You are a helpful assistant.", think_s: float = 0.0,
                  extra_body: dict | None = None, seed: int = 0) -> list[ChatRequest]:
    """Multi-turn chats: turn k sends the whole history (with the real replies) plus a new
    user message, so the context grows every turn; turns of one chat are sequential."""
    out = []
    for c in range(n_conv):
        sid = f"conv-{seed}-{c}"
        for k in range(turns):
            msgs = [{"role": "system", "content": system_prompt}] if k == 0 else []
            topic = _TOPICS[(c + k + seed) % len(_TOPICS)]
            msgs.append({"role": "user", "content":
                         f"Turn {k}: {filler_text(user_tokens, seed=seed * 7919 + c * 131 + k)}. "
                         f"Now tell me more about {topic}."})
            out.append(ChatRequest(messages=msgs, max_tokens=max_tokens, session_id=sid, turn=k,
                                   chain=True, think_s=think_s, extra_body=dict(extra_body or {})))
    return out


def shared_prefix(n: int, prefix_tokens: int, cache_prompt: bool, suffix_tokens: int = 20,
                  max_tokens: int = 16, seed: int = 0) -> list[ChatRequest]:
    """``n`` requests sharing one long system prompt, each with a distinct question;
    ``cache_prompt`` is sent as llama.cpp's request field of that name."""
    prefix = "Reference material: " + filler_text(prefix_tokens, seed=seed + 424242)
    return [ChatRequest(messages=[{"role": "system", "content": prefix},
                                  {"role": "user", "content":
                                   f"Question {i}: {filler_text(suffix_tokens, seed=seed * 31 + i)}?"}],
                        max_tokens=max_tokens, extra_body={"cache_prompt": bool(cache_prompt)},
                        session_id=f"prefix-{i}")
            for i in range(n)]
