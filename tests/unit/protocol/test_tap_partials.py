"""Aux taps as partial sums across PP stages (vllm_dspark_pp/protocol/tap_partials.py).

The identity the mode rests on, ``W @ concat(taps) = sum over stages of W_s @ their taps``, for
random weights, tap counts, layer splits and aux ids, through the module's own functions (slot
assignment, column blocks, the per-stage sums and the last stage's ``PartialSumLinear``); the
controls misassign one stage's columns and must fail. Then the relay of one stage's
``IntermediateTensors``, the mode choice, the draft checkpoint lookup on the tiny pair, and
the patched ``collect_remote_aux_hidden_states``.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_dspark_pp.protocol import tap_partials as tp

TINY_DRAFT = Path(__file__).resolve().parents[3] / "models" / "tiny-pair" / "dspark-draft"


def _case(rng: random.Random):
    num_layers = rng.randint(2, 12)
    pp = rng.randint(2, min(4, num_layers))
    cuts = sorted(rng.sample(range(1, num_layers), pp - 1))
    bounds = [0, *cuts, num_layers]
    stages = [(bounds[r], bounds[r + 1]) for r in range(pp)]
    aux = sorted(rng.sample(range(0, num_layers + 1), rng.randint(1, min(6, num_layers + 1))))
    return stages, aux, rng.choice([1, 3, 8, 16]), rng.choice([1, 5, 8, 24])


def _made_on(aux, start, end, first):
    # which aux ids a stage's forward appends (Qwen2Model.forward: id start on the first stage,
    # then idx + 1 after each layer idx of [start, end))
    return [a for a in aux if (first and a == start) or start < a <= end]


def _run_stages(stages, aux, taps, weight, width, shift=None):
    """The partial-sum pipeline; ``shift``: (stage, slots) moves that stage's column block."""
    pw = weight.shape[0]
    partial = None
    for r, (start, end) in enumerate(stages):
        first, last = r == 0, r == len(stages) - 1
        base, count = tp.stage_slots(aux, start, end, first)
        col_base = base + (shift[1] if shift and shift[0] == r else 0)
        own = [taps[i] for i in range(base, base + count)]
        if not last:
            if base + count == 0:
                continue
            block = tp.column_block(weight, col_base, count, width) if count else None
            partial = tp.partial_sum(own, block, partial)
        else:
            block = tp.column_block(weight, col_base, count, width)
            lin = tp.PartialSumLinear(block, pw)
            if partial is None:  # nothing upstream: the plain linear of the own taps
                return F.linear(torch.cat(own, -1), block)
            return lin(torch.cat([partial, *own], dim=-1))
    raise AssertionError("no last stage")


def test_stage_slots_match_the_taps_each_stage_makes():
    rng = random.Random(0)
    for _ in range(500):
        stages, aux, _, _ = _case(rng)
        covered = []
        for r, (start, end) in enumerate(stages):
            base, count = tp.stage_slots(aux, start, end, r == 0)
            made = _made_on(aux, start, end, r == 0)
            assert [aux[i] for i in range(base, base + count)] == made, (stages, aux, r)
            covered += list(range(base, base + count))
        assert covered == list(range(len(aux)))


def test_partial_sums_equal_the_linear_of_the_concatenation():
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        stages, aux, width, pw = _case(rng)
        g = torch.Generator().manual_seed(rng.randint(0, 10**6))
        n, rows = len(aux), rng.randint(1, 7)
        weight = torch.randn(pw, n * width, generator=g)
        taps = [torch.randn(rows, width, generator=g) for _ in range(n)]
        want = F.linear(torch.cat(taps, -1), weight)
        got = _run_stages(stages, aux, taps, weight, width)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 300


def test_control_a_misassigned_column_block_fails():
    """The control of the test above: move one stage's block by one tap slot (wrapping inside
    the weight) and the sum must differ."""
    rng = random.Random(2)
    failed = tried = 0
    for _ in range(200):
        stages, aux, width, pw = _case(rng)
        n = len(aux)
        if n < 2:
            continue
        g = torch.Generator().manual_seed(rng.randint(0, 10**6))
        weight = torch.randn(pw, n * width, generator=g)
        taps = [torch.randn(3, width, generator=g) for _ in range(n)]
        want = F.linear(torch.cat(taps, -1), weight)
        for r, (start, end) in enumerate(stages):
            base, count = tp.stage_slots(aux, start, end, r == 0)
            if count == 0 or count == n:  # no other block of this width to move to
                continue
            step = 1 if base + count < n else -1
            tried += 1
            got = _run_stages(stages, aux, taps, weight, width, shift=(r, step))
            failed += not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            break
    assert tried > 50 and failed == tried


def _plan(**kw):
    base = dict(
        num_taps=3,
        tap_width=4,
        partial_width=5,
        base=1,
        count=1,
        is_first=False,
        is_last=False,
        upstream=(1, 2),
    )
    return tp.TapPlan(**{**base, **kw})


class _Handler:
    def __init__(self, plan, block):
        self._dspark_tap_plan = plan
        self._dspark_tap_block = block


def test_relay_sends_one_partial_row_in_place_of_taps():
    from vllm.sequence import IntermediateTensors

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 12, generator=g)
    h, res = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    t0, t1 = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    plan = _plan()
    block = tp.column_block(weight, 1, 1, 4)
    received = IntermediateTensors(
        {"hidden_states": h, "residual": res, tp.PARTIAL_KEY: F.linear(t0, weight[:, :4])}
    )
    out = IntermediateTensors({"hidden_states": h, "residual": res, "aux_hidden_states_1": t1})
    sent = tp.relay(_Handler(plan, block), received, out)
    assert sorted(sent.tensors) == ["dspark_tap_partial", "hidden_states", "residual"]
    assert sent["hidden_states"] is h and sent["residual"] is res
    torch.testing.assert_close(
        sent[tp.PARTIAL_KEY], F.linear(torch.cat([t0, t1], -1), weight[:, :8])
    )
    # control: a stage whose forward made other tap rows than its plan says fails loudly
    wrong = IntermediateTensors({"hidden_states": h, "residual": res, "aux_hidden_states_2": t1})
    with pytest.raises(tp.TapPartialsError, match="aux_hidden_states_2"):
        tp.relay(_Handler(plan, block), received, wrong)


def test_first_stage_and_pass_through_stage():
    from vllm.sequence import IntermediateTensors

    h = torch.zeros(2, 4)
    t0 = torch.ones(2, 4)
    w = torch.arange(20.0).reshape(5, 4)
    first = _plan(base=0, count=1, is_first=True)
    sent = tp.relay(
        _Handler(first, w),
        None,
        IntermediateTensors({"hidden_states": h, "aux_hidden_states_0": t0}),
    )
    torch.testing.assert_close(sent[tp.PARTIAL_KEY], F.linear(t0, w))
    # a middle stage with no taps of its own passes the partial on unchanged
    middle = _plan(base=1, count=0)
    p = torch.randn(2, 5)
    sent = tp.relay(
        _Handler(middle, None),
        IntermediateTensors({tp.PARTIAL_KEY: p}),
        IntermediateTensors({"hidden_states": h}),
    )
    assert sent[tp.PARTIAL_KEY].data_ptr() == p.data_ptr() and torch.equal(sent[tp.PARTIAL_KEY], p)


@pytest.mark.parametrize(
    ("knob", "upstream", "on"),
    [
        ("auto", [1, 2], True),
        ("auto", [2], True),
        ("auto", [1], False),  # one tap row either way: nothing to save
        ("1", [1], True),
        ("0", [1, 2], False),
        ("1", [0, 0], False),  # every tap on the last stage
    ],
)
def test_choose_mode(knob, upstream, on):
    assert tp.choose_mode(knob, upstream)[0] is on


def test_bytes_per_boundary():
    # the tiny pair at PP=3 (aux 1, 3, 4; stages 0 | 1-2 | 3)
    up = tp.upstream_counts([1, 3, 4], [0, 1, 3])
    assert up == [1, 2]
    assert tp.boundary_rows(up, False) == [1, 2] and tp.boundary_rows(up, True) == [1, 1]
    row = {"tap": 8192, "partial": 8192}
    assert tp.describe_boundaries(up, True, row) == (
        "0->1: dspark_tap_partial 8192 B | 1->2: dspark_tap_partial 8192 B"
    )
    assert tp.describe_boundaries(up, False, row) == (
        "0->1: 1 x aux_hidden_states_* 8192 B | 1->2: 2 x aux_hidden_states_* 16384 B"
    )


def test_checkpoint_lookup_on_the_tiny_pair():
    hit = tp.find_linear(str(TINY_DRAFT), "fc", 384)
    assert isinstance(hit, tp.LinearInCheckpoint), hit
    assert (hit.key, hit.shape) == ("fc.weight", (128, 384))
    plan = _plan(num_taps=3, tap_width=128, partial_width=128, base=1, count=2)
    block = tp.load_column_block(str(TINY_DRAFT), hit, plan, torch.float32, "cpu")
    from safetensors.torch import load_file

    full = load_file(str(TINY_DRAFT / "model.safetensors"))["fc.weight"]
    assert torch.equal(block, full[:, 128:384])
    assert not torch.equal(block, full[:, 0:256])  # control: another slice differs
    assert isinstance(tp.find_linear(str(TINY_DRAFT), "fc", 256), str)  # wrong width
    assert isinstance(tp.find_linear(str(TINY_DRAFT), "main_proj", 384), str)


def _decoder():
    """A model with vLLM's ``EagleModelMixin`` (the tap-partials patch applied) that expects two
    upstream taps."""
    from vllm.model_executor.models import interfaces

    from vllm_dspark_pp.patches import model_executor_models_interfaces__tap_partials as patch

    patch.apply()

    class Decoder(interfaces.EagleModelMixin):
        pass

    d = Decoder()
    d._aux_upstream_total_cached = 2
    return d


def test_last_stage_collects_the_partial_as_its_one_upstream_tap():
    from vllm.sequence import IntermediateTensors

    d = _decoder()
    p, t0, t1 = torch.ones(2, 5), torch.zeros(2, 4), torch.ones(2, 4)
    it = IntermediateTensors(
        {tp.PARTIAL_KEY: p, "aux_hidden_states_0": t0, "aux_hidden_states_1": t1}
    )
    got = d.collect_remote_aux_hidden_states(it)
    assert [x is y for x, y in zip(got, [t0, t1], strict=True)] == [True, True]  # no plan
    object.__setattr__(d, tp.PLAN_ATTR, _plan(is_last=True, base=2, count=1))
    assert d.collect_remote_aux_hidden_states(it)[0] is p
    assert len(d.collect_remote_aux_hidden_states(it)) == 1


def test_last_stage_collects_no_upstream_tap_from_the_dict_on_the_side_channel():
    """With ``VLLM_DSPARK_PP_TAP_PARTIALS=side`` the partial arrives outside the intermediate
    tensors (test_tap_side.py), so the last stage reads no upstream tap from the dict."""
    from vllm.sequence import IntermediateTensors

    d = _decoder()
    side = dict(base=2, count=1, is_last=True, upstream=(2,), senders=(0,))
    object.__setattr__(d, tp.PLAN_ATTR, _plan(**side, side=True))
    assert d.collect_remote_aux_hidden_states(IntermediateTensors({})) == []
    # control: the in-dict plan still reads the partial from the dict
    p = torch.ones(2, 5)
    object.__setattr__(d, tp.PLAN_ATTR, _plan(**side, side=False))
    assert d.collect_remote_aux_hidden_states(IntermediateTensors({tp.PARTIAL_KEY: p}))[0] is p


class _Linear(torch.nn.Module):
    """Stands in for vLLM's ReplicatedLinear (bias-free, unquantized)."""

    def __init__(self, weight, bias=None, quant_method=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.quant_method = quant_method
        self.output_size, self.input_size = weight.shape

    def forward(self, x):
        return F.linear(x, self.weight)


def _last_stage(fc, staging_width=384, load_format="auto"):
    import types

    from safetensors.torch import load_file

    full = load_file(str(TINY_DRAFT / "model.safetensors"))["fc.weight"]
    hit = tp.find_linear(str(TINY_DRAFT), "fc", 384)
    inner = types.SimpleNamespace()
    plan = _plan(num_taps=3, tap_width=128, partial_width=128, base=1, count=2, is_last=True)
    object.__setattr__(inner, tp.PLAN_ATTR, plan)
    object.__setattr__(inner, tp.SOURCE_ATTR, (str(TINY_DRAFT), hit))
    drafter = types.SimpleNamespace(fc=fc(full))
    draft_cfg = types.SimpleNamespace(architectures=["Qwen3DSparkModel"], hf_config=None)
    spec = types.SimpleNamespace(draft_model_config=draft_cfg)
    speculator = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(
            speculative_config=spec, load_config=types.SimpleNamespace(load_format=load_format)
        ),
        model=types.SimpleNamespace(model=drafter),
        _aux_staging=torch.zeros(4, staging_width),
    )
    return speculator, types.SimpleNamespace(model=inner), drafter, full


def test_last_stage_drafter_adds_its_own_block_to_the_partial():
    speculator, target, drafter, full = _last_stage(_Linear)
    tp.install_on_drafter(speculator, target)
    assert isinstance(drafter.fc, tp.PartialSumLinear)
    assert speculator._aux_staging.shape == (4, 128 + 2 * 128)  # [partial | 2 own taps]
    g = torch.Generator().manual_seed(0)
    taps = [torch.randn(3, 128, generator=g) for _ in range(3)]
    partial = F.linear(taps[0], full[:, :128])  # what stage 0 sends
    got = drafter.fc(torch.cat([partial, taps[1], taps[2]], -1))
    torch.testing.assert_close(got, F.linear(torch.cat(taps, -1), full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda w: _Linear(w, bias=torch.zeros(128)), "has a bias"),
        (lambda w: _Linear(w, quant_method=type("Fp8LinearMethod", (), {})()), "quantized"),
        (lambda w: _Linear(w[:, :256]), "has shape"),
        (lambda w: _Linear(w * 2), "other weights than the checkpoint"),
    ],
)
def test_last_stage_refuses_a_drafter_linear_it_cannot_split(make, why):
    """Controls of the test above: the other stages already send partials, so the last stage
    stops start-up naming the knob instead of reading them wrongly."""
    speculator, target, drafter, _ = _last_stage(make)
    with pytest.raises(tp.TapPartialsError, match=why) as err:
        tp.install_on_drafter(speculator, target)
    assert "VLLM_DSPARK_PP_TAP_PARTIALS=0" in str(err.value)
    assert not isinstance(drafter.fc, tp.PartialSumLinear)


def test_with_raw_taps_the_start_up_and_step_lines_never_stop_the_engine(monkeypatch, caplog):
    """The mode off (the default): what only feeds the log lines (a decoder config without the
    fields the boundary description reads, an intermediate value that is not a tensor) is
    logged as unknown instead of raising at start-up or at the first relay; before this, both
    raised (AttributeError) on such a model."""
    import types

    import torch

    from vllm_dspark_pp.protocol import tap_partials as tp

    inner = types.SimpleNamespace(aux_hidden_state_layers=(1, 3), config=types.SimpleNamespace())
    monkeypatch.setattr(tp, "_inner_decoder", lambda model: inner)
    monkeypatch.setattr(
        tp, "plan_for", lambda cfg, inner: (None, "VLLM_DSPARK_PP_TAP_PARTIALS=0", None)
    )
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    lines = []
    monkeypatch.setattr(
        tp, "_logger", lambda: types.SimpleNamespace(info=lambda f, *a: lines.append(f % a))
    )
    assert tp.configure_stage(object(), object(), cfg) is None
    assert lines and "DSpark tap partials off (VLLM_DSPARK_PP_TAP_PARTIALS=0)" in lines[-1]
    assert "unknown (AttributeError" in lines[-1]
    out = types.SimpleNamespace(tensors={"hidden_states": torch.zeros(2, 4), "meta": [1, 2]})
    tp.log_sent_keys(out)
    assert "hidden_states 16 B" in lines[-1] and "meta (list)" in lines[-1]


def test_under_dummy_weights_the_checkpoint_block_stands_in_for_the_drafters(caplog):
    """``--load-format dummy`` (the served benchmark's real shapes): the loaded linear is random,
    so it is not compared with the checkpoint (the control above, ``w * 2``, refuses start-up
    with real weights); the drafter then reads the checkpoint's ``W`` on every stage alike, and
    the start-up line says so. A bias or a wrong shape still refuses."""
    speculator, target, drafter, full = _last_stage(lambda w: _Linear(w * 2), load_format="dummy")
    with caplog.at_level(logging.INFO):
        tp.install_on_drafter(speculator, target)
    assert isinstance(drafter.fc, tp.PartialSumLinear)
    assert "--load-format dummy: the checkpoint's fc.weight stands in" in caplog.text
    g = torch.Generator().manual_seed(1)
    taps = [torch.randn(3, 128, generator=g) for _ in range(3)]
    got = drafter.fc(torch.cat([F.linear(taps[0], full[:, :128]), taps[1], taps[2]], -1))
    torch.testing.assert_close(got, F.linear(torch.cat(taps, -1), full), rtol=1e-5, atol=1e-5)
    for make, why in ((lambda w: _Linear(w, bias=torch.zeros(128)), "has a bias"),
                      (lambda w: _Linear(w[:, :256]), "has shape")):  # fmt: skip
        speculator, target, _, _ = _last_stage(make, load_format="dummy")
        with pytest.raises(tp.TapPartialsError, match=why):
            tp.install_on_drafter(speculator, target)
