"""Tokenizer of the tiny pair: a small BPE trained with the ``tokenizers`` library on the synthetic
corpus.

Pre-tokenization is one ASCII regex (``PIECE_PATTERN``, "isolated" split) and decoding fuses the
token strings (spaces and newlines are ordinary characters inside tokens), so text round-trips
exactly. ``PurePythonBPE`` re-implements the encoder with the standard library only, for the
training machine (which may not have ``tokenizers``); a unit test checks it against ``tokenizers``
on the corpus.
"""

from __future__ import annotations

import json
import re
import string

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, PAD_TOKEN]  # ids 0, 1, 2
EOS_ID, MASK_ID, PAD_ID = 0, 1, 2

DEFAULT_VOCAB_SIZE = 512
TOKENIZER_TRAIN_DOCS = 20000

# Words with their leading space, single digits (numbers are spelled digit by digit), newlines,
# punctuation runs, and any other whitespace run. Together these match every character.
PIECE_PATTERN = r" ?[A-Za-z]+| ?[0-9]|\n| ?[^A-Za-z0-9\s]+|\s+"

INITIAL_ALPHABET = sorted(set(string.printable) - set("\t\r\x0b\x0c"))


def train_tokenizer(
    out_path: str, vocab_size: int = DEFAULT_VOCAB_SIZE, num_docs: int = TOKENIZER_TRAIN_DOCS
):
    """Train the BPE on the first ``num_docs`` training documents and save ``tokenizer.json``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from dspark_dev.training.corpus import format_document, train_problems

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=INITIAL_ALPHABET,
        show_progress=False,
    )
    docs = [format_document(p) for p in train_problems(num_docs)]
    tok.train_from_iterator(docs, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.save(out_path)
    return tok


def write_hf_tokenizer_files(
    model_dir: str, tokenizer_json: str, model_max_length: int = 1024
) -> None:
    """Copy ``tokenizer.json`` into ``model_dir`` with the config files transformers/vLLM read."""
    import os
    import shutil

    os.makedirs(model_dir, exist_ok=True)
    dst = os.path.join(model_dir, "tokenizer.json")
    if os.path.abspath(tokenizer_json) != os.path.abspath(dst):
        shutil.copyfile(tokenizer_json, dst)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(model_dir, "special_tokens_map.json"), "w") as f:
        json.dump(
            {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}, f, indent=2
        )
        f.write("\n")


class PurePythonBPE:
    """Encoder/decoder for our ``tokenizer.json`` with the standard library only."""

    def __init__(self, tokenizer_json: str):
        with open(tokenizer_json, encoding="utf-8") as f:
            data = json.load(f)
        model = data["model"]
        assert model["type"] == "BPE", model["type"]
        self.vocab: dict[str, int] = dict(model["vocab"])
        for added in data.get("added_tokens", []):
            self.vocab[added["content"]] = added["id"]
        merges = model["merges"]
        self.ranks: dict[tuple[str, str], int] = {}
        for i, m in enumerate(merges):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            self.ranks[(a, b)] = i
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.vocab_size = max(self.id_to_token) + 1
        self._piece_re = re.compile(PIECE_PATTERN)
        self._cache: dict[str, list[int]] = {}

    def _bpe(self, piece: str) -> list[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        parts = list(piece)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            a, b = parts[best], parts[best + 1]
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = [self.vocab[p] for p in parts]
        self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._piece_re.findall(text):
            out.extend(self._bpe(piece))
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.id_to_token[i] for i in ids if i not in (EOS_ID, MASK_ID, PAD_ID))
