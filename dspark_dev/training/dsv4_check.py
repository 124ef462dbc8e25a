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
   (k = 4, ``dsv4_draft_probe``) must emit the same tokens as the first (lossless), and every draft
   step it took must match ``TinyDSV4Draft.draft_greedy`` on the same verified tokens
   (``judge_drafts``; the random draft itself is not expected to be accepted).

``--dry-run`` (CPU): exports, loads the checkpoint into vLLM's CUDA model classes built on the CPU
(every parameter of the target and of the drafter must be filled, with the values the export
meant: ``load_problems``), runs the reference on short prompts and checks that the comparison
passes the reference's own greedy output and flags a flipped token and shifted logprobs, and that
the verdict (``judge``) flags DSpark tokens that differ from the no-spec ones, and that the draft
verdict (``judge_drafts``) passes our own drafts and flags a changed confident draft, shifted base
logprobs and a wrong anchor.
The report is printed and written to ``<out>/dsv4_check.json``; exit status 0 = passed.
"""

from __future__ import annotations

import argparse
import json
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
def vllm_layer_params(sd: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One decoder layer's vLLM parameters (prefix ``dst``) from the checkpoint tensors under
    ``src``: fused projections are concatenations, the routed experts stacked."""
    out: dict[str, torch.Tensor] = {}
    g = lambda k: sd[src + k]  # noqa: E731
    out[dst + "attn.fused_wqa_wkv.weight"] = torch.cat(
        [g("attn.wq_a.weight"), g("attn.wkv.weight")]
    )
    for k in ("attn.q_norm.weight", "attn.kv_norm.weight", "attn.wq_b.weight"):
        out[dst + k] = g(k)
    for k in ("attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink"):
        out[dst + k] = g(k)
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


def expected_vllm_params(sd: dict[str, torch.Tensor], *, drafter: bool, n_layers: int):
    """{vLLM parameter name: the value it must hold after load_weights}, written independently
    of vLLM's loader: fused projections are concatenations, the routed experts stacked."""
    out: dict[str, torch.Tensor] = {}

    def layer(src: str, dst: str) -> None:
        out.update(vllm_layer_params(sd, src, dst))

    if not drafter:
        out["model.embed_tokens.weight"] = sd["embed.weight"]
        out["lm_head.weight"] = sd["head.weight"]
        out["model.norm.weight"] = sd["norm.weight"]
        for p in ("fn", "base", "scale"):
            out[f"model.hc_head_{p}"] = sd[f"hc_head_{p}"]
        for i in range(n_layers):
            layer(f"layers.{i}.", f"model.layers.{i}.")
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

    sys.path.insert(0, str(REPO / "tests"))
    from support.tiny_dsv4_cpu import construct_on_cpu, engine_config
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
) -> dict:
    """One request: vLLM's greedy ``tokens`` (and its per-position ``{token: logprob}``) against
    the reference's log-softmax over ``prompt + tokens`` (teacher-forced)."""
    p = len(prompt)
    problems, diffs, flips = [], [], []
    for j, tok in enumerate(tokens):
        lp = ref_lp[p - 1 + j]
        top2 = torch.topk(lp, 2)
        best, lead = int(top2.indices[0]), float(top2.values[0] - top2.values[1])
        if tok != best:
            flips.append(j)
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


def judge_drafts(target, draft, prompts_, probe: dict, *, margin, lp_tol, k=K_SPEC) -> dict:
    """Every draft step vLLM took against ``TinyDSV4Draft.draft_greedy`` on the same verified
    tokens (fp8 key rounding on): the anchor vLLM used is the token the request holds there; the
    base draft log-softmax at vLLM's top-5 within ``lp_tol``; the drafts equal up to the first
    difference, which must be a near-tie (our lead after the Markov bias below ``margin``);
    confidences within ``CONF_TOL``."""
    problems: list[str] = []
    steps, agree, lp_diffs, conf_diffs = 0, 0, [], []
    for r, (pr, req) in enumerate(zip(prompts_, probe["requests"], strict=True)):
        seq = pr + req["tokens"]
        for s_i, rec in enumerate(req["records"]):
            a, anchor = rec["pos"][0], rec["ids"][0]
            tag = f"prompt {r} draft step {s_i} (anchor position {a})"
            if a >= len(seq) or seq[a] != anchor:
                problems.append(f"{tag}: vLLM's anchor {anchor} is not the request's token there")
                continue
            mine, base_lp, conf, leads = draft.draft_greedy(target, seq, a, k, "fp8_ds_mla")
            steps += 1
            for i in range(k):
                if mine[i] != rec["draft"][i]:
                    if leads[i] >= margin:
                        problems.append(
                            f"{tag}: draft {i} is {rec['draft'][i]}, ours {mine[i]} leads by "
                            f"{leads[i]:.3f} nats"
                        )
                    break
                agree += 1
            for i, (tids, tlps) in enumerate(
                zip(rec["base_top_ids"], rec["base_top_lp"], strict=True)
            ):
                for t, v in zip(tids, tlps, strict=True):
                    d = abs(float(base_lp[i, t]) - v)
                    lp_diffs.append(d)
                    if d > lp_tol:
                        problems.append(f"{tag}: base logprob {i}/{t} differs by {d:.3f}")
            if conf is not None:
                for i, c in enumerate(rec["conf"]):
                    d = abs(float(conf[i]) - c)
                    conf_diffs.append(d)
                    if d > CONF_TOL:
                        problems.append(f"{tag}: confidence {i} differs by {d:.3f}")
    if steps == 0:
        problems.append("the DSpark engine took no draft step")
    stats = {
        "draft_steps": steps,
        "drafts_agreeing_before_first_difference": agree,
        "drafts_compared": steps * k,
        "max_abs_base_lp_diff": max(lp_diffs, default=0.0),
        "max_abs_conf_diff": max(conf_diffs, default=0.0),
    }
    return {"stats": stats, "problems": problems}


def self_test_drafts(target, draft, margin: float, lp_tol: float) -> list[str]:
    """:func:`judge_drafts` on CPU: a probe made of our own drafts passes; a confident draft
    changed, a shifted base logprob and a wrong anchor are each flagged."""
    pr = prompts(lengths=(9,))[0]
    toks, _ = reference_greedy(target, pr, 3, "fp8_ds_mla")
    seq = pr + toks
    a = len(pr)
    mine, base_lp, conf, leads = draft.draft_greedy(target, seq, a, K_SPEC, "fp8_ds_mla")
    top = torch.topk(base_lp, LOGPROBS, dim=-1)
    rec = {
        "pos": list(range(a, a + K_SPEC)),
        "ids": [seq[a]] + [3] * (K_SPEC - 1),
        "draft": list(mine),
        "base_top_ids": top.indices.tolist(),
        "base_top_lp": top.values.tolist(),
        "conf": [] if conf is None else conf.tolist(),
    }
    probe = {"requests": [{"tokens": toks, "records": [rec]}]}
    problems = []
    ok = judge_drafts(target, draft, [pr], probe, margin=margin, lp_tol=lp_tol)
    if ok["problems"]:
        problems.append(f"judge_drafts flagged our own drafts: {ok['problems']}")
    bad_rec = dict(rec, draft=list(mine))
    bad_rec["draft"][0] = (mine[0] + 1) % 512
    bad = {"requests": [{"tokens": toks, "records": [bad_rec]}]}
    if (
        leads[0] >= margin
        and not judge_drafts(target, draft, [pr], bad, margin=margin, lp_tol=lp_tol)["problems"]
    ):
        problems.append("judge_drafts passed a changed confident draft")
    shifted = dict(rec, base_top_lp=[[v + 2 * lp_tol for v in row] for row in rec["base_top_lp"]])
    bad = {"requests": [{"tokens": toks, "records": [shifted]}]}
    if not judge_drafts(target, draft, [pr], bad, margin=margin, lp_tol=lp_tol)["problems"]:
        problems.append("judge_drafts passed shifted base logprobs")
    wrong = dict(rec, ids=[(seq[a] + 1) % 512] + rec["ids"][1:])
    bad = {"requests": [{"tokens": toks, "records": [wrong]}]}
    if not judge_drafts(target, draft, [pr], bad, margin=margin, lp_tol=lp_tol)["problems"]:
        problems.append("judge_drafts passed a wrong anchor")
    return problems


def judge(target, prompts_, wave: dict, spec_wave: dict | None, *, margin, lp_tol) -> dict:
    """The verdict on one engine wave (``tokens``, ``logprobs``) and, optionally, the DSpark
    engine's wave: comparisons against the reference with and without the fp8 key rounding; the
    problems count only the rounded one (the cache vLLM really uses) and DSpark tokens that differ
    from the no-spec ones."""
    per = {}
    for kv_quant in ("fp8_ds_mla", None):
        rows = []
        for pr, toks, lps in zip(prompts_, wave["tokens"], wave["logprobs"], strict=True):
            ref = reference_logprobs(target, pr + toks, kv_quant)
            rows.append(compare(pr, toks, lps, ref, margin=margin, lp_tol=lp_tol))
        per[str(kv_quant)] = rows
    problems = [f"prompt {i}: {p}" for i, r in enumerate(per["fp8_ds_mla"]) for p in r["problems"]]
    if spec_wave is not None:
        for i, (a, b) in enumerate(zip(wave["tokens"], spec_wave["tokens"], strict=True)):
            if a != b:
                problems.append(f"prompt {i}: DSpark tokens differ from no-spec: {a} vs {b}")
    return {"compare": per, "problems": problems}


def self_test_judge(target, margin: float, lp_tol: float) -> list[str]:
    """The GPU verdict (:func:`judge`) on CPU: an engine wave made of the reference's own greedy
    output passes; a DSpark wave with one token changed is flagged."""
    prs = prompts(lengths=(9, 14))
    toks, lps = zip(*(reference_greedy(target, p, 3, "fp8_ds_mla") for p in prs), strict=True)
    wave = {"tokens": [list(t) for t in toks], "logprobs": list(lps)}
    problems = []
    ok = judge(target, prs, wave, wave, margin=margin, lp_tol=lp_tol)
    if ok["problems"]:
        problems.append(f"judge flagged the reference's own output: {ok['problems']}")
    bad = {"tokens": [list(t) for t in toks]}
    bad["tokens"][1][2] = (bad["tokens"][1][2] + 1) % 512
    if not judge(target, prs, wave, bad, margin=margin, lp_tol=lp_tol)["problems"]:
        problems.append("judge passed DSpark tokens that differ from no-spec")
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
    if "spec" in results:
        drafts = judge_drafts(
            target, draft, prs, results["spec"], margin=args.margin, lp_tol=args.lp_tol
        )
        out["drafts"] = drafts["stats"]
        out["problems"] += drafts["problems"]
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
