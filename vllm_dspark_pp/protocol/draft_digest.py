"""Evidence that every rank saw the same drafts: a running digest of each draft payload a rank
posts (last PP stage) or receives (every other stage), logged every N posts.

Under TP x PP each TP rank of the last stage runs its own copy of the drafter and broadcasts its
drafts down its own TP column (vLLM's ``PPHandler.broadcast_group`` is a sibling group of the PP
group, one per TP rank). Equal tokens and acceptance counters say that the columns agreed only
indirectly; with ``VLLM_DSPARK_PP_DRAFT_DIGEST=N`` every rank logs

    DSpark drafts digest: PP rank 1, TP rank 0, global rank 2: 64 draft posts, digest 0x1a2b3c4d

after every N-th draft payload, so that a test (or a reader of the logs) can check that all ranks
of the world report the same digest for the same count.

The digest is computed on the device, in the stream order of the exchange (the broadcast stream),
from the whole fixed-width payload: ``h = sum_i (x_i mod M) * (i + 1)`` over the flattened
payload, then ``d <- (d * B + h + n) mod M`` with M = 2^31 - 1, so every product and sum fits in
int64. Reading it (every N posts) synchronises the broadcast stream once: a debugging aid, off by
default, never on in a timed run.
"""

from __future__ import annotations

import re
from typing import Any

import torch

MODULUS = 2**31 - 1
BASE = 1_000_003
#: the payload size up to which the weighted sum cannot overflow int64 (n^2 * M < 2^63)
MAX_ELEMENTS = 1 << 16
LINE = "DSpark drafts digest: "
_LINE_RE = re.compile(
    r"DSpark drafts digest: (?P<who>PP rank [^:]+): (?P<count>\d+) draft posts, "
    r"digest (?P<digest>0x[0-9a-f]+)"
)


def payload_hash(payload: torch.Tensor) -> torch.Tensor:
    """The weighted sum of one payload (an int64 scalar tensor on the payload's device)."""
    flat = torch.remainder(payload.reshape(-1).to(torch.int64), MODULUS)
    n = flat.numel()
    if n > MAX_ELEMENTS:
        raise ValueError(f"a draft payload of {n} ids is too large to digest (max {MAX_ELEMENTS})")
    weights = torch.arange(1, n + 1, dtype=torch.int64, device=payload.device)
    return torch.remainder((flat * weights).sum(), MODULUS)


class DraftDigest:
    """One rank's running digest; :meth:`add` is called in the exchange's stream order."""

    def __init__(self, every: int, who: str, log: Any = None) -> None:
        if every < 1:
            raise ValueError(f"digest interval must be >= 1, got {every}")
        self.every = every
        self.who = who
        self.count = 0
        self._acc: torch.Tensor | None = None
        self._log = log

    def add(self, payload: torch.Tensor) -> None:
        if self._acc is None:
            self._acc = torch.zeros((), dtype=torch.int64, device=payload.device)
        h = payload_hash(payload)
        self._acc.mul_(BASE).add_(h).add_(payload.numel()).remainder_(MODULUS)
        self.count += 1
        if self.count % self.every == 0:
            self.report()

    def value(self) -> int:
        return 0 if self._acc is None else int(self._acc.item())

    def line(self) -> str:
        return f"{LINE}{self.who}: {self.count} draft posts, digest {self.value():#010x}"

    def report(self) -> None:
        if self._log is None:
            from vllm.logger import init_logger

            self._log = init_logger("vllm.dspark_pp.exchange")
        self._log.info("%s", self.line())


def parse_lines(text: str) -> dict[str, dict[int, str]]:
    """``{rank label: {post count: digest}}`` from the digest lines of a log."""
    out: dict[str, dict[int, str]] = {}
    for m in _LINE_RE.finditer(text):
        out.setdefault(m["who"], {})[int(m["count"])] = m["digest"]
    return out


def disagreements(per_rank: dict[str, dict[int, str]]) -> list[str]:
    """For every post count that every rank reported: the ranks whose digest differs from the
    first rank's. Empty when all agree; a note when no count is common to every rank."""
    if not per_rank:
        return ["no rank logged a drafts digest"]
    common = set.intersection(*(set(v) for v in per_rank.values()))
    if not common:
        return [f"no post count is common to every rank: {sorted(per_rank)}"]
    problems = []
    for count in sorted(common):
        values = {who: v[count] for who, v in per_rank.items()}
        if len(set(values.values())) > 1:
            problems.append(f"after {count} draft posts: {values}")
    return problems


def digest_from_env(handler: Any) -> DraftDigest | None:
    """The handler's digest when ``VLLM_DSPARK_PP_DRAFT_DIGEST`` names an interval, else None."""
    from vllm_dspark_pp import envs

    every = envs.VLLM_DSPARK_PP_DRAFT_DIGEST
    if not every:
        return None
    return DraftDigest(every, _rank_label(handler))


def _rank_label(handler: Any) -> str:
    try:
        from vllm_dspark_pp.protocol.world import vllm_world_position

        pos = vllm_world_position()
        return pos.shape.label(pos.rank_in_group)
    except Exception:  # noqa: BLE001 - a bare handler (unit tests) has no vLLM world
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        return f"PP rank ?, global rank {rank}"
