"""The stream annotator's batched analysis (kvdoctor.collect.proxy.sse): reads are kept with their
timestamps and analysed a batch at a time, the usual content events with no Python step per event.
Whatever the batch and however the stream is cut into reads, the result must be the one the
event-by-event path gives (``_NOT_PLAIN`` holding every event makes every batch take that path)."""
from __future__ import annotations

import random

import orjson
import pytest

from kvdoctor.collect.proxy import sse


def ev(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat(text: str | None, model: str = "m", **delta: object) -> bytes:
    d: dict = {"content": text} if text is not None else {}
    d.update(delta)
    return ev({"id": "c", "object": "chat.completion.chunk", "model": model,
               "choices": [{"index": 0, "delta": d, "finish_reason": None}]})


WORDS = ["Red", " green", " blue", ' "quoted"', " back\\slash", " new\nline", " é ü", " 漢字", " 🙂", " tab\t",
         " the cat", " sat", " the cat", " sat", ""]

STREAMS = {
    "vllm": [chat("", role="assistant")] + [chat(w) for w in WORDS]
            + [ev({"id": "c", "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 14}})]
            + [b"data: [DONE]\n\n"],
    "llamacpp": [chat(w) for w in WORDS] + [ev({"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
                                                "model": "m", "timings": {"prompt_n": 3, "predicted_n": 14,
                                                                          "prompt_ms": 1.5, "cache_n": 2}})]
                + [b"data: [DONE]\n\n"],
    "sglang_nulls": [chat(w, role=None, reasoning_content=None, tool_calls=None) for w in WORDS] + [b"data: [DONE]\n\n"],
    "no_model": [ev({"choices": [{"delta": {"content": w}}]}) for w in WORDS] + [b"data: [DONE]\n\n"],
    "two_choices": [ev({"model": "m", "choices": [{"index": 0, "delta": {"content": w}},
                                                  {"index": 1, "delta": {"content": w.upper()}}]}) for w in WORDS],
    "reasoning_then_content": [chat(None, reasoning_content="think " * 3) for _ in range(4)]
                              + [chat(w) for w in WORDS],
    "tool_calls": [chat(None, tool_calls=[{"index": 0, "function": {"arguments": '{"a": "content"}'}}])
                   for _ in range(5)] + [chat(w) for w in WORDS[:4]],
    "completions": [ev({"model": "m", "choices": [{"text": w, "index": 0}]}) for w in WORDS],
    "error_mid_stream": [chat(w) for w in WORDS[:5]] + [ev({"error": {"message": "slot died"}})]
                        + [chat(w) for w in WORDS[5:]],
    "comments_and_multiline": [b": keep-alive\n\n"] + [chat(w) for w in WORDS[:5]]
                              + [b'data: {"model":"m",\ndata: "choices":[{"delta":{"content":"x y"}}]}\n\n']
                              + [chat(w) for w in WORDS[5:]],
    "content_in_other_strings": [chat('say "content":"x" ' + w) for w in WORDS],
    "crlf": [chat(w).replace(b"\n", b"\r\n") for w in WORDS],
}


def analyse(stream: bytes, cuts: list[int], settle_every: int, monkeypatch, plain: bool) -> sse.StreamAnnotator:
    """``stream`` through an annotator in reads ending at ``cuts`` (read k stamped k)."""
    monkeypatch.setattr(sse, "SETTLE_BYTES", settle_every)
    monkeypatch.setattr(sse, "_NOT_PLAIN", sse._NOT_PLAIN if plain else (b"data",))
    an = sse.StreamAnnotator("completions" if b'"text"' in stream else "chat", 1000.0, True, 0.0)
    an.start(200, "text/event-stream")
    start = 0
    for k, end in enumerate(cuts + [len(stream)]):
        if end > start:
            an.feed(stream[start:end], 1000.0 + k)
        start = max(start, end)
    an.end(2000.0)
    return an


def state(an: sse.StreamAnnotator) -> dict:
    return {"n": an.n_content, "first": an.first_s, "last": an.last_s, "itl": an.itl, "usage": an.usage,
            "timings": an.timings, "model": an.model, "error": an.stream_error, "done": an.saw_done,
            "rep": (an.rep.finish(), an.rep.total), "text": an.out_parts,
            "failed": type(an.failed).__name__ if an.failed else None}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_batched_analysis_equals_event_by_event(name, monkeypatch):
    stream = b"".join(STREAMS[name])
    rng = random.Random(name)
    ends = [sum(map(len, STREAMS[name][:i + 1])) for i in range(len(STREAMS[name]))]
    splits = [ends[:-1],  # one event a read (a paced engine)
              sorted(rng.sample(range(1, len(stream)), 12)),  # reads cut anywhere, events split across them
              [ends[len(ends) // 2]],  # two reads holding many events each
              []]  # the whole stream in one read
    for cuts in splits:
        for settle_every in (1, 200, 1 << 20):  # every read, a few reads, only at the end
            ref = state(analyse(stream, cuts, settle_every, monkeypatch, plain=False))
            got = state(analyse(stream, cuts, settle_every, monkeypatch, plain=True))
            assert got == ref, (name, cuts, settle_every)
            if name not in ("error_mid_stream",):
                assert ref["n"] >= 4 and ref["failed"] is None


def test_the_plain_path_is_taken_and_keeps_read_stamps(monkeypatch):
    """The usual vLLM stream takes the batch path (no per-event call), and events of one read share its
    stamp: ITL 0 between them, the read's gap before the first."""
    calls = []
    monkeypatch.setattr(sse.StreamAnnotator, "_event",
                        lambda self, e, now, texts, f=sse.StreamAnnotator._event: calls.append(1) or f(self, e, now, texts))
    words = [f" w{i}" for i in range(30)]
    reads = [chat("", role="assistant") + chat(words[0])] + [chat(w) for w in words[1:10]] \
        + [b"".join(chat(w) for w in words[10:20])] + [chat(w) for w in words[20:]]
    an = sse.StreamAnnotator("chat", 1000.0, False, 0.0)
    an.start(200, "text/event-stream")
    for k, r in enumerate(reads):
        an.feed(r, 1000.0 + k)
    an.end(1100.0)
    assert an.n_content == 30 and an.first_s == 1000.0 and an.last_s == 1000.0 + len(reads) - 1
    assert an.itl[:9] == [1.0] * 9 and an.itl[9] == 1.0 and an.itl[10:19] == [0.0] * 9 and an.itl[19:] == [1.0] * 10
    assert len(calls) == 1  # the first event (its model), then batches only


def test_an_event_that_is_not_json_fails_the_analysis_on_either_path(monkeypatch):
    bad = [chat(f" w{i}") for i in range(5)] + [b'data: {"model":"m","choices":[{"delta":{"content":"x"}}]\n\n'] \
        + [chat(" after")]
    for plain in (True, False):
        an = analyse(b"".join(bad), [sum(map(len, bad[:i + 1])) for i in range(len(bad) - 1)], 1 << 20,
                     monkeypatch, plain)
        assert isinstance(an.failed, orjson.JSONDecodeError)


def test_the_first_token_is_read_without_settling_the_rest():
    """A live view asks every stream in flight for its first token: once known, the reads kept since
    stay kept (analysed in their own batch, not all streams' at once on the loop), and the stream's
    final figures are those of an annotator settled at every read."""
    events = STREAMS["vllm"]
    lazy = sse.StreamAnnotator("chat", 1000.0, True, 0.0)
    eager = sse.StreamAnnotator("chat", 1000.0, True, 0.0)
    for an in (lazy, eager):
        an.start(200, "text/event-stream")
    assert lazy.first_seen_s() is None
    for k, chunk in enumerate(events[:3]):
        lazy.feed(chunk, float(k))
        eager.feed(chunk, float(k))
        eager.settle()
    first = lazy.first_seen_s()
    assert first == eager.first_s == 1.0  # the role-only first event (read 0) carries no token
    for k, chunk in enumerate(events[3:], start=3):
        lazy.feed(chunk, float(k))
        eager.feed(chunk, float(k))
        eager.settle()
    assert lazy.first_seen_s() == first and lazy._pending  # still kept: nothing settled for the view
    lazy.settle()
    assert (lazy.n_content, lazy.itl, lazy.first_s) == (eager.n_content, eager.itl, eager.first_s)
