"""Does vLLM serve the pure-torch tiny DeepSeek-V4 (dspark_dev/training/dsv4_models.py) as the
pure-torch forward computes it? One GPU call:

    python3 -m dspark_dev.training.dsv4_check --spec --out /tmp/dsv4-check --report $OUT/r.json

1. exports random-init weights of the tiny GPU config (``tiny_mla_targets.dsv4_fields(gpu=True)``)
   as one DeepSeek-V4 checkpoint (target + DSpark ``mtp.*`` stages) with its tokenizer;
2. runs vLLM on it (bf16, the H200's fp8_ds_mla KV cache) in a child with a hard deadline,
   greedy, top-5 logprobs, over prompts of 12 to 150 tokens (past the 128-token sliding window and
   the first 128-token compressed entry);
3. teacher-forces the pure-torch target (float32, the cache's fp8 rounding emulated, and once
   without it) on vLLM's own token sequences and compares: every vLLM token must be the reference's
   argmax where the reference's top-1 lead is at least ``--margin`` nats, and every logprob vLLM
   returned must be within ``--lp-tol`` nats of the reference's (docs/dsv4-pure-torch.md says why
   no exact match is possible and where the tolerance comes from);
4. with ``--spec``: a second engine (started together with the first) with the DSpark draft
   (k = 4, ``dsv4_draft_probe``) must emit the same tokens as the first (lossless) up to a
   near-tie of the reference, then the reference's confident argmax (``judge``), and every draft
   step it took must match ``TinyDSV4Draft.draft_greedy`` on the same verified tokens and vLLM's
   draft chain, or do so once one routing near-tie of the draft is resolved the other way
   (``judge_drafts``; the random draft itself is not expected to be accepted). What is excused
   goes to the report's ``notes``.

``--dry-run`` (CPU): exports, loads the checkpoint into vLLM's CUDA model classes built on the CPU
(every parameter of the target and of the drafter must be filled, with the values the export
meant: ``load_problems``), runs the reference on short prompts and checks that the comparison
passes the reference's own greedy output and flags a flipped token and shifted logprobs, and that
the verdict (``judge``) flags DSpark tokens that differ from the no-spec ones at a confident
token and accepts a divergence at a near-tie, and that the draft verdict (``judge_drafts``) passes
our own drafts, explains a routing near-tie resolved the other way and flags a changed confident
draft, shifted base logprobs, a wrong anchor and a routing change above the tie threshold.
The report is printed and written to ``<out>/dsv4_check.json``; exit status 0 = passed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from dspark_dev.training import dsv4_models as M

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (12, 33, 70, 150)
GEN_TOKENS = 24
LOGPROBS = 5
# First-guess tolerances (bf16 activations + fp8 keys against a float32 reference with the same
# fp8 rounding); the report prints the measured distribution so the lead can tighten them.
DEFAULT_LP_TOL = 0.25
DEFAULT_MARGIN = 0.3
HEAD_GAIN = 3.0  # sharper random logits: fewer near-ties between the top two tokens


def build(seed: int = 0, device: str = "cpu"):
    from dspark_dev import tiny_mla_targets as t

    cfg = M.DSV4Config.from_dict(t.dsv4_fields(gpu=True))
    target, draft = M.TinyDSV4(cfg), M.TinyDSV4Draft(cfg)
    M.init_pair(target, draft, seed=seed)
    with torch.no_grad():
        target.head.weight.mul_(HEAD_GAIN)
    return cfg, target.to(device).eval(), draft.to(device).eval()


def export(out: Path, target, draft) -> Path:
    """``<out>/dsv4``: config, tokenizer and ``model.safetensors`` (one file, both models)."""
    from safetensors.torch import save_file

    from dspark_dev import tiny_mla_targets as t

    pair = t.make_tiny_dsv4_pair(out, gpu=True)
    sd = {k: v.cpu() for k, v in M.vllm_checkpoint(target, draft).items()}
    save_file(sd, str(Path(pair.target) / "model.safetensors"), metadata={"format": "pt"})
    return Path(pair.target)


def prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------- load check (CPU)
def flashmla_padded_sink(sink: torch.Tensor) -> torch.Tensor:
    """The attention sink as vLLM's FlashMLA layer holds it: allocated at the padded head count
    (64 for up to 64 heads, else 128: ``M/nvidia/flashmla.py:74-81``), the checkpoint's heads
    first and -inf (no sink) in the padding slots (``weight_utils.load_attention_sink``). The GPU
    geometry's 64 heads need no padding; the training geometry's 8 get 56 slots."""
    n = sink.numel()
    padded = 64 if n <= 64 else 128
    return torch.cat([sink, sink.new_full((padded - n,), float("-inf"))])


def v4_compression_params(sd: dict[str, torch.Tensor], src: str, dst: str):
    """A V4 layer's compressors (``wkv`` + ``wgate`` fused, ``ape``, ``norm``; the indexer's own
    on a ratio-4 layer) and indexer projections as vLLM parameters."""
    out: dict[str, torch.Tensor] = {}
    g = lambda k: sd[src + k]  # noqa: E731
    for c in ("attn.compressor.", "attn.indexer.compressor."):
        if src + c + "wkv.weight" in sd:
            out[dst + c + "fused_wkv_wgate.weight"] = torch.cat(
                [g(c + "wkv.weight"), g(c + "wgate.weight")]
            )
            out[dst + c + "ape"] = g(c + "ape")
            out[dst + c + "norm.weight"] = g(c + "norm.weight")
    for k in ("attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"):
        if src + k in sd:
            out[dst + k] = g(k)
    return out


def vllm_layer_params(
    sd: dict[str, torch.Tensor], src: str, dst: str, compression=v4_compression_params
) -> dict[str, torch.Tensor]:
    """One decoder layer's vLLM parameters (prefix ``dst``) from the checkpoint tensors under
    ``src``: fused projections are concatenations, the routed experts stacked; the compressor and
    indexer ones from ``compression(sd, src, dst)`` (V4's by default)."""
    out: dict[str, torch.Tensor] = {}
    g = lambda k: sd[src + k]  # noqa: E731
    out[dst + "attn.fused_wqa_wkv.weight"] = torch.cat(
        [g("attn.wq_a.weight"), g("attn.wkv.weight")]
    )
    for k in ("attn.q_norm.weight", "attn.kv_norm.weight", "attn.wq_b.weight"):
        out[dst + k] = g(k)
    for k in ("attn.wo_a.weight", "attn.wo_b.weight"):
        out[dst + k] = g(k)
    out[dst + "attn.attn_sink"] = flashmla_padded_sink(g("attn.attn_sink"))
    out.update(compression(sd, src, dst))
    out[dst + "ffn.gate.weight"] = g("ffn.gate.weight")
    if src + "ffn.gate.tid2eid" in sd:
        out[dst + "ffn.gate.tid2eid"] = g("ffn.gate.tid2eid")
    else:
        out[dst + "ffn.gate.e_score_correction_bias"] = g("ffn.gate.bias")
    se = "ffn.shared_experts."
    out[dst + se + "gate_up_proj.weight"] = torch.cat([g(se + "w1.weight"), g(se + "w3.weight")])
    out[dst + se + "down_proj.weight"] = g(se + "w2.weight")
    n_exp = sum(1 for k in sd if k.startswith(src + "ffn.experts.") and k.endswith(".w1.weight"))
    ex = [f"ffn.experts.{e}." for e in range(n_exp)]
    out[dst + "ffn.experts.routed_experts.w13_weight"] = torch.stack(
        [torch.cat([g(e + "w1.weight"), g(e + "w3.weight")]) for e in ex]
    )
    out[dst + "ffn.experts.routed_experts.w2_weight"] = torch.stack(
        [g(e + "w2.weight") for e in ex]
    )
    for k in ("attn_norm.weight", "ffn_norm.weight"):
        out[dst + k] = g(k)
    for kind in ("attn", "ffn"):
        for p in ("fn", "base", "scale"):
            out[dst + f"hc_{kind}_{p}"] = g(f"hc_{kind}_{p}")
    return out


def expected_vllm_params(
    sd: dict[str, torch.Tensor],
    *,
    drafter: bool,
    n_layers: int,
    layer_params=None,
    target_prefix: str = "",
    hc_head: bool = True,
):
    """{vLLM parameter name: the value it must hold after load_weights}, written independently
    of vLLM's loader: fused projections are concatenations, the routed experts stacked. V4.1
    (``dsv41_check``) passes its ``layer_params`` (default: this module's ``vllm_layer_params``),
    the target's ``target_prefix`` and ``hc_head=False`` (no learned final collapse)."""
    out: dict[str, torch.Tensor] = {}

    def layer(src: str, dst: str) -> None:
        out.update((layer_params or vllm_layer_params)(sd, src, dst))

    if not drafter:
        lm = target_prefix
        out[lm + "model.embed_tokens.weight"] = sd["embed.weight"]
        out[lm + "lm_head.weight"] = sd["head.weight"]
        out[lm + "model.norm.weight"] = sd["norm.weight"]
        if hc_head:
            for p in ("fn", "base", "scale"):
                out[f"{lm}model.hc_head_{p}"] = sd[f"hc_head_{p}"]
        for i in range(n_layers):
            layer(f"layers.{i}.", f"{lm}model.layers.{i}.")
        return out
    stages = sorted({int(k.split(".")[1]) for k in sd if k.startswith("mtp.")})
    last = f"mtp.{stages[-1]}."
    out["model.main_proj.weight"] = sd["mtp.0.main_proj.weight"]
    out["model.main_norm.weight"] = sd["mtp.0.main_norm.weight"]
    for i in stages:
        layer(f"mtp.{i}.", f"model.layers.{i}.")
    out["model.context_wkv_proj.weight"] = torch.cat(
        [sd[f"mtp.{i}.attn.wkv.weight"] for i in stages]
    )
    out["model.norm.weight"] = sd[last + "norm.weight"]
    if hc_head:
        for p in ("fn", "base", "scale"):
            out[f"model.hc_head_{p}"] = sd[last + f"hc_head_{p}"]
    for k in ("markov_w1", "markov_w2"):
        out[f"model.markov_head.{k}.weight"] = sd[last + f"markov_head.{k}.weight"]
    if last + "confidence_head.proj.weight" in sd:
        out["model.confidence_head.proj.weight"] = sd[last + "confidence_head.proj.weight"]
    return out


# the drafter's embedding and head are the target's (vLLM's speculator aliases them)
DRAFTER_ALIASED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def compare_params(model, expected: dict[str, torch.Tensor], skip=frozenset()) -> list[str]:
    params = {n: p for n, p in model.named_parameters() if n not in skip}
    problems = [
        f"vLLM parameter {n} has no exported value" for n in sorted(set(params) - set(expected))
    ]
    problems += [f"exported {n} is no vLLM parameter" for n in sorted(set(expected) - set(params))]
    for n in sorted(set(params) & set(expected)):
        p, e = params[n].detach(), expected[n]
        if tuple(p.shape) != tuple(e.shape):
            problems.append(f"{n}: vLLM shape {tuple(p.shape)}, exported {tuple(e.shape)}")
        elif not torch.equal(p.cpu().to(e.dtype), e):
            problems.append(f"{n}: loaded values differ from the exported ones")
    return problems


def load_problems(
    model_dir: Path, sd: dict[str, torch.Tensor], keep: dict | None = None
) -> dict[str, list[str]]:
    """Build vLLM's CUDA DeepSeek-V4 target and DSpark drafter on the CPU for ``model_dir`` (the
    fp8_ds_mla cache of the H200), run their ``load_weights`` on ``sd`` and compare every
    parameter with :func:`expected_vllm_params`; also names any parameter ``load_weights`` did not
    report loaded. ``keep``: receives the loaded models (``target``, ``drafter``) and the
    VllmConfig (``config``)."""
    import pytest
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        parallel_state,
    )
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4ForCausalLM

    import vllm_dspark_pp
    from dspark_dev import tiny_mla_targets as t
    from dspark_dev.tiny_dsv4_cpu import construct_on_cpu, engine_config

    vllm_dspark_pp.register()
    pair = t.TinyPair(str(model_dir), str(model_dir), "deepseek-v4")
    cfg = engine_config(
        pair, kv_cache_dtype="fp8_ds_mla", speculative_config=pair.speculative_config(4)
    )
    import tempfile

    if parallel_state._TP is None:
        with set_current_vllm_config(cfg):
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
    n_layers = cfg.model_config.hf_config.num_hidden_layers
    report: dict[str, list[str]] = {}
    mp = pytest.MonkeyPatch()
    try:
        for name, cls, drafter in (
            ("target", DeepseekV4ForCausalLM, False),
            ("drafter", DSparkDeepseekV4ForCausalLM, True),
        ):
            model = construct_on_cpu(cfg, cls, mp)
            with set_current_vllm_config(cfg), torch.no_grad():
                loaded = set(model.load_weights(iter(sd.items())))
            skip = DRAFTER_ALIASED if drafter else frozenset()
            exp = expected_vllm_params(sd, drafter=drafter, n_layers=n_layers)
            probs = compare_params(model, exp, skip)
            unloaded = {n for n, _ in model.named_parameters()} - loaded - skip
            probs += [f"load_weights did not load {n}" for n in sorted(unloaded)]
            report[name] = probs
            if keep is not None:  # ready to run: the quant methods' post-load step
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                with set_current_vllm_config(cfg):
                    process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
                keep[name] = model
                keep["config"] = cfg
    finally:
        mp.undo()
    return report


# ---------------------------------------------------------------------------------- comparison
@torch.no_grad()
def reference_logprobs(target, seq: list[int], kv_quant: str | None) -> torch.Tensor:
    dev = next(target.parameters()).device
    ids = torch.tensor([seq], device=dev)
    logits, _ = target(ids, kv_quant=kv_quant)
    return torch.log_softmax(logits[0].float(), -1).cpu()


def compare(
    prompt: list[int],
    tokens: list[int],
    logprobs: list[dict] | None,
    ref_lp: torch.Tensor,
    *,
    margin: float,
    lp_tol: float,
    start: int = 0,
) -> dict:
    """One request: vLLM's greedy ``tokens`` (and its per-position ``{token: logprob}``) against
    the reference's log-softmax over ``prompt + tokens`` (teacher-forced), from token ``start``
    on. ``argmax_flips``: the tokens that are not the reference's argmax, ``flip_gaps`` the
    reference's top-2 gap there (a flip is a problem only where that gap is >= ``margin``)."""
    p = len(prompt)
    problems, diffs, flips, gaps = [], [], [], []
    for j, tok in enumerate(tokens):
        if j < start:
            continue
        lp = ref_lp[p - 1 + j]
        top2 = torch.topk(lp, 2)
        best, lead = int(top2.indices[0]), float(top2.values[0] - top2.values[1])
        if tok != best:
            flips.append(j)
            gaps.append(round(lead, 4))
            if lead >= margin:
                problems.append(
                    f"position {j}: vLLM chose {tok}, the reference's argmax {best} leads by "
                    f"{lead:.3f} nats (>= {margin})"
                )
        for t_str, v in (logprobs[j] if logprobs else {}).items():
            d = abs(float(v) - float(lp[int(t_str)]))
            diffs.append(d)
            if d > lp_tol:
                problems.append(f"position {j}: logprob of {t_str} differs by {d:.3f} > {lp_tol}")
    return {
        "positions": len(tokens),
        "argmax_flips": flips,
        "flip_gaps": gaps,
        "max_abs_lp_diff": max(diffs, default=0.0),
        "mean_abs_lp_diff": sum(diffs) / len(diffs) if diffs else 0.0,
        "problems": problems,
    }


@torch.no_grad()
def reference_greedy(target, prompt: list[int], n: int, kv_quant: str | None):
    """The reference's own greedy continuation and vLLM-shaped top-k logprobs (dry run)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logprobs(target, seq, kv_quant)[-1].argmax()))
    lp = reference_logprobs(target, seq, kv_quant)
    out = []
    for j in range(n):
        row = lp[len(prompt) - 1 + j]
        top = torch.topk(row, LOGPROBS)
        out.append({str(int(i)): float(v) for i, v in zip(top.indices, top.values, strict=True)})
    return seq[len(prompt) :], out


def self_test(target, margin: float, lp_tol: float) -> list[str]:
    """The comparison passes the reference's own output and flags a flipped confident token and
    logprobs shifted past the tolerance."""
    problems = []
    pr = prompts(lengths=(10,))[0]
    toks, lps = reference_greedy(target, pr, 4, "fp8_ds_mla")
    ref = reference_logprobs(target, pr + toks, "fp8_ds_mla")
    ok = compare(pr, toks, lps, ref, margin=margin, lp_tol=lp_tol)
    if ok["problems"]:
        problems.append(f"the reference's own output failed the comparison: {ok['problems']}")
    leads = [
        float(torch.topk(ref[len(pr) - 1 + j], 2).values.diff().neg()) for j in range(len(toks))
    ]
    j = max(range(len(toks)), key=lambda i: leads[i])
    flipped = list(toks)
    flipped[j] = int(torch.topk(ref[len(pr) - 1 + j], 2).indices[1])
    if (
        leads[j] >= margin
        and not compare(pr, flipped, None, ref, margin=margin, lp_tol=lp_tol)["problems"]
    ):
        problems.append("a flipped confident token passed the comparison")
    shifted = [{k: v + 2 * lp_tol for k, v in d.items()} for d in lps]
    if not compare(pr, toks, shifted, ref, margin=margin, lp_tol=lp_tol)["problems"]:
        problems.append("logprobs shifted by twice the tolerance passed the comparison")
    return problems


# -------------------------------------------------------------------------------- the engine
def run_vllm(
    model_dir: Path, waves, *, timeout_s: float, spec: bool = False, name: str = "dsv4-nospec"
) -> dict:
    from dspark_dev import tiny_mla_targets as t
    from dspark_dev.engine import child_env, run_engine
    from dspark_dev.serve import GPU_CHILD_ENV

    llm = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "max_model_len": 256,
        "max_num_seqs": 8,
        "seed": 0,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1,
        "kv_cache_memory_bytes": 256 << 20,
    }
    if spec:
        pair = t.TinyPair(str(model_dir), str(model_dir), "deepseek-v4")
        llm["speculative_config"] = pair.speculative_config(4)
    sampling = {"max_tokens": GEN_TOKENS, "logprobs": LOGPROBS}
    run = run_engine(
        {"name": name, "llm": llm, "waves": waves, "sampling": sampling},
        timeout_s=timeout_s,
        env=child_env(GPU_CHILD_ENV),
        name=name,
        own_cache=True,
    )
    if not run.ok:
        raise RuntimeError(
            f"[{name}] {'timed out' if run.timed_out else 'failed'} in phase {run.phase!r}: "
            f"{run.result.get('error', '')}\n{run.log_text[-4000:]}"
        )
    return run.result


K_SPEC = 4
CONF_TOL = 0.05  # confidence probabilities (first guess, reported)
# A routing margin (biased score of the last chosen expert minus the runner-up's) below this is a
# near-tie that bf16 may resolve the other way; measured at the three draft mismatches of the
# first GPU run: 0.0003, 0.0026, 0.003 (docs/dsv4-pure-torch.md, "First GPU run").
ROUTE_TIE = 0.02


def run_probe(model_dir: Path, prompts_: list[list[int]], *, timeout_s: float) -> dict:
    """The DSpark engine with the draft probe (``dsv4_draft_probe``) in a child with a deadline."""
    import subprocess
    import tempfile

    from dspark_dev.engine import child_env
    from dspark_dev.proc import run_with_timeout
    from dspark_dev.serve import GPU_CHILD_ENV

    tmp = Path(tempfile.mkdtemp(prefix="dsv4-probe-"))
    (tmp / "prompts.json").write_text(json.dumps(prompts_))
    out, log = tmp / "probe.json", tmp / "probe.log"
    cmd = [sys.executable, "-m", "dspark_dev.training.dsv4_draft_probe", str(model_dir)]
    cmd += [str(tmp / "prompts.json"), str(out), str(GEN_TOKENS), str(K_SPEC)]
    timed_out = False
    with open(log, "wb") as f:
        try:
            run_with_timeout(cmd, timeout=timeout_s, env=child_env(GPU_CHILD_ENV), stdout=f)
        except subprocess.TimeoutExpired:
            timed_out = True
    tail = log.read_text(errors="replace")[-4000:]
    res = json.loads(out.read_text()) if out.exists() else {}
    if timed_out or not res.get("ok"):
        why = "timed out" if timed_out else res.get("error", "no result written")
        raise RuntimeError(f"[dspark probe] {why}\n{res.get('traceback', '')}\n{tail}")
    return res


def _step_mismatches(step: M.DraftStep, rec: dict, *, margin: float, lp_tol: float):
    """(problems [(block position, text)], near-tie draft differences [text], base logprob
    diffs, confidence diffs) of our draft step against vLLM's record ``rec``; ``step`` must
    follow vLLM's chain (``prevs`` = the anchor and vLLM's drafts), so every position compares."""
    bad, ties, lp_d, conf_d = [], [], [], []
    for i, (v, m) in enumerate(zip(rec["draft"], step.drafts, strict=True)):
        if v != m:
            lead = step.leads[i]
            what = f"draft {i} is {v}, ours {m} leads by {lead:.3f} nats"
            (bad.append((i, what)) if lead >= margin else ties.append(what))
    for i, (tids, tlps) in enumerate(zip(rec["base_top_ids"], rec["base_top_lp"], strict=True)):
        for t, v in zip(tids, tlps, strict=True):
            d = abs(float(step.base_lp[i, t]) - v)
            lp_d.append(d)
            if d > lp_tol:
                bad.append((i, f"base logprob {i}/{t} differs by {d:.3f}"))
    if step.conf is not None:
        for i, c in enumerate(rec["conf"]):
            d = abs(float(step.conf[i]) - c)
            conf_d.append(d)
            if d > CONF_TOL:
                bad.append((i, f"confidence {i} differs by {d:.3f}"))
    return bad, ties, lp_d, conf_d


def judge_drafts(
    target,
    draft,
    prompts_,
    probe: dict,
    *,
    margin,
    lp_tol,
    flips=None,
    k=K_SPEC,
    route_tie=ROUTE_TIE,
) -> dict:
    """Every draft step vLLM took against ``TinyDSV4Draft.draft_greedy`` on the same verified
    tokens (fp8 key rounding on), our Markov chain fed vLLM's previous drafts so that every
    position compares: the anchor vLLM used is the token the request holds there; each draft
    equal to ours unless our lead after the Markov bias is below ``margin`` (a near-tie, noted);
    the base draft log-softmax at vLLM's top-5 within ``lp_tol``; confidences within
    ``CONF_TOL``. A step that fails is explained (a note, not a problem) only if one routing
    near-tie of the draft (margin < ``route_tie`` at one stage and block position) resolved the
    other way makes the whole step pass. ``flips``: per request the positions where the target
    token is not the reference's argmax; every problem and note says whether its anchor follows
    one, our top-2 lead there and the smallest routing margin at that position."""
    problems: list[str] = []
    notes: list[str] = []
    steps, equal, lp_diffs, conf_diffs, explained = 0, 0, [], [], 0
    for r, (pr, req) in enumerate(zip(prompts_, probe["requests"], strict=True)):
        seq = pr + req["tokens"]
        req_flips = [] if flips is None else flips[r]
        for s_i, rec in enumerate(req["records"]):
            a, anchor = rec["pos"][0], rec["ids"][0]
            after = [f for f in req_flips if f <= a]
            tag = f"prompt {r} draft step {s_i} (anchor position {a}"
            tag += f", after target flips at {after})" if after else ", no target flip before)"
            if a >= len(seq) or seq[a] != anchor:
                problems.append(f"{tag}: vLLM's anchor {anchor} is not the request's token there")
                continue
            prevs = [anchor] + list(rec["draft"][:-1])
            step = draft.draft_greedy(target, seq, a, k, "fp8_ds_mla", prevs=prevs)
            steps += 1
            bad, ties, lp_d, conf_d = _step_mismatches(step, rec, margin=margin, lp_tol=lp_tol)
            equal += sum(int(v == m) for v, m in zip(rec["draft"], step.drafts, strict=True))
            lp_diffs += lp_d
            conf_diffs += conf_d
            notes += [f"{tag}: near-tie {t}" for t in ties]
            if not bad:
                continue
            cands = sorted(
                (g, st, i)
                for st, row in enumerate(step.route_margins)
                for i, g in enumerate(row)
                if g < route_tie
            )
            for g, st, i in cands:
                alt = draft.draft_greedy(target, seq, a, k, "fp8_ds_mla", prevs=prevs, swap=(st, i))
                alt_bad, _, alt_lp, _ = _step_mismatches(alt, rec, margin=margin, lp_tol=lp_tol)
                if not alt_bad:
                    explained += 1
                    notes.append(
                        f"{tag}: {len(bad)} mismatches ({bad[0][1]}, ...) explained by a routing "
                        f"near-tie in draft stage {st} at block position {i} (margin {g:.4f}): "
                        f"with the runner-up expert every check passes (max base logprob diff "
                        f"{max(alt_lp, default=0.0):.3f})"
                    )
                    break
            else:
                for i, what in bad:
                    route = min(row[i] for row in step.route_margins)
                    problems.append(
                        f"{tag}: {what} (our top-2 lead {step.leads[i]:.3f} nats, smallest "
                        f"routing margin at block position {i}: {route:.4f})"
                    )
    if steps == 0:
        problems.append("the DSpark engine took no draft step")
    stats = {
        "draft_steps": steps,
        "drafts_equal": equal,
        "drafts_compared": steps * k,
        "steps_explained_by_a_routing_near_tie": explained,
        "max_abs_base_lp_diff": max(lp_diffs, default=0.0),
        "max_abs_conf_diff": max(conf_diffs, default=0.0),
    }
    return {"stats": stats, "problems": problems, "notes": notes}


def self_test_drafts(target, draft, margin: float, lp_tol: float) -> list[str]:
    """:func:`judge_drafts` on CPU: a probe made of our own drafts passes; a confident draft
    changed, a shifted base logprob and a wrong anchor are each flagged; a step computed with the
    draft's closest routing near-tie resolved the other way is explained when that margin is
    below ``ROUTE_TIE`` and flagged otherwise; a draft chain that departs at a near-tie still
    compares the later drafts and confidences (our chain follows vLLM's)."""
    pr = prompts(lengths=(9,))[0]
    toks, _ = reference_greedy(target, pr, 3, "fp8_ds_mla")
    seq = pr + toks
    a = len(pr)
    mine = draft.draft_greedy(target, seq, a, K_SPEC, "fp8_ds_mla")

    def record(step: M.DraftStep) -> dict:
        top = torch.topk(step.base_lp, LOGPROBS, dim=-1)
        return {
            "pos": list(range(a, a + K_SPEC)),
            "ids": [seq[a]] + [3] * (K_SPEC - 1),
            "draft": list(step.drafts),
            "base_top_ids": top.indices.tolist(),
            "base_top_lp": top.values.tolist(),
            "conf": [] if step.conf is None else step.conf.tolist(),
        }

    def judged(rec: dict, **kw) -> dict:
        probe = {"requests": [{"tokens": toks, "records": [rec]}]}
        return judge_drafts(target, draft, [pr], probe, margin=margin, lp_tol=lp_tol, **kw)

    rec = record(mine)
    problems = []
    if judged(rec)["problems"]:
        problems.append(f"judge_drafts flagged our own drafts: {judged(rec)['problems']}")
    bad_rec = dict(rec, draft=list(mine.drafts))
    bad_rec["draft"][0] = (mine.drafts[0] + 1) % 512
    if mine.leads[0] >= margin and not judged(bad_rec)["problems"]:
        problems.append("judge_drafts passed a changed confident draft")
    shifted = dict(rec, base_top_lp=[[v + 2 * lp_tol for v in row] for row in rec["base_top_lp"]])
    if not judged(shifted)["problems"]:
        problems.append("judge_drafts passed shifted base logprobs")
    wrong = dict(rec, ids=[(seq[a] + 1) % 512] + rec["ids"][1:])
    if not judged(wrong)["problems"]:
        problems.append("judge_drafts passed a wrong anchor")
    # vLLM's chain departs at draft 0 (say a near-tie went the other way) and continues on its
    # own drafts: judged on vLLM's chain, the later drafts and the confidences agree exactly (on
    # our own chain the Markov bias and the confidence of position 1 would see another token),
    # and a changed later confidence is still caught
    top2 = torch.topk(mine.base_lp[0], 2).indices.tolist()
    other = top2[0] if top2[0] != mine.drafts[0] else top2[1]
    prevs = [seq[a], other]
    while len(prevs) < K_SPEC:  # draft i depends on prevs[i] only
        pad = prevs + [0] * (K_SPEC - len(prevs))
        prevs.append(
            draft.draft_greedy(target, seq, a, K_SPEC, "fp8_ds_mla", prevs=pad).drafts[
                len(prevs) - 1
            ]
        )
    chained = draft.draft_greedy(target, seq, a, K_SPEC, "fp8_ds_mla", prevs=prevs)
    rec_c = record(chained)
    rec_c["draft"][0] = other
    res = judged(rec_c)
    later = [p for p in res["problems"] + res["notes"] if re.search(r"(draft|confidence) [1-9]", p)]
    if later or res["stats"]["max_abs_conf_diff"] > 1e-4:
        problems.append(
            f"drafts after a departed draft were judged on our own chain: {later}, max "
            f"confidence diff {res['stats']['max_abs_conf_diff']:.2e}"
        )
    bumped = dict(rec_c, conf=[c + 2 * CONF_TOL * (i == 2) for i, c in enumerate(rec_c["conf"])])
    if rec_c["conf"] and not any("confidence 2" in p for p in judged(bumped)["problems"]):
        problems.append("judge_drafts did not compare the confidence after a departed draft")
    # the step's closest routing near-tie resolved the other way: explained when its margin is
    # below the tie threshold, flagged when it is not
    g, st, i = min(
        (g, st, i) for st, row in enumerate(mine.route_margins) for i, g in enumerate(row)
    )
    flipped = record(draft.draft_greedy(target, seq, a, K_SPEC, "fp8_ds_mla", swap=(st, i)))
    if _step_mismatches(mine, flipped, margin=margin, lp_tol=lp_tol)[0]:
        res = judged(flipped, route_tie=2 * g + 1e-6)
        if res["problems"] or not res["notes"]:
            problems.append(f"a routing near-tie (margin {g:.4f}) was not explained: {res}")
        if not judged(flipped, route_tie=g / 2)["problems"]:
            problems.append(f"a routing change at margin {g:.4f} above the threshold was excused")
    else:
        problems.append(f"swapping the expert at margin {g:.4f} changed nothing: no control")
    return problems


def judge(target, prompts_, wave: dict, spec_wave: dict | None, *, margin, lp_tol) -> dict:
    """The verdict on one engine wave (``tokens``, ``logprobs``) and, optionally, the DSpark
    engine's wave: comparisons against the reference with and without the fp8 key rounding; the
    problems count only the rounded one (the cache vLLM really uses). DSpark tokens must equal
    the no-spec ones up to their first difference, which must be a near-tie of the reference
    there (both tokens within ``margin`` of its top logprob: the two engines' bf16 batch shapes
    differ, one token a step against a verify block); after it the sequences cannot be compared,
    and every DSpark token must instead be the reference's argmax on DSpark's own prefix
    (teacher-forced) wherever its top-2 gap is at least ``margin``. ``spec_flips``: per prompt
    the positions where a DSpark token is not the reference's argmax (for :func:`judge_drafts`)."""
    per = {}
    for kv_quant in ("fp8_ds_mla", None):
        rows = []
        for pr, toks, lps in zip(prompts_, wave["tokens"], wave["logprobs"], strict=True):
            ref = reference_logprobs(target, pr + toks, kv_quant)
            rows.append(compare(pr, toks, lps, ref, margin=margin, lp_tol=lp_tol))
        per[str(kv_quant)] = rows
    problems = [f"prompt {i}: {p}" for i, r in enumerate(per["fp8_ds_mla"]) for p in r["problems"]]
    out: dict = {"compare": per, "problems": problems, "notes": []}
    if spec_wave is None:
        return out
    spec_flips = []
    for i, (pr, a, b) in enumerate(zip(prompts_, wave["tokens"], spec_wave["tokens"], strict=True)):
        ref_b = reference_logprobs(target, pr + b, "fp8_ds_mla")
        own = compare(pr, b, None, ref_b, margin=margin, lp_tol=lp_tol)
        spec_flips.append([len(pr) + j for j in own["argmax_flips"]])
        if a == b:
            continue
        j = next((n for n in range(min(len(a), len(b))) if a[n] != b[n]), min(len(a), len(b)))
        if j >= min(len(a), len(b)):
            problems.append(f"prompt {i}: DSpark gave {len(b)} tokens, no-spec {len(a)}")
            continue
        row = ref_b[len(pr) - 1 + j]  # the common prefix: the same row as on no-spec's tokens
        top = float(row.max())
        lag = {t: top - float(row[t]) for t in (a[j], b[j])}
        tie = max(lag.values()) < margin
        what = (
            f"prompt {i}: DSpark and no-spec first differ at token {j} (position {len(pr) + j}): "
            f"no-spec {a[j]}, DSpark {b[j]}, below the reference's top logprob by "
            f"{lag[a[j]]:.3f} / {lag[b[j]]:.3f} nats"
        )
        if not tie:
            problems.append(f"{what} (not a near-tie; margin {margin})")
            continue
        out["notes"].append(f"{what}: a near-tie; DSpark's continuation judged on its own")
        after = compare(pr, b, None, ref_b, margin=margin, lp_tol=lp_tol, start=j + 1)
        problems += [f"prompt {i}: DSpark after the near-tie: {p}" for p in after["problems"]]
    out["spec_flips"] = spec_flips
    return out


def self_test_judge(target, margin: float, lp_tol: float) -> list[str]:
    """The GPU verdict (:func:`judge`) on CPU: an engine wave made of the reference's own greedy
    output passes; a DSpark wave with a confident token changed is flagged; a DSpark wave that
    takes the runner-up at the reference's closest near-tie and continues greedily passes with a
    note, and is flagged when it then takes a confident wrong token."""
    prs = prompts(lengths=(9, 14))
    toks, lps = zip(*(reference_greedy(target, p, 6, "fp8_ds_mla") for p in prs), strict=True)
    wave = {"tokens": [list(t) for t in toks], "logprobs": list(lps)}
    problems = []
    ok = judge(target, prs, wave, wave, margin=margin, lp_tol=lp_tol)
    if ok["problems"]:
        problems.append(f"judge flagged the reference's own output: {ok['problems']}")
    pr, t1 = prs[1], list(toks[1])
    ref = reference_logprobs(target, pr + t1, "fp8_ds_mla")
    top2 = [torch.topk(ref[len(pr) - 1 + j], 2) for j in range(len(t1))]
    gaps = [float(t.values[0] - t.values[1]) for t in top2]
    conf_j = max(range(len(t1)), key=lambda j: gaps[j])
    bad = {"tokens": [list(toks[0]), list(t1)]}
    bad["tokens"][1][conf_j] = int(top2[conf_j].indices[1])
    if (
        gaps[conf_j] >= margin
        and not judge(target, prs, wave, bad, margin=margin, lp_tol=lp_tol)["problems"]
    ):
        problems.append("judge passed DSpark tokens that differ from no-spec at a confident token")
    # DSpark takes the runner-up at the closest tie and then follows the reference greedily:
    # judged as a near-tie with the loosened margin, flagged with a margin below that gap
    tie_j = min(range(len(t1) - 1), key=lambda j: gaps[j])
    alt = t1[:tie_j] + [int(top2[tie_j].indices[1])]
    while len(alt) < len(t1):
        alt.append(int(reference_logprobs(target, pr + alt, "fp8_ds_mla")[-1].argmax()))
    diverged = {"tokens": [list(toks[0]), alt]}
    loose = gaps[tie_j] + 0.01
    res = judge(target, prs, wave, diverged, margin=max(margin, loose), lp_tol=lp_tol)
    if res["problems"] or not res["notes"]:
        problems.append(f"judge did not accept a divergence at a near-tie: {res['problems']}")
    if not judge(target, prs, wave, diverged, margin=gaps[tie_j] / 2, lp_tol=lp_tol)["problems"]:
        problems.append("judge accepted a divergence at a gap above the margin")
    # then a wrong token where the reference is most confident after the tie
    a_ref = reference_logprobs(target, pr + alt, "fp8_ds_mla")
    a_top = [torch.topk(a_ref[len(pr) - 1 + j], 2) for j in range(len(alt))]
    k = max(range(tie_j + 1, len(alt)), key=lambda j: float(a_top[j].values.diff().neg()))
    lead_k = float(a_top[k].values.diff().neg())
    after = alt[:k] + [int(a_top[k].indices[1])] + alt[k + 1 :]
    wrong = {"tokens": [list(toks[0]), after]}
    res = judge(target, prs, wave, wrong, margin=max(margin, loose), lp_tol=lp_tol)
    if lead_k < max(margin, loose):
        problems.append(f"no confident token after the near-tie (lead {lead_k:.3f}): no control")
    elif not res["problems"]:
        problems.append("judge passed a confident wrong DSpark token after a near-tie")
    return problems


def gpu_check(args, target, draft, model_dir: Path) -> dict:
    """Both engines at once (each its own process group and deadline), then the verdicts."""
    from concurrent.futures import ThreadPoolExecutor

    prs = prompts(args.seed)
    out: dict = {"problems": []}
    with ThreadPoolExecutor(2) as ex:
        futs = {"nospec": ex.submit(run_vllm, model_dir, [prs], timeout_s=args.timeout)}
        if args.spec:
            futs["spec"] = ex.submit(run_probe, model_dir, prs, timeout_s=args.timeout)
        results = {}
        for k, f in futs.items():
            try:
                results[k] = f.result()
            except Exception as e:  # noqa: BLE001 - the report says what broke
                out["problems"].append(f"engine {k}: {e}")
    if "nospec" in results:
        out["startup_s"] = results["nospec"].get("startup_s")
        spec_wave = None
        if "spec" in results:
            spec_wave = {"tokens": [r["tokens"] for r in results["spec"]["requests"]]}
        verdict = judge(
            target,
            prs,
            results["nospec"]["waves"][0],
            spec_wave,
            margin=args.margin,
            lp_tol=args.lp_tol,
        )
        out["compare"] = verdict["compare"]
        out["problems"] += verdict["problems"]
        out["notes"] = verdict["notes"]
        flips = verdict.get("spec_flips")
    else:
        flips = None
    if "spec" in results:
        drafts = judge_drafts(
            target,
            draft,
            prs,
            results["spec"],
            margin=args.margin,
            lp_tol=args.lp_tol,
            flips=flips,
        )
        out["drafts"] = drafts["stats"]
        out["problems"] += drafts["problems"]
        out["notes"] = out.get("notes", []) + drafts["notes"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/dsv4-check", help="where the model is exported")
    ap.add_argument("--report", default=None, help="report path (default <out>/dsv4_check.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU: export, load check, self test")
    ap.add_argument("--spec", action="store_true", help="also run the DSpark engine (k=4)")
    ap.add_argument("--timeout", type=float, default=240.0, help="per engine, seconds")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    ap.add_argument("--lp-tol", type=float, default=DEFAULT_LP_TOL)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    out = Path(args.out)
    device = "cuda" if (not args.dry_run and torch.cuda.is_available()) else "cpu"
    _, target, draft = build(args.seed, device)
    model_dir = export(out, target, draft)
    report: dict = {"model_dir": str(model_dir), "device": device, "problems": []}
    if args.dry_run:
        sd = M.vllm_checkpoint(target, draft)
        loads = load_problems(model_dir, sd)
        report["load_problems"] = loads
        report["problems"] += [f"{k}: {p}" for k, v in loads.items() for p in v]
        report["self_test"] = self_test(target, args.margin, args.lp_tol)
        report["self_test"] += self_test_judge(target, args.margin, args.lp_tol)
        report["self_test"] += self_test_drafts(target, draft, args.margin, args.lp_tol)
        report["problems"] += report["self_test"]
    else:
        gpu = gpu_check(args, target, draft, model_dir)
        report["problems"] += gpu.pop("problems")
        report.update(gpu)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["passed"] = not report["problems"]
    path = Path(args.report) if args.report else out / "dsv4_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
