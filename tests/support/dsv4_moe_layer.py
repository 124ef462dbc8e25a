"""A DeepSeek-V4 MoE layer at a real expert count, built through vLLM's own model code (issue 26,
part 4): ``vllm.models.deepseek_v4.nvidia.model.DeepseekV4MoE`` with 256 routed experts, top-6,
``sqrtsoftplus`` scoring, the ``noaux_tc`` correction bias and one shared expert, on the tiny
DeepSeek-V4 GPU target's dimensions (hidden 256, expert width 64;
``dspark_dev.tiny_mla_targets.dsv4_fields``).

No engine: the layer is constructed under ``set_current_vllm_config`` in a one-rank world (the
layer needs TP and EP groups) and run inside vLLM's forward context, which carries the model
runner's padding mask (``is_padding``) exactly as the GPU model runner publishes it. The checks
run in a child process (``python -m support.dsv4_moe_layer DEVICE OUT.json``, started by
``run_child``) for tests/gpu/test_dsv4_router_gpu.py (CUDA: the router is vLLM's
``FusedTopKBiasRouter``, whose ``fused_topk_bias`` takes the Triton ``dsv4_topk`` fast path) and
for the hand run of tests/unit/support/test_dsv4_moe_layer_cpu.py (vLLM's CPU platform:
``CPURouter`` and the CPU experts), which also dry-runs ``checks_on`` on a stand-in layer.

What is recorded per call: ``dsv4_topk`` is wrapped where ``fused_topk_bias`` looks it up, so a
call counts only if vLLM's router really took the fast path; the call's row and expert counts, a
copy of its mask and the ids and weights it returned are kept for the comparisons.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NUM_EXPERTS = 256
TOPK = 6
# (real decode batch size R, padded size P): P from vLLM's default CUDA-graph capture list
# (1, 2, 4, 8, 16, 24, 32, 40, ...; vllm/config/vllm.py): the next size above R (33 -> 40), and
# R=1 also unpadded at size 1.
BATCHES = ((1, 1), (1, 2), (3, 4), (7, 8), (33, 40))
LAYER_PREFIX = "model.layers.1.ffn"  # layer 1 of mlp_layer_types ["hash_moe", "moe"]: routed


def layer_config_fields(num_experts: int = NUM_EXPERTS) -> dict[str, Any]:
    """The tiny DeepSeek-V4 GPU target's config with a real routed-expert count."""
    from dspark_dev import tiny_mla_targets

    out = tiny_mla_targets.dsv4_fields(gpu=True)
    out.update({"n_routed_experts": num_experts, "num_experts_per_tok": TOPK})
    return out


def vllm_config(num_experts: int = NUM_EXPERTS, workdir: str | None = None):
    """A real VllmConfig for that config (dummy weights, bf16, no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    d = Path(workdir or tempfile.mkdtemp(prefix="dsv4-moe-"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(layer_config_fields(num_experts), indent=1))
    return EngineArgs(
        model=str(d),
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        enforce_eager=True,
        # the modular Triton experts: routing runs in vLLM's router (a monolithic FlashInfer
        # kernel would route inside itself); the kit has no FlashInfer anyway
        moe_backend="triton" if device_is_cuda() else "auto",
    ).create_engine_config()


def device_is_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def init_one_rank_world(cfg, device: torch.device) -> None:
    """TP = PP = EP = 1 in this process (vLLM's MoE layers read their groups)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_world_group,
        init_distributed_environment,
    )
    from vllm.distributed import parallel_state as ps

    backend = "nccl" if device.type == "cuda" else "gloo"
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, backend)
        ensure_model_parallel_initialized(1, 1)
        if ps._EP is None:
            ps._EP = ps.init_model_parallel_group(
                [[0]], get_world_group().local_rank, backend, group_name="ep"
            )


def build_layer(cfg, device: torch.device, seed: int = 0):
    """vLLM's DeepseekV4MoE for layer 1, weights drawn from a seeded generator, post-processed
    as the loader does (the experts' quant method prepares its kernel layout)."""
    import vllm.models.deepseek_v4.nvidia.model as dsv4
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = cfg.model_config.hf_config
    cfg.compilation_config.static_forward_context = {}
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16), device:
        layer = dsv4.DeepseekV4MoE(
            cfg,
            prefix=LAYER_PREFIX,
            num_hash_layers=hf.mlp_layer_types.count("hash_moe"),
        )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                vals = torch.randn(p.shape, generator=g) * 0.3
            elif p.dim() >= 2:  # gate, expert and shared-expert matrices: unit-variance outputs
                vals = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            else:
                vals = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(vals.to(p.dtype))
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(cfg):
        process_weights_after_loading(layer, cfg.model_config, device)
    return layer


def padding_mask(num_real: int, num_padded: int, device) -> torch.Tensor:
    """The model runner's ``is_padding`` for a batch of ``num_real`` tokens padded to
    ``num_padded`` (vllm/v1/worker/gpu/model_runner.py fills it this way)."""
    mask = torch.ones(num_padded, dtype=torch.bool, device=device)
    mask[:num_real] = False
    return mask


def padded_hidden(real: torch.Tensor, num_padded: int, kind: str, seed: int = 0) -> torch.Tensor:
    """The real rows followed by padding rows: ``stale`` (what a reused graph buffer holds: other
    tokens' hidden states, large), ``zeros`` or ``huge`` (rows that would win every expert)."""
    n, h = real.shape
    g = torch.Generator().manual_seed(5_000 + seed)
    if kind == "stale":
        junk = torch.randn(num_padded - n, h, generator=g) * 8.0
    elif kind == "zeros":
        junk = torch.zeros(num_padded - n, h)
    elif kind == "huge":
        junk = torch.randn(num_padded - n, h, generator=g).sign() * 1e4
    else:
        raise ValueError(f"unknown padding kind {kind!r}")
    return torch.cat([real, junk.to(real.dtype).to(real.device)]).contiguous()


class TopkSpy:
    """Wraps ``dsv4_topk`` where vLLM's ``fused_topk_bias`` looks it up: records every call
    (rows, experts, a copy of its mask, and the ids and weights tensors it returned)."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []

    @contextmanager
    def installed(self):
        from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as r

        real = r.dsv4_topk

        def spy(gating_output, correction_bias, indices_dtype, scale, is_padding=None, **kw):
            w, ids = real(
                gating_output, correction_bias, indices_dtype, scale, is_padding=is_padding, **kw
            )
            self.calls.append(
                {
                    "rows": gating_output.shape[0],
                    "experts": gating_output.shape[1],
                    "mask": None if is_padding is None else is_padding.clone(),
                    "ids": ids,  # the returned tensors themselves: valid after a graph replay
                    "weights": w,
                }
            )
            return w, ids

        r.dsv4_topk = spy
        try:
            yield self
        finally:
            r.dsv4_topk = real


def forward(layer, cfg, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One call of the layer as the model calls it, in a forward context carrying the runner's
    padding mask (``None``: no mask, as with ``VLLM_MOE_SKIP_PADDING=0``)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with (
        set_current_vllm_config(cfg),
        set_forward_context(None, cfg, num_tokens=hidden.shape[0], is_padding=mask),
    ):
        return layer(hidden)


def rows_differ(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Rows of two equal-shaped tensors that are not bitwise equal (ids or bf16/float outputs)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.is_floating_point():
        a = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
        b = b.contiguous().view(a.dtype)
    same = (a.long() == b.long()).reshape(a.shape[0], -1).all(-1)
    return torch.nonzero(~same).flatten().tolist()


# ---------------------------------------------------------------------------------------------
# The checks, run in a child process (``python -m support.dsv4_moe_layer DEVICE OUT.json``):
# one distributed world per process, a hard deadline from the parent, a JSON report back.

KINDS = ("stale", "zeros", "huge")
MIN_MARGIN = 1e-3  # real rows: the best 7 routing scores differ pairwise by at least this much
OUT_RTOL = OUT_ATOL = 2e-2  # bf16 layer outputs across different batch sizes (GEMM tiling)
W_RTOL = 1e-4  # float32 routing weights across batch sizes (gate GEMM tiling: about 1e-6)


def real_rows(layer, num_rows: int, seed: int, device) -> torch.Tensor:
    """``num_rows`` bf16 hidden rows whose top-6 under the layer's own gate and bias is far from
    a tie (so a one-ulp change of a logit between batch sizes cannot flip the selection)."""
    from support.dsv4_router_ref import score_margin

    hsz = layer.hidden_size
    g = torch.Generator().manual_seed(seed)
    rows: list[torch.Tensor] = []
    while len(rows) < num_rows:
        cand = torch.randn(16, hsz, generator=g).to(torch.bfloat16).to(device)
        logits, _ = layer.gate(cand)
        margins = score_margin(logits.float(), layer.gate.e_score_correction_bias.float())
        rows += [cand[i] for i in range(16) if margins[i] >= MIN_MARGIN]
    return torch.stack(rows[:num_rows]).contiguous()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _Runner:
    def __init__(self, layer, cfg, device):
        self.layer, self.cfg, self.device = layer, cfg, device
        self.spy = TopkSpy()

    def eager(self, hidden, mask) -> dict[str, Any]:
        """One forward; the layer output and what its dsv4_topk call(s) saw and returned."""
        self.spy.calls.clear()
        out = forward(self.layer, self.cfg, hidden, mask)
        _sync(self.device)
        return {"out": out.clone(), "calls": list(self.spy.calls)}


def call_problems(tag: str, run: dict, rows: int, mask) -> list[str]:
    """The forward took vLLM's dsv4_topk exactly once, on all its rows, with the runner's mask."""
    calls = run["calls"]
    if len(calls) != 1:
        return [f"{tag}: {len(calls)} dsv4_topk calls (vLLM's router did not take the fast path)"]
    c = calls[0]
    out = []
    if (c["rows"], c["experts"]) != (rows, NUM_EXPERTS):
        out.append(f"{tag}: dsv4_topk saw [{c['rows']}, {c['experts']}]")
    if (c["mask"] is None) != (mask is None) or (
        mask is not None and not torch.equal(c["mask"].cpu(), mask.cpu())
    ):
        out.append(f"{tag}: dsv4_topk got mask {c['mask']}, the runner's is {mask}")
    return out


def _routing(run: dict, rows: int):
    if not run["calls"]:
        return None, None
    c = run["calls"][-1]
    return c["ids"][:rows].cpu(), c["weights"][:rows].cpu()


@dataclass
class Comparison:
    problems: list[str]  # what the check reports (empty: the rows agree under the rule)
    flagged: list[int]  # rows that break the rule (ids differ, or beyond the tolerance)
    not_bitwise: list[int]  # rows whose ids, weights or outputs are not bitwise equal


def compare(tag: str, ref: dict, got: dict, rows: int, *, bitwise: bool) -> Comparison:
    """Real rows of ``got`` against ``ref``: ids exactly; weights and outputs bitwise
    (``bitwise``: same batch size, same kernels) or within the cross-size tolerances."""
    o_ref, o_got = ref["out"][:rows].cpu().float(), got["out"][:rows].cpu().float()
    ids_r, w_r = _routing(ref, rows)
    ids_g, w_g = _routing(got, rows)
    not_bitwise = set(rows_differ(ref["out"][:rows].cpu(), got["out"][:rows].cpu()))
    bad: dict[str, list[int]] = {"ids": [], "weights": [], "outputs": []}
    if ids_r is not None and ids_g is not None:
        bad["ids"] = rows_differ(ids_r, ids_g)
        w_diff = rows_differ(w_r, w_g)
        not_bitwise |= set(bad["ids"]) | set(w_diff)
        bad["weights"] = (
            w_diff
            if bitwise
            else [r for r in range(rows) if not torch.allclose(w_r[r], w_g[r], rtol=W_RTOL, atol=0)]
        )
    bad["outputs"] = (
        rows_differ(o_ref, o_got)
        if bitwise
        else [
            r
            for r in range(rows)
            if not torch.allclose(o_ref[r], o_got[r], rtol=OUT_RTOL, atol=OUT_ATOL)
        ]
    )
    rule = "bitwise" if bitwise else "tolerance"
    problems = [f"{tag}: {what} differ ({rule}) in rows {r}" for what, r in bad.items() if r]
    flagged = sorted(set().union(*bad.values()))
    return Comparison(problems, flagged, sorted(not_bitwise))


def padding_row_problems(tag: str, run: dict, mask) -> list[str]:
    """Padding rows must come out of dsv4_topk as id -1, weight 0."""
    if not run["calls"] or mask is None:
        return []
    c = run["calls"][-1]
    rows = torch.nonzero(mask.cpu()).flatten().tolist()
    ids, w = c["ids"].cpu(), c["weights"].cpu()
    bad = [r for r in rows if not (bool((ids[r] == -1).all()) and bool((w[r] == 0).all()))]
    return [f"{tag}: padding rows {bad} were routed"] if bad else []


def run_checks(device: torch.device) -> dict[str, Any]:
    """Build the layer in this process and run every check on ``device``."""
    cfg = vllm_config()
    init_one_rank_world(cfg, device)
    if device.type == "cuda":
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(device)
    layer = build_layer(cfg, device)
    run = _Runner(layer, cfg, device)
    real_all = real_rows(layer, max(r for r, _ in BATCHES), seed=1, device=device)
    report = checks_on(run, real_all, graphs=device.type == "cuda")
    report["facts"]["router"] = type(layer.experts.router).__name__
    report["facts"]["experts_backend"] = type(layer.experts.routed_experts.quant_method).__name__
    return report


def checks_on(run, real_all: torch.Tensor, *, graphs: bool) -> dict[str, Any]:
    """The eager checks, the CUDA-graph checks (``graphs``) and the controls, for a runner whose
    ``eager(hidden, mask)`` calls the module's ``forward``."""
    device = run.device
    report: dict[str, Any] = {"device": device.type, "checks": {}, "controls": {}, "facts": {}}
    checks, facts = report["checks"], report["facts"]
    for name in ("fast_path", "eager_vs_unpadded", "eager_padding_content", "graph"):
        checks[name] = []
    not_bitwise: list[str] = []
    unpadded: dict[int, dict] = {}
    eager_padded: dict[tuple[int, int, str], dict] = {}

    with run.spy.installed():
        for r, p in BATCHES:
            real = real_all[:r]
            m_u = padding_mask(r, r, device)
            if r not in unpadded:
                unpadded[r] = run.eager(real, m_u)
                checks["fast_path"] += call_problems(f"R={r} unpadded", unpadded[r], r, m_u)
            ref = unpadded[r]
            if p == r:
                continue
            first = None
            for kind in KINDS:
                tag = f"R={r} P={p} {kind}"
                mask = padding_mask(r, p, device)
                got = run.eager(padded_hidden(real, p, kind, seed=r), mask)
                eager_padded[(r, p, kind)] = got
                checks["fast_path"] += call_problems(tag, got, p, mask)
                checks["eager_padding_content"] += padding_row_problems(tag, got, mask)
                c = compare(f"{tag} vs unpadded", ref, got, r, bitwise=False)
                checks["eager_vs_unpadded"] += c.problems
                if c.not_bitwise:
                    not_bitwise.append(f"{tag}: rows {c.not_bitwise}")
                if first is None:
                    first = got
                else:  # same padded size, other padding contents: bitwise
                    checks["eager_padding_content"] += compare(
                        f"{tag} vs {KINDS[0]}", first, got, r, bitwise=True
                    ).problems
        facts["eager_rows_not_bitwise_vs_unpadded"] = not_bitwise

        if graphs:
            checks["graph"] += _graph_checks(run, real_all, unpadded, eager_padded, facts)
        report["controls"] = _controls(run, real_all, unpadded, device)
    report["done"] = True
    return report


def _replayed(captured_call: dict, out_buf: torch.Tensor) -> dict:
    """A replay's result: the captured call's outputs and the layer output are the graph's
    static tensors, so they are copied before the next replay overwrites them."""
    call = dict(captured_call, ids=captured_call["ids"].clone())
    call["weights"] = captured_call["weights"].clone()
    return {"out": out_buf.clone(), "calls": [call]}


def _graph_checks(run, real_all, unpadded, eager_padded, facts) -> list[str]:
    """One torch.cuda.CUDAGraph of the layer per padded size P, captured over static hidden and
    mask buffers (the forward context holds the mask buffer, as the runner's does), replayed for
    every real batch size padded to P and every padding content."""
    layer_dev = run.device
    problems: list[str] = []
    hsz = real_all.shape[1]
    sizes = sorted({p for _, p in BATCHES})
    facts["graph_sizes"] = sizes
    not_bitwise: list[str] = []
    vs_eager: list[str] = []
    for p in sizes:
        hidden_buf = torch.zeros(p, hsz, dtype=torch.bfloat16, device=layer_dev)
        mask_buf = torch.zeros(p, dtype=torch.bool, device=layer_dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, workspaces sized
            for _ in range(2):
                forward(run.layer, run.cfg, hidden_buf, mask_buf)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        run.spy.calls.clear()
        with torch.cuda.graph(graph):
            out_buf = forward(run.layer, run.cfg, hidden_buf, mask_buf)
        captured = list(run.spy.calls)
        if len(captured) != 1:
            problems.append(f"P={p}: the captured forward made {len(captured)} dsv4_topk calls")
            continue
        for r, pp in BATCHES:
            if pp != p:
                continue
            first = None
            for kind in KINDS if p > r else ("none",):
                tag = f"graph P={p} R={r} {kind}"
                mask = padding_mask(r, p, layer_dev)
                hidden = real_all[:r] if p == r else padded_hidden(real_all[:r], p, kind, seed=r)
                hidden_buf.copy_(hidden)
                mask_buf.copy_(mask)
                graph.replay()
                torch.cuda.synchronize()
                got = _replayed(captured[0], out_buf)
                problems += padding_row_problems(tag, got, mask)
                c = compare(f"{tag} vs unpadded", unpadded[r], got, r, bitwise=False)
                problems += c.problems
                if c.not_bitwise:
                    not_bitwise.append(f"{tag}: rows {c.not_bitwise}")
                if first is None:
                    first = got
                else:  # the same graph, other padding contents: bitwise
                    problems += compare(
                        f"{tag} vs {KINDS[0]}", first, got, r, bitwise=True
                    ).problems
                # against the eager run at the same size: recorded (cuBLAS may pick another
                # algorithm inside a capture; the padding question is answered above)
                same_p = unpadded[r] if p == r else eager_padded[(r, p, kind)]
                c = compare(f"{tag} vs eager at P", same_p, got, r, bitwise=True)
                if c.not_bitwise:
                    vs_eager.append(f"{tag}: rows {c.not_bitwise}")
        if p == 8:  # control: the replay reads the live buffers; a changed real row is flagged
            r = 7
            pert = real_all[:r].clone()
            pert[2] = real_all[-1]
            hidden_buf.copy_(padded_hidden(pert, p, "stale", seed=r))
            mask_buf.copy_(padding_mask(r, p, layer_dev))
            graph.replay()
            torch.cuda.synchronize()
            got = _replayed(captured[0], out_buf)
            c = compare("graph control perturbed", unpadded[r], got, r, bitwise=False)
            facts["graph_control_perturbed_rows"] = c.flagged
    facts["graph_rows_not_bitwise_vs_unpadded"] = not_bitwise
    facts["graph_rows_not_bitwise_vs_eager_same_size"] = vs_eager
    return problems


def _controls(run, real_all, unpadded, device) -> dict[str, Any]:
    """What the comparisons must see: each control's result, judged by the tests."""
    out: dict[str, Any] = {}
    r, p = 7, 8
    ref = unpadded[r]
    real = real_all[:r]
    mask = padding_mask(r, p, device)
    # 1. a wrong mask that also marks the last real row as padding: that row loses its routed
    #    experts (CUDA: ids -1); the cross-size comparison must flag row 6 and only it
    got = run.eager(padded_hidden(real, p, "huge", seed=r), padding_mask(r - 1, p, device))
    c = compare("control wrong mask", ref, got, r, bitwise=False)
    out["wrong_mask_rows"], out["wrong_mask_problems"] = c.flagged, c.problems
    # 2. no mask (VLLM_MOE_SKIP_PADDING=0 / a runner that does not publish it): padding rows that
    #    would win the top-k are routed; the padding-row check must flag them
    got = run.eager(padded_hidden(real, p, "huge", seed=r), None)
    out["no_mask_calls"] = len(got["calls"])
    out["no_mask_padding_problems"] = padding_row_problems("control no mask", got, mask)
    out["no_mask_real_rows_flagged"] = compare("no mask", ref, got, r, bitwise=False).flagged
    # 3. a perturbed real row (row 2 replaced by another token's hidden state): flagged, alone
    pert = real.clone()
    pert[2] = real_all[-1]
    got = run.eager(padded_hidden(pert, p, "stale", seed=r), mask)
    out["perturbed_rows"] = compare("control perturbed", ref, got, r, bitwise=False).flagged
    # 4. the path check: with the fast-path gate refused, vLLM routes through its generic
    #    sqrtsoftplus op, and the call count must show it (0 dsv4_topk calls)
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router as router

    real_gate = router.can_use_dsv4_topk
    router.can_use_dsv4_topk = lambda *a, **k: False
    run.spy.calls.clear()
    try:
        got = run.eager(padded_hidden(real, p, "stale", seed=r), mask)
        out["gate_off_rows_flagged"] = compare("gate off", ref, got, r, bitwise=False).flagged
    except Exception as e:  # noqa: BLE001 - recorded: only the call count matters here
        out["gate_off_error"] = repr(e)[:500]
    finally:
        router.can_use_dsv4_topk = real_gate
    out["gate_off_call_problems"] = call_problems(
        "control gate off", {"calls": list(run.spy.calls)}, p, mask
    )
    return out


def main(argv: list[str]) -> int:
    device_name, out_path = argv
    device = torch.device(device_name)
    import vllm_dspark_pp

    vllm_dspark_pp.register()
    report: dict[str, Any] = {"device": device.type}
    try:
        report = run_checks(device)
    except Exception:  # noqa: BLE001 - the parent test fails with this traceback
        import traceback

        report["error"] = traceback.format_exc()[-6000:]
    Path(out_path).write_text(json.dumps(report, indent=1, default=str))
    return 0


def run_child(device: str, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run the checks in a fresh process with a hard deadline; the report, or an error naming
    the crash or timeout with the log's tail."""
    import os
    import subprocess
    import sys

    from dspark_dev.proc import run_with_timeout

    repo = Path(__file__).resolve().parents[2]
    out, log = workdir / f"dsv4_moe_{device}.json", workdir / f"dsv4_moe_{device}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "tests"), str(repo), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "support.dsv4_moe_layer", device, str(out)]
    with open(log, "wb") as f:
        try:
            run_with_timeout(cmd, timeout=timeout_s, env=env, stdout=f)
        except subprocess.TimeoutExpired:
            pass
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    if not out.exists():
        raise RuntimeError(f"the DSV4 MoE child wrote no report (crash or {timeout_s}s):\n{tail}")
    report = json.loads(out.read_text())
    report["log_tail"] = tail
    return report


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
