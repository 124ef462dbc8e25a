"""Greedy DSpark (one request, no batching) as vLLM's speculator runs it, shared by the acceptance
simulations: ``train_tiny_pair.simulate_acceptance`` (the pure-torch training modules) and
``k3_vllm_sim`` (vLLM 0.34.0's own Kimi-K3 layers).

* Markov chain (``v1/worker/gpu/spec_decode/dspark/speculator.py:295-340``, greedy): the drafter
  gives base logits for the ``N`` block positions in one pass; position ``i`` then takes the argmax
  of ``base[i] + markov_bias(prev)`` with ``prev`` the anchor for ``i = 0`` and the previous draft
  after that, one position at a time.
* Anchor walk: the first anchor is the first generated token (the prefill's output; its block
  drafts the tokens after it); a step whose first ``k`` drafts equal the target's greedy tokens
  accepts them and the target's own token after them (the bonus), so the next anchor is ``k + 1``
  further on. The acceptance length of a step is ``k + 1`` (vLLM's spec-decode metrics count the
  bonus).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def markov_chain(
    base: torch.Tensor, prev: torch.Tensor, markov_bias: Callable[[torch.Tensor], torch.Tensor]
) -> list[list[int]]:
    """Greedy drafts of ``A`` blocks: ``base`` [A,N,V] logits, ``prev`` [A] anchor tokens,
    ``markov_bias(tokens [A]) -> [A,V]``. Returns the drafts as a list of ``A`` lists of ``N``."""
    drafts = []
    for i in range(base.shape[1]):
        tok = (base[:, i] + markov_bias(prev)).argmax(-1)
        drafts.append(tok)
        prev = tok
    return torch.stack(drafts, 1).tolist()


def anchor_walk(seq: list[int], prompt_len: int, drafts: list[list[int]]) -> list[int]:
    """The accepted-draft count of every step over ``seq`` (prompt, then the target's greedy
    continuation and its final token); ``drafts[j]`` is the block anchored at position
    ``prompt_len + j`` of ``seq``, one for every position before the last."""
    L = len(seq)
    ks = []
    a = prompt_len
    while a < L - 1:
        d = drafts[a - prompt_len]
        k = 0
        while k < len(d) and a + k + 1 < L and d[k] == seq[a + k + 1]:
            k += 1
        ks.append(k)
        a += k + 1
    return ks


def summarize(walks: list[list[int]], block_size: int) -> tuple[float, list[float], int]:
    """(mean acceptance length incl. the bonus, per-position acceptance rates, steps) of the
    walks of several sequences."""
    accepted_at = [0] * block_size
    steps = 0
    total_len = 0
    for ks in walks:
        for k in ks:
            for i in range(k):
                accepted_at[i] += 1
            steps += 1
            total_len += k + 1
    per_pos = [c / max(1, steps) for c in accepted_at]
    return total_len / max(1, steps), per_pos, steps
