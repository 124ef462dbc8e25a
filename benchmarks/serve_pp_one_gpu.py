#!/usr/bin/env python3
"""Served curves at PP=1 and PP=2 on one GPU: ``vllm bench serve`` vs ``vllm serve`` (issue 29).

One GPU command per group of configurations, each under about 470 s of wall time including the
server starts (``--budget-s``), after the kit is booted (tools/gpu/README.md):

    source /tmp/site/env.sh && python3 tools/gpu/check_kit.py /tmp/site && \\
      python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade \\
        --target /tmp/site . && rm -rf build ./*.egg-info && \\
      PYTHONUNBUFFERED=1 python3 -m benchmarks.serve_pp_one_gpu \\
        --configs pp1 --out $OUT
    ... --configs pp2      (PP=2 no-spec + PP=2 DSpark, two launchers each)
    ... --configs stock    (PP=2 no-spec with the plugin left out, and with it, same lease)
    ... --configs pd --budget-s 520   (PD vs aggregated, AL 3.99; three engines on the GPU)
    ... --configs pd_mc_ipc --interleave --repeats 3 --concurrency 8,32 \\
        --acceptance-lengths 3.99 --workload mixed --budget-s 540
                                      (aggregated, PD over Mooncake TCP and over Mooncake's
                                      intra-node CUDA IPC transport, in rotation)
    ... --configs pp1_dspark,pp2_dspark --interleave --repeats 3 --concurrency 8,16,32 \\
        --acceptance-lengths 3.99 --workload decode [--mps 50,50] --budget-s 540
                                      (PP=1 vs PP=2 DSpark in rotation, ratios from one call)
    ... --configs ksweep_pp2 --interleave --repeats 3 --model-dir models/tiny-pair --kv-gib 1 \\
        --workload decode --output-len 768 \\
        --env DSPARK_BENCH_SYNTHETIC_SCHEDULE=geometric --env DSPARK_BENCH_CONFIDENCES=draft
                                      (fixed k = 1..7 and adaptive in rotation, PP=2)
    python3 -m benchmarks.plot_pp_one_gpu RUN*/serve_pp_one_gpu_*.json \\
        --md docs/results/perf_pp_one_gpu.md --png docs/results/perf_pp_one_gpu.png \\
        --copy-to docs/results

Configurations (``--configs``: group names or configuration names, comma-separated):

* ``pp1_nospec`` / ``pp1_dspark``: one ``vllm serve``;
* ``pp2_nospec`` / ``pp2_dspark``: two launchers (``vllm serve --nnodes 2 --node-rank R``,
  node 1 ``--headless``; composed by dspark_dev/pp_launch.py), both on GPU 0 with their own
  ``NCCL_HOSTID`` and NCCL over loopback sockets, or one GPU per stage with
  ``--gpu-layout per-stage``;
* ``pp2_nospec_stock`` (and ``pp2_dspark_stock``, by name only): the same launchers with the
  plugin left out of ``VLLM_PLUGINS`` (stock vLLM 0.34.0 under PP, async scheduling).

* ``pd_dspark``: PD over MooncakeConnector on GPU 0 (protocol ``tcp`` unless
  ``DSPARK_PD_MOONCAKE_PROTOCOL`` names another), composed by dspark_dev/pd_launch.py:
  the DSpark prefill-only producer (``kv_producer``: the plugin's context-KV-only drafter, no
  drafts scheduled) and the DSpark decoder (``kv_consumer``), same speculative config, each with
  its own ``VLLM_PORT`` block, the producer's Mooncake bootstrap port named to the proxy;
  dspark_dev/pd_proxy.py in its own process (started once both engines answer and the bootstrap
  server lists the producer's engine) is what ``vllm bench serve`` targets: it prefills on the
  producer (one token) and streams the decoder's answer back. The acceptance switch, the step
  timers and the spec-decode counters go to the decoder; each point also records the decoder's
  KV-connector counters (prompt tokens pulled over the connector), the producer's draft tokens,
  the connector's transfer histograms (time, bytes, descriptors per transfer batch:
  ``pd.kv_xfer``), the proxy's request/error counts and its per-request hop times (prefill
  sent / answered, decode sent, first / last token: ``pd.hops``, records and
  :func:`hop_summary`, which says in which span requests queue) (``pd``);
* ``pd_nixl_dspark`` (group ``pd_nixl``): ``pd_dspark`` over NixlConnector instead (UCX
  ``cuda_ipc,cuda_copy,tcp`` on ``lo``: the KV copied GPU to GPU over CUDA IPC; no bootstrap
  server, each engine its own NIXL side-channel port; pd_launch.ucx_env);
* ``pd_mc_ipc_dspark`` (group ``pd_mc_ipc``, with ``agg_dspark_kv`` and ``pd_dspark``):
  ``pd_dspark`` over Mooncake's intra-node transport (``"mooncake_protocol": "nvlink_intra"``
  and ``MC_INTRANODE_NVLINK=1`` on producer and decoder, pd_launch.mooncake_env: the producer
  writes the KV into the decoder's blocks with device-to-device copies through CUDA IPC instead
  of Mooncake's TCP transport; docs/pd_transport.md), PP=1 producer; ``pd_pp2_mc_ipc_dspark``
  the same with a PP=2 producer (group ``pd_mc_ipc_goal``, with ``agg_dspark_kv`` and
  ``pd_mc_ipc_dspark``: issue 44's PD goal point without the TCP side);
* ``pd_pp2_dspark`` (by name only): the same with a PP=2 producer (two launchers, one stage
  each, both ``kv_producer`` with one engine id; the producer's KV bytes split over them; the
  decoder pulls from both stages), the decoder PP=1;
* ``agg_dspark_kv``: one aggregated DSpark ``vllm serve`` whose ``--kv-cache-memory-bytes`` is
  the producer's plus the decoder's (``--pd-kv-gib`` per side, the decoder
  ``--pd-decoder-share`` of it, whole MiB; :func:`kv_plan`).

* ``pp2_dspark_taps_dict`` / ``pp2_dspark_taps_side`` (group ``tap_partials``, with
  ``pp2_dspark``): ``pp2_dspark`` with ``VLLM_DSPARK_PP_TAP_PARTIALS=1`` (the first stage's aux
  taps cross as one partial sum inside the intermediate tensors) / ``=side`` (the partial goes
  straight to the last stage on its own process group, off the critical path); the exchange
  table then has the bytes per step stage to stage and on the side channel, and the last
  stage's waits (``pp_recv_wait_ms``, ``side_wait_ms``). The partial sums read the draft's first
  linear from its checkpoint: with ``--shape`` (dummy weights) the benchmark writes a random
  ``fc.weight`` into the shape's draft folder when such a configuration is selected
  (real_shapes.write_context_linear; ``meta.tap_partials_weights`` says what), with
  ``--model-dir`` the pair's own is read.
* ``pp1_dspark_adaptive`` / ``pp2_dspark_adaptive``: ``pp1_dspark`` / ``pp2_dspark`` with
  ``"enable_adaptive_verification": true`` (vLLM's default CUDA-graph mode, which has the full
  graphs it needs; not with ``--cpu``), ``VLLM_DSPARK_PP_ADAPTIVE_PP=1`` on every launcher, and
  ``DSPARK_BENCH_CONFIDENCES=synthetic``: the synthetic sampler's own per-position rates replace
  the dummy draft's confidences, which are about 0.5 everywhere and unrelated to what the sampler
  accepts (``--env DSPARK_BENCH_CONFIDENCES=draft`` keeps the draft's;
  benchmarks/dspark_bench_hooks.py, benchmarks/adaptive_bench.py).
  Their groups: ``adaptive_pp1`` = pp1_dspark + pp1_dspark_adaptive, ``adaptive_pp2`` =
  pp2_dspark + pp2_dspark_adaptive (two: four DSpark deployments' CUDA-graph starts and sweeps
  do not fit one GPU command), ``adaptive_lag`` = pp2_dspark + ``pp2_dspark_adaptive_lag0``
  (``VLLM_DSPARK_PP_ADAPTIVE_LAG=0`` on its launchers only: the counts decided in the round they
  are applied, as before 2026-12-05) + pp2_dspark_adaptive (the default lag: 2 under async
  scheduling, 1 without).
* ``pp1_dspark_adaptive_stock``: ``pp1_dspark_adaptive`` with the plugin left out (vLLM's own
  adaptive path; the benchmark hook stays). Group ``adaptive_stock`` = pp1_dspark_k7 +
  pp1_dspark_adaptive + pp1_dspark_adaptive_stock: whether adaptive's cost against k = 7 at PP=1
  (issue 44 goal (g)) is vLLM's own.
* ``pp1_dspark_k1`` .. ``pp1_dspark_k7`` / ``pp2_dspark_k1`` .. ``pp2_dspark_k7``: DSpark with
  that many draft tokens (the others draft ``-k``). Groups ``ksweep_pp1`` / ``ksweep_pp2``: the
  seven fixed k and the adaptive deployment of that PP size (issue 44 item 5: adaptive against
  the *best* fixed k, not only k = 7), meant for ``--interleave`` (every server starts
  together; eight deployments: use a small pair, ``--model-dir models/tiny-pair``, and a small
  ``--kv-gib``; the tiny pair has 1,024 positions, so a workload's input + output + 128 must fit
  them, e.g. ``--workload decode --output-len 768``: a longer one is refused at start). Where
  the DSpark configurations draft different k, every server gets
  ``DSPARK_BENCH_PROFILE_POSITIONS`` = the largest k: the acceptance profile is the largest k's
  and a shorter k keeps its first positions (the same per-position rates, so a shorter k accepts
  fewer tokens). With ``--env DSPARK_BENCH_SYNTHETIC_SCHEDULE=geometric`` the profile is
  geometric (one conditional rate at every position); ``--env DSPARK_BENCH_CONFIDENCES=draft``
  keeps the draft's own confidence head (non-oracle) instead of the sampler's rates. Each
  interleaved point then has ``adaptive_vs_best_fixed``: the fixed k of the highest mean output
  tok/s at that point and adaptive against it (ratio of means, per rotation).

Groups: ``pp1`` = pp1_nospec + pp1_dspark, ``pp2`` = pp2_nospec + pp2_dspark, ``stock`` =
pp2_nospec_stock + pp2_nospec, ``pd`` = agg_dspark_kv + pd_dspark (AL 3.99 unless
``--acceptance-lengths`` says otherwise: three engines' start leaves one sweep per side),
``pd_nixl`` = agg_dspark_kv + pd_nixl_dspark, ``pd_mc_ipc`` = agg_dspark_kv + pd_dspark +
pd_mc_ipc_dspark, ``pd_mc_ipc_goal`` = agg_dspark_kv + pd_mc_ipc_dspark + pd_pp2_mc_ipc_dspark,
``stock_dspark`` = pp2_dspark_stock + pp2_dspark (the plugin's cost with DSpark at PP=2),
``split`` = pp1_dspark + pp2_dspark + pp2_dspark_balanced (issue 44 item 3: ``*_balanced`` serve
PP=2 with ``VLLM_PP_LAYER_PARTITION`` set to vllm_dspark_pp.stage_balance's split for the served
pair, what ``vllm-dspark-pp plan`` recommends; ``meta.stage_split`` records it with the even
split and both splits' modelled stage costs; on the one GPU the stages only overlap under
``--mps``). A run's ``meta.pd_transport`` says each PD configuration's connector, Mooncake
protocol and the transport variables its engines got; ``servers.<name>.mooncake_transport`` what
the engines' logs say vLLM passed and Mooncake installed.
Every server of a group starts at once (``--start together``:
an idle server computes nothing, so it does not disturb the one being measured; ``sequential``
starts each just before its sweep).

Model: the Qwen3-8B shape (benchmarks/real_shapes.py, ``--load-format dummy``, bf16) with a
local tokenizer of its vocabulary (benchmarks/shape_tokenizer.py), DSpark k=7 with vLLM's
synthetic rejection sampler. One DSpark server serves every acceptance length (``--acceptance-
lengths``, AL 3.99 and 6.1): before each AL's sweep the driver calls the benchmark hook
``dspark_bench_ctl("set_acceptance_length", AL)`` on every worker through vLLM's own
``POST /collective_rpc`` (enabled by ``VLLM_SERVER_DEV_MODE=1``, set for every server alike),
which rewrites the rates tensor the sampler reads in place; the call must report it applied on
the last stage.

Per point (configuration, AL, concurrency C): ``vllm bench serve`` (vLLM's own client, run in
this process through its own argument parser and ``main``, so one Python start serves every
point; the equivalent command line is recorded), random dataset ``--input-len`` / ``--output-len``
(1024 / 256), ``ignore_eos``, greedy, ``max(--min-prompts, --prompts-per-c x C)`` prompts, a seed
that depends on (AL index, C) only, so every configuration sees the same prompts and a server
never sees a prompt twice (no prefix-cache hits); the server's spec-decode counters
(``/metrics`` deltas, dspark_dev/metrics.py) beside vLLM's result JSON (its scalar fields;
per-request lists are not saved). For PP=2 the launchers' logs give the transport: NCCL's init
lines (ranks, nodes, ``NET/Socket``) and the plugin's exchange line.

Workloads (``--workload``, recorded in the JSON's ``meta.workload``): ``mixed``, 1024 prompt /
256 output tokens (every served run before issue 44), and ``decode``, 128 / 1024 (decode-heavy:
where PP's per-step exchange and the last stage's draft bubble weigh most). ``--input-len`` /
``--output-len`` override either part.

Interleaved comparison (``--interleave --repeats N``, N >= 3; issue 44 item 1): sweeps measured
one configuration after another, compared across calls, gave ratios that moved more between
calls than the effects they measured. With ``--interleave`` every server starts together and
each point (AL, C) measures the configurations in rotation, A B A B ... (``--rotation
alternate``: A B B A ...), N runs each, all with the same prompt count; repeat r of every
configuration gets the same prompts (seed of (AL index, C, r)), and no server sees a prompt
twice. The prompt count is the larger of the usual one and what makes the fastest
configuration's run last ``--min-run-s`` (default 60 s; whole waves of C, from its last measured
TPOT; a server with none measured yet first serves one probe wave of C, recorded with ``probe``
true and not counted, which sets its TPOT but not its calibration; no probe where the probes and
one wave per run of the point would not fit the time left, ``--no-probe`` to skip it); when the
point's share of the budget does not hold N runs of
every configuration at that length, every run of the point is shortened alike (whole waves) and
the point's ``trimmed`` says how; a point where not even one wave per run fits is skipped with the
reason. Besides every run in ``points`` (with ``repeat`` and ``slot``, its place in the rotation),
``interleaved`` holds per point: each configuration's repeats (output tok/s; TTFT, TPOT and ITL
p50 (vLLM's ``median_*_ms``) and p99 (``p99_*_ms``); the run's duration; the measured acceptance
length), their mean, min, max and relative spread ((max - min) / mean), and each configuration
against the first one named in ``--configs`` (the baseline), from this call only: the ratio of
the means and the per-rotation ratios (repeat r over repeat r, measured next to each other) with
their range. A point cut at the deadline keeps its rotations that completed; ratios pair only
repeats both sides measured. A run with any failed request counts as failed
(:func:`bench_failure`); its configuration (or one whose server was lost) leaves the comparison,
its servers are stopped (their GPU memory goes back to the others) and the others' rotations go
on, unless it is the baseline or fewer than two would remain, which ends the comparison; either
way the command exits 1.

CUDA MPS (``--mps P0,P1``; issue 44 item 2; ran on an H100 on 2026-12-06: ``meta.mps.used``
true, docs/results/perf_interleaved_gpu.md): benchmarks/mps.py starts an
MPS control daemon for this command (pipe and log folders in a fresh /tmp folder, never the GPU's
compute mode, never a reset), probes it with one small CUDA client, gives PP stage R's launcher
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=P_R`` and the daemon's folders (through
dspark_dev/pp_launch.deployment's ``env_per_rank``), and stops it when the command ends, also on
an error or SIGTERM. PP=1 servers stay outside MPS. When MPS cannot start (binary missing,
refused, the probe cannot attach) the log says ``MPS NOT USED`` with the reason, the run goes on
without it, and ``meta.mps`` records what happened.

The result files carry the options in their name: ``<configs>[_<workload>][_x<N>][_mps<P0-P1>]``
(``_decode`` only for the non-default workload).

Budget: the servers' start and the sweeps share ``--budget-s``. Before each point the driver
estimates its cost from the server's last measured TPOT (or ``--guess-tpot-ms``) and the time
left for the sweeps still to come: it cuts the point's prompts (whole waves of C, at least one)
and skips a point when not even one wave fits; the skip is recorded with its reason. A point
still running at the deadline is cut by stopping its server. Each point is written to the JSON
as soon as it is measured, so a killed run keeps what it measured.

Output (two files per command, well inside what comes back from the GPU machine):
``OUT/serve_pp_one_gpu_<group>.json`` and ``OUT/serve_pp_one_gpu_<group>.log`` (this driver's
progress and the useful lines of every server log). ``--dry-run`` prints every command and
environment without starting anything (no GPU needed). ``--cpu`` runs the same plumbing on vLLM's
CPU platform with a small model folder (``--model-dir``, e.g. models/tiny-pair): numbers
meaningless, plumbing checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.adaptive_bench import adaptive_env, check_args, confidences_of
from benchmarks.dspark_bench_hooks import PROFILE_ENV
from benchmarks.perf_real_shapes import BENCH_PLUGIN, PLUGIN, make_hook_dist
from benchmarks.real_shapes import SHAPES, write_context_linear, write_shape
from dspark_dev.pd_launch import mooncake_transport_evidence
from dspark_dev.pp_launch import transport_evidence
from dspark_dev.provenance import record_commit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

RESULT_PREFIX = "serve_pp_one_gpu"


@dataclass(frozen=True)
class Config:
    name: str
    pp: int
    spec: bool
    plugin: bool = True
    pd: bool = False  # prefill-only producer + decoder + proxy (dspark_dev/pd_launch.py)
    pd_kv: bool = False  # KV budget --pd-kv-gib (the PD group's total) instead of --kv-gib
    adaptive: bool = False  # enable_adaptive_verification (benchmarks/adaptive_bench.py)
    connector: str = "mooncake"  # a PD deployment's KV connector (pd_launch.CONNECTORS)
    # a Mooncake PD deployment's protocol (pd_launch.MOONCAKE_PROTOCOLS; None: the tooling knob
    # DSPARK_PD_MOONCAKE_PROTOCOL, default tcp)
    mooncake_protocol: str | None = None
    k: int | None = None  # num_speculative_tokens of this configuration (None: the driver's -k)
    env: tuple[tuple[str, str], ...] = ()  # launcher variables of this configuration only
    # VLLM_PP_LAYER_PARTITION from `vllm-dspark-pp plan`'s stage balance for the served pair
    # (issue 44 item 3): the cost model's split instead of vLLM's even one
    balanced: bool = False


TAPS_ENV = "VLLM_DSPARK_PP_TAP_PARTIALS"
#: The fixed-k configurations of the k sweep (issue 44 item 5): ``pp{P}_dspark_k{J}``.
SWEEP_KS = tuple(range(1, 8))


CONFIGS = {
    c.name: c
    for c in (
        Config("pp1_nospec", 1, False),
        Config("pp1_dspark", 1, True),
        Config("pp2_nospec", 2, False),
        Config("pp2_dspark", 2, True),
        Config("pp2_nospec_stock", 2, False, plugin=False),
        Config("pp2_dspark_stock", 2, True, plugin=False),
        Config("pp1_dspark_adaptive", 1, True, adaptive=True),
        Config("pp2_dspark_adaptive", 2, True, adaptive=True),
        Config("pp1_dspark_adaptive_stock", 1, True, plugin=False, adaptive=True),
        # the counts of the verify step decided in the same round (lag 0, before 2026-12-05)
        Config(
            "pp2_dspark_adaptive_lag0",
            2,
            True,
            adaptive=True,
            env=(("VLLM_DSPARK_PP_ADAPTIVE_LAG", "0"),),
        ),  # fmt: skip
        # aux taps as one partial sum (issue 44 item 4) in the intermediate tensors ("1") and
        # on the side channel straight to the last stage ("side"); the draft's first linear is
        # read from its checkpoint: the pair's own (--model-dir), or at a dummy-weight shape the
        # random fc.weight prepare_models writes for them (real_shapes.write_context_linear)
        Config("pp2_dspark_taps_dict", 2, True, env=((TAPS_ENV, "1"),)),
        Config("pp2_dspark_taps_side", 2, True, env=((TAPS_ENV, "side"),)),
        Config("pp2_dspark_balanced", 2, True, balanced=True),
        Config("pp2_nospec_balanced", 2, False, balanced=True),
        Config("pd_dspark", 1, True, pd=True, pd_kv=True),
        Config("agg_dspark_kv", 1, True, pd_kv=True),
        Config("pd_pp2_dspark", 2, True, pd=True, pd_kv=True),
        Config("pd_nixl_dspark", 1, True, pd=True, pd_kv=True, connector="nixl"),
        # Mooncake's intra-node transport: CUDA IPC device-to-device copies (docs/pd_transport.md)
        Config("pd_mc_ipc_dspark", 1, True, pd=True, pd_kv=True, mooncake_protocol="nvlink_intra"),
        # the same with a PP=2 producer (two launchers), the decoder PP=1
        Config(
            "pd_pp2_mc_ipc_dspark", 2, True, pd=True, pd_kv=True, mooncake_protocol="nvlink_intra"
        ),
        *(Config(f"pp{pp}_dspark_k{j}", pp, True, k=j) for pp in (1, 2) for j in SWEEP_KS),
    )
}
GROUPS = {
    "pp1": ("pp1_nospec", "pp1_dspark"),
    "pp2": ("pp2_nospec", "pp2_dspark"),
    # with vs without adaptive verification; one GPU command each (CUDA-graph starts)
    "adaptive_pp1": ("pp1_dspark", "pp1_dspark_adaptive"),
    "adaptive_pp2": ("pp2_dspark", "pp2_dspark_adaptive"),
    # adaptive with the counts decided early (the default lag: 2 under async scheduling) and in the
    # same round
    "adaptive_lag": ("pp2_dspark", "pp2_dspark_adaptive_lag0", "pp2_dspark_adaptive"),
    # goal (g)'s PP=1 cost: k = 7 and adaptive with the plugin, adaptive without it (vLLM's own)
    "adaptive_stock": ("pp1_dspark_k7", "pp1_dspark_adaptive", "pp1_dspark_adaptive_stock"),
    # adaptive verification against every fixed k (1..7) in one interleaved call; its summary
    # names the best fixed k of each point (best_fixed_summary)
    "ksweep_pp1": (*(f"pp1_dspark_k{j}" for j in SWEEP_KS), "pp1_dspark_adaptive"),
    "ksweep_pp2": (*(f"pp2_dspark_k{j}" for j in SWEEP_KS), "pp2_dspark_adaptive"),
    "stock": ("pp2_nospec_stock", "pp2_nospec"),
    # issue 44 item 1: the plugin's cost at PP=2 with DSpark (stock vLLM 0.34.0 serves PP=2
    # DSpark under async scheduling; it hangs under sync, docs/sync-scheduling.md)
    "stock_dspark": ("pp2_dspark_stock", "pp2_dspark"),
    # raw taps (vLLM's relay), one partial in the intermediate tensors, one on the side channel:
    # bytes per step stage to stage and on the side channel, and the last stage's waits
    # (the exchange table); meant for --interleave with --model-dir (a pair with weights)
    "tap_partials": ("pp2_dspark", "pp2_dspark_taps_dict", "pp2_dspark_taps_side"),
    # issue 44 item 3: vLLM's even layer split against plan's split around the last-stage
    # drafter, PP=1 beside them (meant for --interleave, and --mps for stages that overlap)
    "split": ("pp1_dspark", "pp2_dspark", "pp2_dspark_balanced"),
    # the aggregated reference first: a PD side that stalls (a KV pull that never completes) is
    # cut at the deadline and must not take the reference's measurements with it
    "pd": ("agg_dspark_kv", "pd_dspark"),
    # the same over NixlConnector (UCX cuda_ipc on one GPU: device-to-device copies), issue 29's
    # test of the Mooncake TCP transport as PD's ceiling; needs the kit's nixl group
    "pd_nixl": ("agg_dspark_kv", "pd_nixl_dspark"),
    # aggregated, Mooncake over TCP, Mooncake's intra-node (CUDA IPC) transport: what the TCP hop
    # costs PD on one GPU, and whether Mooncake itself can take it off (meant for --interleave)
    "pd_mc_ipc": ("agg_dspark_kv", "pd_dspark", "pd_mc_ipc_dspark"),
    # issue 44's PD goal point (C = 64) without the slow TCP side: aggregated, PD over the
    # intra-node transport with a PP=1 and with a PP=2 producer
    "pd_mc_ipc_goal": ("agg_dspark_kv", "pd_mc_ipc_dspark", "pd_pp2_mc_ipc_dspark"),
}
#: --acceptance-lengths when not given: the PD comparison sweeps AL 3.99 only (its servers'
#: start leaves time for one sweep each within one GPU command).
DEFAULT_ALS = "3.99,6.1"
PD_DEFAULT_ALS = "3.99"
READY_S = 360.0
PD_READY_S = 450.0
STOP_RESERVE_S = 25.0  # stopping the servers and writing the files at the end


def select_configs(text: str) -> list[Config]:
    """``--configs``: group and configuration names, comma-separated, in order, no repeats."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in GROUPS:
            names += GROUPS[part]
        elif part in CONFIGS:
            names.append(part)
        else:
            known = ", ".join([*GROUPS, *CONFIGS])
            raise SystemExit(f"--configs: unknown name {part!r}; use one of: {known}")
    if not names:
        raise SystemExit("--configs: nothing selected")
    return [CONFIGS[n] for n in dict.fromkeys(names)]


def run_tag(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", text.strip()).strip("-")


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise SystemExit(f"--concurrency {text!r}: positive integers, comma-separated")
    return vals


def point_seed(al_index: int, concurrency: int, repeat: int = 0) -> int:
    """The random dataset's seed of a point: equal across configurations (same prompts for
    no-spec and DSpark at the same C and repeat), distinct across one server's points and
    repeats (no prefix-cache hits). One decimal field each: C below 10,000, the AL index below
    50 (under :data:`PROBE_SEED_OFFSET`), then the repeat (before 2026-12-07 the AL index moved
    the seed by 100 only, so AL 0 at C = 128 and AL 1 at C = 28 shared their prompts)."""
    if not (0 < concurrency < 10_000 and 0 <= al_index < 50 and repeat >= 0):
        raise ValueError(
            f"no distinct seed for AL index {al_index}, C {concurrency}, repeat {repeat}"
        )
    return 1000 + concurrency + 10_000 * al_index + 1_000_000 * repeat


#: added to a point's seed for its probe runs (:meth:`Runner.probe`): above every AL index's
#: field and below the repeats' step, so a probe's prompts are never a measured run's
PROBE_SEED_OFFSET = 500_000


#: ``--workload``: (input tokens, output tokens) of the random dataset. ``mixed`` is the 1024/256
#: every earlier served run used; ``decode`` is decode-heavy (short prompts, long answers: the
#: regime where PP's per-step exchange and the draft bubble weigh most).
WORKLOADS = {"mixed": (1024, 256), "decode": (128, 1024)}
DEFAULT_WORKLOAD = "mixed"


def default_prompts(concurrency: int, per_c: int, minimum: int) -> int:
    return max(minimum, per_c * concurrency)


# --------------------------------------------------------------------------- budget
@dataclass(frozen=True)
class CostModel:
    """Estimated seconds of a point: a fixed part (the client's start, dataset, tokenizer) plus
    per wave of C requests the decode (output length x TPOT) and the wave's prefills; times
    ``calib``, the last point's measured / estimated wall time on this server."""

    tpot_ms: float
    output_len: int
    prefill_ms: float
    point_s: float
    calib: float = 1.0

    def wave_s(self, c: int) -> float:
        return self.calib * (self.output_len * self.tpot_ms + c * self.prefill_ms) / 1e3

    def point_cost_s(self, c: int, prompts: int) -> float:
        return self.calib * self.point_s + math.ceil(prompts / c) * self.wave_s(c)


def trim_point(
    c: int, prompts: int, model: CostModel, time_for_point_s: float
) -> tuple[int, str | None]:
    """Prompts to run at concurrency ``c`` within ``time_for_point_s``: all of them, fewer
    (whole waves, at least one), or 0 (skip) with the reason."""
    waves = math.ceil(prompts / c)
    if model.point_cost_s(c, prompts) <= time_for_point_s:
        return prompts, None
    wave = model.wave_s(c)
    room = time_for_point_s - model.calib * model.point_s
    fit = min(waves, int(room // wave)) if wave > 0 else waves
    if fit < 1:
        return 0, (
            f"budget: one wave of {c} needs about {model.point_cost_s(c, c):.0f} s, "
            f"{time_for_point_s:.0f} s left for this point"
        )
    return fit * c, f"budget: {fit} of {waves} waves ({fit * c} of {prompts} prompts)"


def plan_point(
    c: int,
    later_cs: list[int],
    later_sweeps: int,
    all_cs: list[int],
    time_left_s: float,
    model: CostModel,
    prompts_for,
) -> tuple[int, str | None]:
    """Prompts for the point at ``c``: its share of ``time_left_s`` among the points still to
    run (``later_cs`` in this sweep, then ``later_sweeps`` whole sweeps over ``all_cs``, each
    estimated with ``model``)."""

    def cost(cc: int) -> float:
        return model.point_cost_s(cc, prompts_for(cc))

    later = [cost(cc) for cc in later_cs] + [sum(cost(cc) for cc in all_cs)] * later_sweeps
    share = time_for_point(time_left_s, cost(c), later)
    return trim_point(c, prompts_for(c), model, share)


def time_for_point(time_left_s: float, this_cost_s: float, later_costs_s: list[float]) -> float:
    """This point's share of the time left: proportional to its estimated cost among the points
    still to run (so a cut falls on every later point alike, not all on the last)."""
    total = this_cost_s + sum(later_costs_s)
    if total <= 0:
        return time_left_s
    return max(0.0, time_left_s * this_cost_s / total) if total > time_left_s else time_left_s


# --------------------------------------------------------------------------- interleaved repeats
def rotation_order(names: list[str], repeats: int, order: str = "fixed") -> list[tuple[int, str]]:
    """(repeat, configuration) in the order one point measures them: ``fixed`` A B A B ...,
    ``alternate`` A B B A A B ... (each configuration first as often as the other, give or
    take one rotation)."""
    out = []
    for r in range(repeats):
        seq = list(names) if order == "fixed" or r % 2 == 0 else list(reversed(names))
        out += [(r, n) for n in seq]
    return out


def steady_prompts(c: int, run_s: float, wave_s: float, minimum: int) -> int:
    """Prompts at concurrency ``c`` (whole waves of ``c``) for a run of at least ``run_s`` when
    a wave takes ``wave_s``, and at least ``minimum`` prompts."""
    waves = max(1, math.ceil(minimum / c), math.ceil(run_s / wave_s) if wave_s > 0 else 1)
    return waves * c


def interleaved_cost_s(c: int, prompts: int, models: list[CostModel], repeats: int) -> float:
    """Estimated seconds of one interleaved point: ``repeats`` runs of every configuration."""
    return repeats * sum(m.point_cost_s(c, prompts) for m in models)


def wanted_prompts(c: int, models: list[CostModel], min_run_s: float, minimum: int) -> int:
    """The point's prompt count before the budget: long enough that the fastest configuration's
    run lasts ``min_run_s`` (so every configuration's does)."""
    return steady_prompts(c, min_run_s, min(m.wave_s(c) for m in models), minimum)


def plan_interleaved_point(
    c: int, models: list[CostModel], repeats: int, want: int, time_for_s: float
) -> tuple[int, str | None]:
    """Prompts per run at ``c`` (the same for every configuration and repeat) within
    ``time_for_s``: ``want``, fewer whole waves (at least one), or 0 (skip) with the reason."""
    if interleaved_cost_s(c, want, models, repeats) <= time_for_s:
        return want, None
    fixed = repeats * sum(m.calib * m.point_s for m in models)
    per_wave = repeats * sum(m.wave_s(c) for m in models)
    waves = want // c
    fit = min(waves, int((time_for_s - fixed) // per_wave)) if per_wave > 0 else waves
    runs = f"{repeats} x {len(models)} runs"
    if fit < 1:
        return 0, (
            f"budget: one wave of {c} per run ({runs}) needs about {fixed + per_wave:.0f} s, "
            f"{time_for_s:.0f} s left for this point"
        )
    run_s = fit * min(m.wave_s(c) for m in models)
    return fit * c, (
        f"budget: {fit} of {waves} waves per run ({fit * c} of {want} prompts, {runs}; the "
        f"fastest configuration's run about {run_s:.0f} s instead of the minimum asked)"
    )


#: What each repeat records from vLLM's ``vllm bench serve`` result (its keys with
#: ``--percentile-metrics ttft,tpot,itl,... --metric-percentiles 50,...,99``: ``median_*`` and
#: ``p50_*`` are the same value; ``duration`` is the run's seconds).
REPEAT_METRICS = (
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "duration",
)


def repeat_record(point: dict) -> dict:
    """One repeat of an interleaved point: its place in the rotation and vLLM's figures."""
    bench = point.get("bench") or {}
    out = {"repeat": point["repeat"], "slot": point.get("slot")}
    out["num_prompts"] = point["num_prompts"]
    out.update({k: bench.get(k) for k in REPEAT_METRICS})
    out["measured_acceptance_length"] = point.get("measured_acceptance_length")
    return out


def spread_stats(values: list[float]) -> dict | None:
    """Mean, min, max and relative spread ((max - min) / mean) of the repeats."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    mean = sum(vals) / len(vals)
    return {
        "n": len(vals),
        "mean": mean,
        "min": min(vals),
        "max": max(vals),
        "spread": (max(vals) - min(vals)) / mean if mean else None,
    }


def interleave_summary(points: list[dict], names: list[str], repeats: int) -> list[dict]:
    """Per (AL, C) of an interleaved run: every configuration's repeats and their statistics,
    and each configuration against the first of ``names`` (the baseline), from this call's
    points only: the ratio of the means and the per-rotation ratios (repeat r of one over
    repeat r of the other: the two runs measured next to each other)."""
    keyed: dict[tuple, dict[str, dict[int, dict]]] = {}
    for p in points:
        if p.get("repeat") is None:
            continue
        key = (p.get("point_al"), p["concurrency"])
        keyed.setdefault(key, {}).setdefault(p["config"], {})[p["repeat"]] = p
    out = []
    base = names[0]
    for (al, c), by_cfg in keyed.items():
        every = [p for reps in by_cfg.values() for p in reps.values()]
        counts = sorted({p["num_prompts"] for p in every})
        entry: dict = {
            "acceptance_length": al,
            "concurrency": c,
            "num_prompts": counts,
            "equal_prompts": len(counts) == 1,
            "wanted_prompts": sorted({p.get("full_prompts") or 0 for p in every}),
            "trimmed": next((p["trimmed"] for p in every if p.get("trimmed")), None),
            "repeats_asked": repeats,
            "configs": {},
            "ratios": {},
        }
        for name in names:
            reps = by_cfg.get(name, {})
            recs = [repeat_record(reps[r]) for r in sorted(reps)]
            entry["configs"][name] = {
                "repeats": recs,
                "stats": {m: spread_stats([x[m] for x in recs]) for m in REPEAT_METRICS},
            }
        for name in names[1:]:
            mine, theirs = by_cfg.get(name, {}), by_cfg.get(base, {})
            both = sorted(set(mine) & set(theirs))
            ratios: dict = {"rotations": len(both)}
            for m in REPEAT_METRICS[:-1]:
                per = [
                    mine[r]["bench"][m] / theirs[r]["bench"][m]
                    for r in both
                    if mine[r]["bench"].get(m) and theirs[r]["bench"].get(m)
                ]
                s_mine = entry["configs"][name]["stats"][m]
                s_base = entry["configs"][base]["stats"][m]
                ratios[m] = {
                    "ratio_of_means": s_mine["mean"] / s_base["mean"]
                    if s_mine and s_base and s_base["mean"]
                    else None,
                    "per_rotation": per,
                    "min": min(per, default=None),
                    "max": max(per, default=None),
                }
            entry["ratios"][f"{name}/{base}"] = ratios
        if any(CONFIGS[n].adaptive for n in names if n in CONFIGS):
            entry["adaptive_vs_best_fixed"] = best_fixed_summary(entry, names)
        out.append(entry)
    return out


def spec_ks(a) -> list[int]:
    """The draft lengths of the selected DSpark configurations."""
    return sorted({c.k or a.k for c in a.cfgs if c.spec})


def profile_env(a) -> dict[str, str]:
    """Where the DSpark configurations draft different numbers of tokens (the k sweep), every
    server gets the acceptance profile of the longest one (``DSPARK_BENCH_PROFILE_POSITIONS``):
    position ``i`` is accepted with the same rate at every k, so a shorter k gives up the later
    positions' acceptances instead of stretching its own profile to the same mean."""
    ks = spec_ks(a)
    return {PROFILE_ENV: str(max(ks))} if len(ks) > 1 else {}


def best_fixed_summary(entry: dict, names: list[str]) -> dict:
    """For one interleaved point: per adaptive configuration, the fixed-k configuration of the
    same PP size with the highest mean output throughput, and adaptive against it (ratio of the
    means, and per rotation: the two runs of repeat r)."""
    out: dict = {}
    for name in names:
        cfg = CONFIGS[name]
        if not cfg.adaptive:
            continue
        fixed = [n for n in names if CONFIGS[n].spec and not CONFIGS[n].adaptive
                 and CONFIGS[n].pp == cfg.pp]  # fmt: skip
        means = {}
        for n in fixed:
            stats = entry["configs"].get(n, {}).get("stats", {}).get("output_throughput")
            if stats and stats.get("mean"):
                means[n] = stats["mean"]
        mine = entry["configs"].get(name, {}).get("stats", {}).get("output_throughput")
        if not means or not mine or not mine.get("mean"):
            out[name] = {"best_fixed": None, "why": "no measured fixed-k or adaptive run"}
            continue
        best = max(means, key=lambda n: means[n])
        reps = {r["repeat"]: r for r in entry["configs"][name]["repeats"]}
        theirs = {r["repeat"]: r for r in entry["configs"][best]["repeats"]}
        per = [
            reps[r]["output_throughput"] / theirs[r]["output_throughput"]
            for r in sorted(set(reps) & set(theirs))
            if reps[r].get("output_throughput") and theirs[r].get("output_throughput")
        ]
        out[name] = {
            "best_fixed": best,
            "best_fixed_k": CONFIGS[best].k,
            "fixed_means": means,
            "ratio_of_means": mine["mean"] / means[best],
            "per_rotation": per,
            "min": min(per, default=None),
            "max": max(per, default=None),
        }
    return out


# --------------------------------------------------------------------------- commands
GIB = 1 << 30


def kv_plan(cfg: Config, kv_gib: float, pd_kv_gib: float, decoder_share: float) -> dict:
    """KV-cache bytes per engine of a configuration: a PP deployment splits ``--kv-gib`` over
    its stages; the PD group's two sides hold ``--pd-kv-gib`` each in all: the aggregated engine
    all of it, the producer and decoder together exactly as much (the decoder
    ``decoder_share`` of it, dspark_dev/pd_launch.split_kv_bytes)."""
    from dspark_dev.pd_launch import split_kv_bytes, split_stage_bytes

    total = int((pd_kv_gib if cfg.pd_kv else kv_gib) * GIB)
    if cfg.pd:
        producer, decoder = split_kv_bytes(total, decoder_share)
        out = {"producer": producer, "decoder": decoder}
        if cfg.pp > 1:  # a PP producer: its bytes over its stages (pd_launch.split_stage_bytes)
            out["producer_stages"] = split_stage_bytes(producer, cfg.pp)
        return out
    if cfg.pp == 1:
        return {"engine": total}
    return {f"stage{r}": total // cfg.pp for r in range(cfg.pp)}


def shape_base_args(
    *, cpu: bool, dummy: bool, max_model_len: int, max_num_seqs: int, kv_bytes: int | None
) -> list[str]:
    """``vllm serve`` arguments every configuration shares (before the PP/spec ones)."""
    if cpu:
        args = ["--dtype", "float32", "--enforce-eager"]
    else:
        args = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.05"]
        if kv_bytes:
            args += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if dummy:
        args += ["--load-format", "dummy"]
    return args + [
        "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
        "--seed", "0", "--async-scheduling",
    ]  # fmt: skip


def spec_config(draft: str, k: int, acceptance_length: float, adaptive: bool = False) -> dict:
    """The server's speculative config. Its synthetic length is only the start value (every
    point sets its own through ``set_acceptance_length``); vLLM refuses one above ``1 + k``, so
    a k sweep's short drafters start at their longest."""
    spec = {
        "method": "dspark",
        "model": draft,
        "num_speculative_tokens": k,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": min(float(acceptance_length), 1.0 + k),
    }
    return {**spec, "enable_adaptive_verification": True} if adaptive else spec


def server_env(cfg: Config, *, hook_root: str, cpu: bool, extra: dict | None = None) -> dict:
    """What a configuration's launchers get on top of the machine's environment: the plugin
    list (ours loaded or left out; the benchmark hook always), the dev endpoint, the hook's
    import path, NCCL's init/transport lines for PP > 1 on GPUs."""
    from dspark_dev.serve import GPU_CHILD_ENV

    env = {} if cpu else dict(GPU_CHILD_ENV)
    env.update(
        VLLM_PLUGINS=f"{PLUGIN},{BENCH_PLUGIN}" if cfg.plugin else BENCH_PLUGIN,
        VLLM_SERVER_DEV_MODE="1",
        PYTHONPATH=os.pathsep.join(
            [str(REPO), hook_root, str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    )
    if cfg.pp > 1 and not cpu:
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    env.update(adaptive_env(cfg.adaptive, cfg.pp))
    env.update(extra or {})
    env.update(dict(cfg.env))  # the configuration's own, over the driver's --env
    return env


def bench_argv(
    *,
    url: str,
    model: str,
    label: str,
    concurrency: int,
    prompts: int,
    seed: int,
    input_len: int,
    output_len: int,
    result_dir: str,
    result_name: str,
) -> list[str]:
    """``vllm bench serve`` arguments of one point (after ``vllm bench serve``)."""
    return [
        "--backend", "vllm", "--base-url", url, "--model", model, "--label", label,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--random-range-ratio", "0",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--disable-tqdm", "--save-result", "--result-dir", result_dir,
        "--result-filename", result_name,
    ]  # fmt: skip


def rpc_body(acceptance_length: float) -> dict:
    """``POST /collective_rpc`` body that switches the synthetic acceptance length."""
    return {
        "method": "dspark_bench_ctl",
        "args": ["set_acceptance_length", repr(acceptance_length)],
    }


def rpc_applied(response: dict) -> bool:
    """True when at least one worker (the sampling stage) applied the new rates."""
    return any(isinstance(r, dict) and r.get("applied") for r in response.get("results") or [])


# --------------------------------------------------------------------------- logs
USEFUL = re.compile(
    r"NCCL INFO (comm |Init COMPLETE|NET/|Using network)|DSpark|dspark_bench:|PP handshake|"
    r"vllm_dspark_pp|"
    r"Traceback|Error|ERROR|Exception|WARNING.*(KV|memory|graph)|Available KV cache|"
    r"GPU KV cache size|Maximum concurrency|Model loading took|Graph capturing finished|"
    r"torch.compile took|init engine|Starting vLLM|plugin|"
    r"Mooncake Transfer Engine is using|IntraNodeNvlinkTransport|Intra-Node NVLink|"
    r"Using (TCP|RDMA) transport|MC_FORCE_TCP"
)
TIMESTAMP = re.compile(
    r"\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?|\d\d:\d\d:\d\d(\.\d+)?|pid=\d+|\(\w+ pid=\d+\)"
)


def useful_lines(text: str, max_lines: int = 300, tail: int = 0) -> list[str]:
    """The log lines worth bringing back (init, transport, errors), at most ``max_lines``,
    repeats dropped; plus the last ``tail`` lines (a failed server)."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        if USEFUL.search(line):
            key = TIMESTAMP.sub("", line)[:200]  # the same message at another time is a repeat
            seen.setdefault(key, line)
    out = list(seen.values())[:max_lines]
    if tail:
        out += ["... last lines:"] + text.splitlines()[-tail:]
    return out


# --------------------------------------------------------------------------- results
SCALAR_TYPES = (int, float, str, bool, type(None))
# vLLM's per-request fields (one entry per prompt), left out even when the point is small
PER_REQUEST = set(
    "latencies queue_times input_lens output_lens ttfts itls start_times generated_texts errors "
    "server_queue_times server_ttfts".split()
)


def bench_summary(result: dict) -> dict:
    """vLLM's result JSON without its per-request lists (its scalar fields and short lists,
    such as the per-position acceptance rates)."""
    out = {}
    for k, v in result.items():
        if k in PER_REQUEST:
            continue
        if isinstance(v, SCALAR_TYPES):
            out[k] = v
        elif isinstance(v, list) and len(v) <= 16 and all(isinstance(x, SCALAR_TYPES) for x in v):
            out[k] = v
    return out


def measured_acceptance_length(delta: dict) -> float | None:
    drafts = delta.get("num_drafts") or 0
    return 1.0 + delta.get("num_accepted_tokens", 0) / drafts if drafts else None


@dataclass
class Results:
    """The run's JSON, rewritten (atomically) after every change."""

    path: Path
    data: dict = field(default_factory=dict)

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)

    def add(self, kind: str, item: dict) -> None:
        self.data.setdefault(kind, []).append(item)
        self.save()


# --------------------------------------------------------------------------- the run
class Log:
    def __init__(self, path: Path | None):
        self.t0 = time.monotonic()
        self.f = open(path, "a") if path else None

    def __call__(self, msg: str) -> None:
        line = f"[{RESULT_PREFIX}] {time.strftime('%H:%M:%S')} +{self.elapsed():4.0f}s {msg}"
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()

    def raw(self, lines: list[str]) -> None:
        if self.f:
            self.f.write("\n".join(lines) + "\n")
            self.f.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def build_deployment(cfg: Config, a, paths, hook_root: str, log_dir: Path, initial_al: float):
    """The configuration's launchers (not started): a plain ``vllm serve`` for PP=1,
    dspark_dev/pp_launch.py's launchers for PP > 1."""
    from dspark_dev import pp_launch
    from dspark_dev.serve import Server, free_port
    from dspark_dev.serve_demo import serve_argv

    k = cfg.k or a.k
    spec = spec_config(paths.draft, k, initial_al, cfg.adaptive) if cfg.spec else None
    kv = kv_plan(cfg, *kv_args(a))
    base = shape_base_args(
        cpu=a.cpu,
        dummy=a.model_dir is None,
        max_model_len=max_model_len(a),
        max_num_seqs=a.max_num_seqs,
        # a PD deployment gives each role its own share (pd_deployment); PP stages hold equal ones
        kv_bytes=None if a.cpu or cfg.pd else next(iter(kv.values())),
    )
    env = server_env(cfg, hook_root=hook_root, cpu=a.cpu, extra=profile_env(a) | a.extra_env)
    if cfg.balanced:
        env[LAYER_PARTITION_ENV] = ",".join(map(str, stage_split(cfg, a, paths)["partition"]))
    if cfg.pd_kv and not a.cpu and "VLLM_ENGINE_READY_TIMEOUT_S" not in a.extra_env:
        # vLLM's own start-up deadline must not end an engine the driver still waits for
        env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(a.ready_s))
    if cfg.pd:
        from dspark_dev.pd_launch import pd_deployment

        return pd_deployment(
            cfg.name, paths.target, spec=spec, base_args=base,
            producer_kv_bytes=kv["producer"], decoder_kv_bytes=kv["decoder"],
            log_dir=log_dir, env=env, cpu=a.cpu, proxy_timeout_s=a.proxy_timeout_s,
            producer_pp=cfg.pp, gpu_layout=a.gpu_layout, connector=cfg.connector,
            protocol=cfg.mooncake_protocol,
        )  # fmt: skip
    kept = compile_cache_dir(a, cfg)
    if cfg.pp == 1:
        port = free_port()
        root = str(kept) if kept else tempfile.mkdtemp(prefix=f"dspark-{cfg.name}-cache-")
        env = {**env, "VLLM_CACHE_ROOT": root}
        if not a.cpu and a.gpu_layout == pp_launch.PER_STAGE:
            env["CUDA_VISIBLE_DEVICES"] = "0"
        argv = serve_argv(paths.target, pp=1, spec=spec, port=port, base=base)
        srv = Server(argv, log_dir / f"{cfg.name}.log", env=env, port=port, name=cfg.name,
                     cpu=a.cpu)  # fmt: skip
        return pp_launch.Deployment(cfg.name, [srv])
    return pp_launch.deployment(
        cfg.name,
        paths.target,
        pp=cfg.pp,
        spec=spec,
        log_dir=log_dir,
        device="cpu" if a.cpu else "gpu",
        gpu_layout=a.gpu_layout,
        base_args=base,
        env=env,
        env_per_rank=getattr(a, "mps_env_per_rank", None),
        cache_dir=kept,
    )


def compile_cache_dir(a, cfg: Config) -> Path | None:
    """Where ``cfg``'s launchers keep vLLM's caches under ``--cache-root`` (None: a fresh folder
    per call, the default). One folder per configuration (and per launcher below it): servers
    started together never share a compile cache. PD deployments keep fresh ones."""
    if not getattr(a, "cache_root", None) or cfg.pd:
        return None
    return Path(a.cache_root) / "vllm-cache" / cfg.name


#: vLLM 0.34.0's line when a compiled graph came from the cache (vllm/compilation/decorators.py)
CACHE_HIT_LINE = "Directly load AOT compilation from path"


def compile_cache_hits(log_texts: list[str]) -> int:
    """How many compiled graphs a deployment's launchers loaded from the cache (their logs)."""
    return sum(text.count(CACHE_HIT_LINE) for text in log_texts)


LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def stage_split(cfg: Config, a, paths) -> dict:
    """The layer split a ``balanced`` configuration serves with: vllm_dspark_pp.stage_balance
    (what ``vllm-dspark-pp plan`` recommends) for the served target and draft configs at the
    configuration's PP size and k, from their ``config.json``. ``partition`` is the cost model's
    split (vLLM's even split when the model finds nothing better: ``improves`` False), beside
    the even split and both splits' modelled stage costs (target-layer units)."""
    from vllm_dspark_pp.stage_balance import stage_balance

    def cfg_json(folder: str) -> dict:
        return json.loads((Path(folder) / "config.json").read_text())

    k = cfg.k or a.k
    sb = stage_balance(cfg_json(paths.target), cfg_json(paths.draft), k, cfg.pp)
    return {
        "partition": sb.best.partition,
        "improves": sb.improves,
        "costs": [round(c, 3) for c in sb.best.stage_costs],
        "even_partition": sb.default.partition,
        "even_costs": [round(c, 3) for c in sb.default.stage_costs],
        "draft_cost_layers": round(sb.draft_cost_layers, 3),
        "k": k,
    }


def kv_args(a) -> tuple[float, float, float]:
    return a.kv_gib, a.pd_kv_gib, a.pd_decoder_share


def control_url(dep) -> str:
    """Where the spec-decode counters and ``/collective_rpc`` of a deployment live: the API
    server, or for PD the decoder (the engine that drafts and samples)."""
    return getattr(dep, "control_url", dep.url)


def pd_snapshot(dep) -> dict:
    """What a PD point records besides the decoder's spec-decode counters: the decoder's
    KV-connector counters, the connector's transfer histograms summed over both engines (sum
    and count of the time, bytes and descriptors per transfer batch: Mooncake's producer or
    NIXL's decoder records them), the producer's spec-decode counters (no drafts expected), the
    proxy's request counters."""
    from dspark_dev.pd_launch import kv_counters_at, xfer_counters_at
    from dspark_dev.serve_demo import spec_metrics

    urls = [dep.producer_url, dep.control_url]
    out: dict = {}
    for key, fn in (
        ("decoder_kv", lambda: kv_counters_at(dep.control_url)),
        ("kv_xfer", lambda: xfer_counters_at(urls, getattr(dep, "connector", "mooncake"))),
        ("producer_spec", lambda: spec_metrics(dep.producer_url, settle_s=0.0)),
        ("proxy", lambda: http_get_json(dep.url + "/stats")),
    ):
        try:
            out[key] = fn()
        except (OSError, ValueError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


#: The variables that choose a PD deployment's transport (Mooncake's, UCX's for NIXL).
TRANSPORT_ENV_PREFIXES = ("MC_", "UCX_")


def pd_transport(dep) -> dict:
    """A PD deployment's KV transport as its engines were launched: the connector, Mooncake's
    protocol (None over NIXL), and per engine launcher the ``mooncake_protocol`` of its
    ``--kv-transfer-config`` and the transport variables (``MC_*``, ``UCX_*``) of its env."""
    engines = {}
    for node in (*dep.producers, dep.decoder):
        argv = list(node.argv)
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        engines[node.name] = {
            "mooncake_protocol": (kv.get("kv_connector_extra_config") or {}).get(
                "mooncake_protocol"
            ),
            "env": {
                k: v for k, v in sorted(node.env.items()) if k.startswith(TRANSPORT_ENV_PREFIXES)
            },
        }
    return {"connector": dep.connector, "mooncake_protocol": dep.protocol, "engines": engines}


def pd_delta(before: dict, after: dict) -> dict:
    """After minus before of :func:`pd_snapshot` (numbers; the proxy's new errors)."""
    out: dict = {}
    for key, a in after.items():
        b = before.get(key) or {}
        if "error" in a or "error" in b:
            out[key] = {"error": a.get("error") or b.get("error")}
            continue
        d = {}
        for k, v in a.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                d[k] = v - b.get(k, 0)
            elif isinstance(v, list) and k == "errors":
                d[k] = v[len(b.get(k) or []) :][:5]
            elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                old = b.get(k) or [0] * len(v)
                d[k] = [x - y for x, y in zip(v, old, strict=False)]
        out[key] = d
    return out


#: A PD request's spans at the proxy, from its hop times (dspark_dev/pd_proxy.HOP_KEYS): name,
#: from, to. ``decode_first``: the decoder's KV pull, its queue and its first step (with the
#: decoder's HTTP front end); ``prefill``: the producer's queue and prefill.
HOP_SPANS = (
    ("prefill", "prefill_sent", "prefill_answered"),
    ("handoff", "prefill_answered", "decode_sent"),
    ("decode_first", "decode_sent", "first_token"),
    ("stream", "first_token", "last_token"),
    ("total", None, "last_token"),
)


def hop_summary(records: list[dict]) -> dict:
    """Per span of :data:`HOP_SPANS` over a point's completed requests: how many, mean, p50,
    p90, p99 (ms), and ``in_flight``, the mean number of requests inside that span over the
    point (sum of the span over the first arrival to the last answer: Little's law), which says
    where requests queue."""
    done = [r for r in records if r.get("ok") and r.get("last_token") is not None]
    if not done:
        return {"requests": len(records), "completed": 0}
    t_first = min(r["t0"] for r in done)
    t_last = max(r["t0"] + r["last_token"] / 1e3 for r in done)
    window_ms = max(1e-9, (t_last - t_first) * 1e3)
    out: dict = {"requests": len(records), "completed": len(done), "window_s": window_ms / 1e3}
    for name, start, end in HOP_SPANS:
        vals = sorted(r[end] - (r[start] if start else 0.0) for r in done)

        def pct(q: float, vals=vals) -> float:
            return vals[min(len(vals) - 1, max(0, math.ceil(q / 100 * len(vals)) - 1))]

        out[name] = {
            "mean_ms": round(sum(vals) / len(vals), 3),
            "p50_ms": round(pct(50), 3), "p90_ms": round(pct(90), 3),
            "p99_ms": round(pct(99), 3), "in_flight": round(sum(vals) / window_ms, 3),
        }  # fmt: skip
    return out


def pd_hops(dep, start: int) -> dict:
    """The proxy's hop records of the requests it finished from the ``start``-th on (t0 made
    relative to the first one's, seconds) and their :func:`hop_summary`; a point's include
    ``vllm bench serve``'s one test request before its run."""
    try:
        records = http_get_json(f"{dep.url}/hops?start={int(start)}")["hops"]
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    t_first = min((r["t0"] for r in records), default=0.0)
    for r in records:
        r["t0"] = round(r["t0"] - t_first, 6)
    return {"summary": hop_summary(records), "records": records}


def http_get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode() or "{}")


def describe(dep) -> list[str]:
    """Every launcher's environment (what this driver sets) and command line."""
    out = []
    for node in dep.nodes:
        env = " ".join(f"{k}={v}" for k, v in sorted(node.env.items()))
        out.append(f"  {node.name}: env {env}")
        out.append(f"  {node.name}: {' '.join(node.argv)}")
    return out


def run_bench_in_process(argv: list[str], timeout_s: float, on_timeout) -> tuple[dict | None, str]:
    """``vllm bench serve ARGV`` through vLLM's own parser and ``main`` in a thread. Past
    ``timeout_s`` ``on_timeout()`` runs (it stops the server, which ends the requests), then the
    thread gets 30 s more. Returns (vLLM's result dict or None, error text)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    box: dict = {}

    def target():
        try:
            box["result"] = main(args)
        except BaseException as e:  # noqa: BLE001 - recorded, the run goes on
            box["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=target, name="bench-serve", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        on_timeout()
        th.join(30)
        return None, f"cut after {timeout_s:.0f} s, at the budget's deadline (server stopped)"
    return box.get("result"), box.get("error", "")


def bench_failure(result: dict | None, err: str) -> str | None:
    """Why a ``vllm bench serve`` result does not count as a run (None: it counts). A run with
    any failed request is a failed run: its throughput counts only the requests that finished
    before the server broke (2026-12-06: 132 of 448 requests answered, 316 failed after an
    out-of-memory error, and the run's 344 tok/s had entered a ratio)."""
    if result is None:
        return err or "no result"
    failed, done = int(result.get("failed") or 0), int(result.get("completed") or 0)
    if failed:
        return f"{failed} of {failed + done} requests failed" + (f" ({err})" if err else "")
    if not done:
        return err or "no request completed"
    return None


def step_rpc(url: str, cmd: str) -> list | dict:
    """The benchmark hook's per-step timers on every worker (``enable`` before a point,
    ``collect`` after it: per worker, in rank order, the median target / draft / step GPU
    milliseconds per batch size; dspark_bench_hooks.summarize_steps)."""
    try:
        resp = http_post(url + "/collective_rpc", {"method": "dspark_bench_ctl", "args": [cmd]})
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    results = resp.get("results") or []
    if cmd == "collect":
        return [r.get("summary") if isinstance(r, dict) else r for r in results]
    return results


def http_post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    return json.loads(raw) if raw else {}


def versions(cpu: bool) -> dict:
    out: dict = {}
    try:
        import torch
        import vllm

        out.update(vllm=vllm.__version__, torch=torch.__version__)
        if not cpu and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001
        out["error"] = str(e)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="pp1", help="groups/configurations, comma-separated")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/dspark-serve-pp"))
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument(
        "--model-dir", default=None, help="a pair folder (target/, dspark-draft/) instead of a "
        "dummy-weight shape, e.g. models/tiny-pair for --cpu"
    )  # fmt: skip
    ap.add_argument("-k", type=int, default=7, help="DSpark draft tokens (the shape's block)")
    ap.add_argument(
        "--acceptance-lengths", default=None,
        help=f"comma-separated (default {DEFAULT_ALS}; {PD_DEFAULT_ALS} when only the pd group's "
        "configurations run)",
    )  # fmt: skip
    ap.add_argument("--concurrency", default="1,4,16,32,64")
    ap.add_argument(
        "--workload", choices=sorted(WORKLOADS), default=DEFAULT_WORKLOAD,
        help="random dataset shape: " + ", ".join(
            f"{k} = {i} in / {o} out" for k, (i, o) in WORKLOADS.items()
        ) + " (--input-len / --output-len override its parts)",
    )  # fmt: skip
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument(
        "--interleave", action="store_true",
        help="per (AL, C): every configuration --repeats times in rotation, one prompt count "
        "for all (implies --start together)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="with --interleave: at least 3")
    ap.add_argument(
        "--rotation", choices=("fixed", "alternate"), default="fixed",
        help="with --interleave: A B A B ... (fixed) or A B B A ... (alternate)",
    )  # fmt: skip
    ap.add_argument(
        "--min-run-s", type=float, default=60.0,
        help="with --interleave: prompts for a run of at least this long (the fastest "
        "configuration's, estimated); the budget may shorten it, which the JSON says",
    )  # fmt: skip
    ap.add_argument(
        "--mps", default=None, metavar="P0,P1",
        help="run the PP>1 launchers under a CUDA MPS daemon started for this command, stage R "
        "with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=P_R (benchmarks/mps.py); "
        "PP=1 servers stay outside MPS",
    )  # fmt: skip
    ap.add_argument(
        "--cache-root", default=None, metavar="DIR",
        help="keep the shape folders and every non-PD server's vLLM caches under DIR, one folder "
        "per configuration and launcher, so that a later call on the same machine loads the "
        "compiled graphs instead of compiling (default: fresh folders per call); the record "
        "counts each server's cache hits (compile_cache_hits)",
    )  # fmt: skip
    ap.add_argument("--prompts-per-c", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=16.0, help="KV cache per deployment (GiB)")
    ap.add_argument(
        "--pd-kv-gib", type=float, default=24.0,
        help="the pd group's KV cache per side (GiB): the aggregated engine's, and the producer's "
        "plus the decoder's together",
    )  # fmt: skip
    ap.add_argument(
        "--pd-decoder-share", type=float, default=0.75,
        help="the decoder's share of --pd-kv-gib (it holds every running request's whole "
        "context; the producer only prompts not yet pulled)",
    )  # fmt: skip
    ap.add_argument("--proxy-timeout-s", type=float, default=300.0, help="pd proxy, per upstream")
    ap.add_argument("--budget-s", type=float, default=470.0)
    ap.add_argument(
        "--ready-s", type=float, default=None,
        help=f"start-up deadline per server (default {READY_S:.0f} s; {PD_READY_S:.0f} s when "
        "only the pd group runs: three engines compile and capture at once, and their "
        "VLLM_ENGINE_READY_TIMEOUT_S follows it)",
    )  # fmt: skip
    ap.add_argument("--start", choices=("together", "sequential"), default="together")
    ap.add_argument("--gpu-layout", choices=("shared", "per-stage"), default="shared")
    ap.add_argument("--guess-tpot-ms", type=float, default=6.0, help="until one is measured")
    ap.add_argument(
        "--probe", action=argparse.BooleanOptionalAction, default=True,
        help="with --interleave: one wave on each server before its first point, so the "
        "point's prompt count comes from a measured TPOT (recorded, not counted)",
    )  # fmt: skip
    ap.add_argument(
        "--guess-prefill-ms", type=float, default=None,
        help="per prompt (default 40 ms per 1024 prompt tokens)",
    )  # fmt: skip
    ap.add_argument("--guess-point-s", type=float, default=4.0, help="fixed cost of a point")
    ap.add_argument(
        "--step-times", action=argparse.BooleanOptionalAction, default=True,
        help="per-step target/draft GPU times of every worker (CUDA events of "
        "benchmarks/dspark_bench_hooks.py, installed after start-up) beside each point",
    )  # fmt: skip
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU platform (plumbing only)")
    ap.add_argument("--dry-run", action="store_true", help="print commands, start nothing")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every server")
    a = ap.parse_args(argv)
    a.cfgs = select_configs(a.configs)
    if a.acceptance_lengths is None:
        only_pd = all(c.pd_kv for c in a.cfgs)
        a.acceptance_lengths = PD_DEFAULT_ALS if only_pd else DEFAULT_ALS
    if a.ready_s is None:
        a.ready_s = PD_READY_S if all(c.pd_kv for c in a.cfgs) else READY_S
    a.als = parse_floats(a.acceptance_lengths)
    if any(c.pd_kv for c in a.cfgs) and not 0.0 < a.pd_decoder_share < 1.0:
        raise SystemExit(f"--pd-decoder-share {a.pd_decoder_share}: strictly between 0 and 1")
    a.cs = parse_ints(a.concurrency)
    if not a.als:
        raise SystemExit("--acceptance-lengths: at least one")
    bad = [e for e in a.env if "=" not in e]
    if bad:
        raise SystemExit(f"--env {bad[0]!r}: use KEY=VALUE")
    a.extra_env = dict(e.split("=", 1) for e in a.env)
    wl_in, wl_out = WORKLOADS[a.workload]
    a.input_len = wl_in if a.input_len is None else a.input_len
    a.output_len = wl_out if a.output_len is None else a.output_len
    if a.guess_prefill_ms is None:
        a.guess_prefill_ms = 40.0 * a.input_len / 1024
    if a.interleave:
        if a.repeats < 3:
            raise SystemExit(f"--interleave --repeats {a.repeats}: at least 3")
        if len(a.cfgs) < 2:
            raise SystemExit("--interleave: at least two configurations to compare")
        if a.start != "together":
            raise SystemExit("--interleave: every server starts together (--start together)")
    elif a.repeats != 1:
        raise SystemExit("--repeats: only with --interleave (one call, the runs in rotation)")
    a.mps_shares = None
    if a.mps is not None:
        from benchmarks.mps import parse_percentages

        a.mps_shares = parse_percentages(a.mps)
        if any(c.pd for c in a.cfgs):
            raise SystemExit("--mps: PD configurations are not wired for MPS")
        odd = [c.name for c in a.cfgs if c.pp > 1 and c.pp != len(a.mps_shares)]
        if odd:
            raise SystemExit(f"--mps {a.mps}: one percentage per PP stage ({', '.join(odd)})")
        if a.cpu:
            raise SystemExit("--mps: GPU only")
    a.tag = "_".join(
        [run_tag(a.configs)]
        + ([a.workload] if a.workload != DEFAULT_WORKLOAD else [])
        + ([f"x{a.repeats}"] if a.interleave else [])
        + (["mps" + "-".join(map(str, a.mps_shares))] if a.mps_shares else [])
    )
    check_args(any(c.adaptive for c in a.cfgs), a.cpu, a.extra_env)
    return a


def plan_sweeps(a) -> list[tuple[Config, int | None, float | None]]:
    """(configuration, AL index, AL) in the order they run; no-spec has one sweep (AL None)."""
    out = []
    for cfg in a.cfgs:
        if cfg.spec:
            out += [(cfg, i, al) for i, al in enumerate(a.als)]
        else:
            out.append((cfg, None, None))
    return out


def prepare_models(a, work: Path):
    from benchmarks.real_shapes import ShapePaths

    a.tap_weights = None  # a --shape run's random draft fc for the tap partials (below)
    if a.model_dir:
        d = Path(a.model_dir).resolve()
        target, draft = d / "target", d / "dspark-draft"
        if not target.is_dir():  # a folder of make_tiny_models (benchmarks.serve_pp's wide pair)
            from vllm_dspark_pp.tiny_models import DRAFT_DIR_NAME, TARGET_DIR_NAME

            target, draft = d / TARGET_DIR_NAME, d / DRAFT_DIR_NAME
        return ShapePaths(d.name, str(target), str(draft)), None
    from benchmarks import shape_tokenizer

    # under --cache-root the shape folder keeps its path: vLLM's compile cache key holds it
    paths = write_shape(a.shape, (Path(a.cache_root) if a.cache_root else work) / "shapes")
    if any(dict(c.env).get(TAPS_ENV, "0") != "0" for c in a.cfgs):
        # the tap partials read the draft's fc from its checkpoint: give the shape one
        a.tap_weights = write_context_linear(paths, a.shape, write=not a.dry_run)
    return paths, shape_tokenizer.write(paths.target)


def max_model_len(a) -> int:
    """Every server's ``--max-model-len``: the workload's prompt and output, and 128 to spare."""
    return a.input_len + a.output_len + 128


def check_model_len(a, paths) -> None:
    """Refuse, before any server starts, a workload longer than the models' positions: vLLM
    refuses ``--max-model-len`` above ``max_position_embeddings`` only once every launcher has
    started (2026-12-06: all eight ``ksweep_pp2`` servers on the tiny pair, 1024 positions,
    with ``--workload decode``, 128 + 1024 + 128)."""
    need = max_model_len(a)
    for role, folder in (("target", paths.target), ("drafter", paths.draft)):
        cfg_file = Path(folder) / "config.json"
        if not cfg_file.is_file():
            continue
        limit = json.loads(cfg_file.read_text()).get("max_position_embeddings")
        if limit and need > int(limit):
            fits = int(limit) - a.input_len - 128
            fix = f"pass --output-len {fits}" if fits > 0 else "pass a shorter --input-len"
            raise SystemExit(
                f"--max-model-len {need} ({a.input_len} in + {a.output_len} out + 128) is above "
                f"the {role}'s max_position_embeddings {limit} ({folder}): {fix}"
            )


def preflight() -> str | None:
    """Why this machine cannot run ``vllm bench serve`` in this process (None: it can). Checked
    before any server starts, so a missing client dependency costs no start-up."""
    try:
        import vllm.benchmarks.serve  # noqa: F401
    except ImportError as e:
        return (
            f"vllm bench serve cannot be imported here ({e}); install the missing package "
            f"({getattr(e, 'name', None) or '?'}) next to vLLM"
        )
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dspark-serve-pp-"))
    log = Log(None if a.dry_run else out / f"{RESULT_PREFIX}_{a.tag}.log")
    deadline = time.monotonic() + a.budget_s
    paths, tok = prepare_models(a, work)
    check_model_len(a, paths)
    hook_root = str(make_hook_dist(work / "hooks"))
    mps, previous = None, None
    if a.mps_shares:
        from benchmarks import mps as mps_mod

        # a dry run names the folders and creates nothing
        mps = mps_mod.MpsDaemon(Path("/tmp/dspark-mps-DRY-RUN") if a.dry_run else None)
    try:
        if not a.dry_run:
            # SIGTERM (tools/gpu/span_calls.py stop, a timeout) must reach the finally clauses
            # that stop the servers (each in a session of its own) and the MPS daemon
            previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if mps is not None and not a.dry_run:
            if mps.start():
                log(f"MPS daemon started ({mps.root}); PP stages' thread shares {a.mps}")
            else:
                log(f"MPS NOT USED: {mps.problem}")
        if mps is not None and (a.dry_run or mps.used):
            a.mps_env_per_rank = mps_mod.stage_env(a.mps_shares, mps.pipe_dir, mps.log_dir)
        return _main(a, argv, out, work, log, deadline, paths, tok, hook_root, mps)
    finally:
        if mps is not None and not a.dry_run:
            log(f"MPS daemon: {mps.stop() or 'not running'}")
            res_path = out / f"{RESULT_PREFIX}_{a.tag}.json"
            if res_path.exists():  # the run's record says what MPS did, also after a failure
                data = json.loads(res_path.read_text())
                data.setdefault("meta", {})["mps"] = mps.record(a.mps_shares)
                Results(res_path, data).save()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _main(a, argv, out, work, log, deadline, paths, tok, hook_root, mps) -> int:
    deps = {
        cfg.name: build_deployment(cfg, a, paths, hook_root, work / "logs", a.als[0])
        for cfg in a.cfgs
    }
    sweeps = plan_sweeps(a)
    if a.dry_run:
        try:
            return dry_run(a, deps, sweeps, paths, tok, mps)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # the shape folders, tokenizer, hook
    problem = preflight()
    if problem:
        log(f"FATAL: {problem}")
        return 3
    res = Results(out / f"{RESULT_PREFIX}_{a.tag}.json")
    res.data = {
        "meta": {
            "driver": "benchmarks/serve_pp_one_gpu.py",
            "commit": record_commit(Path(__file__).resolve().parents[1]),
            "command": "serve_pp_one_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "configs": [c.name for c in a.cfgs],
            "shape": paths.shape,
            "tokenizer": tok,
            "k": a.k,
            "acceptance_lengths": a.als,
            "concurrency": a.cs,
            "workload": {
                "name": a.workload,
                "input_len": a.input_len,
                "output_len": a.output_len,
            },  # fmt: skip
            "input_len": a.input_len,
            "output_len": a.output_len,
            "prompts": {"per_c": a.prompts_per_c, "min": a.min_prompts},
            "interleave": {
                "repeats": a.repeats,
                "rotation": a.rotation,
                "min_run_s": a.min_run_s,
                "probe": a.probe,
                "baseline": a.cfgs[0].name,
            }
            if a.interleave
            else None,  # fmt: skip
            "mps": mps.record(a.mps_shares) if mps is not None else None,
            "kv_gib_per_deployment": a.kv_gib,
            "pd_kv_gib_per_side": a.pd_kv_gib if any(c.pd_kv for c in a.cfgs) else None,
            "pd_decoder_share": a.pd_decoder_share if any(c.pd for c in a.cfgs) else None,
            "kv_cache_bytes": {c.name: kv_plan(c, *kv_args(a)) for c in a.cfgs},
            "pd_proxy": "dspark_dev/pd_proxy.py (own process; streams the decoder's answer)"
            if any(c.pd for c in a.cfgs)
            else None,
            "pd_transport": {c.name: pd_transport(deps[c.name]) for c in a.cfgs if c.pd} or None,
            "stage_split": {c.name: stage_split(c, a, paths) for c in a.cfgs if c.balanced} or None,
            # a --shape run's random draft fc for the tap partials (None: none written)
            "tap_partials_weights": a.tap_weights,
            "budget_s": a.budget_s,
            "start": a.start,
            "gpu_layout": a.gpu_layout,
            "platform": "cpu" if a.cpu else "gpu",
            "step_times": a.step_times,
            "adaptive_confidences": confidences_of(a.extra_env)
            if any(c.adaptive for c in a.cfgs)
            else None,
            "cache_root": a.cache_root,
            "versions": versions(a.cpu),
        },
        "servers": {},
        "points": [],
        "skipped": [],
    }
    res.save()
    log(f"configs {', '.join(deps)}; shape {paths.shape}; workload {a.workload} "
        f"({a.input_len} in / {a.output_len} out); budget {a.budget_s:.0f} s")  # fmt: skip
    try:
        if a.interleave:
            return run_interleaved(a, deps, paths, res, log, deadline)
        return run(a, deps, sweeps, paths, res, log, deadline)
    finally:
        log("stopping the servers (errors logged after this line are the shutdown's)")
        for name, dep in deps.items():
            stuck = dep.stop()
            texts = [n.log_tail(10**8) for n in dep.nodes]
            srv = res.data["servers"].setdefault(name, {})
            if CONFIGS[name].pp > 1:
                srv["transport"] = transport_evidence(texts)
            if a.cache_root:
                srv["compile_cache_hits"] = compile_cache_hits(texts)
            if CONFIGS[name].pd:
                srv["engine_id"] = dep.engine_id
                srv["producer_log_markers"] = dep.log_markers()
                if dep.connector == "mooncake":
                    srv["mooncake_transport"] = mooncake_transport_evidence(texts)
            failed = srv.get("outcome") not in (None, "ok")
            for node, text in zip(dep.nodes, texts, strict=True):
                log.raw([f"----- {node.name} ({node.log_path}) -----"])
                log.raw(useful_lines(text, tail=80 if failed else 0))
            if stuck:
                srv["left_running"] = stuck
            res.save()
        log(f"done: {len(res.data['points'])} points, {len(res.data['skipped'])} skipped; "
            f"{res.path}")  # fmt: skip


def dry_run(a, deps, sweeps, paths, tok, mps=None) -> int:
    print(f"# dry run: {', '.join(deps)} ({a.start} start), shape {paths.shape}")
    print(f"# workload {a.workload}: {a.input_len} in / {a.output_len} out")
    if tok:
        print(f"# tokenizer: {json.dumps(tok)}")
    if mps is not None:
        print(f"# mps {a.mps}: the PP>1 launchers under one daemon; PP=1 servers outside it")
        for cmd in mps.commands():
            print(f"# mps: {cmd}")
    for dep in deps.values():
        print(f"deployment {dep.name}:")
        print("\n".join(describe(dep)))
    if a.step_times:
        rpc = 'POST URL/collective_rpc {"method": "dspark_bench_ctl", "args": ["enable"]}'
        print(f'# around every point: {rpc} before, ["collect"] after (--no-step-times: not)')
    if any(c.pd for c in a.cfgs):
        print(
            "# pd: the proxy starts once producer and decoder answer /health and the producer's "
            "bootstrap /query lists its engine; /metrics and /collective_rpc go to the decoder"
        )
        for cfg in a.cfgs:
            if cfg.pd:  # what meta.pd_transport will record
                print(f"# pd transport {cfg.name}: {json.dumps(pd_transport(deps[cfg.name]))}")
    for cfg in a.cfgs:
        if cfg.balanced:  # what meta.stage_split will record
            print(f"# stage split {cfg.name}: {json.dumps(stage_split(cfg, a, paths))}")
    if a.interleave:
        return dry_run_interleaved(a, paths)
    for cfg, ali, al in sweeps:
        url = "URL(" + cfg.name + (" proxy" if cfg.pd else "") + ")"
        ctl = "URL(" + cfg.name + " decoder)" if cfg.pd else url
        if al is not None:
            print(f"POST {ctl}/collective_rpc {json.dumps(rpc_body(al))}")
        for c in a.cs:
            n = default_prompts(c, a.prompts_per_c, a.min_prompts)
            argv = bench_argv(
                url=url, model=paths.target, label=cfg.name, concurrency=c, prompts=n,
                seed=point_seed(ali or 0, c), input_len=a.input_len, output_len=a.output_len,
                result_dir="DIR", result_name=f"{cfg.name}_al{al}_c{c}.json",
            )  # fmt: skip
            print("vllm bench serve " + " ".join(argv))
    return 0


class Runner:
    """Starts, checks and measures the deployments of one command; :func:`run` (one sweep per
    configuration and AL) and :func:`run_interleaved` (the configurations in rotation per point)
    drive it."""

    def __init__(self, a, deps, paths, res: Results, log: Log, deadline: float):
        self.a, self.deps, self.paths, self.res, self.log = a, deps, paths, res, log
        self.deadline = deadline
        self.started: set[str] = set()
        self.tpot: dict[str, float] = {}
        self.calib: dict[str, float] = {}
        self.bench_dir = Path(tempfile.mkdtemp(prefix="dspark-bench-res-"))

    def time_left(self) -> float:
        return self.deadline - time.monotonic() - STOP_RESERVE_S

    def start(self, names) -> None:
        for name in names:
            if name not in self.started:
                self.deps[name].start()
                self.started.add(name)
                self.res.data["servers"][name] = {"launchers": len(self.deps[name].nodes)}
                self.log(f"starting {name} ({len(self.deps[name].nodes)} launcher(s))")
                self.log.raw(describe(self.deps[name]))

    def ready(self, name) -> bool:
        srv = self.res.data["servers"][name]
        if "outcome" in srv:
            return srv["outcome"] == "ok"
        wait = min(self.a.ready_s, self.time_left())
        try:
            srv["ready_s"] = round(self.deps[name].wait_ready(max(1.0, wait)), 1)
            srv["outcome"] = "ok"
            self.log(f"{name} ready after {srv['ready_s']} s")
        except (RuntimeError, TimeoutError) as e:
            srv["outcome"] = f"not ready: {e}"
            self.log(f"FAILED: {name}: {e}")
            for node in self.deps[name].nodes:  # the cause on the console, not only the log file
                tail = node.log_tail(6000).splitlines()[-25:]
                print(f"----- {node.name}: last lines of {node.log_path} -----", flush=True)
                print("\n".join(tail), flush=True)
        self.res.save()
        return srv["outcome"] == "ok"

    def skip(self, cfg, al, c, why, **extra) -> None:
        self.res.add("skipped", {"config": cfg.name, "acceptance_length": al, "concurrency": c,
                                 "why": why[:300], **extra})  # fmt: skip

    def set_al(self, cfg, al) -> str | None:
        """Switch ``cfg``'s server to acceptance length ``al``; None when applied, else why."""
        what = f"{cfg.name} AL {al}"
        try:
            resp = http_post(control_url(self.deps[cfg.name]) + "/collective_rpc", rpc_body(al))
        except OSError as e:
            resp = {"error": str(e)}
        if not rpc_applied(resp):
            self.log(f"FAILED: {what}: the acceptance length was not applied: {resp}")
            return f"AL not applied: {resp}"
        applied = [r for r in resp["results"] if isinstance(r, dict) and r.get("applied")]
        self.res.data["servers"][cfg.name].setdefault("acceptance_switch", {})[repr(al)] = {
            "workers": len(resp["results"]),
            "applied": len(applied),
            "unconditional_rates": applied[0].get("unconditional_rates"),
        }
        self.res.save()
        self.log(f"{what}: synthetic acceptance length set on {len(applied)} of "
                 f"{len(resp['results'])} workers (the sampling stage)")  # fmt: skip
        return None

    def lost(self, cfg) -> bool:
        dead = self.deps[cfg.name].dead_nodes()
        if dead:
            self.res.data["servers"][cfg.name]["outcome"] = f"lost: {', '.join(dead)}"
            self.log(f"FAILED: {cfg.name}: lost {', '.join(dead)}")
            self.res.save()
        return bool(dead)

    def leave(self, gone: list[str], names: list[str], live: list) -> bool:
        """:func:`drop_from_comparison`, then stop the deployments that left (their GPU memory
        goes back to the others) and mark them (the call's exit status becomes 1)."""
        if not drop_from_comparison(gone, names, live, self.log):
            return False
        for name in gone:
            srv = self.res.data["servers"][name]
            if srv.get("outcome") == "ok":
                srv["outcome"] = "left the comparison after a failed run"
            self.deps[name].stop()
        self.res.save()
        return True

    def model(self, cfg) -> CostModel:
        a = self.a
        return CostModel(
            tpot_ms=self.tpot.get(cfg.name, a.guess_tpot_ms),
            output_len=a.output_len,
            prefill_ms=a.guess_prefill_ms,
            point_s=a.guess_point_s,
            calib=self.calib.get(cfg.name, 1.0),
        )

    def measure(
        self, cfg, al, ali, c, n, *, why, n_full, repeat=None, extra=None
    ) -> tuple[dict | None, bool]:
        """One ``vllm bench serve`` of ``n`` prompts at ``c`` on ``cfg``'s server; returns (the
        recorded point or None, whether this server should measure no more)."""
        a, dep = self.a, self.deps[cfg.name]
        ctl = control_url(dep)
        what = f"{cfg.name}" + ("" if al is None else f" AL {al}")
        probe = bool((extra or {}).get("probe"))
        rep = "_probe" if probe else "" if repeat is None else f"_r{repeat}"
        seed = point_seed(ali or 0, c, repeat or 0) + (PROBE_SEED_OFFSET if probe else 0)
        argv = bench_argv(
            url=dep.url, model=self.paths.target,
            label=cfg.name, concurrency=c, prompts=n, seed=seed,
            input_len=a.input_len, output_len=a.output_len, result_dir=str(self.bench_dir),
            result_name=f"{cfg.name}_al{al}_c{c}{rep}.json",
        )  # fmt: skip
        if a.step_times:
            step_rpc(ctl, "enable")
        from dspark_dev.metrics import counter_delta
        from dspark_dev.serve_demo import spec_metrics

        before = spec_metrics(ctl, settle_s=0.0)
        pd_before = pd_snapshot(dep) if cfg.pd else None
        model = self.model(cfg)
        t0 = time.monotonic()
        result, err = run_bench_in_process(argv, max(5.0, self.time_left()), dep.stop)
        wall = time.monotonic() - t0
        why_not = bench_failure(result, err)
        if why_not:
            self.skip(cfg, al, c, f"bench failed: {why_not}",
                      **({} if repeat is None else {"repeat": repeat}),
                      **({"probe": True} if probe else {}))  # fmt: skip
            self.log(f"FAILED {what} C={c}: {why_not}")
            # a result with failed requests: the deployment is not serving; measure it no more
            return None, bool(dep.dead_nodes() or err.startswith("cut") or result is not None)
        delta = counter_delta(before, spec_metrics(ctl, settle_s=3.0))
        summary = bench_summary(result)
        point = {
            "config": cfg.name, "pp": cfg.pp, "spec": cfg.spec, "plugin": cfg.plugin,
            "pd": cfg.pd,
            "acceptance_length": al, "concurrency": c, "num_prompts": n,
            "full_prompts": n_full, "trimmed": why, "seed": seed,
            "wall_s": round(wall, 2), "bench": summary, "spec_metrics": delta,
            "measured_acceptance_length": measured_acceptance_length(delta),
            "bench_command": "vllm bench serve " + " ".join(argv),
        }  # fmt: skip
        if repeat is not None:
            point["repeat"] = repeat
        point.update(extra or {})
        if cfg.pd:
            point["pd"] = pd_delta(pd_before, pd_snapshot(dep))
            point["pd"]["hops"] = pd_hops(
                dep, (pd_before.get("proxy") or {}).get("hops_recorded", 0)
            )
        if a.step_times:
            point["step_times"] = step_rpc(ctl, "collect")
        self.res.add("points", point)
        if summary.get("median_tpot_ms"):
            self.tpot[cfg.name] = float(summary["median_tpot_ms"])
            # how far off the estimate was, with the measured TPOT (bounded: one odd point
            # must not starve or flood the rest). Not from a probe: its one wave leaves the
            # guessed fixed part (--guess-point-s) most of the estimate, so the ratio would
            # scale every later wave by the guess's error instead of the run's
            if not probe:
                est = replace(model, tpot_ms=self.tpot[cfg.name], calib=1.0).point_cost_s(c, n)
                self.calib[cfg.name] = min(3.0, max(0.5, wall / est)) if est > 0 else 1.0
        mal = point["measured_acceptance_length"]
        self.log(
            f"{what} C={c}{'' if repeat is None else f' repeat {repeat}'}: "
            f"{summary.get('output_throughput', 0):.1f} tok/s, "
            f"TTFT p50 {summary.get('p50_ttft_ms', 0):.1f} ms, "
            f"TPOT p50 {summary.get('p50_tpot_ms', 0):.2f} ms, "
            f"AL {'-' if mal is None else f'{mal:.2f}'}, {n} prompts"
            f"{'' if why is None else ' (' + why + ')'}, {wall:.0f} s"
            + (" (probe: sets the point's prompt count, not counted)" if probe else "")
        )
        return point, False

    def probe(self, cfg, al, ali, c) -> bool:
        """One wave of ``c`` prompts on ``cfg``'s server before its first measured point, so that
        the point's prompt count comes from a measured TPOT, not ``--guess-tpot-ms`` (2026-12-07:
        the tiny pair's TPOT was 1.2 ms against the 6 ms guessed, and its runs lasted 4 s where 10
        were asked). Recorded in ``points`` with ``probe`` true and no ``repeat`` (no summary,
        ratio or page reads it), on prompts of its own. It also takes the server's first-run
        effects out of repeat 0. Returns whether the server should measure no more."""
        _point, stop = self.measure(
            cfg, al if cfg.spec else None, ali, c, c, why=None, n_full=c,
            extra={"probe": True, "point_al": al, "interleaved": True},
        )  # fmt: skip
        return stop

    def outcome(self) -> int:
        data = self.res.data
        # probes are not measurements: a call that measured nothing else did not succeed
        ok = any(not p.get("probe") for p in data["points"]) and all(
            s.get("outcome") == "ok" for s in data["servers"].values()
        )
        return 0 if ok else 1


def dry_run_interleaved(a, paths) -> int:
    """The rotation of every point, with the prompt count wanted before the budget (from the
    guessed TPOT: the run itself re-plans each point with the TPOT it measured)."""
    names = [c.name for c in a.cfgs]
    models = [
        CostModel(a.guess_tpot_ms, a.output_len, a.guess_prefill_ms, a.guess_point_s) for _ in names
    ]
    current = None
    probed = False
    for ali, al, c in interleaved_points(a):
        if al is not None and al != current:
            current = al
            for cfg in a.cfgs:
                if cfg.spec:
                    print(f"POST URL({cfg.name})/collective_rpc {json.dumps(rpc_body(al))}")
        if a.probe and a.min_run_s > 0 and not probed:
            probed = True
            print(
                f"# probe AL {al} C={c}: one wave on each server, its own prompts (seed "
                f"+ {PROBE_SEED_OFFSET}); the point's prompt count then comes from its TPOT"
            )
            for name in names:
                cfg = CONFIGS[name]
                argv = bench_argv(
                    url=f"URL({name})", model=paths.target, label=name, concurrency=c,
                    prompts=c, seed=point_seed(ali or 0, c) + PROBE_SEED_OFFSET,
                    input_len=a.input_len, output_len=a.output_len, result_dir="DIR",
                    result_name=f"{name}_al{al if cfg.spec else None}_c{c}_probe.json",
                )  # fmt: skip
                print("vllm bench serve " + " ".join(argv))
        base = default_prompts(c, a.prompts_per_c, a.min_prompts)
        n = wanted_prompts(c, models, a.min_run_s, base)
        print(f"# point AL {al} C={c}: {a.repeats} rotations ({a.rotation}), {n} prompts per "
              f"run before the budget (--min-run-s {a.min_run_s:.0f}"
              f"{', guessed TPOT: the probe re-plans it' if a.probe else ''})")  # fmt: skip
        for slot, (r, name) in enumerate(rotation_order(names, a.repeats, a.rotation)):
            cfg = CONFIGS[name]
            argv = bench_argv(
                url=f"URL({name})", model=paths.target, label=name, concurrency=c, prompts=n,
                seed=point_seed(ali or 0, c, r), input_len=a.input_len,
                output_len=a.output_len, result_dir="DIR",
                result_name=f"{name}_al{al if cfg.spec else None}_c{c}_r{r}.json",
            )  # fmt: skip
            print(f"# slot {slot} repeat {r} {name}")
            print("vllm bench serve " + " ".join(argv))
    return 0


def run(a, deps, sweeps, paths, res: Results, log: Log, deadline: float) -> int:
    """One sweep over ``a.cs`` per (configuration, AL), in ``sweeps`` order."""
    rn = Runner(a, deps, paths, res, log, deadline)
    if a.start == "together":
        rn.start(deps)
    for si, (cfg, ali, al) in enumerate(sweeps):
        rn.start([cfg.name])
        if not rn.ready(cfg.name):
            for c in a.cs:
                rn.skip(cfg, al, c, "server not ready")
            continue
        if al is not None:
            why_not = rn.set_al(cfg, al)
            if why_not:
                for c in a.cs:
                    rn.skip(cfg, al, c, why_not)
                continue
        sweeps_left = len(sweeps) - si
        what = f"{cfg.name}" + ("" if al is None else f" AL {al}")
        for ci, c in enumerate(a.cs):
            if rn.lost(cfg):
                break
            n_full = default_prompts(c, a.prompts_per_c, a.min_prompts)
            n, why = plan_point(
                c, a.cs[ci + 1 :], sweeps_left - 1, a.cs, rn.time_left(), rn.model(cfg),
                lambda cc: default_prompts(cc, a.prompts_per_c, a.min_prompts),
            )  # fmt: skip
            if n == 0:
                rn.skip(cfg, al, c, why)
                log(f"SKIP {what} C={c}: {why}")
                continue
            _point, stop = rn.measure(cfg, al, ali, c, n, why=why, n_full=n_full)
            if stop:
                break
    return rn.outcome()


def interleaved_points(a) -> list[tuple[int | None, float | None, int]]:
    """(AL index, AL, C) of an interleaved run in order: every AL (None when no configuration
    speculates), then every C."""
    if any(c.spec for c in a.cfgs):
        return [(i, al, c) for i, al in enumerate(a.als) for c in a.cs]
    return [(None, None, c) for c in a.cs]


def drop_from_comparison(gone: list[str], names: list[str], live: list, log: Log) -> bool:
    """Take the configurations ``gone`` (a failed run, a lost server) out of ``live`` so that
    the others' rotations go on; False (the comparison must end) when the baseline
    (``names[0]``) is among them or fewer than two configurations would remain. A failed
    PP=2-producer PD run ended the whole 2026-12-06 goal call, aggregated and PP=1-producer PD
    included, before this."""
    rest = [cfg for cfg in live if cfg.name not in gone]
    if names[0] in gone or len(rest) < 2:
        return False
    live[:] = rest
    log(f"{', '.join(gone)} left the comparison after a failed run; "
        f"{', '.join(cfg.name for cfg in rest)} go on")  # fmt: skip
    return True


def run_interleaved(a, deps, paths, res: Results, log: Log, deadline: float) -> int:
    """Per (AL, C): every configuration ``a.repeats`` times in rotation, the same prompt count
    for all of them (``plan_interleaved_point``), then the point's summary
    (:func:`interleave_summary`, rewritten into ``res.data["interleaved"]`` after every run)."""
    rn = Runner(a, deps, paths, res, log, deadline)
    rn.start(deps)  # --interleave implies --start together
    names = [c.name for c in a.cfgs]
    live = [cfg for cfg in a.cfgs if rn.ready(cfg.name)]
    gone = {cfg.name for cfg in a.cfgs} - {cfg.name for cfg in live}
    if gone:
        for cfg in a.cfgs:
            if cfg.name in gone:
                for c in a.cs:
                    rn.skip(cfg, None, c, "server not ready")
        log(f"FAILED: not ready: {', '.join(sorted(gone))}; no interleaved comparison")
        return 1
    plan = interleaved_points(a)
    current_al: float | None = None
    al_failed: dict[float, list[str]] = {}  # AL -> the servers that did not apply it
    for pi, (ali, al, c) in enumerate(plan):
        if al is not None and al != current_al:
            current_al = al
            bad = [cfg.name for cfg in live if cfg.spec and rn.set_al(cfg, al)]
            if bad:
                al_failed[al] = bad
        if al in al_failed:
            for cfg in live:
                rn.skip(cfg, al, c, f"AL not applied on {', '.join(al_failed[al])}")
            continue
        lost = [cfg.name for cfg in live if rn.lost(cfg)]
        if lost and not rn.leave(lost, names, live):
            log("FAILED: a server was lost; the interleaved comparison ends here")
            break
        unmeasured = [cfg for cfg in live if cfg.name not in rn.tpot]
        if a.probe and a.min_run_s > 0 and unmeasured:
            # a probe must not eat the point: the probes and one wave per run of the point,
            # by the guess, must fit the time left, else the guess sets the prompt count
            need = sum(rn.model(cfg).point_cost_s(c, c) for cfg in unmeasured)
            need += interleaved_cost_s(c, c, [rn.model(cfg) for cfg in live], a.repeats)
            if rn.time_left() < need:
                log(f"no probe at AL {al} C={c}: {rn.time_left():.0f} s left, under the "
                    f"{need:.0f} s of the probes and one wave per run; the guessed TPOT sets "
                    "the prompt count")  # fmt: skip
                unmeasured = []
            else:
                log(f"probe at AL {al} C={c}: one wave on "
                    f"{', '.join(x.name for x in unmeasured)} (no TPOT measured yet; "
                    f"--guess-tpot-ms {a.guess_tpot_ms:g} would set the prompt count)")  # fmt: skip
            lost, cut = [], False
            for cfg in unmeasured:
                if rn.probe(cfg, al, ali, c):
                    lost.append(cfg.name)
                    if rn.time_left() <= 0:
                        cut = True
                        break
            if cut or (lost and not rn.leave(lost, names, live)):
                log("a probe failed or a server was lost; the interleaved comparison ends here")
                break
        models = [rn.model(cfg) for cfg in live]

        def want(cc: int, models=models) -> int:
            base = default_prompts(cc, a.prompts_per_c, a.min_prompts)
            return wanted_prompts(cc, models, a.min_run_s, base)

        def cost(cc: int, models=models, want=want) -> float:
            return interleaved_cost_s(cc, want(cc), models, a.repeats)

        n_want = want(c)
        share = time_for_point(rn.time_left(), cost(c), [cost(cc) for *_x, cc in plan[pi + 1 :]])
        n, why = plan_interleaved_point(c, models, a.repeats, n_want, share)
        if n == 0:
            for cfg in live:
                rn.skip(cfg, al, c, why)
            log(f"SKIP AL {al} C={c}: {why}")
            continue
        active = [cfg.name for cfg in live]
        log(f"point AL {al} C={c}: {n} prompts per run, {a.repeats} rotations of "
            f"{', '.join(active)}{'' if why is None else ' (' + why + ')'}")  # fmt: skip
        cut = False
        for slot, (r, name) in enumerate(rotation_order(active, a.repeats, a.rotation)):
            cfg = CONFIGS[name]
            if cfg not in live:  # left the comparison earlier in this point
                rn.skip(cfg, al, c, "left the comparison after a failed run", repeat=r)
                continue
            # the point's AL index seeds every configuration alike (no-spec too: its server
            # must not see one AL's prompts again at the next)
            _point, stop = rn.measure(
                cfg, al if cfg.spec else None, ali, c, n, why=why,
                n_full=n_want, repeat=r,
                extra={"slot": slot, "point_al": al, "interleaved": True},
            )  # fmt: skip
            res.data["interleaved"] = interleave_summary(res.data["points"], names, a.repeats)
            res.save()
            if stop and (rn.time_left() <= 0 or not rn.leave([name], names, live)):
                cut = True
                break
        if cut:
            log("a run was cut or a server lost; the interleaved comparison ends here")
            break
    for entry in res.data.get("interleaved", []):
        for key, r in entry["ratios"].items():
            tp = r["output_throughput"]
            if tp["ratio_of_means"] is not None and tp["per_rotation"]:
                log(f"AL {entry['acceptance_length']} C={entry['concurrency']} {key}: output "
                    f"tok/s {tp['ratio_of_means']:.3f} (rotations {tp['min']:.3f}-"
                    f"{tp['max']:.3f}, {r['rotations']} pairs)")  # fmt: skip
    return rn.outcome()


if __name__ == "__main__":
    raise SystemExit(main())
