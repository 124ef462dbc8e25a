"""A pytest plugin that runs the DSV4/K3 GPU groups' tests on CPU with FAKE engines: checks the
wiring (which engines a mode starts, with which arguments, and that the tests' assertions pass and
fail on the counters they are given), never vLLM. Written for the trained mode of issue 26, which
no GPU has run yet; the default dummy mode (k=4) runs too (19 passed, 12 skipped, 2026-12-05).

    DSPARK_FAKE_MODELS=<dir holding k3-pair/ and dsv4-pair/> DSPARK_DSV4K3_WEIGHTS=trained \\
    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/gpu python -m pytest -p support.gpu_fake_engines \\
        tests/gpu/test_dsv4_k3_engine.py tests/gpu/test_dsv4_k3_pp.py

    DSPARK_FAKE_MODELS=$PWD/models DSPARK_GPU_PD_PP_PAIR=tiny|dsv4|k3 PYTHONPATH=... \\
        python -m pytest -p support.gpu_fake_engines tests/gpu/test_pd_pp_producer.py

    PYTHONPATH=... python -m pytest -p support.gpu_fake_engines tests/gpu/test_tp_pp_one_gpu.py

    DSPARK_GPU_PP_JOBS=ref,pp1_async,pp1_sync,pp2_async,pp2_sync,pp3_async,pp3_sync,pp2_fixed8 \
    PYTHONPATH=... python -m pytest -p support.gpu_fake_engines tests/gpu/test_pp_one_gpu.py

    DSPARK_FAKE_MODELS=$PWD/models PYTHONPATH=... python -m pytest -p support.gpu_fake_engines \\
        tests/gpu/test_dsv41_pp.py

Fakes: ``support.gpu.run_llm``, ``support.pd_run.run_pd``, ``dspark_dev.pp_launch.deployment`` /
``serve_waves``, ``dspark_dev.multi_gpu.NcclStubGuard`` (the kit's recording NCCL stub: built,
nothing called; its ``env()`` is ``DSPARK_FAKE_NCCL_GUARD=1``, so the calls show which launchers
got it) and ``gpu_common.require_cuda``; the GPU markers' skips are lifted. Every engine answers
the same tokens for a prompt (greedy parity holds) and trained-looking counters at the speculative
config's k ([36, 30, 25, 20, 15, 10, 4] of 40 drafts, cut to k; a PP deployment's served counters
follow its own k); the NaN-norm PD control accepts nothing, the subtle control [30, 20, 12, 8, 5,
3, 2], and an engine started with ``VLLM_DSPARK_PP_SKIP_PATCHES`` fails at start-up.
``DSPARK_FAKE_MUTATION`` breaks one thing, for showing that a check fails: ``subtle_same`` (the
subtle control accepts like the PD run), ``pos6_zero`` (draft position 6 never accepts),
``nan_leaks`` (the NaN-norm control accepts 6 %), ``pp2_low`` (PP=2 accepts less than PP=1 at its
last two positions), ``rank_silent`` (the last launcher of a deployment logged no rank line),
``digest_differs`` (the last rank of a PP deployment logs another drafts digest; it and
``rank_silent`` can be joined with ``+``), ``skip_starts`` (the split-skipped engine starts),
``stock_serves`` (stock vLLM serves DeepSeek-V4.1 DSpark over PP instead of refusing it at start),
``pp_one_stage`` (only launcher 0 of a PP deployment logged the handshake and the exchange),
``nccl_stub_called`` (a launcher reached a stubbed NCCL symbol), ``pd_one_stage`` (only node 0 of a
PP producer logged the exchange), ``pd_low`` (a PD decoder accepts less at its last two positions),
``nan_same`` (the NaN-norm PD control accepts like the good run), ``kv_recomputed`` (the PD decoder
computed every prompt token itself), ``side_unconnected`` (the tap side channel's launchers log no
start-up link). A fake PD run answers as its proxy and launchers would: every
request through both sides, one log per producer launcher (vLLM's rank line of the ``-tp`` x
``-pp`` world its arguments name, the handshake and ``over nccl`` lines, the context-KV-only
drafter's build line on the last stage's launchers; launcher 0 also vLLM's ``non-default args``
line with the scheduling flag of the common arguments), one per decoder launcher (its rank line;
launcher 0 that flag too), the decoder's prompt tokens by source (all but one per prompt over the
connector). A fake PP deployment has ``tp * pp`` launchers whose logs say what real ones do: vLLM's
rank line, NCCL communicators of the TP and PP sizes over sockets, the handshake and exchange lines
(PP > 1), one drafts digest line per launcher when the deployment's env sets
``VLLM_DSPARK_PP_DRAFT_DIGEST``, every last-stage launcher's pinned-dispatch lines (counts 1, 10,
100) when its speculative config sets the fixed graph batch (``dspark_pp_fixed_graph_batch``; the
pp group's stock and ``fault`` jobs are not faked: leave them out of ``DSPARK_GPU_PP_JOBS``); a
client abort mid-stream (test_pp_one_gpu.py ``_abort_mid_stream``) reads 4 chunks and leaves
nothing running. The engine calls are written as JSON to ``DSPARK_FAKE_CALLS`` (default: none
written).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CALLS: list = []
MUTATION = os.environ.get("DSPARK_FAKE_MUTATION", "")
#: several mutations at once, "+"-joined (only the TP x PP rank evidence reads them this way)
MUTATIONS = set(MUTATION.split("+"))
GOOD = [36, 30, 25, 20, 15, 10, 4]
SUBTLE = [30, 20, 12, 8, 5, 3, 2]


def _counters(per: list[int]) -> dict:
    return {
        "num_drafts": 40,
        "num_draft_tokens": 40 * len(per),
        "num_accepted_tokens": sum(per),
        "accepted_per_pos": per,
    }


def _good(k: int) -> list[int]:
    per = list(GOOD if MUTATION != "pos6_zero" else [*GOOD[:6], 0])
    return (per + [0] * k)[:k]


V41 = "DeepseekV41ForCausalLM"
#: vLLM 0.34.0's refusal of DSpark over PP for a decoder without aux relays (support.pp_refusal)
STOCK_PP_REFUSAL = "does not support dspark with pipeline parallelism"


def _stock_refuses(target: str, kw: dict) -> bool:
    """Stock vLLM (plugin left out) asked for DSpark on a DeepSeek-V4.1 target over PP > 1
    refuses at start, as vLLM 0.34.0 does (``stock_serves``: it serves instead)."""
    if (kw.get("env") or {}).get("VLLM_PLUGINS") != "no-such-plugin" or not kw.get("spec"):
        return False
    if kw.get("pp", 2) < 2 or MUTATION == "stock_serves":
        return False
    try:
        cfg = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return V41 in (cfg.get("architectures") or [])


def _tokens(prompts) -> list[list[int]]:
    return [[(sum(p) + i) % 400 + 3 for i in range(20)] for p in prompts]


def pytest_configure(config):
    import gpu_common

    import support.gpu as g
    import support.mla_pairs as mp
    import support.pd_run as pd
    from dspark_dev import multi_gpu, pp_launch
    from vllm_dspark_pp.protocol import graph_batch

    if os.environ.get("DSPARK_FAKE_MODELS"):
        mp.MODELS = Path(os.environ["DSPARK_FAKE_MODELS"])
    gpu_common.require_cuda = lambda: None

    def run_llm(
        name, cfg, waves, *, timeout_s, sampling=None, logprobs=None, probe=False, env=None
    ):
        CALLS.append(["llm", name, cfg, sampling, logprobs, env, waves, timeout_s])
        if env and "VLLM_DSPARK_PP_SKIP_PATCHES" in env and MUTATION != "skip_starts":
            raise g.GPUCaseFailure(f"[{name}] failed (exit 1) in phase 'startup': fake")
        k = (cfg.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        out = []
        for w in waves:
            toks = _tokens(w)
            lps = [[{str(t): -0.1, "7": -2.5} for t in r] for r in toks] if logprobs else None
            out.append(
                {"tokens": toks, "logprobs": lps, "metrics": _counters(_good(k)) if k else {}}
            )
        return g.LLMResult(name, out, {}, None, 1.0, 2.0)

    def _size(args, flag: str) -> int:
        return int(args[args.index(flag) + 1]) if flag in args else 1

    def run_pd(model, spec, prompts, *, prefill_speculative_config=None, **kw):
        CALLS.append(["pd", model, spec, prefill_speculative_config, kw])
        k = spec["num_speculative_tokens"]
        per = _good(k) if MUTATION != "pd_low" else [*_good(k)[:-2], 1, 0]
        pre = (prefill_speculative_config or {}).get("model", "")
        if "nan-norm" in pre and MUTATION != "nan_same":
            per = [0] * k if MUTATION != "nan_leaks" else ([10, 5, 2] + [0] * k)[:k]
        elif "aux-perturbed" in pre and MUTATION != "subtle_same":
            per = SUBTLE[:k]
        n = len(prompts)
        followers = kw.get("prefill_followers") or []
        args0 = list(kw.get("prefill_args") or [])
        tp, pp = _size(args0, "-tp"), _size(args0, "-pp")
        names = ["prefill"] + [f"prefill-node{i + 1}" for i in range(len(followers))]
        logs = {}
        for i, x in enumerate(names):  # what launcher i (global rank i) of the producer logs
            text = f"rank {i} in world size {tp * pp} is assigned as DP rank 0, PP rank {i // tp}"
            text += f", PCP rank 0, TP rank {i % tp}, ETP rank 0\n"
            if i == 0 or MUTATION != "pd_one_stage":
                text += f"PP handshake: {pp} ranks agree\nDSpark PP exchange: fake over nccl\n"
            if i // tp == pp - 1:
                text += "Built the context-KV-only DSpark drafter: {}\n"
            logs[x] = text
        common = list(kw.get("common_args") or [])
        sched = {"--async-scheduling": True, "--no-async-scheduling": False}
        flags = [v for a, v in sched.items() if a in common]
        if flags:  # vLLM's API servers log their non-default arguments
            logs[names[0]] += f"non-default args: {{'async_scheduling': {flags[-1]}}}\n"
        dtp = _size(list(kw.get("decode_args") or []), "-tp")
        dec_logs = {
            ("decode" if i == 0 else f"decode-node{i}"): (
                f"rank {i} in world size {dtp} is assigned as DP rank 0, PP rank 0, PCP rank 0, "
                f"TP rank {i}, ETP rank 0\n"
            )
            for i in range(1 + len(kw.get("decode_followers") or []))
        }
        if flags:
            dec_logs["decode"] += f"non-default args: {{'async_scheduling': {flags[-1]}}}\n"
        tokens = sum(len(p) for p in prompts)
        local = tokens if MUTATION == "kv_recomputed" else n
        by = 'vllm:prompt_tokens_by_source_total{engine="0",source="%s"}'
        return {
            "tokens": _tokens(prompts),
            "decoder_spec": _counters(per),
            "prefill_spec": {"num_draft_tokens": 0},
            "decoder_kv": {
                "vllm:external_prefix_cache_hits_total": float(tokens - local),
                "vllm:mooncake_num_failed_transfers_total": 0.0,
                "vllm:mooncake_num_failed_recvs_total": 0.0,
                by % "local_compute": float(local),
                by % "external_kv_transfer": float(tokens - local),
            },
            "prefill_log_markers": {"context-KV-only drafter": True},
            "proxy": {"requests": n, "prefill_ok": n, "decode_ok": n, "errors": []},
            "producer_logs": logs,
            "decoder_logs": dec_logs,
            "timings": "fake",
        }

    class Node:
        def __init__(self, rank=0, tp=1, pp=2, env=None, spec=None):
            self.text = ""
            if "rank_silent" not in MUTATIONS or rank < tp * pp - 1:
                self.text += (
                    f"rank {rank} in world size {tp * pp} is assigned as DP rank 0, PP rank "
                    f"{rank // tp}, PCP rank 0, TP rank {rank % tp}, ETP rank 0\n"
                )
            for size in {s for s in (tp, pp) if s > 1}:
                self.text += f"NCCL INFO comm 0x1 rank 0 nRanks {size} nNodes {size}\n"
            self.text += "NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>\n"
            if pp > 1 and (MUTATION != "pp_one_stage" or rank == 0):
                self.text += (
                    f"PP handshake: {tp * pp} ranks agree\nDSpark PP exchange: fake over nccl\n"
                )
            if rank // tp == pp - 1 and graph_batch.KEY in (spec or {}):  # the drafter's ranks
                for n in (1, 10, 100):  # the patch logs its count at 1, 10, 100, ...
                    self.text += (
                        f"DSpark drafter dispatch pinned to the fixed graph batch of "
                        f"{spec[graph_batch.KEY]} requests (64 tokens): {n} pinned dispatches "
                        "so far\n"
                    )
            taps = (env or {}).get("VLLM_DSPARK_PP_TAP_PARTIALS")
            if pp > 1 and taps in ("1", "side"):
                self.text += _tap_lines(rank // tp, pp, taps)
            if pp > 1 and (env or {}).get("VLLM_DSPARK_PP_DRAFT_DIGEST"):
                digest = 0x1234ABCD + (rank == tp * pp - 1 and "digest_differs" in MUTATIONS)
                self.text += (
                    f"DSpark drafts digest: PP rank {rank // tp}, TP rank {rank % tp}, global "
                    f"rank {rank}: 16 draft posts, digest {digest:#010x}\n"
                )

        def log_tail(self, n):
            return self.text

    def _tap_lines(stage: int, pp: int, mode: str) -> str:
        """What a stage of the tiny pair (hidden 128, float32) logs with tap partials on (the
        plugin's formats, protocol/tap_partials.py); ``taps_in_dict``: the side channel's
        stages still send the partial in the intermediate tensors."""
        row = "hidden_states 512 B, residual 512 B"
        # TapSideChannel.connect's start-up lines (``side_unconnected``: none, as before it)
        links = mode == "side" and MUTATION != "side_unconnected"
        if stage == pp - 1:
            senders = ", ".join(str(s) for s in range(pp - 1))
            return (
                "DSpark tap partials on, side channel (VLLM_DSPARK_PP_TAP_PARTIALS=side): ...\n"
                + (f"DSpark tap partials: side channel connected (from PP ranks {senders})\n"
                   if links else "")
                if mode == "side"
                else "DSpark tap partials on (VLLM_DSPARK_PP_TAP_PARTIALS=1): ...\n"
            )  # fmt: skip
        if mode == "1" or MUTATION == "taps_in_dict":
            row = f"dspark_tap_partial 512 B, {row}"
        text = f"DSpark PP stage {stage} sends per token row: {row}\n"
        if links:
            text += f"DSpark tap partials: side channel connected (to PP rank {pp - 1})\n"
        if mode == "side":
            text += (
                f"DSpark PP stage {stage} sends on the side channel per token row: "
                f"dspark_tap_partial 512 B (to PP rank {pp - 1}, first step 27 rows, 13824 B)\n"
            )
        return text

    class Deployment:
        def __init__(self, name, target, **kw):
            CALLS.append(["pp", name, target, kw.get("spec"), kw.get("base_args"), kw.get("tp")])
            self.k = (kw.get("spec") or {}).get("num_speculative_tokens", 0)
            tp, pp = kw.get("tp", 1), kw.get("pp", 2)
            # the served counters follow this deployment's k (dummy mode drafts 4, trained 7)
            self.nodes = [Node(r, tp, pp, kw.get("env"), kw.get("spec")) for r in range(tp * pp)]
            # the tap control's probe zeroes the early stages' blocks: the drafter reads another
            # context, so it accepts less (``taps_wrong_unseen``: as much as ever)
            wrong = (kw.get("env") or {}).get("DSPARK_TEST_TAP_WRONG_BLOCK") == "1"
            wrong = wrong and MUTATION != "taps_wrong_unseen"
            self.url = f"fake://{name}{'-wrong' if wrong else ''}/k{self.k}"
            self.refused = _stock_refuses(target, kw)
            if self.refused:  # the last stage loads the model and raises; its launcher exits
                self.nodes[-1].text += f"ValueError: {V41} {STOCK_PP_REFUSAL}\n"

        def start(self):
            return self

        def wait_ready(self, timeout_s):
            if self.refused:
                raise RuntimeError(f"fake: {self.dead_nodes()[0]} exited before /health")
            return 1.0

        def dead_nodes(self):
            return [f"node {len(self.nodes) - 1} (exit 1)"] if self.refused else []

        def stop(self, grace_s=10.0):
            return []

    def deployment(name, target, **kw):
        return Deployment(name, target, **kw)

    def serve_waves(url, model, waves, max_tokens, *, ignore_eos=False, timeout_s=120.0):
        CALLS.append(["serve", model, max_tokens, ignore_eos])
        k = int(url.rsplit("/k", 1)[1]) if url.startswith("fake://") else len(GOOD)
        per = _good(k) if MUTATION != "pp2_low" else [*_good(k)[:-2], 1, 0]
        if "-wrong/" in url:
            per = [max(0, n // 3 - 2 * i) for i, n in enumerate(per)]
        return [t for w in waves for t in _tokens(w)], [_counters(per) for _ in waves]

    class NcclStubGuard:
        def __init__(self, work_dir, site=None):
            self.so, self.problem = Path(work_dir) / "libnccl_stub_loud.so", None

        def build(self):
            return self

        def env(self):
            return {"DSPARK_FAKE_NCCL_GUARD": "1"}

        symbols = ["ncclCommInitRankScalable"]

        def calls(self):
            return ["ncclCommInitRankScalable"] if MUTATION == "nccl_stub_called" else []

    g.run_llm, pd.run_pd = run_llm, run_pd
    multi_gpu.NcclStubGuard = NcclStubGuard
    pp_launch.deployment, pp_launch.serve_waves = deployment, serve_waves


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    import sys

    for item in items:  # engines are faked: lift the no-CUDA skips
        item.own_markers = [m for m in item.own_markers if m.name != "skip"]
    pp_tier = sys.modules.get("test_pp_one_gpu")  # imported by the TP x PP module too
    if pp_tier is not None:

        def abort_mid_stream(url, prompt, after_chunks=4):
            CALLS.append(["abort", url, after_chunks])
            return {"chunks_read": after_chunks, "running_after_s": 0.0, "running": 0}

        pp_tier._abort_mid_stream = abort_mid_stream


def pytest_unconfigure(config):
    out = os.environ.get("DSPARK_FAKE_CALLS")
    if out:
        with open(out, "w") as f:
            json.dump(CALLS, f, indent=1, default=str)
