import subprocess
import sys

import pytest

from kvdoctor.collect import textstats as ts


def test_conversation_id_stable_across_turns_and_processes():
    t1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "first"}]
    t3 = t1 + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "second"},
               {"role": "assistant", "content": "b"}, {"role": "user", "content": "third"}]
    cid = ts.conversation_id(t1)
    assert cid == ts.conversation_id(t3) and len(cid) == 16
    assert cid != ts.conversation_id([{"role": "system", "content": "S2"}, {"role": "user", "content": "first"}])
    assert cid != ts.conversation_id([{"role": "user", "content": "first"}])
    assert ts.conversation_id([{"role": "system", "content": "only"}]) is None
    assert ts.conversation_id([]) is None and ts.conversation_id(None) is None
    # content parts give the same id as the plain string
    parts = [{"role": "system", "content": [{"type": "text", "text": "S"}]},
             {"role": "user", "content": [{"type": "text", "text": "fir"}, {"type": "text", "text": "st"}]}]
    assert ts.conversation_id(parts) == cid
    code = ("from kvdoctor.collect.textstats import conversation_id as c;"
            "print(c([{'role':'system','content':'S'},{'role':'user','content':'first'}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == cid


def test_turn_number():
    assert ts.turn_number([{"role": "user", "content": "x"}]) == 1
    assert ts.turn_number([{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                           {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]) == 2
    assert ts.turn_number(None) is None


def test_render_prompt():
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert ts.render_prompt(body) == "<|system|>\nS\n<|user|>\nU\n"
    assert ts.render_prompt({"prompt": "abc"}) == "abc"
    assert ts.render_prompt({"prompt": ["a", "b"]}) == "a\nb"
    assert ts.render_prompt({"prompt": [1, 2, 3]}) is None
    assert ts.render_prompt(None) is None and ts.render_prompt([1]) is None
    img = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                     {"type": "text", "text": "what?"}]}]}
    assert ts.render_prompt(img) == "<|user|>\n<image_url>what?\n"


def test_prefix_block_hashes_chained_and_63bit():
    a = "x" * 100 + "y" * 100 + "z" * 57
    h = ts.prefix_block_hashes(a, 100)
    assert len(h) == 2  # trailing partial block not hashed
    assert all(0 <= v < 2 ** 63 for v in h)
    # same block content at a different position -> different id (chained)
    h2 = ts.prefix_block_hashes("y" * 100 + "y" * 100, 100)
    assert h2[1] != h[1]
    # shared prefix -> shared leading ids, then diverge forever
    b = "x" * 100 + "Y" * 100 + "z" * 100
    hb = ts.prefix_block_hashes(b, 100)
    assert hb[0] == h[0] and hb[1] != h[1]
    assert ts.common_prefix_blocks(h, hb) == 1
    assert ts.common_prefix_blocks(h, h) == 2
    assert ts.prefix_block_hashes("short", 256) == []
    assert ts.prefix_block_hashes("é" * 512, 256) == ts.prefix_block_hashes("é" * 600, 256)
    with pytest.raises(ValueError):
        ts.prefix_block_hashes("abc", 0)


def test_prefix_block_tokens():
    assert ts.prefix_block_tokens(100, 1000, 256) == 26
    assert ts.prefix_block_tokens(None, 1000, 256) is None
    assert ts.prefix_block_tokens(10, 0, 256) is None
    assert ts.prefix_block_tokens(1, 100000, 256) == 1


def test_repetition_whole_text():
    assert ts.repetition("a b c d e f g h") == 0.0
    assert ts.repetition("a b c") is None
    # "a b c d a b c d": 5 four-grams, only the last ("a b c d") repeats
    assert ts.repetition("a b c d a b c d") == pytest.approx(1 / 5)
    loop = " ".join(["the cat sat down"] * 25)
    assert ts.repetition(loop) > 0.9


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 13])
def test_repetition_incremental_equals_whole(cut):
    text = "I think that I think that the answer is the answer is the answer, really really really."
    rc = ts.RepetitionCounter()
    for i in range(0, len(text), cut):
        rc.feed(text[i:i + cut])
    assert rc.finish() == ts.repetition(text)
    assert rc.total == len(text.split()) - 3


def test_repetition_whitespace_pieces():
    rc = ts.RepetitionCounter(2)
    for p in ["a", " ", "b", "\n", "", "a ", " b", "  "]:
        rc.feed(p)
    assert rc.finish() == pytest.approx(1 / 3)  # a b | b a | a b(repeat)
