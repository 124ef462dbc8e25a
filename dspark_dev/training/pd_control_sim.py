"""Estimate, on CPU, what the GPU group's subtle PD control does to a trained Kimi-K3 pair's
acceptance (issue 26 item 2; tests/gpu/test_dsv4_k3_engine.py, ``support.draft_controls``).

The control gives the prefill-only producer a draft whose context projection reads one aux layer
at ``scale`` times its weight (or, ``--perturb``, another change of the projection's aux
blocks); the decoder keeps the real draft. So the draft context of the
prompt positions comes from the perturbed projection and every later position's from the real one.
This replays that with the training modules (``export.load_k3_pair``) in the greedy DSpark loop of
``train_tiny_pair.simulate_acceptance`` (the target's own greedy continuation; a step with k
accepted drafts moves the anchor by k + 1): acceptance with the real context everywhere, with the
prompt's context perturbed (the PD control), and with every position's perturbed (an upper bound).
Teacher-forced float32 on CPU, not vLLM's bf16 engine: an estimate of the effect's size, for
choosing the control's strength, not a measurement.

    python3 -m dspark_dev.training.pd_control_sim --pair models/k3-pair --prompts 15
"""

from __future__ import annotations

import argparse
import json

import torch


def perturbed_weight(w: torch.Tensor, n_aux: int, perturb: str) -> torch.Tensor:
    """The context projection ``w`` ([hidden, n_aux * hidden]) under ``perturb``:
    ``scale:J:S`` (aux block J times S) or ``swap:I:J`` (aux blocks I and J exchanged, i.e. the
    taps read in the wrong order)."""
    w = w.detach().clone()
    if w.dim() != 2 or w.shape[1] % n_aux:
        raise ValueError(f"weight {tuple(w.shape)}: columns are not {n_aux} aux blocks")
    width = w.shape[1] // n_aux
    kind, a, b = perturb.split(":")
    blk = lambda j: slice(j * width, (j + 1) * width)  # noqa: E731
    if kind == "scale":  # a power of two keeps bf16 weights exact
        w[:, blk(range(n_aux)[int(a)])] *= torch.tensor(float(b), dtype=w.dtype)
    elif kind == "swap":
        i, j = range(n_aux)[int(a)], range(n_aux)[int(b)]
        wi = w[:, blk(i)].clone()
        w[:, blk(i)] = w[:, blk(j)]
        w[:, blk(j)] = wi
    else:
        raise ValueError(f"perturbation {perturb!r}: scale:J:S or swap:I:J")
    return w


def _perturbed_context(draft, aux: list[torch.Tensor], perturb: str):
    w = perturbed_weight(draft.context_proj.weight, len(aux), perturb)
    return draft.context_norm(torch.nn.functional.linear(torch.cat(aux, dim=-1), w))


@torch.no_grad()
def simulate(target, draft, prompts, gens, ctx_mode: str, perturb: str = "") -> dict:
    """Greedy DSpark acceptance over ``prompts`` with their target continuations ``gens``;
    ``ctx_mode``: "real", "prompt" (positions before the first generated token perturbed) or
    "all"."""
    from dspark_dev.training.tokenizer import EOS_ID, PAD_ID

    N = draft.dcfg.block_size
    accepted_at, steps, total = [0] * N, 0, 0
    for prompt, gen in zip(prompts, gens, strict=True):
        seq = prompt + gen + [EOS_ID]
        P, L = len(prompt), len(seq)
        ids = torch.tensor([seq + [PAD_ID] * (N + 1)])
        _, _, aux = target(ids, draft.aux_layer_ids)
        ctx = draft.context(aux)
        if ctx_mode != "real":
            bad = _perturbed_context(draft, aux, perturb)
            upto = P if ctx_mode == "prompt" else ctx.shape[1]
            ctx = torch.cat([bad[:, :upto], ctx[:, upto:]], dim=1)
        anchors = torch.arange(P, L - 1).view(1, -1)
        if anchors.numel() == 0:
            continue
        _, _, hidden = draft(ids, ctx, anchors, target.lm_head_weight)
        base = hidden[0].float() @ target.lm_head_weight.float().t()
        prev = ids[0, anchors[0]]
        drafts = []
        for i in range(N):
            tok = (base[:, i] + draft.markov_w2(draft.markov_w1(prev)).float()).argmax(-1)
            drafts.append(tok)
            prev = tok
        drafts = torch.stack(drafts, 1).tolist()
        a = P
        while a < L - 1:
            d = drafts[a - P]
            k = 0
            while k < N and a + k + 1 < L and d[k] == seq[a + k + 1]:
                k += 1
            for i in range(k):
                accepted_at[i] += 1
            steps += 1
            total += k + 1
            a += k + 1
    return {
        "acceptance_pct": round(100.0 * sum(accepted_at) / max(1, steps * N), 2),
        "acceptance_length": round(total / max(1, steps), 3),
        "per_position": [round(c / max(1, steps), 3) for c in accepted_at],
        "steps": steps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="models/k3-pair", help="a write_k3_pair directory")
    ap.add_argument("--prompts", type=int, default=15, help="first N held-out prompts")
    ap.add_argument(
        "--first", type=int, default=0, help="skip this many (8: the GPU PD wave, prompts 8-14)"
    )
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument(
        "--perturb",
        default="scale:-1:0.5",
        help="comma-separated: scale:J:S (aux block J times S), swap:I:J (blocks exchanged)",
    )
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)

    from dspark_dev.training import corpus
    from dspark_dev.training.export import load_k3_pair
    from dspark_dev.training.tokenizer import PurePythonBPE
    from dspark_dev.training.train_tiny_pair import greedy_generate

    torch.manual_seed(0)
    target, draft = load_k3_pair(args.pair)
    target.eval()
    draft.eval()
    tok = PurePythonBPE(f"{args.pair}/k3-target/tokenizer.json")
    probs = corpus.heldout_problems(max(args.prompts, corpus.DEFAULT_HELDOUT_SIZE))
    chosen = probs[args.first : args.first + args.prompts]
    prompts = [tok.encode(corpus.format_prompt(p.question)) for p in chosen]
    gens = [greedy_generate(target, p, args.max_new, "cpu") for p in prompts]
    out = {"pair": args.pair, "prompts": len(prompts), "first": args.first}
    out["real"] = simulate(target, draft, prompts, gens, "real")
    for p in args.perturb.split(","):
        for mode in ("prompt", "all"):
            out[f"{mode} {p}"] = simulate(target, draft, prompts, gens, mode, p)
            print(mode, p, out[f"{mode} {p}"]["acceptance_pct"], flush=True)
    print(json.dumps(out, indent=1))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
