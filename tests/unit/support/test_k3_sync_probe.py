"""The Kimi-K3 PP=2 race probes (tests/support/k3_probe/k3_sync_probe.py, docs/k3-pp-race.md) on
stand-in classes: each probe acts where it says, on the ranks it says, and nowhere when unset.
The GPU jobs that use them: ``K3_DIAG`` in tests/gpu/test_dsv4_k3_pp.py."""

from __future__ import annotations

import types

import pytest
from support.k3_probe import k3_sync_probe as P


def _points(points: str, ranks: str = "", rank: int = 0, fail_at: int = 0):
    calls: list[str] = []
    out: list[str] = []

    def sync():
        calls.append("sync")
        if fail_at and len(calls) == fail_at:
            raise RuntimeError("device-side assert triggered")

    sp = P.SyncPoints(
        P.parse_points(points),
        P.parse_ranks(ranks),
        sync=sync,
        rank_of=lambda: rank,
        out=out.append,
    )
    return sp, calls, out


def _runner_module():
    log: list[str] = []

    class PPHandler:
        def receive(self, batch, recv_drafts):
            log.append("receive")
            return True

        def get_prev_sampled_outputs(self):
            log.append("get_prev")

    class DSparkPPHandler(PPHandler):  # the plugin binds a subclass under the same name
        def broadcast(self, *a):
            log.append("broadcast")

    class GPUModelRunner:
        def execute_model(self, so):
            log.append("execute")
            return "out"

        def sample_tokens(self, g):
            log.append("sample")
            return "sampled"

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner, PPHandler=DSparkPPHandler), log


def _model_module():
    class KimiDecoderLayer:
        def __init__(self, i):
            self.layer_idx = i

        def forward(self, x):
            return x + 1

    class KimiLinearModel:
        def __init__(self):
            self.layers = [KimiDecoderLayer(0), KimiDecoderLayer(1)]

        def embed_input_ids(self, ids):
            return ids

        def forward(self, ids):
            h = self.embed_input_ids(ids)
            for layer in self.layers:
                h = layer.forward(h)
            return h

    class KimiLinearForCausalLM:
        def __init__(self):
            self.model = KimiLinearModel()

        def forward(self, ids):
            return self.model.forward(ids)

    return types.SimpleNamespace(
        KimiDecoderLayer=KimiDecoderLayer,
        KimiLinearModel=KimiLinearModel,
        KimiLinearForCausalLM=KimiLinearForCausalLM,
    )


def test_step_and_recv_points_sync_after_each_call_on_the_selected_rank():
    module, log = _runner_module()
    sp = P.SyncPoints(
        P.parse_points("step,recv"), P.parse_ranks("0"), sync=lambda: log.append("sync"),
        rank_of=lambda: 0, out=log.append,
    )  # fmt: skip
    done = P.patch_runner(module, sp)
    runner, handler = module.GPUModelRunner(), module.PPHandler()
    assert runner.execute_model(None) == "out" and runner.sample_tokens(None) == "sampled"
    assert handler.receive(None, False) is True
    handler.get_prev_sampled_outputs()
    handler.broadcast()
    steps = ["execute", "sample", "receive", "get_prev", "broadcast"]
    assert log == [x for step in steps for x in (step, "sync")]  # each sync after its call
    assert sp.count == 5 and sp.last_clean == "after PPHandler.broadcast"
    assert "DSparkPPHandler.receive" in done and "GPUModelRunner.sample_tokens" in done


def test_other_ranks_and_unasked_points_do_not_sync():
    module, _ = _runner_module()
    sp, calls, _ = _points("step", ranks="0", rank=1)  # PP rank 1, syncs asked on rank 0 only
    P.patch_runner(module, sp)
    module.GPUModelRunner().execute_model(None)
    module.PPHandler().receive(None, False)  # "recv" not asked: not wrapped
    assert calls == []
    assert P.parse_ranks("") is None and P.parse_ranks("all") is None
    assert P.parse_ranks("0,1") == {0, 1}


def test_model_points_name_the_interval_of_the_first_failing_kernel():
    module = _model_module()
    sp, calls, out = _points("prep,embed,layers", fail_at=4)  # entry, embed, layer 0, layer 1
    P.patch_model(module, sp)
    with pytest.raises(RuntimeError, match="device-side assert"):
        module.KimiLinearForCausalLM().forward(1)
    assert len(calls) == 4
    assert out == [
        "CUDA error first seen at 'after layer 1' (sync #4); last clean sync 'after layer 0': "
        "RuntimeError: device-side assert triggered"
    ]


def test_model_points_in_order_when_nothing_fails():
    module = _model_module()
    labels: list[str] = []
    sp, _, _ = _points("prep,embed,layers")
    real_hit = sp.hit
    sp.hit = lambda label: (labels.append(label), real_hit(label))[1]
    P.patch_model(module, sp)
    assert module.KimiLinearForCausalLM().forward(1) == 3
    assert labels == [
        "forward entry", "after embedding", "after layer 0", "after layer 1", "forward exit"
    ]  # fmt: skip


def test_no_side_streams_sets_every_stream_to_none_and_nothing_else():
    class Stream:
        pass

    class Mod:
        def __init__(self, **attrs):
            self.__dict__.update(attrs)

    moe = Mod(_down_proj_stream=Stream(), other=Stream())
    mla = Mod(aux_stream=Stream(), _gate_events=("e0", "e1"))
    kda = Mod(_projection_aux_stream=Stream())
    shared = Mod(_stream=Stream())
    plain = Mod(aux_stream=None)
    model = types.SimpleNamespace(
        named_modules=lambda: [
            ("", plain),
            ("moe", moe),
            ("mla", mla),
            ("kda", kda),
            ("sh", shared),
        ]
    )
    changed = P.null_side_streams(model, lambda x: isinstance(x, Stream))
    assert changed == ["moe._down_proj_stream", "mla.aux_stream", "kda._projection_aux_stream",
                       "sh._stream"]  # fmt: skip
    assert moe._down_proj_stream is None and mla.aux_stream is None
    assert kda._projection_aux_stream is None and shared._stream is None
    assert isinstance(moe.other, Stream) and mla._gate_events == ("e0", "e1")


def test_uva_depth_raises_the_pool_depth_but_never_lowers_it():
    asked: list[int] = []
    module = types.SimpleNamespace(set_default_max_concurrency=asked.append)
    P.patch_uva_depth(module, 8)
    module.set_default_max_concurrency(3)
    module.set_default_max_concurrency(12)
    assert asked == [8, 12]


def test_install_registers_only_what_the_environment_asks():
    hooks: list[str] = []

    def when_imported(name, cb):
        hooks.append(name)

    assert P.install({}, when_imported) == [] and hooks == []
    got = P.install(
        {P.SYNC_ENV: "step,layers", P.NO_STREAMS_ENV: "1", P.UVA_DEPTH_ENV: "8"}, when_imported
    )
    assert got == ["sync:layers,step", "no-side-streams", "uva-depth:8"]
    assert hooks == [P.RUNNER, P.MODEL, P.MODEL, P.BUFFERS]
    with pytest.raises(ValueError, match="unknown points"):
        P.install({P.SYNC_ENV: "stepp"}, when_imported)


def test_no_pdl_makes_the_platform_answer_false_and_is_registered_alone():
    class CudaPlatformBase:
        @classmethod
        def is_arch_support_pdl(cls) -> bool:
            return True

    class CudaPlatform(CudaPlatformBase):
        pass

    module = types.SimpleNamespace(CudaPlatformBase=CudaPlatformBase)
    assert CudaPlatform.is_arch_support_pdl()
    P.patch_no_pdl(module)
    assert CudaPlatform.is_arch_support_pdl() is False  # the subclass vLLM instantiates too
    hooks: list[str] = []
    got = P.install({P.NO_PDL_ENV: "1"}, lambda name, cb: hooks.append(name))
    assert got == ["no-pdl"] and hooks == [P.CUDA_PLATFORM]


def test_exchange_reads_report_both_sides_and_flag_non_token_data():
    import torch

    class PPHandler:
        def broadcast_drafts(self, draft_tokens):
            return "sent"

        def get_prev_sampled_outputs(self):
            return {"sampled_tokens": torch.tensor([[5]]), "draft_tokens": self.recv}

    lines: list[str] = []
    module = types.SimpleNamespace(PPHandler=PPHandler)
    names = P.patch_exchange_reads(module, out=lines.append, sync=lambda: None)
    assert names == ["PPHandler.broadcast_drafts", "PPHandler.get_prev_sampled_outputs"]
    h = PPHandler()
    assert h.broadcast_drafts(torch.tensor([[3, 4, -1]])) == "sent"
    h.recv = torch.tensor([[3, 1041776429, -1107968379]])  # float32 bit patterns, as on the H100
    assert h.get_prev_sampled_outputs()["sampled_tokens"].item() == 5
    assert lines[0] == "call=1 side=send drafts n=3 min=-1 max=4"
    assert lines[1] == "call=1 side=recv sampled_tokens n=1 min=5 max=5"
    assert lines[2].startswith("call=1 BAD side=recv draft_tokens n=3") and "1041776429" in lines[2]
    hooks: list[str] = []
    assert P.install({P.DRAFTS_ENV: "1"}, lambda name, cb: hooks.append(name)) == [
        "exchange-reads"
    ] and hooks == [P.RUNNER]


def test_wire_copies_report_each_side_in_stream_order_without_waiting_on_the_last_rank():
    """The wire probe never waits on the sending rank (a copy not finished yet is reported at a
    later call), waits on the receiving one, names a foreign current stream, and flags
    non-token data; a control: the same copies with a finished flag never set report nothing."""
    import torch

    finished: list[bool] = [False]
    waited: list[str] = []

    def copy(tensor, stream):
        host = tensor.clone()  # what the stream would copy at this point
        return host, lambda: finished[0], lambda: waited.append(str(stream))

    class PPHandler:
        def __init__(self):
            self.device, self.main_stream, self.broadcast_stream = "cpu", "main", "bcast"
            self.queue: list = [None]

        def broadcast(self, sampled, *a):
            return "b"

        def broadcast_drafts(self, drafts):
            return "sent"

        def receive(self, batch, recv_drafts):
            self.queue[-1] = types.SimpleNamespace(
                sampled_tokens=torch.tensor([[7]]), draft_tokens=self.recv
            )
            return True

        def get_prev_sampled_outputs(self):
            return {"sampled_tokens": torch.tensor([[7]]), "draft_tokens": self.recv}

    lines: list[str] = []
    current = ["main"]
    snaps = P.WireSnapshots(out=lines.append, copy=copy)
    module = types.SimpleNamespace(PPHandler=PPHandler)
    names = P.patch_exchange_wire(module, snaps, current_stream=lambda dev: current[0])
    assert names == [f"PPHandler.{n}" for n in P.PP_HANDLER_METHODS]

    last = PPHandler()
    assert last.broadcast(torch.tensor([[9]])) == "b"
    current[0] = "side"
    assert last.broadcast_drafts(torch.tensor([[3, 4]])) == "sent"
    assert lines == [] and waited == []  # nothing finished, nothing waited for on the last rank
    finished[0] = True
    last.broadcast(torch.tensor([[10]]))  # the next call reports what finished meanwhile
    assert lines == [
        "call=1 side=send-main sampled n=1 min=9 max=9 stream=main",
        "call=1 side=send-main drafts n=2 min=3 max=4 stream=OTHER",
        "call=1 side=send-bcast drafts n=2 min=3 max=4 stream=OTHER",
    ]
    assert waited == []

    lines.clear()
    snaps.pending.clear()  # ranks are processes of their own; this one starts clean
    current[0] = "main"
    first = PPHandler()
    first.recv = torch.tensor([[3, 1041776429]])  # a float32 bit pattern, as on the H100
    first.receive(None, True)
    assert first.get_prev_sampled_outputs()["sampled_tokens"].item() == 7
    assert waited == ["bcast", "bcast", "main", "main"]  # the receiving side waits for its copies
    assert lines[0] == "call=1 side=recv-bcast sampled n=1 min=7 max=7 stream=main"
    assert lines[1].startswith("call=1 BAD side=recv-bcast drafts n=2") and "1041776429" in lines[1]
    assert lines[3].startswith("call=1 BAD side=recv-main drafts")
    hooks: list[str] = []
    assert P.install({P.WIRE_ENV: "1"}, lambda name, cb: hooks.append(name)) == [
        "exchange-wire"
    ] and hooks == [P.RUNNER]
