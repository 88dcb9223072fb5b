"""Pure functions that turn request/response text into numbers, keeping no text.

Used by the streaming proxy's record (``kvdoctor.collect.proxy.record``) and `kvdoctor quality`, usable on their own:

* :func:`conversation_id` - a short, stable id for a chat: hash of the system prompt(s) and
  the first user message, so every turn of one conversation gets the same id;
* :func:`turn_number` - how many user messages the request carries (1 = first turn);
* :func:`render_prompt` - the prompt as one string (role + content of each message, or the
  completion ``prompt``), the text that prefix blocks are cut from;
* :func:`prefix_block_hashes` - chained 63-bit hashes of fixed-size character blocks of that
  text: two requests share the first *k* ids exactly when their first *k* blocks are equal,
  which is what prefix (KV) caching can reuse;
* :class:`RepetitionCounter` - share of word 4-grams of an output that already appeared
  earlier in the same output, fed incrementally with streamed deltas.

All hashes are stable across processes and machines (BLAKE2b), so captures can be compared.
"""
from __future__ import annotations

import itertools

import hashlib
from typing import Any, Iterable

_MASK63 = (1 << 63) - 1


def _text_of(content: Any) -> str:
    """The text of a message ``content``: a string, or OpenAI content parts (text parts kept,
    other parts - images, audio - represented by their type so they still change the hash)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
                else:
                    out.append(f"<{part.get('type', 'part')}>")
        return "".join(out)
    return str(content)


def chat_messages(body: Any) -> list[dict] | None:
    """A chat request's ``messages`` (the well-formed ones), or None when it has none."""
    if not isinstance(body, dict):
        return None
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    return [m for m in msgs if isinstance(m, dict)]


def conversation_id(messages: Iterable[dict] | None) -> str | None:
    """16 hex chars identifying a conversation: hash of all system/developer messages before
    the first user message, plus that first user message. ``None`` without a user message."""
    if not messages:
        return None
    h = hashlib.blake2b(digest_size=8)
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            h.update(b"S\x00")
            h.update(_text_of(m.get("content")).encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        elif role == "user":
            h.update(b"U\x00")
            h.update(_text_of(m.get("content")).encode("utf-8", "surrogatepass"))
            return h.hexdigest()
    return None


def turn_number(messages: Iterable[dict] | None) -> int | None:
    """Number of user messages (1 = first turn); ``None`` when there are no messages."""
    if not messages:
        return None
    return sum(1 for m in messages if m.get("role") == "user")


def render_prompt(body: Any) -> str | None:
    """The prompt text of a chat or completion request body (parsed JSON).

    Chat: ``<|role|>\\ncontent\\n`` per message (tool calls appended as their JSON-ish repr,
    so they take part in the hash). Completion: the ``prompt`` string, or the strings of a
    list joined by newlines. Token-id prompts and anything else: ``None``.
    """
    msgs = chat_messages(body)
    if msgs is not None:
        parts = []
        for m in msgs:
            parts.append(f"<|{m.get('role', '')}|>\n")
            parts.append(_text_of(m.get("content")))
            tc = m.get("tool_calls")
            if tc:
                parts.append(repr(tc))
            parts.append("\n")
        return "".join(parts)
    if isinstance(body, dict):
        p = body.get("prompt")
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return "\n".join(p)
    return None


def prefix_block_hashes(text: str, block_chars: int = 256) -> list[int]:
    """Chained hashes of the *full* ``block_chars``-character blocks of ``text``:
    ``h_i = H(h_{i-1} || block_i)`` as 63-bit non-negative ints (``h_{-1}`` = 0). A trailing
    partial block is not hashed (engines only reuse whole KV blocks either)."""
    if block_chars <= 0:
        raise ValueError("block_chars must be positive")
    n = len(text) // block_chars
    out: list[int] = []
    prev = b"\x00" * 8
    blake = hashlib.blake2b
    for i in range(n):
        block = text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
        d = blake(prev + block, digest_size=8).digest()
        prev = d
        out.append(int.from_bytes(d, "big") & _MASK63)
    return out


def prefix_block_tokens(prompt_tokens: int | None, prompt_chars: int | None, block_chars: int) -> int | None:
    """Approximate tokens per prefix block: ``prompt_tokens * block_chars / prompt_chars``."""
    if not prompt_tokens or not prompt_chars or prompt_chars <= 0:
        return None
    return max(1, round(prompt_tokens * block_chars / prompt_chars))


def common_prefix_blocks(a: list[int] | None, b: list[int] | None) -> int:
    """How many leading blocks two hash lists share."""
    n = 0
    for x, y in zip(a or (), b or ()):
        if x != y:
            break
        n += 1
    return n


class RepetitionCounter:
    """Share of word ``n``-grams (default 4) that already occurred earlier in the same text.

    Feed the text in any pieces (streamed deltas; a word may be split across pieces), then
    read :attr:`value`. Only hashes of n-grams and the last ``n-1`` words are kept.
    """

    __slots__ = ("n", "_seen", "_window", "_partial", "total", "repeated")

    def __init__(self, n: int = 4) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = n
        self._seen: set[int] = set()
        self._window: list[str] = []
        self._partial = ""
        self.total = 0
        self.repeated = 0

    def _words(self, words: list[str]) -> None:
        """Count the n-grams that ``words`` complete (with the last ``n-1`` words before them): in C
        loops (zip, map, set), not a Python step per word, as a stream's text comes a batch at a time."""
        n = self.n
        win = self._window + words if self._window else words
        if len(win) >= n:
            hashes = list(map(hash, zip(*(itertools.islice(win, i, None) for i in range(n)))))
            fresh = set(hashes)
            fresh -= self._seen
            self.total += len(hashes)
            self.repeated += len(hashes) - len(fresh)  # every one already seen, earlier here or before
            self._seen |= fresh
        self._window = win[-(n - 1):] if n > 1 else []

    def feed(self, text: str) -> None:
        if not text:
            return
        s = self._partial + text
        words = s.split()
        if not words:
            self._partial = ""
            return
        if not s[-1].isspace():
            self._partial = words.pop()
        else:
            self._partial = ""
        if words:
            self._words(words)

    def finish(self) -> float | None:
        """Flush the last word; returns :attr:`value`."""
        if self._partial:
            self._words([self._partial])
            self._partial = ""
        return self.value

    @property
    def value(self) -> float | None:
        """repeated / total n-grams so far, ``None`` before the first n-gram."""
        return self.repeated / self.total if self.total else None


def repetition(text: str, n: int = 4) -> float | None:
    """:class:`RepetitionCounter` over a whole text at once."""
    rc = RepetitionCounter(n)
    rc.feed(text)
    return rc.finish()
