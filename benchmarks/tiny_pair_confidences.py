"""The trained tiny pair's DSpark confidences on CPU, and where vLLM's adaptive budget binds at a
pinned verify-cost slope (tests/gpu/test_pp_adaptive_one_gpu.py pins one,
``DSPARK_TEST_VERIFY_COST_SLOPE``, through tests/support/adaptive_probe).

    python -m benchmarks.tiny_pair_confidences [--prompts 7] [--max-tokens 64] [--slopes 3,10,20]

A hand-run reading, not a test: one in-process CPU engine (float32, eager), the held-out prompts
the GPU test sends, one at a time, greedy. vLLM 0.34.0 computes the drafter's confidence head only
with adaptive verification (full CUDA graphs, so not on CPU); here each drafting step computes it
beside the drafts and keeps a copy, handing vLLM what it would have had (nothing). The budget is
vLLM's ``get_num_tokens`` rule for one request (:func:`budget`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def budget(survival: np.ndarray, slope: float, k: int | None = None) -> int:
    """The drafts vLLM's adaptive budget keeps for one request (one bonus token, draft cost 1,
    verify cost ``1 + slope x tokens``): the count maximising (1 + the kept drafts' survival
    probabilities) / (1 + 1 + slope x (1 + drafts)), the highest probabilities first."""
    scores = np.sort(np.asarray(survival, dtype=np.float64))[::-1][: k or len(survival)]
    accepted = np.concatenate(([1.0], 1.0 + np.cumsum(scores)))
    cost = 2.0 + slope * (1 + np.arange(len(accepted)))
    return int(np.argmax(accepted / cost))


def summary(confidences: np.ndarray, slopes: list[float]) -> list[str]:
    """Lines: the confidences per position and their quantiles, then per slope the mean budget,
    the share of steps it trims and the share it cuts to zero drafts."""
    conf = np.asarray(confidences, dtype=np.float64)
    survival = np.cumprod(conf, axis=1)
    k = conf.shape[1]
    q = np.quantile(conf, [0.05, 0.25, 0.5, 0.75, 0.95])
    lines = [
        f"{conf.shape[0]} drafting steps, k = {k}; mean confidence per position "
        + ", ".join(f"{x:.4f}" for x in conf.mean(axis=0)),
        "confidence quantiles 5/25/50/75/95 %: " + ", ".join(f"{x:.4f}" for x in q),
    ]
    for slope in slopes:
        kept = np.array([budget(s, slope) for s in survival])
        lines.append(
            f"slope {slope:g}: mean drafts kept {kept.mean():.2f} of {k}, steps trimmed "
            f"{np.mean(kept < k):.0%}, steps cut to zero {np.mean(kept == 0):.0%}"
        )
    return lines


def read_confidences(num_prompts: int, max_tokens: int) -> np.ndarray:
    """Serve the held-out prompts on CPU and return every drafting step's confidences."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the wrap below must see it
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu.spec_decode.dspark import speculator as dspark

    from benchmarks.tiny_pair_acceptance import DEFAULT_PAIR, _prompts

    seen: list[np.ndarray] = []
    inner = dspark.DSparkSpeculator._sample_markov_chain

    def keep_confidences(self, *args, **kwargs):
        had = self.use_confidence_head
        self.use_confidence_head = True
        try:
            conf = inner(self, *args, **kwargs)
        finally:
            self.use_confidence_head = had
        if conf is not None:
            seen.append(conf.float().cpu().numpy().copy())
        return conf if had else None

    dspark.DSparkSpeculator._sample_markov_chain = keep_confidences
    draft = os.path.join(DEFAULT_PAIR, "dspark-draft")
    with open(os.path.join(draft, "config.json")) as f:
        k = int(json.load(f)["block_size"])  # the block the drafter was trained to draft
    llm = LLM(
        model=os.path.join(DEFAULT_PAIR, "target"),
        speculative_config={"method": "dspark", "model": draft, "num_speculative_tokens": k},
        enforce_eager=True, max_num_seqs=1, dtype="float32", max_model_len=512,
    )  # fmt: skip
    for prompt in _prompts(num_prompts)[0]:  # the held-out questions, in the GPU test's order
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return np.concatenate([c.reshape(-1, c.shape[-1]) for c in seen])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slopes", default="3,10,20,30")
    a = ap.parse_args(argv)
    conf = read_confidences(a.prompts, a.max_tokens)
    print("\n".join(summary(conf, [float(s) for s in a.slopes.split(",")])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
