"""Where each rank of a vLLM world sits (TP x PP, PCP, DP), and how messages name it.

The start-up handshake and the peer watch cover every rank of vLLM's world group, not only one
PP group. A rank that is silent (no plugin) publishes nothing, so the rank that reports it must
work out its coordinates from its global rank alone. vLLM 0.34.0 numbers its ranks
``ExternalDP x DP x PP x PCP x TP`` with TP varying fastest
(``vllm/distributed/parallel_state.py``, ``initialize_model_parallel``); :class:`WorldShape`
mirrors that numbering, and the handshake checks it against the coordinates every answering rank
reads from vLLM's own groups, so a layout change in vLLM shows up as a start-up failure instead of
a message that names the wrong rank.

Pure functions only; nothing here talks to another rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Coords:
    tp: int
    pcp: int
    pp: int
    dp: int  # which TP x PCP x PP block (vLLM's DP and an external DP together)

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pcp": self.pcp, "pp": self.pp, "dp": self.dp}


@dataclass(frozen=True)
class WorldShape:
    """``world_size`` ranks in blocks of ``tp * pcp * pp`` (one block per DP rank)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    pcp: int = 1

    def __post_init__(self) -> None:
        block = self.tp * self.pp * self.pcp
        if min(self.tp, self.pp, self.pcp) < 1 or self.world_size < block:
            raise ValueError(f"not a vLLM world: {self}")
        if self.world_size % block:
            raise ValueError(
                f"a world of {self.world_size} ranks is not a whole number of TP={self.tp} x "
                f"PCP={self.pcp} x PP={self.pp} blocks"
            )

    @classmethod
    def pp_only(cls, pp: int) -> WorldShape:
        """One PP group and nothing else (TP = DP = 1): global rank = PP rank."""
        return cls(world_size=pp, pp=pp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.pcp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        pcp, rest = rest % self.pcp, rest // self.pcp
        pp, dp = rest % self.pp, rest // self.pp
        return Coords(tp=tp, pcp=pcp, pp=pp, dp=dp)

    @property
    def only_pp(self) -> bool:
        return self.tp == self.pcp == self.dp == 1

    def label(self, rank: int) -> str:
        """``PP rank 1`` when the world is one PP group (global rank = PP rank), else e.g.
        ``PP rank 0, TP rank 1, global rank 1``; every label starts with ``PP rank``."""
        c = self.coords(rank)
        if self.only_pp:
            return f"PP rank {c.pp}"
        parts = [f"PP rank {c.pp}"]
        if self.tp > 1:
            parts.append(f"TP rank {c.tp}")
        if self.pcp > 1:
            parts.append(f"PCP rank {c.pcp}")
        if self.dp > 1:
            parts.append(f"DP rank {c.dp}")
        parts.append(f"global rank {rank}")
        return ", ".join(parts)

    def worker_name(self, rank: int) -> str:
        """The process name vLLM 0.34.0's multiprocessing executor gives that rank's worker
        (``WorkerProc``: ``Worker_DP.._PP.._PCP.._TP..``, each part only when its size > 1)."""
        c = self.coords(rank)
        name = "Worker"
        if self.dp > 1:
            name += f"_DP{c.dp}"
        if self.pp > 1:
            name += f"_PP{c.pp}"
        if self.pcp > 1:
            name += f"_PCP{c.pcp}"
        if self.tp > 1:
            name += f"_TP{c.tp}"
        return name

    def describe(self) -> str:
        """E.g. ``TP=2 x PP=2`` (DP and PCP named only when > 1)."""
        parts = []
        if self.dp > 1:
            parts.append(f"DP={self.dp}")
        parts.append(f"TP={self.tp}")
        if self.pcp > 1:
            parts.append(f"PCP={self.pcp}")
        parts.append(f"PP={self.pp}")
        return " x ".join(parts)


@dataclass(frozen=True)
class WorldPosition:
    """This process in vLLM's world group: its index, the group's global ranks, the shape, and
    the coordinates vLLM's own groups give it (checked against ``shape.coords`` by the
    handshake)."""

    rank_in_group: int
    ranks: list[int]
    shape: WorldShape
    reported: dict[str, int]


def vllm_world_position() -> WorldPosition:
    """Read this process's place from vLLM's initialised parallel state."""
    from vllm.distributed import parallel_state as ps

    world = ps.get_world_group()
    tp, pp, pcp = ps.get_tp_group(), ps.get_pp_group(), ps.get_pcp_group()
    shape = WorldShape(
        world_size=world.world_size, tp=tp.world_size, pp=pp.world_size, pcp=pcp.world_size
    )
    reported = {"tp": tp.rank_in_group, "pcp": pcp.rank_in_group, "pp": pp.rank_in_group}
    return WorldPosition(world.rank_in_group, list(world.ranks), shape, reported)


def layout_mismatch(shape: WorldShape, rank: int, reported: dict[str, Any] | None) -> str | None:
    """A problem line when a rank's coordinates from vLLM's groups are not the ones
    :meth:`WorldShape.coords` gives its global rank; ``None`` when they match (or were not
    sent)."""
    if not reported:
        return None
    expected = shape.coords(rank).as_dict()
    diff = {k: v for k, v in reported.items() if k in expected and expected[k] != v}
    if not diff:
        return None
    got = ", ".join(f"{k.upper()} rank {v}" for k, v in sorted(reported.items()))
    want = ", ".join(f"{k.upper()} rank {expected[k]}" for k in sorted(reported) if k in expected)
    return (
        f"global rank {rank} is {got} in vLLM's groups, but vllm-dspark-pp's layout "
        f"({shape.describe()}, TP fastest) puts it at {want}: this vLLM numbers its ranks "
        "differently from the release the plugin supports (report it; the plugin would name the "
        "wrong ranks)"
    )
