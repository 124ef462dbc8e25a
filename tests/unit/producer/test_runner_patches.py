"""The producer patches of the model runner, the DSpark speculator and EPLB, on stand-ins."""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch

from vllm_dspark_pp.context_kv import ContextOnlyDrafterError


@pytest.fixture(scope="module")
def modules(plugin):
    import vllm.v1.worker.gpu.eplb_utils as eplb
    import vllm.v1.worker.gpu.model_runner as mr
    import vllm.v1.worker.gpu.spec_decode.dspark.speculator as sp

    return mr, sp, eplb


def test_patches_installed_on_import(modules):
    from vllm_dspark_pp.patches._util import is_patched

    mr, sp, eplb = modules
    for name in ("load_model", "sample", "execute_model", "sample_tokens"):
        assert is_patched(mr.GPUModelRunner, name)
    import vllm.v1.core.sched.scheduler as sched

    assert is_patched(sched.Scheduler, "__init__")
    for name in ("__init__", "load_draft_model", "propose", "init_cudagraph_manager", "capture"):
        assert is_patched(sp.DSparkSpeculator, name)
    assert hasattr(sp.DSparkSpeculator, "materialize_context_kv")
    assert is_patched(eplb.EPLBController, "maybe_register_speculator")


class _State(NamedTuple):
    num_spec_tokens_to_schedule: int


def _patched_runner_class():
    """A stand-in GPUModelRunner with recording originals, patched by our patch module."""
    from vllm_dspark_pp.patches import v1_worker_gpu_model_runner__producer as patch

    seen: dict = {}

    class Runner:
        def load_model(self):
            self.rejection_sampler = "built by vLLM"

        def sample(self, hidden_states, input_batch, grammar_output):
            seen["sampler"] = self.rejection_sampler
            return "sampled"

        def execute_model(self, scheduler_output):
            self.execute_model_state = scheduler_output  # vLLM builds the state here
            return None

        def sample_tokens(self, grammar_output):
            seen["n"] = self.execute_model_state.num_spec_tokens_to_schedule
            return "out"

    class FakeRejectionSampler:
        def __init__(self, sampler, spec, device, watermark_key=None):
            self.args = (sampler, spec, device, watermark_key)

    module = types.SimpleNamespace(
        GPUModelRunner=Runner,
        RejectionSampler=FakeRejectionSampler,
        speculative_target_watermark_key=lambda cfg: "wm",
    )
    patch._patch(module)
    return Runner, seen, FakeRejectionSampler


def _runner_cfg(role):
    from vllm.config import KVTransferConfig

    spec = types.SimpleNamespace(method="dspark")
    return types.SimpleNamespace(
        speculative_config=spec,
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role=role),
        watermark_config=None,
    )


@pytest.mark.parametrize("role,expected", [("kv_producer", 0), ("kv_both", 4),
                                           ("kv_consumer", 4)])
def test_sample_tokens_schedules_no_drafts_on_producers(role, expected):
    Runner, seen, _ = _patched_runner_class()
    r = Runner()
    r.vllm_config = _runner_cfg(role)
    r.load_model()
    r.execute_model(_State(4))
    assert r.sample_tokens(None) == "out"
    assert seen["n"] == expected


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_producer_draft_buffer_holds_only_token_ids(role):
    """vLLM marks unproposed draft slots -1 after a zero-draft propose; on a producer the patch
    turns them into token 0 so a warm-up batch with draft slots embeds valid ids."""
    Runner, _, _ = _patched_runner_class()
    r = Runner()
    r.vllm_config = _runner_cfg(role)
    r.load_model()
    r.req_states = types.SimpleNamespace(draft_tokens=torch.tensor([[5, 7], [3, 9], [2, 2]]))
    r.execute_model(_State(2))

    def fill_like_vllm(rows):
        r.req_states.draft_tokens[rows, 0:] = -1  # model_runner.py:2388-2390 with 0 drafts

    fill_like_vllm([0, 2])
    r.sample_tokens(None)
    buf = r.req_states.draft_tokens
    if role == "kv_producer":
        assert buf.tolist() == [[0, 0], [3, 9], [0, 0]]
    else:  # a full drafter's buffer is vLLM's business
        assert buf.tolist() == [[-1, -1], [3, 9], [-1, -1]]


def test_scheduler_of_a_producer_schedules_no_drafts(make_vllm_config):
    from vllm.config import KVTransferConfig

    from vllm_dspark_pp.patches import v1_core_sched_scheduler as patch

    def kv(role):
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role=role,
                                kv_connector_extra_config={"shared_storage_path": "/tmp/x"})

    for role, zeroed in (("kv_producer", True), ("kv_both", False), ("kv_consumer", False)):
        cfg = make_vllm_config(kv(role))
        assert cfg.num_speculative_tokens > 0
        sched = types.SimpleNamespace(num_spec_tokens=cfg.num_speculative_tokens,
                                      dynamic_sd_lookup=[1, 2])
        assert patch.producer_schedules_no_drafts(sched, cfg) is zeroed, role
        assert (sched.num_spec_tokens == 0) is zeroed
        assert (sched.dynamic_sd_lookup is None) is zeroed

    # The wiring: the wrapped __init__ runs vLLM's first, then zeroes the count.
    class Scheduler:
        def __init__(self, vllm_config, kv_cache_config=None):
            self.num_spec_tokens = vllm_config.num_speculative_tokens
            self.dynamic_sd_lookup = None

    class AsyncScheduler(Scheduler):
        pass

    patch._patch(types.SimpleNamespace(Scheduler=Scheduler))
    assert AsyncScheduler(vllm_config=make_vllm_config(kv("kv_producer"))).num_spec_tokens == 0
    assert AsyncScheduler(make_vllm_config(kv("kv_both")), None).num_spec_tokens > 0


def test_drafting_dspark_scheduler_pads_no_resumed_request(make_vllm_config):
    """Case 2 of the scheduler patch: a drafting DSpark engine (decoder, aggregated) gets the
    constant per-batch-size schedule, so vLLM skips its placeholder-draft padding while every
    batch size still schedules k drafts; a user's own dynamic schedule and a producer are left to
    their own rules."""
    from vllm.config import KVTransferConfig

    from vllm_dspark_pp.patches import v1_core_sched_scheduler as patch

    def kv(role):
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role=role,
                                kv_connector_extra_config={"shared_storage_path": "/tmp/x"})

    for role in (None, "kv_consumer", "kv_both"):
        cfg = make_vllm_config(kv(role) if role else None)
        k = cfg.num_speculative_tokens
        sched = types.SimpleNamespace(num_spec_tokens=k, dynamic_sd_lookup=None)
        assert patch.schedules_no_placeholder_drafts(sched, cfg), role
        assert isinstance(sched.dynamic_sd_lookup, patch.SameDraftCountForEveryBatch)
        assert [sched.dynamic_sd_lookup[n] for n in (1, 2, 7, 64, 4096)] == [k] * 5
        user = types.SimpleNamespace(num_spec_tokens=k, dynamic_sd_lookup=[0, 3, 2])
        assert not patch.schedules_no_placeholder_drafts(user, cfg)
        assert user.dynamic_sd_lookup == [0, 3, 2]
    zero = types.SimpleNamespace(num_spec_tokens=0, dynamic_sd_lookup=None)
    assert not patch.schedules_no_placeholder_drafts(zero, make_vllm_config(kv("kv_producer")))
    assert zero.dynamic_sd_lookup is None

    class Scheduler:
        def __init__(self, vllm_config, kv_cache_config=None):
            self.num_spec_tokens = vllm_config.num_speculative_tokens
            self.dynamic_sd_lookup = None

    patch._patch(types.SimpleNamespace(Scheduler=Scheduler))
    dec = Scheduler(make_vllm_config(kv("kv_consumer")))
    assert dec.num_spec_tokens > 0 and dec.dynamic_sd_lookup[5] == dec.num_spec_tokens
    prod = Scheduler(make_vllm_config(kv("kv_producer")))
    assert prod.num_spec_tokens == 0 and prod.dynamic_sd_lookup is None


def test_real_scheduler_schedules_a_resumed_request_without_placeholder_drafts(plugin, make_vllm_config):
    """vLLM's own Scheduler (patched by the plugin) admits a request whose KV arrived from a
    connector with one token left: it is scheduled as that token alone. With the patch's draft
    schedule taken away again (stock 0.34.0 behaviour) the same request is padded to 1 + k tokens
    with k placeholder drafts that no drafter proposed (issue 13)."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    def admit_resumed(stock: bool):
        cfg = make_vllm_config()
        cfg.cache_config.num_gpu_blocks = 64
        bs, k = cfg.cache_config.block_size, cfg.num_speculative_tokens
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=32, dtype=torch.float32)
        groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)]
        sched = Scheduler(cfg, KVCacheConfig(64, [], groups), StructuredOutputManager(cfg), block_size=bs)
        if stock:
            sched.dynamic_sd_lookup = None
        req = Request("r", list(range(5, 5 + bs + 1)), SamplingParams(max_tokens=16), None)
        req.num_computed_tokens = bs  # what a finished remote KV load leaves: one token to compute
        sched.add_request(req)
        out = sched.schedule()
        return out.num_scheduled_tokens["r"], out.scheduled_spec_decode_tokens.get("r"), k

    n, drafts, k = admit_resumed(stock=False)
    assert (n, drafts) == (1, None)
    n, drafts, k = admit_resumed(stock=True)
    assert (n, drafts) == (1 + k, [-1] * k), "stock vLLM no longer pads: retire case 2 of the patch"


def test_rejection_sampler_built_only_when_drafts_arrive():
    Runner, seen, Fake = _patched_runner_class()
    r = Runner()
    r.vllm_config = _runner_cfg("kv_producer")
    r.speculative_config, r.device, r.sampler = "spec", "cpu", "sampler"
    r.load_model()
    assert r.rejection_sampler is None
    r.sample(None, types.SimpleNamespace(num_draft_tokens=0), None)
    assert seen["sampler"] is None
    r.sample(None, types.SimpleNamespace(num_draft_tokens=3), None)
    assert isinstance(seen["sampler"], Fake)
    assert seen["sampler"].args == ("sampler", "spec", "cpu", "wm")
    full = Runner()
    full.vllm_config = _runner_cfg("kv_both")
    full.load_model()
    assert full.rejection_sampler == "built by vLLM"


def test_speculator_propose_routes_on_producers(modules):
    from vllm_dspark_pp.patches import (
        v1_worker_gpu_spec_decode_dspark_speculator__producer as patch,
    )

    calls = []

    class Base:
        def __init__(self, vllm_config, device):
            self.vllm_config = vllm_config
            self.draft_tokens = torch.zeros(4, 2, dtype=torch.long)

        def propose(self, *args, **kwargs):
            calls.append(kwargs.get("num_speculative_tokens"))
            return "proposed"

        def load_draft_model(self, *a):
            return "full"

        def init_cudagraph_manager(self, mode):
            calls.append("cg")

        def capture(self):
            calls.append("capture")

    class Spec(Base):
        pass

    patch._patch(types.SimpleNamespace(DSparkSpeculator=Spec))
    from vllm.config import KVTransferConfig

    spec_cfg = types.SimpleNamespace(method="dspark", is_dspark_prefill_only=lambda: True)
    cfg = types.SimpleNamespace(
        speculative_config=spec_cfg,
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector",
                                            kv_role="kv_producer"),
    )
    s = Spec(cfg, "cpu")
    assert s.dspark_prefill_only and not s.use_draft_logits and not s.enable_adaptive_verification
    batch = types.SimpleNamespace(num_reqs=3)
    assert s.propose(input_batch=batch, dummy_run=True).shape == (3, 2)
    assert calls == []  # dummy proposes do nothing on a producer
    assert s.propose(batch, num_speculative_tokens=0) == "proposed"
    assert calls == [0]  # materialize_context_kv = vLLM's propose with zero drafts
    with pytest.raises(ContextOnlyDrafterError):
        s.propose(batch, num_speculative_tokens=2)
    s.init_cudagraph_manager(None)
    s.capture()
    assert calls == [0] and s.query_cudagraph_manager is None

    cfg.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    spec_cfg.is_dspark_prefill_only = lambda: False
    full = Spec(cfg, "cpu")
    assert not full.dspark_prefill_only
    assert full.propose(batch, num_speculative_tokens=2) == "proposed"
    assert full.load_draft_model(None, set()) == "full"
    full.capture()
    assert calls[-2:] == [2, "capture"]


def test_attached_role_disagreement_is_refused(modules):
    from vllm.config import KVTransferConfig

    from vllm_dspark_pp import roles
    from vllm_dspark_pp.patches import (
        v1_worker_gpu_spec_decode_dspark_speculator__producer as patch,
    )

    class Spec:  # weak-referenceable stand-in
        method = "dspark"

        def is_dspark_prefill_only(self):
            return roles.is_dspark_prefill_only(self)

    spec_cfg = Spec()
    roles.attach_kv_transfer_config(spec_cfg, None)  # engine side: no KV transfer
    cfg = types.SimpleNamespace(
        speculative_config=spec_cfg,
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector",
                                            kv_role="kv_producer"),
    )
    with pytest.raises(RuntimeError, match="disagrees"):
        patch._is_producer(types.SimpleNamespace(vllm_config=cfg))


def test_eplb_skips_context_only_drafter(modules):
    eplb = modules[2]
    ctl = eplb.EPLBController.__new__(eplb.EPLBController)
    ctl.parallel_config = types.SimpleNamespace(enable_eplb=True)
    spec = types.SimpleNamespace(model=types.SimpleNamespace(context_kv_only=True))
    assert ctl.maybe_register_speculator(spec, None, False) is False
