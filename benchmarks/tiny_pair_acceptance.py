"""Acceptance of the tiny pair under vLLM: greedy DSpark (k=7) on held-out prompts.

Runs vLLM twice in subprocesses with hard timeouts: once without speculation, once with the DSpark
drafter, on the first ``--num-prompts`` held-out prompts of the seeded corpus. Reports the mean
acceptance length as vLLM's spec-decode metrics count it (1 + accepted draft tokens per draft step,
i.e. the bonus token included), the per-position acceptance rates, whether the speculative outputs
equal the non-speculative ones token for token (lossless check), the answer accuracy and the wall
times. CPU:

    VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=
    VLLM_CPU_OMP_THREADS_BIND=nobind \\
    PYTHONPATH=. python benchmarks/tiny_pair_acceptance.py --out-json /tmp/acc.json

GPU: the same without the CPU variables (``--dtype`` defaults to float32 either way).

``--family k3`` measures the Kimi-K3 pair (``<pair>/k3-target`` + ``<pair>/k3-dspark``, written by
``train_tiny_pair --family k3``; GPU only: vLLM 0.34.0's CPU engine cannot serve Kimi-K3, see
tests/unit/training/test_k3_equivalence.py), in bfloat16 unless ``--dtype`` says otherwise.
``--compare-training`` also runs the pure-torch training modules (float32) on the same prompts:
their greedy tokens against vLLM's no-speculation tokens, and their simulated greedy DSpark
acceptance (``train_tiny_pair.simulate_acceptance``) beside vLLM's.

Lossless check: float32 (the Qwen3 default) must give identical outputs. In bfloat16 the
no-speculation run also returns its top-2 logprobs and the check is the GPU parity rule
(``dspark_dev.parity``: identical tokens except at a proven near-tie, each first difference
reported with its top-2 gap); the exit status is 1 for any difference the rule does not excuse.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PAIR = os.path.join(REPO, "models", "tiny-pair")


def _prompts(n: int):
    from dspark_dev.training import corpus

    probs = corpus.heldout_problems(max(n, corpus.DEFAULT_HELDOUT_SIZE))[:n]
    return [corpus.format_prompt(p.question) for p in probs], [p.value for p in probs]


def answer_value(text: str):
    if "####" not in text:
        return None
    tail = text.split("####")[-1].strip().split()
    try:
        return int(tail[0].replace(",", "")) if tail else None
    except ValueError:
        return None


def _dirs(args) -> tuple[str, str]:
    if args.family == "dsv4":  # one checkpoint: target + mtp.<i>.* drafter
        from dspark_dev.training.dsv4_train import DSV4_DIR

        return os.path.join(args.pair, DSV4_DIR), os.path.join(args.pair, DSV4_DIR)
    if args.family == "k3":
        from dspark_dev.training.export import K3_DRAFT_DIR, K3_TARGET_DIR

        return os.path.join(args.pair, K3_TARGET_DIR), os.path.join(args.pair, K3_DRAFT_DIR)
    return os.path.join(args.pair, "target"), os.path.join(args.pair, "dspark-draft")


def compare_training(args, prompts: list[str], base_tokens: list[list[int]]) -> dict:
    """The training modules (float32, on CUDA when present) on the same prompts."""
    import torch

    from dspark_dev.training.dsv4_train import load_dsv4_pair
    from dspark_dev.training.export import load_k3_pair, load_pair
    from dspark_dev.training.tokenizer import EOS_ID, PurePythonBPE
    from dspark_dev.training.train_tiny_pair import greedy_generate, simulate_acceptance

    target_dir, _ = _dirs(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = {"k3": load_k3_pair, "dsv4": load_dsv4_pair}.get(args.family, load_pair)
    target, draft = loader(args.pair)
    target.to(device).eval()
    draft.to(device).eval()
    bpe = PurePythonBPE(os.path.join(target_dir, "tokenizer.json"))
    ids = [bpe.encode(p) for p in prompts]
    same = sum(
        greedy_generate(target, p, args.max_tokens, device) == [t for t in b if t != EOS_ID]
        for p, b in zip(ids, base_tokens, strict=True)
    )
    mean_len, per_pos, steps, _ = simulate_acceptance(draft, target, ids, args.max_tokens, device)
    return {
        "training_greedy_equal_to_vllm_no_spec": f"{same}/{len(ids)}",
        "training_simulated_mean_acceptance_length": mean_len,
        "training_simulated_per_position_acceptance": per_pos,
        "training_simulated_steps": steps,
    }


def run_one(args, spec: bool) -> dict:
    """One engine in a child with a hard deadline (dspark_dev.engine, the shared runner)."""
    from dspark_dev.engine import child_env, run_engine

    prompts, _ = _prompts(args.num_prompts)
    target_dir, draft_dir = _dirs(args)
    llm = {
        "model": target_dir,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": True,
        "pipeline_parallel_size": args.pp,
        "seed": 0,
    }
    if spec:
        llm["speculative_config"] = {
            "method": "dspark",
            "num_speculative_tokens": args.k,
            "model": draft_dir,
        }
    job = {
        "name": "tiny-pair-acceptance",
        "llm": llm,
        "waves": [prompts],
        "sampling": {
            "max_tokens": args.max_tokens,
            "ignore_eos": False,
            # the near-tie rule needs the reference's top-2 where it is not exact (bf16)
            **({"logprobs": 2} if not spec and args.dtype != "float32" else {}),
        },
    }
    print(
        f"[tiny_pair_acceptance] running {f'DSpark k={args.k}' if spec else 'no speculation'} "
        f"on {args.num_prompts} prompts ...",
        flush=True,
    )
    run = run_engine(job, timeout_s=args.timeout, env=child_env({}))
    if run.timed_out:
        raise SystemExit(
            f"vLLM run timed out after {args.timeout}s in phase {run.phase!r} and was "
            "killed (raise --timeout)"
        )
    if not run.ok:
        sys.stderr.write(run.log_text[-8000:])
        raise SystemExit(f"vLLM run failed in phase {run.phase!r}: {run.result.get('error')}")
    wave = run.result["waves"][0]
    return {
        "tokens": wave["tokens"],
        "texts": wave["texts"],
        "metrics": wave["metrics"],
        "logprobs": wave.get("logprobs"),
        "generate_s": run.result.get("generate_s", 0.0),
    }


def main() -> int:
    from dspark_dev.parity import DEFAULT_NEAR_TIE, compare_tokens

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=DEFAULT_PAIR)
    p.add_argument("--family", choices=["qwen3", "k3", "dsv4"], default="qwen3")
    p.add_argument("--compare-training", action="store_true")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="", help="default: float32 (qwen3), bfloat16 (k3, dsv4)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1500)
    p.add_argument("--out-json", default="")
    p.add_argument(
        "--near-tie",
        type=float,
        default=DEFAULT_NEAR_TIE,
        help="bf16 only: the largest top-2 gap (nats) that excuses a first difference",
    )
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.family == "qwen3" else "bfloat16")

    _, values = _prompts(args.num_prompts)
    base = run_one(args, spec=False)
    spec = run_one(args, spec=True)
    m = spec["metrics"]
    drafts = m.get("num_drafts", 0)
    acc_len = 1 + m.get("num_accepted_tokens", 0) / drafts if drafts else float("nan")
    per_pos = [a / drafts for a in m.get("accepted_per_pos", [])] if drafts else []
    same = sum(a == b for a, b in zip(base["tokens"], spec["tokens"], strict=True))
    exact = args.dtype == "float32"
    parity = compare_tokens(
        base["tokens"], spec["tokens"], None if exact else base["logprobs"], near_tie=args.near_tie
    )
    lossless = parity.identical if exact else parity.ok
    acc_base = sum(answer_value(t) == v for t, v in zip(base["texts"], values, strict=True)) / len(
        values
    )
    acc_spec = sum(answer_value(t) == v for t, v in zip(spec["texts"], values, strict=True)) / len(
        values
    )
    result = {
        "pair": os.path.relpath(args.pair, REPO) if args.pair.startswith(REPO) else args.pair,
        "family": args.family,
        "num_prompts": args.num_prompts,
        "k": args.k,
        "pp": args.pp,
        "dtype": args.dtype,
        "mean_acceptance_length": acc_len,
        "per_position_acceptance": per_pos,
        "num_drafts": drafts,
        "num_draft_tokens": m.get("num_draft_tokens", 0),
        "num_accepted_tokens": m.get("num_accepted_tokens", 0),
        "lossless_identical_outputs": f"{same}/{len(values)}",
        "lossless_rule": "identical" if exact else f"identical except near-ties <= {args.near_tie}",
        "lossless_ok": lossless,
        "first_differences": [m.describe() for m in parity.mismatches] + parity.length_problems,
        "accuracy_no_spec": acc_base,
        "accuracy_dspark": acc_spec,
        "generate_s_no_spec": round(base["generate_s"], 2),
        "generate_s_dspark": round(spec["generate_s"], 2),
        "output_tokens": sum(len(t) for t in spec["tokens"]),
    }

    def record() -> None:
        print(json.dumps(result, indent=2), flush=True)
        if args.out_json:
            with open(args.out_json, "w") as f:
                json.dump(result, f, indent=2)

    if args.compare_training:
        # vLLM's figures are kept first: a deadline that ends the comparison leaves them recorded
        result["training_comparison"] = "running"
        record()
        result.update(compare_training(args, _prompts(args.num_prompts)[0], base["tokens"]))
        result["training_comparison"] = "done"
    record()
    if not lossless:
        print(
            "[tiny_pair_acceptance] LOSSLESS CHECK FAILED: speculative outputs differ\n"
            + parity.describe(),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
