"""Acceptance of the tiny pair under vLLM: greedy DSpark (k=7) on held-out prompts.

Runs vLLM twice in subprocesses with hard timeouts: once without speculation, once with the DSpark
drafter, on the first ``--num-prompts`` held-out prompts of the seeded corpus. Reports the mean
acceptance length as vLLM's spec-decode metrics count it (1 + accepted draft tokens per draft step,
i.e. the bonus token included), the per-position acceptance rates, whether the speculative outputs
equal the non-speculative ones token for token (lossless check), the answer accuracy and the wall
times. CPU:

    VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=
    VLLM_CPU_OMP_THREADS_BIND=nobind \\
    python -m benchmarks.tiny_pair_acceptance --out-json /tmp/acc.json

GPU: the same without the CPU variables (``--dtype`` defaults to float32 either way).

``--family k3`` measures the Kimi-K3 pair (``<pair>/k3-target`` + ``<pair>/k3-dspark``, written by
``train_tiny_pair --family k3``; GPU only: vLLM 0.34.0's CPU engine cannot serve Kimi-K3, see
tests/unit/dspark_dev/training/test_k3_equivalence.py), in bfloat16 unless ``--dtype`` says
otherwise.
``--compare-training`` also runs the pure-torch training modules (float32) on the same prompts:
their greedy tokens against vLLM's no-speculation tokens, and their simulated greedy DSpark
acceptance (``train_tiny_pair.simulate_acceptance``) beside vLLM's; on CUDA only when a tiny
``torch.linalg.solve_triangular`` works there (K3 needs it; some GPU kits' torch lacks
libtorch_cuda_linalg.so), else on CPU, the device recorded as ``training_device``.
``--training-only --from-json PATH`` (with the recorded run's other arguments, hence its prompts)
runs only that comparison, afterwards and without vLLM, and writes PATH back with it added (the
greedy-equality count is n/a there: vLLM's tokens are not recorded).

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


def training_device() -> tuple[str, str]:
    """("cuda", "") when CUDA is present and its linear algebra works (K3's ``kda_chunked`` needs
    ``torch.linalg.solve_triangular``; a torch without libtorch_cuda_linalg.so fails it), else
    ("cpu", why CUDA was refused, "" when there is none)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", ""
    try:
        eye = torch.eye(2, device="cuda")
        torch.linalg.solve_triangular(eye, eye, upper=False)
        torch.cuda.synchronize()
    except Exception as e:  # any failure: not on this CUDA
        first = (str(e).splitlines() or [""])[0][:160]
        return "cpu", f"CUDA solve_triangular probe failed: {type(e).__name__}: {first}"
    return "cuda", ""


def compare_training(args, prompts: list[str], base_tokens: list[list[int]] | None) -> dict:
    """The training modules (float32; on CUDA when its probe passes, else CPU) on the same prompts.
    ``base_tokens`` None (vLLM's tokens not recorded): no greedy-equality count."""
    import torch

    from dspark_dev.training.dsv4_train import load_dsv4_pair
    from dspark_dev.training.export import load_k3_pair, load_pair
    from dspark_dev.training.tokenizer import EOS_ID, PurePythonBPE
    from dspark_dev.training.train_tiny_pair import simulate_acceptance

    target_dir, _ = _dirs(args)
    name, why = training_device()
    device = torch.device(name)
    loader = {"k3": load_k3_pair, "dsv4": load_dsv4_pair}.get(args.family, load_pair)
    target, draft = loader(args.pair)
    target.to(device).eval()
    draft.to(device).eval()
    bpe = PurePythonBPE(os.path.join(target_dir, "tokenizer.json"))
    ids = [bpe.encode(p) for p in prompts]
    # the simulation's completions are the training target's greedy tokens (EOS dropped)
    mean_len, per_pos, steps, gens = simulate_acceptance(
        draft, target, ids, args.max_tokens, device
    )
    if base_tokens is None:
        greedy = "n/a (vLLM tokens not recorded)"
    else:
        same = sum(
            g == [t for t in b if t != EOS_ID] for g, b in zip(gens, base_tokens, strict=True)
        )
        greedy = f"{same}/{len(ids)}"
    return {
        "training_device": name,
        **({"training_device_reason": why} if why else {}),
        "training_max_tokens": args.max_tokens,
        "training_greedy_equal_to_vllm_no_spec": greedy,
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


def _pair_label(pair: str) -> str:
    """The pair as the JSON records it: relative to the repository when inside it."""
    full = os.path.normpath(os.path.join(REPO, pair))  # a relative pair: from the repository
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else full


def training_only(args) -> int:
    """The training comparison afterwards (e.g. on a CPU machine) for a recorded vLLM run."""
    if not args.from_json:
        raise SystemExit("--training-only needs --from-json PATH (a recorded acceptance JSON)")
    with open(args.from_json) as f:
        result = json.load(f)
    missing = [k for k in ("pair", "family", "num_prompts", "k") if k not in result]
    if missing:
        raise SystemExit(
            f"--from-json {args.from_json}: not a recorded acceptance JSON, missing {missing}"
        )
    ours = {"pair": _pair_label(args.pair), "family": args.family}
    ours |= {"num_prompts": args.num_prompts, "k": args.k}
    theirs = dict(result, pair=_pair_label(result["pair"]))
    differ = [
        f"{k}: {theirs[k]!r} recorded, {v!r} given" for k, v in ours.items() if theirs[k] != v
    ]
    if differ:
        raise SystemExit(
            f"--from-json {args.from_json} was recorded with other settings (pass the same "
            "--pair/--family/--num-prompts/--k): " + "; ".join(differ)
        )
    result.update(compare_training(args, _prompts(args.num_prompts)[0], None))
    result["training_comparison"] = f"done ({result['training_device']}, afterwards)"
    print(json.dumps(result, indent=2), flush=True)
    with open(args.out_json or args.from_json, "w") as f:
        json.dump(result, f, indent=2)
    return 0


def main() -> int:
    from dspark_dev.parity import DEFAULT_NEAR_TIE, compare_tokens

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=DEFAULT_PAIR)
    p.add_argument("--family", choices=["qwen3", "k3", "dsv4"], default="qwen3")
    p.add_argument("--compare-training", action="store_true")
    p.add_argument(
        "--training-only",
        action="store_true",
        help="no vLLM: add the training comparison to the recorded --from-json (same argv "
        "otherwise, so the same prompts), written back there or to --out-json",
    )
    p.add_argument("--from-json", default="")
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
    if args.training_only:
        return training_only(args)

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
