#!/usr/bin/env python3
"""Several-GPU run 1: aggregated DSpark on a PP=2 target (and PP=2 x TP=2 with four GPUs).

One command (< 10 minutes; or two with --part parity / --part startup), on a machine with >= 2 GPUs
after the kit is booted:

    source /tmp/site/env.sh && PYTHONPATH=.:tests \
        python3 tools/gpu/run_pp2_aggregated.py --out $OUT
    [--trained-pair DIR]

For each model pair (the random-weight tiny pair, generated here, and the trained tiny pair when
``--trained-pair DIR`` holds ``target/`` and ``draft/``):

* PP=1 without speculation (reference tokens, top-2 logprobs), PP=1 DSpark (reference acceptance),
  PP=2 DSpark, and PP=2 x TP=2 DSpark with 4 GPUs: greedy tokens equal the PP=1 non-speculative
  run (the near-tie rule of dspark_dev/parity.py) and acceptance equals PP=1 DSpark's (exact
  counts reported; the verdict allows 2 points for bf16);
* start-up + warm-up of PP=2 DSpark repeated 5 times, each under a hard deadline: a hang is a
  failure naming the phase and the last log line where it stopped;
* the start-up handshake rejects a mismatched rank: rank 1 is made to publish a different
  protocol version (through a sitecustomize hook in its environment only) and the engine must
  fail at start with the handshake's error, not hang;
* no child reaches the kit's stubbed NCCL functions (dspark_dev.multi_gpu.NcclStubGuard).

Writes its log to OUT/pp2_aggregated.log and prints the table last. Exit 0 only if all passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

from support.gpu import GPUCaseFailure, run_llm

from dspark_dev.multi_gpu import Report, gpu_count, guarded_env
from dspark_dev.parity import acceptance_close, compare_tokens

WAVES_SEED = 4321
MAX_TOKENS = 48

# A stage-1 rank that lies about the protocol: loaded by every process of the child through
# PYTHONPATH; it only acts on the PP rank named by DSPARK_TEST_MISMATCH_RANK.
SITECUSTOMIZE = r"""
import importlib.abc, importlib.machinery, os, sys

_RANK = int(os.environ.get("DSPARK_TEST_MISMATCH_RANK", "-1"))
_TARGET = "vllm_dspark_pp.protocol.handshake"


def _patch(mod):
    import dataclasses
    orig = mod.facts_from_config

    def facts_from_config(vllm_config):
        facts = orig(vllm_config)
        from vllm.distributed.parallel_state import get_pp_group
        if get_pp_group().rank_in_group == _RANK:
            facts = dataclasses.replace(facts, protocol=facts.protocol + 1000)
        return facts

    mod.facts_from_config = facts_from_config


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        sys.meta_path.insert(0, self)
        if spec is None:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


if _RANK >= 0:
    sys.meta_path.insert(0, _Finder())
"""


def waves(vocab: int = 512):
    import random

    rng = random.Random(WAVES_SEED)
    return [
        [[rng.randrange(4, vocab) for _ in range(rng.randrange(6, 41))] for _ in range(n)]
        for n in (3, 7)
    ]


def random_pair(root: Path):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(
        root, seed=0, dtype="bfloat16", hidden_size=128, intermediate_size=256, head_dim=64
    )


def last_log_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip() and "Traceback" not in line:
            return line.strip()[-200:]
    return "(empty log)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/dspark-mg-out"))
    ap.add_argument(
        "--trained-pair", default=None, help="dir with target/ and draft/ of the trained tiny pair"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--part",
        choices=("all", "parity", "startup"),
        default="all",
        help="parity: tokens + acceptance; startup: the 5x start-up repeat + handshake "
        "(split if one command is too long)",
    )
    a = ap.parse_args(argv)
    out = Path(a.out)
    os.environ.setdefault("DSPARK_GPU_ARTIFACTS", str(out / "artifacts"))
    rep = Report("several GPUs, run 1: aggregated PP=2 DSpark", out / "pp2_aggregated.log")
    n_gpu = gpu_count()
    rep.log(f"GPUs visible: {n_gpu}")
    if n_gpu < 2:
        rep.add("needs >= 2 GPUs", "FAIL", f"found {n_gpu}")
        return rep.finish()
    guard, env = guarded_env()
    # the runs here are sequential: one shared torch.compile cache keeps the repeats inside the
    # budget
    env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="dspark-mg-vllm-cache-")
    rep.log(f"NCCL guard: {len(guard.symbols)} symbols, so={guard.so}, problem={guard.problem}")
    if importlib.util.find_spec("vllm_dspark_pp.tiny_models") is None:
        rep.add("tiny models", "FAIL", "vllm_dspark_pp.tiny_models missing")
        return rep.finish()
    pairs = {"random": random_pair(Path(tempfile.mkdtemp(prefix="dspark-mg-models-")))}
    if a.trained_pair:
        tp = Path(a.trained_pair)
        pairs["trained"] = type(
            "P", (), {"target": str(tp / "target"), "draft": str(tp / "draft")}
        )()
    else:
        rep.add("trained tiny pair", "SKIP", "no --trained-pair DIR given")
    w = waves()
    logs: list[str] = []
    sampling = {"max_tokens": MAX_TOKENS}
    base_kw = {"distributed_executor_backend": "mp", "gpu_memory_utilization": 0.3}

    def run(name, cfg, timeout=300, **kw):
        r = run_llm(
            name, {**base_kw, **cfg}, w, timeout_s=timeout, sampling=sampling, env=env, **kw
        )
        logs.append(r.log_tail)
        rep.log(f"{name}: startup {r.startup_s:.0f} s, wall {r.wall_s:.0f} s, spec {r.metrics()}")
        return r

    for pname, pair in pairs.items() if a.part in ("all", "parity") else ():
        spec = {"method": "dspark", "model": pair.draft}
        try:
            ref = run(f"{pname}_pp1_plain", {"model": pair.target}, logprobs=2)
            ref_spec = run(
                f"{pname}_pp1_dspark", {"model": pair.target, "speculative_config": spec}
            )
        except GPUCaseFailure as e:
            rep.add(f"{pname}: PP=1 references", "FAIL", str(e).splitlines()[0])
            logs.append(str(e))
            continue
        layouts = [("pp2", {"pipeline_parallel_size": 2})]
        if n_gpu >= 4:
            layouts.append(("pp2_tp2", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}))
        else:
            rep.add(f"{pname}: PP=2 x TP=2", "SKIP", f"needs 4 GPUs, found {n_gpu}")
        for lname, par in layouts:
            try:
                r = run(
                    f"{pname}_{lname}_dspark",
                    {"model": pair.target, "speculative_config": spec, **par},
                )
            except GPUCaseFailure as e:
                rep.add(f"{pname}: {lname} DSpark runs", "FAIL", str(e).splitlines()[0])
                logs.append(str(e))
                continue
            par_rep = compare_tokens(ref.tokens, r.tokens, ref.logprobs)
            rep.add(
                f"{pname}: {lname} DSpark greedy = PP=1 plain",
                "PASS" if par_rep.ok else "FAIL",
                par_rep.describe().splitlines()[0],
            )
            ok, desc = acceptance_close(r.metrics(), ref_spec.metrics())
            exact = r.metrics() == ref_spec.metrics()
            rep.add(
                f"{pname}: {lname} acceptance = PP=1 DSpark",
                "PASS" if ok else "FAIL",
                f"exact={exact}; {desc}",
            )

    # start-up / warm-up repeated: a hang is a failure with the phase and last log line
    pair = pairs["random"]
    spec = {"method": "dspark", "model": pair.draft}
    hangs = []
    if a.part == "parity":
        guard.check(rep, logs)
        return rep.finish()
    for i in range(a.repeats):
        try:
            run(
                f"repeat{i}_pp2",
                {"model": pair.target, "speculative_config": spec, "pipeline_parallel_size": 2},
                timeout=150,
            )
        except GPUCaseFailure as e:
            text = str(e)
            logs.append(text)
            hangs.append(f"#{i}: {text.splitlines()[0][:120]} | last line: {last_log_line(text)}")
    rep.add(
        f"PP=2 start-up + warm-up x{a.repeats}, no hang",
        "PASS" if not hangs else "FAIL",
        "all started and generated" if not hangs else "; ".join(hangs),
    )

    # handshake: a mismatched rank must make start-up fail quickly with the handshake's message
    if importlib.util.find_spec("vllm_dspark_pp.protocol.handshake") is None:
        rep.add(
            "handshake rejects a mismatched rank",
            "SKIP",
            "vllm_dspark_pp.protocol.handshake missing (protocol branch)",
        )
    else:
        hook = Path(tempfile.mkdtemp(prefix="dspark-mismatch-"))
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        bad_env = {
            **env,
            "DSPARK_TEST_MISMATCH_RANK": "1",
            "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S": "30",
            "PYTHONPATH": os.pathsep.join(
                [
                    str(hook),
                    str(Path(__file__).resolve().parents[2]),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ),
        }
        try:
            run_llm(
                "handshake_mismatch",
                {
                    **base_kw,
                    "model": pair.target,
                    "speculative_config": spec,
                    "pipeline_parallel_size": 2,
                },
                w[:1],
                timeout_s=150,
                sampling=sampling,
                env=bad_env,
            )
            rep.add(
                "handshake rejects a mismatched rank",
                "FAIL",
                "the engine started and generated anyway",
            )
        except GPUCaseFailure as e:
            text = str(e)
            hung = "HUNG" in text.splitlines()[0]
            named = "HandshakeError" in text and "protocol" in text
            rep.add(
                "handshake rejects a mismatched rank",
                "PASS" if (named and not hung) else "FAIL",
                ("hung instead of failing: " if hung else "")
                + (
                    "HandshakeError naming 'protocol'"
                    if named
                    else f"failed without the handshake's message: {last_log_line(text)}"
                ),
            )
    guard.check(rep, logs)
    return rep.finish()


if __name__ == "__main__":
    raise SystemExit(main())
