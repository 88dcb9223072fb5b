"""Conversations and turns inferred from prompt prefix chains, for clients that send no session id.

A chat client resends the whole history every turn: turn k+1's prompt is turn k's prompt, its
answer and the next user message. Prompt block hashes are chained (an equal id means an equal
prefix up to that block), so turn k's full blocks are a prefix of turn k+1's. A request's *parent*
is the latest earlier request whose last block appears at the same position in its own list; the
longest such prefix wins (the previous turn, not the system prompt). A block list that several
earlier requests end on is a shared template (a system prompt, a retried request), never a
parent. Conversations are the chains' roots; a request's turn is its depth plus one. Requests
without hashes, or with no parent and no child, stay unknown (-1 and NaN).
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
    ends: dict[tuple[int, int], int] = {}  # (block position, last block id) -> the request ending there
    shared: set[tuple[int, int]] = set()  # ended on by several requests: a template, not a turn
    parent = np.full(n, -1, dtype=np.int64)
    for k in range(n):  # arrival order
        i = int(order[k])
        blocks = values[offsets[i]:offsets[i + 1]]
        for pos in range(len(blocks) - 1, -1, -1):  # the longest earlier prompt this one extends
            key = (pos, int(blocks[pos]))
            hit = ends.get(key)
            if hit is not None and key not in shared:
                parent[k] = hit
                break
        if len(blocks):
            key = (len(blocks) - 1, int(blocks[-1]))
            if key in ends:
                shared.add(key)
                parent[k] = -1 if parent[k] == ends[key] else parent[k]  # a resend of the same prompt
            ends[key] = k
    has_child = np.zeros(n, dtype=bool)
    has_child[parent[parent >= 0]] = True
    for k in range(n):  # parents come first in arrival order: one pass sets roots and depths
        p = parent[k]
        if p >= 0:
            session[k], turn[k] = session[p], turn[p] + 1
        elif has_child[k]:
            session[k], turn[k] = k, 1.0
    return session, turn
