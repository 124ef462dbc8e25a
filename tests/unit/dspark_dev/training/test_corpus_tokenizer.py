"""Corpus determinism and split, tokenizer round trip, pure-Python BPE == ``tokenizers``."""

import json
import os

import pytest

from dspark_dev.training import corpus
from dspark_dev.training.tokenizer import (
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    PurePythonBPE,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
TOKENIZER = os.path.join(REPO, "models", "tiny-pair", "target", "tokenizer.json")


def test_corpus_is_deterministic_and_gsm8k_formatted():
    a, b = corpus.train_problems(300), corpus.train_problems(300)
    assert a == b
    assert a[0].question != a[1].question
    for p in a + corpus.heldout_problems(64):
        last = p.answer.splitlines()[-1]
        assert last == f"#### {p.value}"
        assert "<<" in p.answer and ">>" in p.answer


def test_heldout_questions_never_in_training_stream():
    held = {p.question for p in corpus.heldout_problems()}
    assert len(held) == corpus.DEFAULT_HELDOUT_SIZE
    train = corpus.train_problems(20000)
    assert not held & {p.question for p in train}


def test_gsm8k_jsonl(tmp_path):
    path = tmp_path / "heldout.jsonl"
    probs = corpus.heldout_problems(8)
    corpus.write_gsm8k_jsonl(str(path), probs)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["question"] for r in rows] == [p.question for p in probs]
    assert all(r["answer"].endswith(f"#### {p.value}") for r, p in zip(rows, probs, strict=True))


def test_committed_tokenizer_matches_pure_python_encoder():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(TOKENIZER)
    bpe = PurePythonBPE(TOKENIZER)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [EOS_ID, MASK_ID, PAD_ID]
    docs = [
        corpus.format_document(p) for p in corpus.train_problems(2000) + corpus.heldout_problems()
    ]
    for d in docs:
        ids = tok.encode(d).ids
        assert bpe.encode(d) == ids, d
        assert tok.decode(ids) == d
        assert bpe.decode(ids) == d
    # the prompt alone tokenizes as the prefix of its document (what vLLM sees at inference)
    for p in corpus.heldout_problems(64):
        prompt = tok.encode(corpus.format_prompt(p.question)).ids
        assert tok.encode(corpus.format_document(p)).ids[: len(prompt)] == prompt


def test_committed_tokenizer_is_reproducible(tmp_path):
    pytest.importorskip("tokenizers")
    from dspark_dev.training.tokenizer import train_tokenizer

    out = tmp_path / "tokenizer.json"
    train_tokenizer(str(out))
    assert json.loads(out.read_text())["model"] == json.loads(open(TOKENIZER).read())["model"]
