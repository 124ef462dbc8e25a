"""The trained tiny pair (models/tiny-pair, docs/tiny-pair.md) for the CPU end-to-end tier.

The random-weight pair of ``vllm_dspark_pp.tiny_models`` accepts only at draft position 0, so it
cannot show that acceptance is preserved; the trained pair accepts about 7.5 tokens per step at
k=7 with rejections spread over positions 1-6, which makes the per-position counters a real check.

``heldout_prompts(n, min_tokens=0)`` gives the first ``n`` held-out problems of the seeded corpus
(``dspark_dev.training.corpus.heldout_problems``, never seen in training) whose prompt has
at
least ``min_tokens`` tokens, as token-id lists from the pair's tokenizer (no BOS is added: the
tokenizer config says ``add_bos_token: false``, so these are exactly what vLLM would tokenize).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAIR_DIR = REPO_ROOT / "models" / "tiny-pair"
TARGET = str(PAIR_DIR / "target")
DRAFT = str(PAIR_DIR / "dspark-draft")
TOKENIZER = PAIR_DIR / "target" / "tokenizer.json"  # the one committed copy


def num_speculative_tokens() -> int:
    """The drafter's trained block size (7): what the pair was trained to draft."""
    cfg = json.loads((PAIR_DIR / "dspark-draft" / "config.json").read_text())
    return int(cfg["block_size"])


def num_target_layers() -> int:
    return int(json.loads((PAIR_DIR / "target" / "config.json").read_text())["num_hidden_layers"])


def spec_config() -> dict:
    return {"method": "dspark", "model": DRAFT, "num_speculative_tokens": num_speculative_tokens()}


def available() -> tuple[bool, str]:
    for p in (Path(TARGET) / "model.safetensors", Path(DRAFT) / "model.safetensors", TOKENIZER):
        if not os.path.exists(p):
            return False, f"the trained tiny pair is incomplete: {p} is missing (docs/tiny-pair.md)"
    return True, ""


@cache
def _encoded_heldout(count: int) -> tuple[tuple[int, ...], ...]:
    from tokenizers import Tokenizer

    from dspark_dev.training import corpus

    tok = Tokenizer.from_file(str(TOKENIZER))
    probs = corpus.heldout_problems(max(count, corpus.DEFAULT_HELDOUT_SIZE))[:count]
    return tuple(tuple(tok.encode(corpus.format_prompt(p.question)).ids) for p in probs)


def heldout_prompts(n: int, min_tokens: int = 0) -> list[list[int]]:
    out = [list(ids) for ids in _encoded_heldout(256) if len(ids) >= min_tokens][:n]
    if len(out) < n:
        raise AssertionError(
            f"only {len(out)} held-out prompts have >= {min_tokens} tokens (wanted {n})"
        )
    return out
