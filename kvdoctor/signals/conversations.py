"""Conversations and turns inferred from prompt prefix chains, for clients that send no session id.

A chat client resends the whole history every turn: turn k+1's prompt is turn k's prompt, its
answer and the next user message. Prompt block hashes are chained (an equal id means an equal
prefix up to that block), so turn k's full blocks are a prefix of turn k+1's. A request's *parent*
is the latest earlier request whose last block appears at the same position in its own list; the
longest such prefix wins (the previous turn, not the system prompt). A block list that several
earlier requests end on is a shared template (a system prompt, a retried request), never a
parent. Conversations are the chains' roots; a request's turn is its depth plus one. Requests
without hashes, or with no parent and no child, stay unknown (-1 and NaN).

All of it with arrays, no loop over requests: every request looks one block further back at each
step, all at once, among the requests that end on that prefix (how many did before it, and the
latest), and the chains are walked to their roots by pointer jumping (a number of steps
logarithmic in their depth).
"""
from __future__ import annotations

import numpy as np


def infer_conversations(req, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(conversation code per request, turn per request), in arrival order (``order`` maps arrival
    order to file order); -1 / NaN where no chain is found."""
    n = len(order)
    session = np.full(n, -1, dtype=np.int64)
    turn = np.full(n, np.nan)
    lists = req.lists("prefix_block_hashes")
    if lists is None or n == 0:
        return session, turn
    offsets, values = lists
    parent = _parents(offsets[order], (offsets[1:] - offsets[:-1])[order], values.astype(np.int64, copy=False))
    has_child = np.zeros(n, dtype=bool)
    has_child[parent[parent >= 0]] = True
    root, depth = _roots(parent)
    chained = (parent >= 0) | has_child
    session[chained] = root[chained]
    turn[chained] = depth[chained] + 1.0
    return session, turn


def _parents(start: np.ndarray, length: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per request in arrival order (its blocks: ``blocks[start:start + length]``): the latest
    earlier request that ended on the longest prefix of its blocks that exactly one earlier request
    ended on (more than one: a shared template), else -1; -1 also for a resend of an earlier
    request's whole prompt (its own block list ended by exactly one earlier request).

    Every request looks one block shorter at each step, all at once, and stops at its first
    prefix that exactly one earlier request ended on: the steps are as many as the longest block
    list, the lookups as many as the positions a request goes back (its previous turn is a few
    blocks shorter)."""
    n = len(start)
    parent = np.full(n, -1, dtype=np.int64)
    looking = np.flatnonzero(length > 0)
    if not len(looking):
        return parent
    # each request's own prefix, its (last position, last block): the key other requests extend;
    # keys as one integer (the last block's rank among all last blocks, times the positions, plus
    # the position), the enders sorted by key, then arrival
    end_pos = length[looking] - 1
    end_block = blocks[start[looking] + end_pos]
    ids = np.unique(end_block)
    span = int(end_pos.max()) + 1
    if len(ids) * span * n >= 2**62:  # too many to number this way (never on real captures): one by one
        return _parents_by_loop(start, length, blocks)
    stamp = np.sort((np.searchsorted(ids, end_block) * span + end_pos) * n + looking)
    back = 0
    while len(looking):
        pos = length[looking] - 1 - back
        looking, pos = looking[pos >= 0], pos[pos >= 0]
        block = blocks[start[looking] + pos]
        rank = np.minimum(np.searchsorted(ids, block), len(ids) - 1)
        ends_here = np.flatnonzero((ids[rank] == block) & (pos < span))  # some request ends on this prefix
        key = rank[ends_here] * span + pos[ends_here]
        before = np.searchsorted(stamp, key * n + looking[ends_here], side="left")  # its enders up to here
        once = before - np.searchsorted(stamp, key * n, side="left") == 1
        found = ends_here[once]
        # found: at its own whole prompt (back == 0) a resend, no parent; else that one ender
        parent[looking[found]] = -1 if back == 0 else stamp[before[once] - 1] % n
        keep = np.ones(len(looking), dtype=bool)
        keep[found] = False
        looking = looking[keep]
        back += 1
    return parent


def _roots(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(root, depth) of each request's chain, parents before children, by pointer jumping."""
    n = len(parent)
    jump = np.where(parent >= 0, parent, np.arange(n))
    depth = (parent >= 0).astype(np.int64)
    while True:
        nxt = jump[jump]
        if np.array_equal(nxt, jump):
            return jump, depth
        depth = depth + depth[jump]
        jump = nxt


def _parents_by_loop(start: np.ndarray, length: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """_parents one request at a time (keys too many to number as one integer)."""
    n = len(start)
    ends: dict[tuple[int, int], int] = {}  # (block position, last block id) -> the request ending there
    shared: set[tuple[int, int]] = set()  # ended on by several requests: a template, not a turn
    parent = np.full(n, -1, dtype=np.int64)
    for k in range(n):  # arrival order
        own = blocks[start[k]:start[k] + length[k]]
        for pos in range(len(own) - 1, -1, -1):  # the longest earlier prompt this one extends
            key = (pos, int(own[pos]))
            hit = ends.get(key)
            if hit is not None and key not in shared:
                parent[k] = hit
                break
        if len(own):
            key = (len(own) - 1, int(own[-1]))
            if key in ends:
                shared.add(key)
                parent[k] = -1 if parent[k] == ends[key] else parent[k]  # a resend of the same prompt
            ends[key] = k
    return parent
