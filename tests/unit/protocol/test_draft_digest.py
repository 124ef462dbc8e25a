"""VLLM_DSPARK_PP_DRAFT_DIGEST (protocol/draft_digest.py): the running digest of the draft
payloads, its log lines and the comparison the TP x PP tests make across every rank's log. The
digest through the real handler with real gloo ranks: tests/unit/protocol/test_protocol_gloo.py
(every rank ends each seeded case with the same count and digest)."""

from __future__ import annotations

import pytest
import torch

from vllm_dspark_pp import envs
from vllm_dspark_pp.protocol import draft_digest as dd


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, fmt: str, *args) -> None:
        self.lines.append(fmt % args)


def _digest(payloads, every=1, who="PP rank 1, TP rank 0, global rank 2"):
    d = dd.DraftDigest(every, who, log=_Log())
    for p in payloads:
        d.add(torch.tensor(p, dtype=torch.int64))
    return d


def test_equal_payloads_give_equal_digests_and_parseable_lines():
    payloads = [[[5, 7, 9, 3], [-1, -1, -1, 3]], [[11, 2, 2, 1]]]
    a, b = _digest(payloads, who="PP rank 0, TP rank 1, global rank 1"), _digest(payloads)
    assert a.value() == b.value() and a.count == 2
    text = "\n".join(["noise"] + a._log.lines + b._log.lines)
    per_rank = dd.parse_lines(text)
    assert per_rank == {
        "PP rank 0, TP rank 1, global rank 1": {
            1: a._log.lines[0].rsplit(" ", 1)[-1],
            2: f"{a.value():#010x}",
        },
        "PP rank 1, TP rank 0, global rank 2": {
            1: b._log.lines[0].rsplit(" ", 1)[-1],
            2: f"{b.value():#010x}",
        },
    }
    assert dd.disagreements(per_rank) == []


@pytest.mark.parametrize(
    "changed",
    [
        [[[5, 7, 9, 4], [-1, -1, -1, 3]], [[11, 2, 2, 1]]],  # one id
        [[[7, 5, 9, 3], [-1, -1, -1, 3]], [[11, 2, 2, 1]]],  # two ids swapped in a row
        [[[-1, -1, -1, 3], [5, 7, 9, 3]], [[11, 2, 2, 1]]],  # two rows swapped
        [[[11, 2, 2, 1]], [[5, 7, 9, 3], [-1, -1, -1, 3]]],  # two posts swapped
        [[[5, 7, 9, 3], [-1, -1, -1, 3]], [[11, 2, 2, 1]], [[0]]],  # one post more
    ],
)
def test_a_different_draft_stream_gives_another_digest(changed):
    """The control of every digest comparison: the check would see a rank that drafted or
    received anything else."""
    base = [[[5, 7, 9, 3], [-1, -1, -1, 3]], [[11, 2, 2, 1]]]
    a, b = _digest(base), _digest(changed)
    assert a.value() != b.value()
    per_rank = {"PP rank 0": {2: f"{a.value():#x}"}, "PP rank 1": {2: f"{b.value():#x}"}}
    if b.count == a.count:
        assert dd.disagreements(per_rank) != []


def test_lines_every_n_posts_and_what_the_comparison_says_without_common_counts():
    d = _digest([[[1]]] * 7, every=3)
    assert [x.split(": ")[2].split(" ")[0] for x in d._log.lines] == ["3", "6"]
    assert dd.disagreements({}) == ["no rank logged a drafts digest"]
    assert (
        "no post count is common" in dd.disagreements({"PP rank 0": {3: "0x1"}, "PP rank 1": {}})[0]
    )


def test_the_knob_reads_an_interval_and_refuses_anything_else(monkeypatch):
    monkeypatch.delenv("VLLM_DSPARK_PP_DRAFT_DIGEST", raising=False)
    assert envs.VLLM_DSPARK_PP_DRAFT_DIGEST == 0
    monkeypatch.setenv("VLLM_DSPARK_PP_DRAFT_DIGEST", "16")
    assert envs.VLLM_DSPARK_PP_DRAFT_DIGEST == 16
    for bad in ("-1", "yes", "1.5"):
        monkeypatch.setenv("VLLM_DSPARK_PP_DRAFT_DIGEST", bad)
        with pytest.raises(ValueError, match="VLLM_DSPARK_PP_DRAFT_DIGEST"):
            _ = envs.VLLM_DSPARK_PP_DRAFT_DIGEST
