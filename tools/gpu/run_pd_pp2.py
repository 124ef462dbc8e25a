#!/usr/bin/env python3
"""Several-GPU run 2: PD with a PP=2 producer (context-only drafter) and a PP=1 decoder.

One command (< 10 minutes), on a machine with >= 2 GPUs after the kit is booted:

    source /tmp/site/env.sh && PYTHONPATH=.:tests python3 tools/gpu/run_pd_pp2.py --out $OUT

Producer: ``vllm serve --pipeline-parallel-size 2`` on GPUs 0,1, ``kv_producer``; decoder: PP=1
``kv_consumer`` on GPU 2 when three or more GPUs exist, else sharing GPU 1 with producer stage 1;
both with the DSpark speculative config, joined by MooncakeConnector over TCP on loopback with
dspark_dev/pd_proxy.py in front (tests/support/pd_run.py). References: PP=1 aggregated runs
on GPU 0
(plain, with top-2 logprobs; and DSpark). Checked: the KV came over Mooncake, greedy = aggregated,
decoder acceptance = aggregated DSpark acceptance within 2 points, no NCCL stub reached.
Log: OUT/pd_pp2.log; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from run_pp2_aggregated import MAX_TOKENS, random_pair, waves
from support.gpu import GPUCaseFailure, run_llm
from support.pd_run import run_pd

from dspark_dev.multi_gpu import Report, gpu_count, guarded_env
from dspark_dev.parity import acceptance_close, compare_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/dspark-mg-out"))
    ap.add_argument("--eager", action="store_true", help="servers with --enforce-eager")
    a = ap.parse_args(argv)
    out = Path(a.out)
    os.environ.setdefault("DSPARK_GPU_ARTIFACTS", str(out / "artifacts"))
    rep = Report("several GPUs, run 2: PD with a PP=2 producer", out / "pd_pp2.log")
    n_gpu = gpu_count()
    if n_gpu < 2:
        rep.add("needs >= 2 GPUs", "FAIL", f"found {n_gpu}")
        return rep.finish()
    guard, env = guarded_env()
    pair = random_pair(Path(tempfile.mkdtemp(prefix="dspark-mg-models-")))
    spec = {"method": "dspark", "model": pair.draft}
    prompts = waves()[-1]
    logs: list[str] = []
    on_gpu0 = {**env, "CUDA_VISIBLE_DEVICES": "0"}
    try:
        base = run_llm(
            "pp1_plain",
            {"model": pair.target},
            [prompts],
            timeout_s=240,
            sampling={"max_tokens": MAX_TOKENS},
            logprobs=2,
            env=on_gpu0,
        )
        agg = run_llm(
            "pp1_dspark",
            {"model": pair.target, "speculative_config": spec},
            [prompts],
            timeout_s=240,
            sampling={"max_tokens": MAX_TOKENS},
            env=on_gpu0,
        )
        logs += [base.log_tail, agg.log_tail]
    except GPUCaseFailure as e:
        rep.add("PP=1 aggregated references", "FAIL", str(e).splitlines()[0])
        guard.check(rep, [str(e)])
        return rep.finish()
    dec_gpu = "2" if n_gpu >= 3 else "1"
    rep.log(f"producer PP=2 on GPUs 0,1; decoder on GPU {dec_gpu}")
    common = [
        "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(1 << 30),
    ]  # fmt: skip
    common += ["--enforce-eager"] if a.eager else []
    try:
        res = run_pd(
            pair.target,
            spec,
            prompts,
            timeout_s=480,
            common_args=common,
            prefill_args=["--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"],
            prefill_env={**env, "CUDA_VISIBLE_DEVICES": "0,1"},
            decode_env={**env, "CUDA_VISIBLE_DEVICES": dec_gpu},
            max_tokens=MAX_TOKENS,
        )
    except GPUCaseFailure as e:
        rep.add("PD PP=2 producer -> PP=1 decoder", "FAIL", str(e).splitlines()[0])
        guard.check(rep, logs + [str(e)])
        return rep.finish()
    rep.log(
        "PD result: " + json.dumps({k: v for k, v in res.items() if k != "tokens"}, default=str)
    )
    st = res["proxy"]
    rep.add(
        "every request: prefill then decode",
        "PASS" if not st["errors"] and st["decode_ok"] == len(prompts) else "FAIL",
        json.dumps(st)[:150],
    )
    hits = res["decoder_kv"].get("vllm:external_prefix_cache_hits_total", 0)
    rep.add(
        "decoder pulled the prompt KV over Mooncake TCP",
        "PASS" if hits > 0 else "FAIL",
        f"external prefix-cache hits {hits:.0f} tokens",
    )
    p1 = compare_tokens(base.tokens, res["tokens"], base.logprobs)
    rep.add("PD greedy = PP=1 plain", "PASS" if p1.ok else "FAIL", p1.describe().splitlines()[0])
    p2 = compare_tokens(agg.tokens, res["tokens"], base.logprobs)
    rep.add(
        "PD greedy = PP=1 DSpark aggregated",
        "PASS" if p2.ok else "FAIL",
        p2.describe().splitlines()[0],
    )
    ok, desc = acceptance_close(res["decoder_spec"], agg.metrics())
    rep.add("decoder acceptance = aggregated (2 points)", "PASS" if ok else "FAIL", desc)
    guard.check(rep, logs)
    return rep.finish()


if __name__ == "__main__":
    raise SystemExit(main())
