"""How the handshake and the peer watch place and name a rank (vllm_dspark_pp/protocol/world.py),
and the handshake's layout check, in process (threads over one ``HashStore``).

The layout is checked against vLLM's real groups in test_world_handshake_watch.py (TP=2 x PP=2);
here the DP and PCP blocks, which that world lacks, against the ordering vLLM's
``initialize_model_parallel`` documents (``ExternalDP x DP x PP x PCP x TP``, torch reshape)."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_dspark_pp.protocol import handshake
from vllm_dspark_pp.protocol.world import WorldShape, layout_mismatch


@pytest.mark.parametrize(
    "dp,pp,pcp,tp", [(1, 2, 1, 2), (2, 2, 1, 2), (2, 3, 2, 2), (3, 4, 1, 1), (1, 2, 2, 1)]
)
def test_coords_follow_vllms_rank_layout(dp, pp, pcp, tp):
    shape = WorldShape(world_size=dp * pp * pcp * tp, tp=tp, pp=pp, pcp=pcp)
    grid = torch.arange(shape.world_size).reshape(-1, dp, pp, pcp, tp)
    for g in range(shape.world_size):
        _, d, p, c, t = (int(i) for i in (grid == g).nonzero()[0])
        got = shape.coords(g)
        assert (got.dp, got.pp, got.pcp, got.tp) == (d, p, c, t), g
    assert shape.dp == dp


def test_labels_worker_names_and_the_shape():
    tp2pp2 = WorldShape(world_size=4, tp=2, pp=2)
    assert [tp2pp2.label(g) for g in range(4)] == [
        "PP rank 0, TP rank 0, global rank 0",
        "PP rank 0, TP rank 1, global rank 1",
        "PP rank 1, TP rank 0, global rank 2",
        "PP rank 1, TP rank 1, global rank 3",
    ]
    assert tp2pp2.worker_name(1) == "Worker_PP0_TP1" and tp2pp2.describe() == "TP=2 x PP=2"
    pp2 = WorldShape.pp_only(2)  # global rank = PP rank: the messages stay as they were
    assert (pp2.label(1), pp2.worker_name(1), pp2.describe()) == (
        "PP rank 1",
        "Worker_PP1",
        "TP=1 x PP=2",
    )
    dp = WorldShape(world_size=8, tp=2, pp=2)
    assert dp.label(5) == "PP rank 0, TP rank 1, DP rank 1, global rank 5"
    assert dp.worker_name(5) == "Worker_DP1_PP0_TP1" and dp.describe() == "DP=2 x TP=2 x PP=2"
    with pytest.raises(ValueError, match="not a whole number"):
        WorldShape(world_size=6, tp=2, pp=2)


def test_layout_mismatch_names_both_placements():
    shape = WorldShape(world_size=4, tp=2, pp=2)
    assert layout_mismatch(shape, 1, {"tp": 1, "pcp": 0, "pp": 0}) is None
    assert layout_mismatch(shape, 1, None) is None
    msg = layout_mismatch(shape, 1, {"tp": 0, "pcp": 0, "pp": 1})
    assert msg is not None
    assert "global rank 1 is PCP rank 0, PP rank 1, TP rank 0 in vLLM's groups" in msg, msg
    assert "puts it at PCP rank 0, PP rank 0, TP rank 1" in msg, msg


FACTS = handshake.HandshakeFacts(
    protocol=2,
    plugin_version="0.1.0",
    vllm_version="0.34.0",
    pp_size=2,
    method="dspark",
    num_speculative_tokens=3,
    fixed_graph_batch=None,
    tp_size=2,
)


def _run_world(shape: WorldShape, coords_of, facts_of=lambda g: FACTS) -> dict[int, str]:
    """Every rank of ``shape`` in its own thread; returns each rank's outcome ("ok" or the
    error message)."""
    store = torch.distributed.HashStore()
    out: dict[int, str] = {}

    def run(g: int) -> None:
        try:
            handshake.run_handshake(
                facts_of(g),
                rank_in_group=g,
                ranks=list(range(shape.world_size)),
                store=store,
                timeout=10.0,
                epoch=1,
                shape=shape,
                coords=coords_of(g),
            )
            out[g] = "ok"
        except handshake.HandshakeError as exc:
            out[g] = str(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(shape.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_rank_placed_elsewhere_by_vllm_fails_every_rank():
    """If vLLM numbered its ranks otherwise, the messages would name the wrong ranks: the
    handshake refuses to start instead."""
    shape = WorldShape(world_size=4, tp=2, pp=2)

    def coords(g):
        c = shape.coords(g).as_dict()
        c.pop("dp")
        if g == 2:  # vLLM says TP rank 1, PP rank 0 (the layout says TP rank 0, PP rank 1)
            c.update(tp=1, pp=0)
        return c

    out = _run_world(shape, coords)
    assert sorted(out) == [0, 1, 2, 3]
    for g in range(4):
        assert "global rank 2 is PCP rank 0, PP rank 0, TP rank 1 in vLLM's groups" in out[g], out
    assert _run_world(shape, lambda g: {k: v for k, v in shape.coords(g).as_dict().items()
                                        if k != "dp"}) == dict.fromkeys(range(4), "ok")  # fmt: skip


def test_a_dp_world_is_one_handshake_naming_the_dp_rank():
    """DP=2 x TP=1 x PP=2: the second DP rank's last stage runs another k."""
    import dataclasses

    shape = WorldShape(world_size=4, pp=2)
    out = _run_world(
        shape,
        lambda g: None,
        lambda g: dataclasses.replace(FACTS, tp_size=1, num_speculative_tokens=5 if g == 2 else 3),
    )
    for g in range(4):
        assert "PP rank 0, DP rank 1, global rank 2 has num_speculative_tokens=5" in out[g], out
        assert "PP rank 1, DP rank 1, global rank 3 (last) has num_speculative_tokens=3" in out[g]
