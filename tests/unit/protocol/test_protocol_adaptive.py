"""Adaptive verification under PP (protocol/adaptive.py, the two ``__adaptive`` patches), on CPU.

What CPU can run: the drafts payload with the admitted column, the layout every stage builds from
shipped counts through vLLM's real ``compact_batch`` and ``reallocate_drafts``, the pipeline cost
curve and its store transport (with a silent stage), the activations check, and vLLM's real
``_validate_adaptive_verification`` with the plugin's wrapper (the refusal kept for every
configuration not covered, with its reason). Full CUDA graphs (which vLLM requires for adaptive
verification) cannot run here: tests/gpu/test_pp_adaptive_one_gpu.py runs the engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dspark_pp.protocol import adaptive
from vllm_dspark_pp.protocol.schedule import ExchangeSpec, step_schedule


class _Decodes:
    def __init__(self, n):
        self.num_reqs = n
        self.num_computed_tokens_np = np.full(n, 9, dtype=np.int32)
        self.num_scheduled_tokens = np.full(n, 4, dtype=np.int32)
        self.prefill_len_np = np.full(n, 5, dtype=np.int32)
        self.max_seq_len_np = None
        self.is_prefilling_np = np.zeros(n, dtype=bool)


@pytest.mark.parametrize("admitted", [False, True])
def test_the_drafts_payload_has_one_admitted_column_exactly_when_counts_ship(admitted):
    sched = step_schedule(ExchangeSpec(3, admitted_counts=admitted), _Decodes(5), 3)
    assert sched.drafts.shape == (5, 4 if admitted else 3)
    assert [p.name for p in sched.payloads] == ["sampled", "counts", "drafts"]
    # no drafts scheduled: no drafts payload, whatever the setting
    assert step_schedule(ExchangeSpec(3, admitted_counts=admitted), _Decodes(5), 0).drafts is None


def test_admitted_layout_takes_the_shipped_count_never_more_than_scheduled():
    scheduled = np.array([3, 3, 0, 2], dtype=np.int32)
    shipped = np.array([1, -1, 2, 3], dtype=np.int32)
    assert adaptive.admitted_layout(scheduled, shipped, 100).tolist() == [1, 3, 0, 2]
    # vLLM's one-chunk logits bound: trimmed from the last rows
    assert adaptive.admitted_layout(scheduled, shipped, 4).tolist() == [1, 3, 0, 0]
    assert adaptive.admitted_layout(scheduled, shipped, 0).tolist() == [0, 0, 0, 0]


class _Handler:
    def __init__(self, counts):
        self.counts = counts

    def admitted_counts_for(self, slots):
        return np.array([self.counts.get(int(s), -1) for s in slots], dtype=np.int32)


def _shipped_manager(counts, k=3, max_num_reqs=8):
    """A real vLLM AdaptiveVerificationManager turned ShippedCounts, with CPU buffers (its
    __init__ needs CUDA streams, so the fields its methods read are set here)."""
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import (
        AdaptiveVerificationManager,
    )

    cls = adaptive.shipped_counts_class(AdaptiveVerificationManager)
    m = object.__new__(cls)
    m.req_states = SimpleNamespace(
        req_id_to_index={f"r{i}": i for i in range(max_num_reqs)},
        device=torch.device("cpu"),
        num_computed_tokens_np=np.zeros(max_num_reqs, dtype=np.int32),
        prefill_len=SimpleNamespace(np=np.full(max_num_reqs, 5, dtype=np.int32)),
    )
    m.num_speculative_steps = k
    m.num_bonus_tokens = 1
    m._max_total_logits = 1 << 20
    m._batch_budget = None
    m.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
    m._batch_draft_capacity = torch.zeros(max_num_reqs, dtype=torch.int32)
    m._num_non_draft_tokens = torch.zeros(max_num_reqs, dtype=torch.int32)
    m._cu_num_logits = torch.zeros(max_num_reqs + 1, dtype=torch.int32)
    m._copy_admitted_drafts_to_host = False
    m.pp_handler = _Handler(counts)
    return m


@pytest.fixture
def cpu_h2d(monkeypatch):
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    def h2d(array, out=None, **kwargs):
        t = torch.from_numpy(np.asarray(array))
        if out is None:
            return t.clone()
        out[: len(t)].copy_(t)
        return out

    monkeypatch.setattr(av, "async_tensor_h2d", h2d)


def test_every_stage_builds_the_layout_of_the_shipped_counts_through_vllms_own_code(cpu_h2d):
    """get_num_tokens (ours) -> vLLM's compact_batch and reallocate_drafts: the device layout is
    exactly the shipped counts, vLLM's ranking kernel is not needed (it would fail on CPU)."""
    m = _shipped_manager({0: 1, 1: 3, 2: 0})
    tokens = {"r0": 4, "r1": 4, "r2": 4, "r3": 1}
    drafts = {"r0": [7] * 3, "r1": [7] * 3, "r2": [7] * 3}
    assert m.get_num_tokens(tokens, drafts) == 4 + 1 + 3 + 0
    req_ids = ["r0", "r1", "r2", "r3"]
    num_drafts = np.array([3, 3, 3, 0], dtype=np.int32)
    scheduled = np.array([4, 4, 4, 1], dtype=np.int32)
    cu = np.array([0, 4, 8, 12, 13], dtype=np.int32)
    host_tokens, _ = m.compact_batch(num_drafts, scheduled, cu)
    assert int(host_tokens.sum()) == 8  # vLLM's host placeholder: the same total
    cu_logits, qsl, total_drafts, admitted = m.reallocate_drafts(
        req_ids, torch.arange(4, dtype=torch.int64)
    )
    assert total_drafts == 4 and admitted is None
    assert qsl[:5].tolist() == [0, 2, 6, 7, 8]  # 1+1, 1+3, 1+0, 1
    assert cu_logits.tolist() == [0, 2, 6, 7, 8]


def test_no_shipped_count_verifies_every_scheduled_draft(cpu_h2d):
    m = _shipped_manager({})
    assert m.get_num_tokens({"r0": 4, "r1": 1}, {"r0": [1, 2, 3]}) == 5


def test_decide_counts_use_vllms_budget_and_ranking(monkeypatch):
    """Last stage: the budget comes from vLLM's get_num_tokens on the predicted verify batch
    (one bonus + k drafts per request that samples), the split from vLLM's ranking kernel."""
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    seen = {}

    def budget(self, tokens, drafts):
        seen["batch"] = (dict(tokens), {r: len(d) for r, d in drafts.items()})
        # a request prefilled in the drafting step samples in its next step
        seen["computed"] = self.req_states.num_computed_tokens_np[:3].tolist()
        self._batch_budget = "stash of the verify step"
        return len(tokens) + 4  # a budget of 4 drafts

    def ranking(conf, idx, capacities, draft_budget, survival):
        seen["ranking"] = (capacities.tolist(), draft_budget)
        capacities.copy_(torch.tensor([2, 0, 2], dtype=torch.int32))

    monkeypatch.setattr(av.AdaptiveVerificationManager, "get_num_tokens", budget)
    monkeypatch.setattr(av, "assign_draft_token_budget", ranking)
    m = _shipped_manager({}, k=3)
    m._batch_budget = "stash of the verify step"
    m.cost_tables = ("draft", "verify")
    m._confidence_probs = m._draft_survival = None
    batch = SimpleNamespace(
        num_reqs=3, req_ids=["r0", "r1", "r2"], idx_mapping=torch.tensor([0, 1, 2])
    )
    counts = adaptive.decide_admitted_counts(m, batch, np.array([True, False, True]))
    assert seen["batch"] == ({"r0": 4, "r2": 4}, {"r0": 3, "r2": 3})
    assert seen["ranking"] == ([3, 0, 3], 4)
    assert counts.tolist() == [2, 0, 2]
    assert m._batch_budget == "stash of the verify step"  # vLLM's own stash left as it was
    assert seen["computed"] == [5, 5, 5] and m.req_states.num_computed_tokens_np[0] == 0


@pytest.mark.parametrize("profiled", [False, True])
def test_the_last_stage_decides_without_making_its_host_wait_for_the_gpu(monkeypatch, profiled):
    """The decision runs on the last stage right after ``propose``, every drafting step: a host
    sync there (a blocking copy of the row mask to the device, a boolean-mask assignment, which
    counts the mask with ``nonzero``) stalls the host until the stream has run the draft, so the
    host stops running ahead of the GPU (issue 30: PP=2 adaptive slower than fixed drafts). On
    the ``meta`` device nothing executes; the recorder lists what would block on a GPU."""
    from support.host_syncs import host_syncs
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    seen = {}

    def budget(self, tokens, drafts):
        return len(tokens) + 2  # binds: 2 of the 6 drafts

    def ranking(conf, idx, capacities, draft_budget, survival):
        seen["ranking"] = (capacities.device.type, capacities.dtype, draft_budget)

    monkeypatch.setattr(av.AdaptiveVerificationManager, "get_num_tokens", budget)
    monkeypatch.setattr(av, "assign_draft_token_budget", ranking)
    m = _shipped_manager({}, k=3)
    m.cost_tables = ("draft", "verify") if profiled else None
    m._confidence_probs = m._draft_survival = None
    batch = SimpleNamespace(
        num_reqs=3, req_ids=["r0", "r1", "r2"], idx_mapping=torch.zeros(3, device="meta")
    )
    with host_syncs() as syncs:
        counts = adaptive.decide_admitted_counts(m, batch, np.array([True, False, True]))
    assert syncs == []
    assert counts.device.type == "meta" and counts.dtype == torch.int32
    assert tuple(counts.shape) == (3,)
    assert seen.get("ranking") == (("meta", torch.int32, 2) if profiled else None)


def test_the_sync_recorder_sees_what_blocks_the_host():
    """Control for the test above: the recorder flags each kind of host sync it looks for."""
    from support.host_syncs import host_syncs

    mask = np.array([True, False])
    with host_syncs() as syncs:
        dev = torch.zeros(2, dtype=torch.int32, device="meta")
        dev[torch.from_numpy(mask).to("meta")] = 1  # blocking copy + boolean-mask assignment
        torch.from_numpy(mask).to("meta", non_blocking=True)  # not a sync
        dev.nonzero()
    assert [s.split(":")[0] for s in syncs] == [
        "aten._to_copy.default",
        "aten.index_put_.default",
        "aten.nonzero.default",
    ]


def test_the_pipeline_curve_is_the_sum_of_the_stages():
    last = [(8, 1.0), (16, 2.0), (32, 4.0)]
    first = [(8, 0.5), (16, 1.5), (32, 3.0)]
    assert adaptive.pipeline_verify_curve([last, first]) == [(8, 1.5), (16, 3.5), (32, 7.0)]


def _stage_manager(stage, world, captured):
    class Base:
        def set_cost_curves(self, draft_curve, verify_curve):
            captured["tables"] = (draft_curve, verify_curve)

    m = object.__new__(adaptive.shipped_counts_class(Base))
    m.is_last_stage = stage == world - 1
    m.stage = stage
    m.pipeline_ranks = tuple(range(10, 10 + world))
    return m


def test_stages_publish_their_curves_and_the_last_one_prices_the_pipeline(monkeypatch):
    store = torch.distributed.HashStore()
    monkeypatch.setattr(adaptive, "_store", lambda: store)
    captured = {}
    _stage_manager(0, 3, captured).set_cost_curves([], [(8, 0.5), (16, 1.0)])
    _stage_manager(1, 3, captured).set_cost_curves([], [(8, 0.25), (16, 0.5)])
    assert "tables" not in captured  # earlier stages build no tables
    _stage_manager(2, 3, captured).set_cost_curves([(1, 0.1)], [(8, 1.0), (16, 2.0)])
    assert captured["tables"] == ([(1, 0.1)], [(8, 1.75), (16, 3.5)])


def test_a_stage_that_never_publishes_fails_the_last_stage_at_start(monkeypatch):
    store = torch.distributed.HashStore()
    monkeypatch.setattr(adaptive, "_store", lambda: store)
    monkeypatch.setenv("VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S", "0.5")
    _stage_manager(0, 3, {}).set_cost_curves([], [(8, 0.5)])
    with pytest.raises(RuntimeError, match=r"PP stage\(s\) \[1\] published no profiled step cost"):
        _stage_manager(2, 3, {}).set_cost_curves([(1, 0.1)], [(8, 1.0)])


def _runner_with_buffers(stage=1, hidden=2):
    """A non-first stage: vLLM's persistent receive buffers (max 64 tokens) give the row size."""
    buffers = {"hidden_states": torch.zeros(64, hidden), "residual": torch.zeros(64, hidden)}
    return SimpleNamespace(
        adaptive_verification=SimpleNamespace(stage=stage),
        intermediate_tensors=SimpleNamespace(tensors=buffers),
    )


def test_received_activations_of_another_token_count_fail_at_once():
    runner = _runner_with_buffers()
    batch = SimpleNamespace(num_tokens_after_padding=16)
    ok = SimpleNamespace(tensors={"hidden_states": torch.zeros(16, 2)})
    adaptive.check_received_activations(runner, ok, batch)
    bad = SimpleNamespace(tensors={"hidden_states": torch.zeros(12, 2)})
    with pytest.raises(RuntimeError, match="stage 1 built a batch of 16 tokens in step 2") as e:
        adaptive.check_received_activations(runner, bad, batch)
    # The message lists every received tensor and this stage's batch (what the GPU run lacked).
    assert "all received: hidden_states (12, 2);" in str(e.value)
    assert "num_tokens_after_padding 16)" in str(e.value)


def test_received_activations_are_counted_in_rows_of_the_stages_own_buffer():
    """What the first H200 run met: before vLLM's wait_for_comm the received tensors are the flat
    receive buffers (rows x hidden elements). Reading their shape[0] as rows stopped a correct
    32-token batch with "4096 tokens" (32 x 128); the row count is elements / row size."""
    runner = _runner_with_buffers(hidden=128)
    batch = SimpleNamespace(num_tokens_after_padding=32)
    flat = SimpleNamespace(
        tensors={"hidden_states": torch.zeros(32 * 128), "residual": torch.zeros(32 * 128)}
    )
    adaptive.check_received_activations(runner, flat, batch)  # a correct batch passes
    short = SimpleNamespace(
        tensors={"hidden_states": torch.zeros(31 * 128), "residual": torch.zeros(31 * 128)}
    )
    with pytest.raises(RuntimeError, match="built a batch of 32 tokens .* for 31 tokens"):
        adaptive.check_received_activations(runner, short, batch)


def test_a_sent_layout_that_differs_within_one_padded_size_fails_at_once():
    """Two stages that disagree by one admitted draft can pad to the same graph size (5 and 6
    real tokens, both 8 padded): the row count cannot tell them apart, the sent layout does."""
    runner = _runner_with_buffers()
    mine = _batch(8, real=5, offsets=[0, 5])
    same = _batch(8, real=5, offsets=[0, 5])
    rows = {"hidden_states": torch.zeros(8 * 2)}
    ok = SimpleNamespace(tensors={**rows, adaptive.LAYOUT_KEY: adaptive.batch_layout(same)})
    adaptive.check_received_activations(runner, ok, mine)
    other = _batch(8, real=6, offsets=[0, 6])
    bad = SimpleNamespace(tensors={**rows, adaptive.LAYOUT_KEY: adaptive.batch_layout(other)})
    with pytest.raises(RuntimeError, match="built a batch of 5 tokens .* sent one of 6 tokens"):
        adaptive.check_received_activations(runner, bad, mine)
    # Same token count, requests split differently: the checksum still differs.
    split = _batch(8, real=5, offsets=[0, 2, 5])
    assert adaptive.batch_layout(split)[1] != adaptive.batch_layout(mine)[1]


def test_a_non_last_stage_tags_what_it_sends_and_the_next_stage_reads_it(runner_module):
    first = runner_module(0).GPUModelRunner()
    first.adaptive_verification = runner_module(0).maybe_create_adaptive_verification_manager(
        enable_adaptive_verification=False, vllm_config=_config()
    )
    first.pp_handler = object()
    first.num_tokens = 8
    model_out = {"hidden_states": torch.zeros(8, 2)}
    first.output = SimpleNamespace(tensors=model_out)
    sent = first.execute_model("step")
    assert sent.tensors[adaptive.LAYOUT_KEY] == adaptive.batch_layout(_batch(8))
    assert adaptive.LAYOUT_KEY not in model_out  # the model's own dict is not changed
    last = runner_module(1).GPUModelRunner()
    last.adaptive_verification = runner_module(1).maybe_create_adaptive_verification_manager(
        enable_adaptive_verification=True, vllm_config=_config()
    )
    last.pp_handler = object()
    last.output = None
    last.intermediate_tensors = SimpleNamespace(tensors={"hidden_states": torch.zeros(64, 2)})
    last.num_tokens = 8
    last.execute_model("step", SimpleNamespace(tensors=dict(sent.tensors)))
    assert last.output is None  # the last stage sends nothing and tags nothing
    last.num_tokens = 9
    with pytest.raises(RuntimeError, match="stages disagree"):
        last.execute_model("step", SimpleNamespace(tensors=dict(sent.tensors)))


# ---------------------------------------------------------------- the refusal (config patch)


def _config(method="dspark", pp=2, tp=1, dp=1, kv_role=None, sharded=False, dcp=1):
    """The fields vLLM's _validate_adaptive_verification and ours read (a real VllmConfig
    cannot be built with full CUDA graphs on the CPU platform)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.kv_transfer import KVTransferConfig

    kv = (
        None
        if kv_role is None
        else KVTransferConfig(kv_connector="MooncakeConnector", kv_role=kv_role)
    )
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            enable_adaptive_verification=True,
            method=method,
            num_speculative_tokens=3,
            draft_model_config=None,
        ),
        lora_config=None,
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
            decode_cudagraph_capture_request_sizes=None,
        ),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pp,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
            enable_batch_sharded_sampling=sharded,
        ),
        kv_transfer_config=kv,
    )


@pytest.fixture
def validate():
    from vllm.config.vllm import VllmConfig

    from vllm_dspark_pp.patches import config_vllm__adaptive

    config_vllm__adaptive.apply()
    return VllmConfig._validate_adaptive_verification


@pytest.fixture(autouse=True)
def _opted_in(monkeypatch):
    """The covered configurations run only with the opt-in (until the GPU tier verifies them)."""
    from vllm_dspark_pp.protocol.adaptive_config import OPT_IN_ENV

    monkeypatch.setenv(OPT_IN_ENV, "1")


def test_without_the_opt_in_vllms_refusal_stands_naming_it(validate, monkeypatch):
    from vllm_dspark_pp.protocol.adaptive_config import OPT_IN_ENV

    monkeypatch.delenv(OPT_IN_ENV)
    cfg = _config()
    with pytest.raises(ValueError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "not currently compatible with pipeline parallelism" in msg and OPT_IN_ENV in msg, msg
    assert not adaptive.ships_admitted_counts(cfg)


def test_vllms_pp_refusal_stands_without_the_patch():
    from vllm.config.vllm import VllmConfig

    from vllm_dspark_pp.patches._util import original

    with pytest.raises(ValueError, match="not currently compatible with pipeline parallelism"):
        original(VllmConfig, "_validate_adaptive_verification")(_config())


@pytest.mark.parametrize("kv_role", [None, "kv_consumer"])
def test_dspark_under_pp_is_covered_aggregated_and_as_pd_decoder(validate, kv_role):
    cfg = _config(kv_role=kv_role)
    validate(cfg)  # no refusal
    assert adaptive.ships_admitted_counts(cfg)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(method="eagle3"), "only DSpark drafts ship admitted counts (method is 'eagle3')"),
        (dict(kv_role="kv_producer"), "prefill-only producer never verifies"),
        (dict(kv_role="kv_both"), "only the PD decoder (kv_consumer) is covered, not kv_both"),
        (dict(tp=2), "only TP=1 and DP=1 are covered"),
        (dict(dp=2), "only TP=1 and DP=1 are covered"),
        (dict(dcp=2), "context parallelism is not covered"),
        (dict(sharded=True), "batch-sharded sampling"),
    ],
)
def test_the_refusal_stays_for_every_uncovered_config_with_its_reason(validate, kwargs, reason):
    cfg = _config(**kwargs)
    with pytest.raises(ValueError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "not currently compatible with pipeline parallelism" in msg and reason in msg, msg
    assert not adaptive.ships_admitted_counts(cfg)


def test_vllms_other_adaptive_checks_still_run_first(validate):
    cfg = _config()
    cfg.lora_config = object()
    with pytest.raises(ValueError, match="not currently compatible with LoRA"):
        validate(cfg)


def test_pp1_and_adaptive_off_are_untouched(validate):
    validate(_config(pp=1))
    assert not adaptive.ships_admitted_counts(_config(pp=1))
    cfg = _config()
    cfg.speculative_config.enable_adaptive_verification = False
    validate(cfg)
    assert not adaptive.ships_admitted_counts(cfg)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_step_without_a_draft_broadcast_leaves_no_counts_for_the_next(patch_broadcast, lag):
    """The last rank's decision belongs to its step: a step that drafts nothing (skipped drafts)
    must not hand its counts to the next step's draft broadcast (another batch). With lag 1 a
    verify step applies the counts of the request's draft broadcast before its latest one."""
    from protocol_sim import Batch, make_handler

    posted = []
    patch_broadcast(lambda tensor, src, group=None, async_op=False: posted.append(tensor.clone()))
    h = make_handler(1, 2, 3, 8, SimpleNamespace(rank=1), adaptive=True, lag=lag)

    def batch(n):
        return Batch(
            req_ids=[f"r{i}" for i in range(n)],
            idx_mapping_np=np.arange(n, dtype=np.intp),
            num_computed_tokens_np=np.full(n, 9, dtype=np.int32),
            num_scheduled_tokens=np.full(n, 4, dtype=np.int32),
            prefill_len_np=np.full(n, 5, dtype=np.int32),
            max_seq_len_np=None,
            is_prefilling_np=np.zeros(n, dtype=bool),
            num_drafts_np=np.full(n, 3, dtype=np.int32),
        )

    def step(n, num_spec, admitted=None):
        h.begin_step(num_spec)
        h.broadcast(torch.zeros(n, 4, dtype=torch.int64), torch.ones(n, dtype=torch.int32),
                    torch.zeros(n, dtype=torch.int32), batch(n))  # fmt: skip
        if admitted is not None:
            h.step_admitted = torch.tensor(admitted, dtype=torch.int32)
        if num_spec:
            h.broadcast_drafts(torch.zeros(n, 3, dtype=torch.int64))
        h.end_step()

    step(2, 0, admitted=[1, 2])  # decided, but the step broadcasts no drafts
    step(3, 3)  # no decision this step: every request verifies all k drafts
    assert posted[-1].shape == (3, 4) and posted[-1][:, 3].tolist() == [3, 3, 3]
    first = [3, 3, 3] if lag == 0 else [-1, -1, -1]  # lag 1: no broadcast before the latest
    assert h.admitted_counts_for(np.arange(3)).tolist() == first
    step(3, 3, admitted=[0, 1, 2])
    assert h.admitted_counts_for(np.arange(3)).tolist() == ([0, 1, 2] if lag == 0 else [3, 3, 3])
    step(3, 3, admitted=[2, 2, 1])
    assert h.admitted_counts_for(np.arange(3)).tolist() == ([2, 2, 1] if lag == 0 else [0, 1, 2])


# ---------------------------------------------------------------- the model runner patch


def _batch(padded, real=None, offsets=None):
    """The InputBatch fields the checks read."""
    real = padded if real is None else real
    offsets = [0, real] if offsets is None else offsets
    return SimpleNamespace(
        num_tokens_after_padding=padded,
        num_tokens=real,
        num_reqs=len(offsets) - 1,
        num_draft_tokens=0,
        query_start_loc_np=np.asarray(offsets, dtype=np.int32),
    )


class _FakeRunnerModule:
    """Stands for vllm.v1.worker.gpu.model_runner: the manager factory and the runner methods the
    patch wraps."""

    def __init__(self):
        from vllm.v1.worker.gpu.spec_decode.adaptive_verification import (
            AdaptiveVerificationManager,
        )

        self.calls = []

        def create(**kwargs):
            self.calls.append(kwargs["enable_adaptive_verification"])
            if not kwargs["enable_adaptive_verification"]:
                return None
            return object.__new__(AdaptiveVerificationManager)

        class Runner:
            def profile_adaptive_verification(self):
                self.profiled = "vllm"

            def execute_model(self, scheduler_output, intermediate_tensors=None):
                batch = self.prepare_inputs()
                self.execute_model_state = SimpleNamespace(input_batch=batch)
                return getattr(self, "output", None)  # a non-last stage's activations

            def prepare_inputs(self):
                return _batch(self.num_tokens)

        self.maybe_create_adaptive_verification_manager = create
        self.GPUModelRunner = Runner


@pytest.fixture
def runner_module(monkeypatch):
    from vllm.distributed import parallel_state

    from vllm_dspark_pp.patches import v1_worker_gpu_model_runner__adaptive as patch

    def at_stage(rank, world=2):
        pp = SimpleNamespace(
            is_last_rank=rank == world - 1, ranks=[5, 6][:world], rank_in_group=rank
        )
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: pp)
        module = _FakeRunnerModule()
        patch._patch(module)
        return module

    return at_stage


def test_every_stage_gets_a_shipped_counts_manager_under_pp(runner_module):
    module = runner_module(0)  # a first stage: no speculator, vLLM would pass False
    manager = module.maybe_create_adaptive_verification_manager(
        enable_adaptive_verification=False, vllm_config=_config()
    )
    assert module.calls == [True]
    assert isinstance(manager, adaptive.ShippedCounts) and not manager.is_last_stage
    assert (manager.stage, manager.pipeline_ranks) == (0, (5, 6))


def test_pp1_and_uncovered_configs_get_vllms_manager(runner_module):
    module = runner_module(0)
    for cfg in (_config(pp=1), _config(tp=2)):
        assert (
            module.maybe_create_adaptive_verification_manager(
                enable_adaptive_verification=False, vllm_config=cfg
            )
            is None
        )
    assert module.calls == [False, False]


def test_a_last_stage_speculator_without_the_flag_fails_at_start(runner_module):
    module = runner_module(1)
    with pytest.raises(RuntimeError, match="turned adaptive verification off"):
        module.maybe_create_adaptive_verification_manager(
            enable_adaptive_verification=False, vllm_config=_config()
        )


def test_the_runner_wires_the_handler_and_checks_received_activations(runner_module):
    module = runner_module(1)
    runner = module.GPUModelRunner()
    runner.adaptive_verification = module.maybe_create_adaptive_verification_manager(
        enable_adaptive_verification=True, vllm_config=_config()
    )
    runner.pp_handler = handler = object()
    runner.intermediate_tensors = SimpleNamespace(tensors={"hidden_states": torch.zeros(64, 2)})
    runner.num_tokens = 8
    received = SimpleNamespace(tensors={"hidden_states": torch.zeros(8 * 2)})  # flat, as received
    runner.execute_model("step", received)
    assert runner.adaptive_verification.pp_handler is handler
    runner.num_tokens = 9
    with pytest.raises(RuntimeError, match="stages disagree"):
        runner.execute_model("step", received)


def test_only_non_last_stages_profile_their_own_curve(runner_module, monkeypatch):
    seen = []
    monkeypatch.setattr(adaptive, "profile_stage_curve", lambda r, m: seen.append(m.stage))
    for stage in (0, 1):
        module = runner_module(stage)
        runner = module.GPUModelRunner()
        runner.adaptive_verification = module.maybe_create_adaptive_verification_manager(
            enable_adaptive_verification=True, vllm_config=_config()
        )
        runner.profile_adaptive_verification()
        assert getattr(runner, "profiled", None) == (None if stage == 0 else "vllm")
    assert seen == [0]


# ---------------------------------------------------------------- no host wait for the counts


class _NotLanded:
    """A copy event that has not completed (a broadcast whose sender is still drafting)."""

    landed = False

    def query(self) -> bool:
        return self.landed


@pytest.mark.parametrize("last_rank", [True, False])
@pytest.mark.parametrize(
    ("lag", "in_flight"),
    [(1, 1), (2, 2), (0, 1), (1, 2)],
    ids=["sync-lag1", "async-lag2", "control-lag0", "control-async-lag1"],
)
def test_a_verify_step_never_waits_for_the_draft_it_verifies(patch_broadcast, monkeypatch, lag,
                                                             in_flight, last_rank):  # fmt: skip
    """Each round of a steady decode batch posts its drafts with counts; before the next round's
    verify step reads them, every copy has landed except the latest ``in_flight`` broadcasts'
    (on a GPU: the last stage is still drafting them). Without async scheduling one is in flight
    (vLLM sends a request's next round once its previous one came back) and lag 1 does not wait;
    with async scheduling vLLM may send the next round while the previous one is in flight, two
    are, and lag 2 (the default there) does not wait: the counts of round r - lag in round r + 1,
    on the last rank (broadcast) and a non-last rank (receive) alike. Controls: lag 0 (the
    behaviour before) reads the latest and waits until the timeout; lag 1 under async
    scheduling reads one still in flight and waits too (seen on an H200, 2026-12-06: 5 host waits
    in 10 verify steps)."""
    from protocol_sim import Batch, make_handler

    from vllm_dspark_pp.protocol import handler as exchange

    n, k = 3, 3
    rounds = [[3, 1, 0], [2, 2, 1], [0, 3, 2], [1, 1, 1], [2, 0, 3]]
    sent = {"counts": None}

    def wire(tensor, src, group=None, async_op=False):
        if not last_rank and tuple(tensor.shape) == (n, k + 1):
            tensor[:, k] = torch.tensor(sent["counts"])

    patch_broadcast(wire)
    records = []

    class Pending(exchange.AdmittedCounts):
        def __init__(self, column, stream):
            super().__init__(column, stream)
            self.event = _NotLanded()
            records.append(self)

    monkeypatch.setattr(exchange, "AdmittedCounts", Pending)
    monkeypatch.setenv("VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S", "0.05")
    h = make_handler(1 if last_rank else 0, 2, k, 8, SimpleNamespace(rank=1), True, lag)
    batch = Batch(
        req_ids=[f"r{i}" for i in range(n)],
        idx_mapping_np=np.arange(n, dtype=np.intp),
        num_computed_tokens_np=np.full(n, 9, dtype=np.int32),
        num_scheduled_tokens=np.full(n, 1 + k, dtype=np.int32),
        prefill_len_np=np.full(n, 5, dtype=np.int32),
        max_seq_len_np=None,
        is_prefilling_np=np.zeros(n, dtype=bool),
        num_drafts_np=np.full(n, k, dtype=np.int32),
    )
    read = []
    for counts in rounds:
        for i, record in enumerate(records):  # the latest in_flight broadcasts have not landed
            record.event.landed = i < len(records) - in_flight
        if lag < in_flight and len(records) > lag:
            with pytest.raises(exchange.ExchangeError, match="never arrived"):
                h.admitted_counts_for(np.arange(n))
            assert h.admitted_waits == 1
            return
        read.append(h.admitted_counts_for(np.arange(n)).tolist())
        sent["counts"] = counts
        h.begin_step(k)
        if last_rank:
            h.broadcast(torch.zeros(n, k + 1, dtype=torch.int64),
                        torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                        batch)  # fmt: skip
            h.step_admitted = torch.tensor(counts, dtype=torch.int32)
            h.broadcast_drafts(torch.zeros(n, k, dtype=torch.int64))
        else:
            h.receive(batch, recv_drafts=True)
        h.end_step()
    assert lag >= in_flight
    # the first lag + 1 rounds: no broadcast lag before the latest yet (every draft is verified)
    assert read == [[-1] * n] * (lag + 1) + rounds[: len(rounds) - lag - 1]
    assert h.admitted_waits == 0 and h.admitted_wait_s == 0.0
