"""Every environment variable the checkout's tooling, tests, benchmarks and GPU scripts read: one
registry (name, default, meaning); who reads each is found by :mod:`dspark_dev.knob_scan`.

The runtime knobs (``VLLM_DSPARK_PP_*``) live in ``vllm_dspark_pp/envs.py``; this registry holds
the rest (``DSPARK_*``: test, tooling and diagnosis switches, none read by the plugin).
docs/knobs.md lists both and is generated here::

    python -m dspark_dev.knobs --markdown > docs/knobs.md

tests/unit/repo/test_knobs.py fails when a ``DSPARK_*`` / ``VLLM_DSPARK_*`` variable is read (Python
or shell) without an entry here or in ``envs.py``, when an entry is no longer named anywhere,
when a literal default at a read site is not the one written here, and when the page is stale.
A new knob: add a :class:`Knob` below (default as the reader has it: ``unset``, a literal, or
the rule), then regenerate the page.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from unittest import mock

from dspark_dev import knob_scan


@dataclass(frozen=True)
class Knob:
    name: str
    default: str  # as the reader has it; several readers' literals separated by "; "
    meaning: str


#: One knob per entry: ``NAME | default | meaning``; an indented line continues the entry above,
#: a ``#`` line heads a group.
_TABLE = """
# test tiers and harness
DSPARK_PP_TEST_DEVICE | auto | Test device: `cpu` or `gpu` forces it; `auto` picks the CPU platform
    unless CUDA is there (tests/conftest.py puts the CPU env first).
DSPARK_PP_REQUIRE_E2E | unset | `1`: an e2e test that would skip fails instead (tools/run_tests.sh
    sets it).
DSPARK_E2E_FULL | unset | `1`: also run the e2e variants marked `e2e_full`, redundant in the
    default (CI) run.
DSPARK_E2E_TIMEOUT_S | 300 | Hard wall-clock limit of one e2e engine case, in seconds.
DSPARK_E2E_PARALLEL | 2 | How many independent e2e engine cases a fixture runs at once
    (tests/support/e2e.py run_together); `1`: one at a time.
DSPARK_E2E_LOG_DIR | unset | Keep every e2e case's full log in this folder (debugging aid).
DSPARK_E2E_PLUGINS | unset | `none`: run the e2e engines without the plugin
    (VLLM_PLUGINS=no-such-plugin), to show a failure on stock vLLM.
DSPARK_E2E_PD_CORRUPT_DRAFT_KV | unset | `1`: the PD producer CPU test also runs its
    corrupted-draft-KV control (hand run).
DSPARK_PGID_DIR | unset | Folder where every process group the tooling starts is noted while it
    runs, so an outer script can kill them if Python dies (the GPU scripts set it).
DSPARK_PP_RANDOM_CASES | 1200 | Cases of the randomized PP exchange-schedule test (fewer than 1000
    only when set on purpose).
DSPARK_PP_PROTOCOL_GPU_TEST_DEVICE | cuda | Device of the protocol GPU test; `cpu` dry-runs its
    logic under the Triton interpreter.
DSPARK_SAMPLING_REQUESTS | 0 | Hand run of the e2e sampling test: seeded requests per temperature
    (0 skips it).
DSPARK_RELIABILITY_HAND | unset | `1`: run the hand-run process-fault cases (minutes each).
DSPARK_RELIABILITY_STOCK | unset | `1`: run the reliability cases on stock vLLM (without the
    plugin), as their control.
DSPARK_RELIABILITY_EXIT_LIMIT_S | 120 | Process-fault cases: seconds the survivors may take to exit
    after a fault.
DSPARK_RELIABILITY_EXIT_BOUND_S | 15 | Process-fault cases: the exit bound the plugin's runs must
    meet, in seconds.
DSPARK_RELIABILITY_EXEC_TIMEOUT_S | 300 | Process-fault cases: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
    given to the launchers.
DSPARK_RELIABILITY_ENV | unset | Process-fault cases: extra `K=V K=V` variables for every launcher.
DSPARK_PD_SERVE_HAND | unset | `1`: run the served PD benchmark test by hand (about 30 s).
DSPARK_SERVE_INTERLEAVE_HAND | unset | `1`: run the served benchmark's interleaved comparison
    against stand-in servers by hand (about 60 s).
DSPARK_GSM8K_LAUNCHERS | unset | `1`: run the GSM8K gate over `vllm serve` launchers too (about 3
    min on 2 cores).
DSPARK_DSV4_CPU_CHECKS | unset | `1`: run the DeepSeek-V4 CPU reference checks (about 10 s, imports
    transformers).
DSPARK_DSV4_LAYER_CPU | unset | `1`: run the DeepSeek-V4 MoE layer test on vLLM's CPU kernels (hand
    run).
DSPARK_DSV4_TRAIN_SMOKE | unset | `1`: run the DeepSeek-V4 training smoke test (about 15 s).
DSPARK_K3_TRAIN_CHECK | unset | `1`: run the Kimi-K3 training equivalence checks (vLLM's K3 modules
    on CPU, minutes).
# GPU scripts (tools/gpu)
DSPARK_SITE | /tmp/site | Where the GPU kit is installed (run_gpu_suite.sh; the NCCL stub guard).
DSPARK_GPU_BUDGET_S | 560 | run_gpu_suite.sh: the whole GPU suite's time budget, in seconds.
DSPARK_GPU_GROUPS_BUDGET_S | 540 | run_groups.sh: each group's time limit, in seconds; the groups'
    deadlines are derived from it.
DSPARK_GPU_GROUPS_STAGGER_S | 0 | run_groups.sh: seconds between the starts of the groups.
DSPARK_GPU_GROUPS_SERIAL_S | unset | run_groups.sh: the call's seconds; set, the groups run one
    after another, each under min(budget, what is left of the call).
DSPARK_GPU_GROUPS_MIN_S | 200 | run_groups.sh with DSPARK_GPU_GROUPS_SERIAL_S: a group with fewer
    seconds of the call left is not started.
DSPARK_GPU_ARTIFACTS | unset | Folder where GPU tests leave failing jobs' logs and records (the GPU
    scripts set it).
DSPARK_GPU_COMMIT | unset | Commit recorded in GPU result records (the GPU machine has no git
    history).
DSPARK_GPU_DRYRUN_CPU | unset | `1`: run the one-GPU tier's plumbing on the CPU platform
    (developers only: tools/gpu/README.md).
DSPARK_GPU_JOBS | unset | GPU tier engine jobs to start (`a,b`); empty: all.
DSPARK_GPU_PD_EAGER | 0 | `1`: the GPU tier's PD servers run eager instead of CUDA graphs.
DSPARK_GPU_PAIR_DTYPE | float32 | dtype of the tiny pair in the GPU tier's PD jobs.
DSPARK_GPU_NEAR_TIE | 0.125 | Parity: a top-2 logprob gap under this (nats) counts as a near tie.
DSPARK_GPU_PP_LAYOUT | unset (shared) | PP launchers' GPU layout: `shared` (every stage on GPU 0)
    or `per-stage` (stage R on GPU R).
DSPARK_GPU_PP_JOBS | unset | PP one-GPU test jobs to start (`a,b`, `all`); empty: all but the
    tap-partials jobs (`pp3_taps_dict`, `pp3_taps_side`).
DSPARK_GPU_TAP_PARTIALS_JOBS | ref,pp1_async,pp3_async,pp3_taps_dict,pp3_taps_side,pp3_taps_wrong |
    run_groups.sh tap_partials: its DSPARK_GPU_PP_JOBS.
DSPARK_GPU_PP_LOGS | unset (a new temporary folder) | Folder for the PP GPU tests' launcher logs.
DSPARK_GPU_PP_OUT | unset (DSPARK_GPU_ARTIFACTS, else the log folder) | Where the PP one-GPU test
    writes its JSON record pp.json.
DSPARK_GPU_PP_READY_S | 330; 900 (CPU dry run) / 200 (load test) | PP GPU tests: seconds the
    plugin's launchers may take to be ready.
DSPARK_GPU_PP_STOCK_READY_S | 420 | PP GPU tests: seconds stock vLLM's launchers may take to be
    ready.
DSPARK_GPU_ADAPTIVE_READY_S | BUDGET - 200 | run_groups.sh pp_adaptive: its DSPARK_GPU_PP_READY_S.
DSPARK_GPU_TAP_PARTIALS_READY_S | BUDGET - 200 | run_groups.sh tap_partials: its
    DSPARK_GPU_PP_READY_S (a short lease's smaller budget need not shorten it alike).
DSPARK_GPU_LOST_STAGE_READY_S | BUDGET - 200 | run_groups.sh lost_stage groups: their
    DSPARK_GPU_PP_READY_S.
DSPARK_GPU_LOAD_READY_S | BUDGET * 6 / 10 | run_groups.sh load: its DSPARK_GPU_PP_READY_S.
DSPARK_GPU_TP_PP_READY_S | BUDGET - 170 | run_groups.sh tp_pp: its DSPARK_GPU_PP_READY_S.
DSPARK_GPU_TP_PP_STOCK_READY_S | BUDGET - 150 | run_groups.sh tp_pp: its
    DSPARK_GPU_PP_STOCK_READY_S.
DSPARK_GPU_DSV41_PP_READY_S | BUDGET - 200 | run_groups.sh dsv41_pp: its DSPARK_GPU_PP_READY_S and
    DSPARK_GPU_PP_STOCK_READY_S.
DSPARK_GPU_TP_PP_JOBS | unset | TP x PP one-GPU test jobs (`a,b`, `all`); empty: its default jobs.
DSPARK_GPU_TP_PP_DTYPE | bfloat16 | dtype of the TP x PP one-GPU test (float32 in a CPU dry run).
DSPARK_GPU_DSV4K3_PP_OUT | unset (DSPARK_GPU_ARTIFACTS, else the log folder) | Where the DSV4/K3 PP
    test writes its JSON record dsv4k3_pp.json.
DSPARK_GPU_TP_PP_OUT | unset (DSPARK_GPU_ARTIFACTS, else the log folder) | Where the TP x PP test
    writes its result record.
DSPARK_GPU_DSV41_PP_OUT | unset (DSPARK_GPU_ARTIFACTS, else the log folder) | Where the V4.1 PP
    test writes its JSON record dsv41_pp.json.
DSPARK_GPU_PD_PP_JOBS | unset | PD-with-PP-producer test jobs (`a,b`, `all`); empty: group
    pd_pp's jobs.
DSPARK_GPU_PD_PP_PAIR | tiny | Pair of the PD-with-PP-producer test: `tiny`, `dsv4`, `dsv41` or
    `k3`.
DSPARK_GPU_PD_K3_BLOCKING | unset | `1`: the K3 PD-with-PP-producer test's producer runs eager with
    `CUDA_LAUNCH_BLOCKING=1` (its setting before the stream pin).
DSPARK_GPU_PD_PP_READY_S | 420 | PD-with-PP-producer test: seconds its servers may take to be
    ready.
DSPARK_GPU_PD_TP_PP_JOBS | pair_baseline,pair_spec,pd_tp2pp2_tp2 | run_groups.sh pd_tp_pp: its
    DSPARK_GPU_PD_PP_JOBS.
DSPARK_GPU_PD_TP_PP_READY_S | BUDGET - 120 | run_groups.sh pd_tp_pp: its DSPARK_GPU_PD_PP_READY_S.
DSPARK_GPU_DSV4K3_PP_READY_S | BUDGET - 200 | run_groups.sh dsv4k3_pp: its DSPARK_GPU_PP_READY_S.
DSPARK_GPU_PD_TP_PP_OUT | unset (DSPARK_GPU_ARTIFACTS) | Where the PD TP x PP test writes its
    result record.
DSPARK_GPU_PD_PP_OUT | unset (DSPARK_GPU_ARTIFACTS, else a temporary folder) | Where the
    PD-with-PP-producer test writes the JSON record pd_pp.json of its PP=2 / PP=1 producer jobs.
DSPARK_GPU_LOST_STAGE_BOUND_S | 30 | Lost-stage GPU test: seconds within which the plugin's engine
    must stop after a stage dies.
DSPARK_GPU_LOST_STAGE_CONTROL | unset | `1`: the lost-stage test runs its control (peer watch off).
DSPARK_GPU_LOST_STAGE_STOCK | unset | `1`: the lost-stage test runs on stock vLLM.
DSPARK_GPU_LOST_STAGE_LOGS | unset (the test's temporary folder) | Folder for the lost-stage test's
    launcher logs.
DSPARK_GPU_LOAD_PROMPTS | 500; 8 (CPU dry run) | Served load test: prompts per run.
DSPARK_GPU_LOAD_CONCURRENCY | 32; 4 (CPU dry run) | Served load test: concurrent requests.
DSPARK_GPU_LOAD_RUNS | 3 | Served load test: runs per server.
DSPARK_GPU_LOAD_INPUT_LEN | 128; 32 (CPU dry run) | Served load test: prompt length in tokens.
DSPARK_GPU_LOAD_OUTPUT_LEN | 64; 8 (CPU dry run) | Served load test: output length in tokens.
DSPARK_GPU_LOAD_BUDGET_S | 320; 1800 (CPU dry run) | Served load test: its time budget, in seconds.
DSPARK_GPU_LOAD_GROWTH_MIB | 2048 | Served load test: the memory growth bound between runs, in MiB.
DSPARK_GPU_LOAD_STOCK | 1 | `1`: the served load test also runs stock vLLM.
DSPARK_GPU_LOAD_LOGS | unset (a new temporary folder) | Folder for the served load test's logs.
DSPARK_GPU_SAMPLING_REQUESTS | unset (64 in a CPU dry run, else the test's figure) | GPU sampling
    test: seeded requests per temperature.
DSPARK_GPU_SAMPLING_BUDGET_S | 500; 1500 (CPU dry run) | GPU sampling test: its time budget, in
    seconds.
DSPARK_GPU_SAMPLING_OUT | unset (a new temporary folder) | Where the GPU sampling test writes its
    record.
DSPARK_GPU_SAMPLING_LOGS | unset (DSPARK_GPU_SAMPLING_OUT) | Folder for the GPU sampling test's
    engine logs.
DSPARK_GPU_PRODUCER_MEMORY | unset | `1`: run the PD producer memory test (its own GPU group).
DSPARK_PRODUCER_MEMORY_BUDGET_S | 170 | PD producer memory test: its time budget, in seconds.
DSPARK_PRODUCER_MEMORY_OUT | unset (the test's temporary folder) | Where the PD producer memory
    test writes its record.
DSPARK_PRODUCER_GPU_TIMEOUT_S | 420 | PD producer GPU test: seconds per engine.
DSPARK_GPU_NIXL | unset | `1`: run the NIXL PD GPU test.
DSPARK_NIXL_READY_S | 170 | NIXL PD GPU test: seconds its servers may take to be ready.
DSPARK_NIXL_OUT | unset (DSPARK_GPU_ARTIFACTS) | Where the NIXL PD GPU test writes its record.
DSPARK_NIXL_UCX_TLS | cuda_ipc,cuda_copy,tcp | UCX_TLS for NIXL on one host
    (dspark_dev/pd_launch.py).
DSPARK_NIXL_UCX_NET_DEVICES | lo | UCX_NET_DEVICES for NIXL on one host; empty: left unset.
DSPARK_PD_MOONCAKE_PROTOCOL | tcp | `mooncake_protocol` of the PD tooling's MooncakeConnector
    engines where the caller names none: `tcp`, `rdma` or `nvlink_intra` (then every engine also
    gets `MC_INTRANODE_NVLINK=1`; dspark_dev/pd_launch.py, docs/pd_transport.md).
DSPARK_PD_KILL_BOUND_S | 40; 150 (CPU dry run) | PD kill GPU test: seconds within which clients
    must see the failure.
DSPARK_PD_KILL_BUDGET_S | 240; 1500 (CPU dry run) | PD kill GPU test: its time budget, in seconds.
DSPARK_PD_KILL_READY_S | 150; 600 (CPU dry run) | PD kill GPU test: seconds its servers may take to
    be ready (run_groups.sh: BUDGET * 6 / 10).
DSPARK_PD_KILL_STOCK | 1; 0 (CPU dry run) | `1`: the PD kill test also runs stock vLLM.
DSPARK_PD_KILL_DECODER_ABORT_S | unset | PD kill test: VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT for the
    decoders; unset: vLLM's default.
DSPARK_GPU_PD_KILL_LOGS | unset (a new temporary folder) | Folder for the PD kill test's logs.
DSPARK_PD_DKILL_BOUND_S | 40; 150 (CPU dry run) | PD decoder-kill GPU test: seconds within which
    clients must see the failure.
DSPARK_PD_DKILL_BUDGET_S | 240; 1500 (CPU dry run) | PD decoder-kill GPU test: its time budget, in
    seconds.
DSPARK_PD_DKILL_READY_S | 130; 600 (CPU dry run) | PD decoder-kill GPU test: seconds its servers
    may take to be ready (run_groups.sh: BUDGET * 55 / 100).
DSPARK_PD_DKILL_STOCK | 1; 0 (CPU dry run) | `1`: the PD decoder-kill test also runs stock vLLM.
DSPARK_PD_DKILL_HOLD_S | 45 | PD decoder-kill test: seconds the killed decoder's requests are held.
DSPARK_PD_DKILL_FREE_MARGIN_S | 30 | PD decoder-kill test: margin, in seconds, for the producer to
    free the killed decoder's blocks.
DSPARK_GPU_PD_DKILL_LOGS | unset (a new temporary folder) | Folder for the PD decoder-kill test's
    logs.
# DeepSeek-V4 / Kimi-K3 GPU
DSPARK_DSV4K3_WEIGHTS | dummy | DSV4/K3 GPU tests: `dummy` (random weights, k=4) or `trained` (the
    bundled trained pairs).
DSPARK_DSV4K3_FAMILIES | k3,dsv4 | DSV4/K3 engine test: families to run.
DSPARK_DSV4K3_JOBS | unset | DSV4/K3 engine test: jobs to start (`a,b`); empty: all.
DSPARK_DSV4K3_MAX_JOBS | 16 | DSV4/K3 engine test: engines started at once.
DSPARK_DSV4K3_TIMEOUT_S | 250 | DSV4/K3 engine test: seconds per engine job (run_groups.sh: BUDGET
    - 90).
DSPARK_DSV4K3_PD_EAGER | unset | `1`: the DSV4/K3 PD servers run eager.
DSPARK_DSV4K3_PP_JOBS | unset (all) | DSV4/K3 PP test: jobs to start (`a,b`).
DSPARK_DSV41_PP_JOBS | unset (all) | DeepSeek-V4.1 PP test: jobs to start (`a,b`, `all`); empty:
    every one (base, pp1, pp2_graphs, pp2_eager, pp2_sync_eager, stock_pp2).
DSPARK_CHILD_DEVICE | cuda | Context-KV MLA GPU child: `cpu` dry-runs its own logic.
# probes loaded into engines
DSPARK_TEST_VERIFY_COST_SLOPE | 20.0 (test); unset (probe: off) | Adaptive probe: pins vLLM's
    adaptive-verification cost tables to this slope.
DSPARK_TEST_VERIFY_COST_CAP | 4 (test); unset (probe: no cap) | Adaptive probe: a verify step of
    more than this many tokens costs 1000x, so a lone request's budget binds at every verify step.
DSPARK_TEST_CORRUPT_STAGE0 | unset | `1`: the adaptive probe's control: the first PP stage reads
    wrong admitted counts.
DSPARK_TEST_TAP_WRONG_BLOCK | unset | `1`: the tap probe's control: every PP stage before the last
    reads its column block of the draft's first linear as zeros.
DSPARK_TEST_K3_IDS_PROBE | unset | `1`: the K3 probe logs each embed_input_ids call of the Kimi-K3
    target.
DSPARK_TEST_K3_SYNC | unset (none) | K3 sync probe: device syncs at the named points (`step`, ...).
DSPARK_TEST_K3_SYNC_RANKS | unset (every rank) | K3 sync probe: PP ranks that sync (`0,1`).
DSPARK_TEST_K3_NO_SIDE_STREAMS | unset | `1`: the K3 probe turns Kimi-K3's side streams off.
DSPARK_TEST_K3_UVA_DEPTH | unset | K3 probe: vLLM's UVA staging pools get at least this many slots.
DSPARK_TEST_K3_NO_PDL | unset | `1`: the K3 probe reports no Programmatic Dependent Launch.
DSPARK_TEST_K3_DRAFTS_PROBE | unset | `1`: the K3 probe reads back the exchanged token ids.
DSPARK_TEST_K3_WIRE_PROBE | unset | `1`: the K3 probe copies the exchanged ids in
    stream order, no sync on the last rank.
DSPARK_TEST_MISMATCH_RANK | -1 | tools/gpu/run_pp2_aggregated.py's probe: the PP rank whose
    handshake facts it falsifies (-1: none).
# fakes and stubs
DSPARK_FAKE_MODELS | unset | GPU-fake plugin: folder holding the pairs the fake engines read.
DSPARK_FAKE_MUTATION | unset | GPU-fake plugin: break one thing, to show a check fails
    (`subtle_same`, `pos6_zero`, ...).
DSPARK_FAKE_WIRING_PARALLEL | 2 | tests/unit/support/test_gpu_fake_wiring.py: how many
    fake-engine child runs run at once.
DSPARK_FAKE_CALLS | unset (none written) | GPU-fake plugin: write the recorded engine calls as JSON
    here.
DSPARK_FAKE_NCCL_GUARD | set by the fake guard | Marker the GPU-fake NCCL guard puts in a
    launcher's env, so the recorded calls show which launchers got it.
DSPARK_NCCL_STUB_LOG | unset (stderr) | The recording NCCL stub appends the symbols called to this
    file.
# benchmarks
DSPARK_BENCH_CONFIDENCES | draft | Benchmark hooks: what adaptive verification ranks with: `draft`
    or `synthetic`.
DSPARK_BENCH_SYNTHETIC_SCHEDULE | min-variance | Benchmark hooks: how a mean acceptance length is
    spread: `min-variance` or `geometric`.
DSPARK_BENCH_PROFILE_POSITIONS | unset (the server's k) | Benchmark hooks: the acceptance profile
    spans this many positions and a server keeps its first k (serve_pp_one_gpu.py sets it for a k
    sweep, so every k accepts position i alike).
"""


def _parse(table: str) -> tuple[Knob, ...]:
    entries: list[str] = []
    for line in table.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line[0].isspace():
            entries[-1] += " " + line.strip()
        else:
            entries.append(line.strip())
    out = []
    for entry in entries:
        name, default, meaning = (part.strip() for part in entry.split(" | ", 2))
        out.append(Knob(name, default, meaning))
    return tuple(out)


KNOBS = _parse(_TABLE)

#: Names that look like knobs but are not environment variables.
NOT_KNOBS: dict[str, str] = {
    "DSPARK_NCCL_STUB_CALLED": "a line marker the recording NCCL stub writes into its log",
}

REGISTRY: dict[str, Knob] = {k.name: k for k in KNOBS}


def runtime_knobs() -> list[Knob]:
    """The runtime knobs from ``vllm_dspark_pp/envs.py``: default from the getter with the
    variable unset, meaning from the comment above its entry."""
    import inspect

    from vllm_dspark_pp import envs

    comments = _entry_comments(inspect.getsource(envs))
    out = []
    for name in envs.environment_variables:
        names = [name, *(o for o, n in envs.deprecated_environment_variables.items() if n == name)]
        without = {k: v for k, v in os.environ.items() if k not in names}
        with mock.patch.dict(os.environ, without, clear=True):
            default = envs.environment_variables[name]()
        out.append(Knob(name, _shown(default), comments.get(name, "")))
    return out


def _shown(default: object) -> str:
    """A typed default as the variable's text: 120.0 -> "120", False -> "unset (off)"."""
    if isinstance(default, bool):
        return "unset (off)" if not default else "on"
    if isinstance(default, float):
        return f"{default:g}"
    if default is None:  # chosen at run time (the meaning says from what)
        return "unset (chosen)"
    return str(default) if default != "" else "unset"


def _entry_comments(source: str) -> dict[str, str]:
    """``"NAME": ...`` entries of the ``environment_variables`` dict -> the comment above."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("environment_variables"))
    out: dict[str, str] = {}
    block: list[str] = []
    for line in lines[start + 1 :]:
        text = line.strip()
        if text == "}":
            break
        if text.startswith("#"):
            block.append(text.lstrip("#").strip())
        elif text.startswith('"'):
            out[text.split('"')[1]] = " ".join(block)
            block = []
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(scan: knob_scan.Scan | None = None) -> str:
    """The docs/knobs.md page."""
    scan = scan or knob_scan.scan()
    out = [
        "# Environment variables",
        "",
        "Generated (`python -m dspark_dev.knobs --markdown > docs/knobs.md`; "
        "tests/unit/repo/test_knobs.py checks it is current) from `vllm_dspark_pp/envs.py` "
        "(runtime) and `dspark_dev/knobs.py` (tests and tooling). A variable of ours read "
        "anywhere else fails that test.",
        "",
        "## Runtime (read by the plugin in every vLLM process)",
        "",
        "| Variable | Default | Meaning |",
        "|---|---|---|",
    ]
    from vllm_dspark_pp import envs

    for k in runtime_knobs():
        out.append(f"| `{k.name}` | {_cell(k.default)} | {_cell(k.meaning)} |")
    out += ["", "Deprecated names, still read (with a warning) for one release:", ""]
    for old, new in envs.deprecated_environment_variables.items():
        out.append(f"* `{old}`: use `{new}`.")
    out += [
        "",
        "## Tests, tooling, benchmarks and GPU scripts",
        "",
        "| Variable | Default | Meaning | Read in |",
        "|---|---|---|---|",
    ]
    for k in sorted(KNOBS, key=lambda k: k.name):
        where = scan.files(k.name) or scan.files(k.name, reads_only=False)
        cells = ", ".join(f"`{p}`" for p in where)
        out.append(f"| `{k.name}` | {_cell(k.default)} | {_cell(k.meaning)} | {cells} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark_dev.knobs", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print docs/knobs.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for k in [*runtime_knobs(), *KNOBS]:
            print(f"{k.name}={k.default}  {k.meaning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
