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


def run_one(args, spec: bool) -> dict:
    """One engine in a child with a hard deadline (dspark_dev.engine, the shared runner)."""
    from dspark_dev.engine import child_env, run_engine

    prompts, _ = _prompts(args.num_prompts)
    llm = {
        "model": os.path.join(args.pair, "target"),
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
            "model": os.path.join(args.pair, "dspark-draft"),
        }
    job = {
        "name": "tiny-pair-acceptance",
        "llm": llm,
        "waves": [prompts],
        "sampling": {"max_tokens": args.max_tokens, "ignore_eos": False},
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
        "generate_s": run.result.get("generate_s", 0.0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=DEFAULT_PAIR)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1500)
    p.add_argument("--out-json", default="")
    args = p.parse_args()

    _, values = _prompts(args.num_prompts)
    base = run_one(args, spec=False)
    spec = run_one(args, spec=True)
    m = spec["metrics"]
    drafts = m.get("num_drafts", 0)
    acc_len = 1 + m.get("num_accepted_tokens", 0) / drafts if drafts else float("nan")
    per_pos = [a / drafts for a in m.get("accepted_per_pos", [])] if drafts else []
    same = sum(a == b for a, b in zip(base["tokens"], spec["tokens"], strict=True))
    acc_base = sum(answer_value(t) == v for t, v in zip(base["texts"], values, strict=True)) / len(
        values
    )
    acc_spec = sum(answer_value(t) == v for t, v in zip(spec["texts"], values, strict=True)) / len(
        values
    )
    result = {
        "pair": os.path.relpath(args.pair, REPO) if args.pair.startswith(REPO) else args.pair,
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
        "accuracy_no_spec": acc_base,
        "accuracy_dspark": acc_spec,
        "generate_s_no_spec": round(base["generate_s"], 2),
        "generate_s_dspark": round(spec["generate_s"], 2),
        "output_tokens": sum(len(t) for t in spec["tokens"]),
    }
    print(json.dumps(result, indent=2))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=2)
    if same != len(values):
        print(
            "[tiny_pair_acceptance] LOSSLESS CHECK FAILED: speculative outputs differ",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
