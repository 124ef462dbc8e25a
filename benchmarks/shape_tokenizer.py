"""A local tokenizer whose vocabulary matches a model shape's ``config.json`` (no download).

A dummy-weight target at a real shape (benchmarks/real_shapes.py) has no tokenizer, and the GPU
machine cannot download one; ``vllm serve`` and ``vllm bench serve`` (random dataset) need one
whose vocabulary covers every token id the model can emit. This writes one next to the config:

    python -m benchmarks.shape_tokenizer MODEL_DIR [--check]

What it builds, with the ``tokenizers`` package (a vLLM dependency):

* a word-level model with exactly ``vocab_size`` entries (Qwen3 shapes: 151,936), token id ``i``
  is the word ``w<i>``; the ids the config names as BOS/EOS (Qwen3: 151643, 151645) carry
  Qwen3's names (``<|endoftext|>``, ``<|im_end|>``) and are special tokens, so vLLM's random
  dataset leaves them out of its prompts and ``ignore_eos`` runs are not cut short by them;
* a SentencePiece-style word boundary (``Metaspace`` pre-tokenizer and decoder): text is split
  on spaces, and decoding a token stream one token at a time (vLLM's incremental detokenizer)
  gives the same text as decoding it whole;
* ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` (no BOS added, like Qwen3).

Decode-then-encode gives back every non-special id sequence exactly (``--check`` verifies that
on random sequences, and ``tests/unit/benchmarks/test_perf_pp_one_gpu.py`` in CI), so a
random-dataset prompt of 1024 tokens is 1024 tokens for the server as well. The text means
nothing, which is fine: the weights are random and the acceptance is synthetic.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Qwen3's names for the ids its config uses as BOS / EOS (others are plain words).
QWEN3_SPECIAL_NAMES = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
BOUNDARY = "\u2581"  # the SentencePiece word-boundary mark


def word(i: int) -> str:
    return f"w{i}"


def special_ids(config: dict) -> dict[int, str]:
    """The config's BOS/EOS ids (ints or lists) with their names: Qwen3's where known."""
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(key)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    vocab = int(config["vocab_size"])
    return {i: QWEN3_SPECIAL_NAMES.get(i, f"<|special_{i}|>") for i in sorted(ids) if i < vocab}


def build(vocab_size: int, specials: dict[int, str]):
    """The ``tokenizers.Tokenizer`` (vocabulary ``vocab_size``, ``specials`` as special tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {}
    for i in range(vocab_size):
        vocab[specials[i] if i in specials else BOUNDARY + word(i)] = i
    unk = specials[min(specials)] if specials else BOUNDARY + word(0)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=BOUNDARY, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=BOUNDARY, prepend_scheme="always")
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in specials.values()]
    )
    return tok


def tokenizer_config(specials: dict[int, str], eos_id: int | None, max_len: int) -> dict:
    eos = specials.get(eos_id) if eos_id is not None else None
    pad = specials[min(specials)] if specials else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": pad,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [s for s in specials.values() if s not in (eos, pad)],
    }


def write(model_dir: str | Path) -> dict:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir`` (which holds the
    shape's ``config.json``). Returns what was written."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    specials = special_ids(config)
    tok = build(vocab_size, specials)
    tok.save(str(model_dir / "tokenizer.json"))
    eos = config.get("eos_token_id")
    eos_id = eos[0] if isinstance(eos, list) else eos
    cfg = tokenizer_config(specials, eos_id, int(config.get("max_position_embeddings", 4096)))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return {
        "dir": str(model_dir),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "config_vocab_size": vocab_size,
        "special_tokens": {str(k): v for k, v in specials.items()},
    }


def round_trip_failures(model_dir: str | Path, n: int = 20, length: int = 256, seed: int = 0):
    """Random non-special id sequences whose decode-then-encode (through ``transformers``, as
    vLLM loads it) is not the same sequence. Returns (checked, failures)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tok.all_special_ids)
    rng = random.Random(seed)
    failures = []
    for _ in range(n):
        ids = []
        while len(ids) < length:
            i = rng.randrange(tok.vocab_size)
            if i not in special:
                ids.append(i)
        back = tok.encode(tok.decode(ids), add_special_tokens=False)
        if back != ids:
            failures.append((ids[:8], back[:8]))
    return n, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="a folder with the shape's config.json")
    ap.add_argument("--check", action="store_true", help="round-trip random id sequences")
    a = ap.parse_args(argv)
    info = write(a.model_dir)
    print(json.dumps(info), flush=True)
    if a.check:
        n, bad = round_trip_failures(a.model_dir)
        print(f"round trip: {n - len(bad)} of {n} sequences identical", flush=True)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
