"""Estimate, on CPU, what the GPU group's subtle PD control does to a trained Kimi-K3 or
DeepSeek-V4 pair's acceptance (issue 26 item 2; tests/gpu/test_dsv4_k3_engine.py,
``support.draft_controls``).

The control gives the prefill-only producer a draft whose context projection has its aux column
blocks changed by ``--perturb`` (by default in the GPU test: the first and last aux taps
exchanged; Kimi-K3's ``context_proj``, DeepSeek-V4's ``mtp.0.main_proj``); the decoder keeps the
real draft. So the draft context of the prompt positions comes from the perturbed projection and
every later position's from the real one. This replays that with the training modules
(``export.load_k3_pair`` / ``dsv4_train.load_dsv4_pair``, the family from the pair's layout or
``--family``) through ``train_tiny_pair.training_drafts`` and ``greedy_dspark``'s anchor walk (the
target's own greedy continuation; a step with k accepted drafts moves the anchor by k + 1):
acceptance with the real context everywhere, with the prompt's context perturbed (the PD control),
and with every position's perturbed (an upper bound). Teacher-forced float32 on CPU, not vLLM's
bf16 engine: an estimate of the effect's size, for choosing the control's strength, not a
measurement. The GPU PD wave is held-out prompts 8-14 (``--first 8 --prompts 7``):

    python3 -m dspark_dev.training.pd_control_sim --pair models/k3-pair --first 8 --prompts 7
    python3 -m dspark_dev.training.pd_control_sim --pair models/dsv4-pair --first 8 --prompts 7 \
        --perturb swap:0:-1
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


def context_parts(draft) -> tuple[torch.nn.Linear, torch.nn.Module]:
    """(projection ``concat(aux) -> hidden``, the norm after it) of a training draft: Kimi-K3's
    ``context_proj`` / ``context_norm``, DeepSeek-V4's ``main_proj`` / ``main_norm`` (the
    checkpoint's ``mtp.0.main_proj.weight``, the tensor ``draft_controls`` perturbs)."""
    if hasattr(draft, "context_proj"):
        return draft.context_proj, draft.context_norm
    return draft.core.main_proj, draft.core.main_norm


def perturbed_context(draft, aux: list[torch.Tensor], perturb: str) -> torch.Tensor:
    proj, norm = context_parts(draft)
    w = perturbed_weight(proj.weight, len(aux), perturb)
    return norm(torch.nn.functional.linear(torch.cat(aux, dim=-1), w))


@torch.no_grad()
def simulate(target, draft, prompts, gens, ctx_mode: str, perturb: str = "") -> dict:
    """Greedy DSpark acceptance (``greedy_dspark`` through ``train_tiny_pair.training_drafts``)
    over ``prompts`` with their target continuations ``gens``; ``ctx_mode``: "real", "prompt"
    (positions before the first generated token perturbed) or "all"."""
    from dspark_dev.training.greedy_dspark import anchor_walk, summarize
    from dspark_dev.training.tokenizer import EOS_ID
    from dspark_dev.training.train_tiny_pair import training_drafts

    def context(prompt_len: int):
        def ctx_of(aux):
            ctx = draft.context(aux)
            if ctx_mode == "real":
                return ctx
            bad = perturbed_context(draft, aux, perturb)
            upto = prompt_len if ctx_mode == "prompt" else ctx.shape[1]
            return torch.cat([bad[:, :upto], ctx[:, upto:]], dim=1)

        return ctx_of

    walks = []
    for prompt, gen in zip(prompts, gens, strict=True):
        seq = prompt + gen + [EOS_ID]
        drafts, _ = training_drafts(draft, target, seq, len(prompt), "cpu", context(len(prompt)))
        walks.append(anchor_walk(seq, len(prompt), drafts))
    N = draft.dcfg.block_size
    mean_len, per_pos, steps = summarize(walks, N)
    return {
        "acceptance_pct": round(100.0 * sum(per_pos) / N, 2),
        "acceptance_length": round(mean_len, 3),
        "per_position": [round(r, 3) for r in per_pos],
        "steps": steps,
    }


def load_pair(pair: str, family: str | None = None):
    """(family, target, draft, tokenizer.json) of a bundled pair directory: ``k3`` (a
    ``write_k3_pair`` one: k3-target/, k3-dspark/) or ``dsv4`` (``write_dsv4_pair``: dsv4/);
    ``family`` None detects it from the layout."""
    import os

    from dspark_dev.training.dsv4_train import DSV4_DIR, load_dsv4_pair
    from dspark_dev.training.export import K3_TARGET_DIR, load_k3_pair

    if family is None:
        family = "dsv4" if os.path.isdir(os.path.join(pair, DSV4_DIR)) else "k3"
    if family == "dsv4":
        target, draft = load_dsv4_pair(pair)
        tok = os.path.join(pair, DSV4_DIR, "tokenizer.json")
    elif family == "k3":
        target, draft = load_k3_pair(pair)
        tok = os.path.join(pair, K3_TARGET_DIR, "tokenizer.json")
    else:
        raise ValueError(f"family {family!r}: k3 or dsv4")
    return family, target, draft, tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pair", default="models/k3-pair", help="a write_k3_pair or write_dsv4_pair directory"
    )
    ap.add_argument(
        "--family", choices=["k3", "dsv4"], default=None, help="default: from the pair's layout"
    )
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
    from dspark_dev.training.tokenizer import PurePythonBPE
    from dspark_dev.training.train_tiny_pair import greedy_generate

    torch.manual_seed(0)
    family, target, draft, tok_json = load_pair(args.pair, args.family)
    target.eval()
    draft.eval()
    tok = PurePythonBPE(tok_json)
    probs = corpus.heldout_problems(max(args.prompts, corpus.DEFAULT_HELDOUT_SIZE))
    chosen = probs[args.first : args.first + args.prompts]
    prompts = [tok.encode(corpus.format_prompt(p.question)) for p in chosen]
    gens = [greedy_generate(target, p, args.max_new, "cpu") for p in prompts]
    out = {"pair": args.pair, "family": family, "prompts": len(prompts), "first": args.first}
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
