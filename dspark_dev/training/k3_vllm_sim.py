"""Greedy DSpark (k = block size, 7) acceptance of a tiny Kimi-K3 pair computed with vLLM 0.34.0's
own Kimi-K3 layers on CPU (float32; ``k3_vllm_layers``), beside the training modules' simulation.

    python -m dspark_dev.training.k3_vllm_sim PAIR --num-prompts 4 --out-json /tmp/k3sim.json

On the held-out prompts ``train_tiny_pair`` and ``benchmarks/tiny_pair_acceptance.py`` use (the
first ``--num-prompts`` of the seeded held-out set), per prompt:

1. the target's greedy continuation (up to ``--max-new`` tokens, stopping at EOS) under vLLM's
   layers: generated with the training modules (faster: no Triton interpreter), then checked with
   one teacher-forced forward of vLLM's target, whose argmax must give every generated token (and
   the EOS, when the generation stopped at one). At the first position where it does not, vLLM's
   token is taken, the training modules continue from there, and the check repeats, so the
   continuation is vLLM's greedy one; each such divergence is reported with both top-2 gaps.
2. for every anchor (the first generated token up to the one before the last token), the drafter's
   block through vLLM's layers on vLLM's target context, then vLLM's Markov head run sequentially
   over the block (``greedy_dspark.markov_chain``), then the anchor walk
   (``greedy_dspark.anchor_walk``), shared with ``train_tiny_pair.simulate_acceptance``.

The training modules' own simulation runs beside it (``simulate_acceptance``'s result on the same
prompts), and their drafts on vLLM's continuation give the fraction of equal draft tokens and the
max |difference| of the drafter's base logits (the target's logits likewise).

What this is not: vLLM's engine (no paged KV or Mamba-state cache, no scheduler, no attention
backend kernels, no CUDA graphs), and not bfloat16: it shows that vLLM's Kimi-K3 layers, loaded
from the exported checkpoint, compute the acceptance the training simulation claims. The served
number is the GPU benchmark's (docs/tiny-pair.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from dspark_dev.training import corpus
from dspark_dev.training.greedy_dspark import anchor_walk, markov_chain, summarize
from dspark_dev.training.tokenizer import EOS_ID


def log(msg: str) -> None:
    print(f"[k3-vllm-sim {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def heldout_prompt_ids(pair: str, n: int) -> list[list[int]]:
    """The first ``n`` held-out prompts (the held-out set size the pair was trained with)."""
    from dspark_dev.training.export import K3_DRAFT_DIR, K3_TARGET_DIR
    from dspark_dev.training.tokenizer import PurePythonBPE

    with open(os.path.join(pair, K3_DRAFT_DIR, "training.json")) as f:
        size = json.load(f).get("args", {}).get("heldout_docs", corpus.DEFAULT_HELDOUT_SIZE)
    bpe = PurePythonBPE(os.path.join(pair, K3_TARGET_DIR, "tokenizer.json"))
    probs = corpus.heldout_problems(max(n, size))[:n]
    return [bpe.encode(corpus.format_prompt(p.question)) for p in probs]


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def vllm_greedy(vp, target, prompt: list[int], gen: list[int], max_new: int, device):
    """vLLM's greedy continuation of ``prompt``, starting from the training modules' ``gen``
    (see the module docstring). Returns (gen, vLLM logits [L,V] and aux of the final sequence,
    divergences)."""
    from dspark_dev.training.train_tiny_pair import greedy_generate

    P = len(prompt)
    divergences = []
    while True:
        seq = prompt + gen + [EOS_ID]
        logits, aux = vp.target_forward(torch.tensor(seq))
        greedy = logits.argmax(-1).tolist()
        # the last position's EOS is the model's token only when the generation stopped at it
        last = len(seq) - 1 if len(gen) < max_new else len(seq) - 2
        bad = next((t for t in range(P - 1, last) if greedy[t] != seq[t + 1]), None)
        if bad is None:
            return gen, logits, aux, divergences
        tr_logits, _, _ = target(torch.tensor([seq[: bad + 1]], device=device))
        divergences.append(
            {
                "position": bad - P + 1,
                "training_token": seq[bad + 1],
                "vllm_token": greedy[bad],
                "vllm_top2_gap": top2_gap(logits[bad]),
                "training_top2_gap": top2_gap(tr_logits[0, -1]),
            }
        )
        gen = gen[: bad - P + 1]
        if greedy[bad] == EOS_ID:
            continue  # re-checked with the shorter sequence (a no-op check then)
        gen = gen + [greedy[bad]]
        gen = gen + greedy_generate(target, prompt + gen, max_new - len(gen), device)


def vllm_drafts(vp, ctx: torch.Tensor, seq: list[int], prompt_len: int):
    """vLLM's greedy drafts for every anchor of ``seq``: (drafts [A][N], base logits [A,N,V])."""
    ids = torch.tensor(seq)
    anchors = range(prompt_len, len(seq) - 1)
    if not anchors:
        return [], None
    base = torch.stack([vp.draft_block(ctx, ids, a)[0] for a in anchors])
    return markov_chain(base.float(), ids[prompt_len : len(seq) - 1], vp.markov_bias), base


def run(args) -> dict:
    from dspark_dev.training.export import K3_DRAFT_DIR, load_k3_pair
    from dspark_dev.training.k3_vllm_layers import K3VllmPair
    from dspark_dev.training.train_tiny_pair import greedy_generate, training_drafts

    t_start = time.time()
    device = torch.device("cpu")
    target, draft = load_k3_pair(args.pair)  # float32 from the bfloat16 checkpoint
    target.eval()
    draft.eval()
    vp = K3VllmPair(args.pair, num_speculative_tokens=draft.dcfg.block_size)
    if vp.unloaded_target or vp.unloaded_draft:
        raise RuntimeError(f"vLLM left unloaded: {vp.unloaded_target} {vp.unloaded_draft}")
    N = vp.block_size
    prompts = heldout_prompt_ids(args.pair, args.num_prompts)
    log(f"{len(prompts)} prompts, k={N}, max_new {args.max_new}; models built")
    walks_v, walks_t, per_prompt, divergences, draft_diffs = [], [], [], [], []
    n_equal_greedy = n_draft_equal = n_draft = 0
    max_target_diff = max_draft_diff = 0.0
    deadline = t_start + 60 * args.minutes
    with vp.running():
        for pi, prompt in enumerate(prompts):
            if time.time() > deadline:
                log(f"time cap reached: {pi} of {len(prompts)} prompts done")
                break
            t0 = time.time()
            P = len(prompt)
            gen_t = greedy_generate(target, prompt, args.max_new, device)
            gen_v, v_logits, v_aux, divs = vllm_greedy(
                vp, target, prompt, gen_t, args.max_new, device
            )
            divergences += [{"prompt": pi, **d} for d in divs]
            n_equal_greedy += gen_v == gen_t
            seq_t, seq_v = prompt + gen_t + [EOS_ID], prompt + gen_v + [EOS_ID]
            tr_logits, _, _ = target(torch.tensor([seq_v]))
            max_target_diff = max(max_target_diff, float((v_logits - tr_logits[0]).abs().max()))
            d_v, base_v = vllm_drafts(vp, vp.context(v_aux), seq_v, P)
            d_t, base_t = training_drafts(draft, target, seq_v, P, device)
            ks_v = anchor_walk(seq_v, P, d_v)
            if seq_t == seq_v:
                ks_t = anchor_walk(seq_t, P, d_t)
            else:  # the training modules' own simulation runs on their own continuation
                ks_t = anchor_walk(seq_t, P, training_drafts(draft, target, seq_t, P, device)[0])
            walks_v.append(ks_v)
            walks_t.append(ks_t)
            if base_v is not None:
                max_draft_diff = max(max_draft_diff, float((base_v - base_t).abs().max()))
            for a, (row_v, row_t) in enumerate(zip(d_v, d_t, strict=True)):
                for i, (x, y) in enumerate(zip(row_v, row_t, strict=True)):
                    n_draft += 1
                    n_draft_equal += x == y
                    if x != y and len(draft_diffs) < 50:
                        prev = seq_v[P + a] if i == 0 else row_v[i - 1]
                        lg = base_v[a, i] + vp.markov_bias(torch.tensor([prev]))[0]
                        draft_diffs.append(
                            {
                                "prompt": pi,
                                "anchor": a,
                                "position": i,
                                "vllm_top2_gap": top2_gap(lg),
                            }
                        )
            per_prompt.append(
                {
                    "prompt_tokens": P,
                    "generated_tokens": len(gen_v),
                    "greedy_equal": gen_v == gen_t,
                    "accepted_per_step_vllm_layers": ks_v,
                    "accepted_per_step_training": ks_t,
                    "seconds": round(time.time() - t0, 1),
                }
            )
            al_v, _, steps_v = summarize(walks_v, N)
            al_t, _, _ = summarize(walks_t, N)
            log(
                f"prompt {pi + 1}/{len(prompts)}: {P}+{len(gen_v)} tokens, {len(ks_v)} steps "
                f"(training {len(ks_t)}); running AL vLLM layers {al_v:.3f} / training "
                f"{al_t:.3f} over {steps_v} steps; {time.time() - t0:.1f}s"
            )
    al_v, pp_v, steps_v = summarize(walks_v, N)
    al_t, pp_t, steps_t = summarize(walks_t, N)
    done = len(per_prompt)
    with open(os.path.join(args.pair, K3_DRAFT_DIR, "training.json")) as f:
        trained = json.load(f)
    rep = {
        "pair": os.path.abspath(args.pair),
        "what": "greedy DSpark k=7 computed with vLLM 0.34.0's Kimi-K3 layers on CPU, float32 "
        "(no engine: no paged KV, no scheduler, no bf16); see k3_vllm_sim's docstring",
        "num_prompts": done,
        "max_new": args.max_new,
        "block_size": N,
        "vllm_layers": {
            "mean_acceptance_length": al_v,
            "per_position_acceptance": pp_v,
            "steps": steps_v,
        },
        "training_modules": {
            "mean_acceptance_length": al_t,
            "per_position_acceptance": pp_t,
            "steps": steps_t,
        },
        "training_json": {
            k: trained.get(k)
            for k in (
                "simulated_mean_acceptance_length",
                "simulated_per_position_acceptance",
                "simulated_steps",
                "simulated_prompts",
            )
        },
        "greedy_equal": f"{n_equal_greedy}/{done}",
        "greedy_divergences": divergences,
        "draft_tokens_equal": n_draft_equal / max(1, n_draft),
        "draft_tokens_compared": n_draft,
        "draft_token_differences": draft_diffs,
        "max_abs_target_logit_diff": max_target_diff,
        "max_abs_draft_base_logit_diff": max_draft_diff,
        "wall_s": round(time.time() - t_start, 1),
        "per_prompt": per_prompt,
    }
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair", help="a train_tiny_pair --family k3 output (k3-target/, k3-dspark/)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new", type=int, default=64, help="as train_tiny_pair's simulation")
    p.add_argument(
        "--minutes", type=float, default=60.0, help="start no new prompt after this (wall time)"
    )
    p.add_argument("--out-json", required=True)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rep = run(args)
    with open(args.out_json, "w") as f:
        json.dump(rep, f, indent=2)
    summary = {k: v for k, v in rep.items() if k not in ("per_prompt", "draft_token_differences")}
    log(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
