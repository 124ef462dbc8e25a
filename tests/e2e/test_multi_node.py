"""PP across two "nodes" on loopback through vLLM 0.34.0's own launchers (CPU, float32, greedy).

**Multiprocessing launcher** (``--nnodes 2 --node-rank R --master-addr 127.0.0.1``): node 0 runs
``vllm serve`` (API server, engine core, the PP rank 0 worker; ``node_rank_within_dp == 0`` makes
its executor the leader), node 1 runs ``vllm serve --headless`` (``run_headless`` in
vllm/entrypoints/cli/serve.py starts a ``MultiprocExecutor`` with only the PP rank 1 worker, which
joins the torch.distributed store at ``--master-addr:--master-port`` and receives scheduler output
over the cross-node message queue). Each node loads the plugin itself through the entry point, so
the start-up handshake runs across the two launchers over that store.

* parity: the trained pair, 16 held-out prompts in one ``/v1/completions`` request, synchronous
  scheduling (the CPU default), the parity settings of test_pp_parity.py: tokens equal PP=1 without
  speculation (``pair_reference``), spec-decode counters from ``/metrics`` equal PP=1 DSpark's
  (``pair_pp1``), per position included;
* node 1 without the plugin (``VLLM_PLUGINS`` leaves it out): node 0 fails at start with the
  handshake's message naming PP rank 1, within the handshake timeout plus its grace period;
* node 1 with another ``num_speculative_tokens``: both fail at start, the message names the ranks
  and the field (opt-in, ``DSPARK_E2E_FULL=1``: the skip reason names what covers it in CI).

**TP=2 x PP=2 on four launchers** (``--nnodes 4 -tp 2 -pp 2``, issue 40): vLLM puts one rank on
each launcher, launcher R holding global rank R (PP stage R // 2, TP rank R % 2); the same 32
prompts in one request: tokens equal PP=1 without speculation, counters equal PP=1 DSpark's (the
two-launcher PP=2 run equals it too, so TP=1 PP=2 is the same reference), every rank logged its
place in the 4-rank world and every PP group its handshake, and all four ranks logged the same
digest of the drafts they posted (stage 1's two TP ranks) or received (stage 0's).

**Ray** (``--distributed-executor-backend ray``): cannot run on the CPU platform of vLLM 0.34.0;
the test says why and is skipped (see its docstring).

Each node is its own process group, stopped (SIGTERM, then SIGKILL) whatever happens.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from support import engines, tiny_pair

from dspark_dev import pp_launch, serve_demo
from dspark_dev.serve import Server, free_port
from dspark_dev.serve_demo import serve_argv
from vllm_dspark_pp.protocol import draft_digest, handshake

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 240.0
HANDSHAKE_TIMEOUT_S = 20.0  # VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S on the nodes of the k-mismatch test
# ... of the no-plugin test: node 0 waits it plus the 5 s verdict grace for a node 1 that never
# answers, so it is short (both nodes get it; node 1 runs without the plugin and ignores it)
SILENT_TIMEOUT_S = 2.0
DIGEST_ENV = "VLLM_DSPARK_PP_DRAFT_DIGEST"  # every rank logs its drafts digest every N posts
DIGEST_EVERY = 8


@contextlib.contextmanager
def two_nodes(tmp_path, *, spec1=None, env0=None, env1=None):
    """Node 0 (API server, PP rank 0) and node 1 (headless, PP rank 1) on loopback
    (dspark_dev/pp_launch.py: the same composition as the one-GPU PP tier)."""
    dep = pp_launch.deployment(
        "two_nodes",
        tiny_pair.TARGET,
        pp=2,
        spec=tiny_pair.spec_config(),
        log_dir=tmp_path,
        extra=engines.pair_serve_args(),
        env_per_rank={0: dict(env0 or {}), 1: dict(env1 or {})},
        spec_per_rank={1: spec1} if spec1 else None,
    )
    node0, node1 = dep.nodes
    try:
        dep.start()
        yield node0, node1
    finally:
        left = dep.stop()
        assert not left, f"launchers left processes behind: {left}"


def _logs(*nodes) -> str:
    return "\n".join(f"--- {n.name} log tail ---\n{n.log_tail(3000)}" for n in nodes)


@pytest.mark.e2e_full(
    covered_by="test_four_launchers_tp2_pp2_dspark_parity (the same launchers, --nnodes with one "
    "rank each and headless nodes, at TP=2 x PP=2: tokens equal PP=1 no-spec, counters equal PP=1 "
    "DSpark's and so TP=1 PP=2's, the handshake and the exchange on every rank) and "
    "test_node_without_plugin_fails_at_start_naming_the_rank (two launchers, PP=2, the "
    "handshake across them)"
)
def test_two_launchers_pp2_dspark_parity(tmp_path, pair_reference, pair_pp1):
    with two_nodes(tmp_path) as (node0, node1):
        try:
            node0.wait_ready(READY_TIMEOUT_S)
        except Exception as exc:
            pytest.fail(f"{exc}\n{_logs(node0, node1)}")
        assert node1.exited() is None, _logs(node1)
        prompts = tiny_pair.heldout_prompts(engines.PAIR_NUM_PROMPTS)
        out = serve_demo.complete(node0.url, tiny_pair.TARGET, prompts, engines.PAIR_MAX_TOKENS)
        metrics = serve_demo.spec_metrics(node0.url)
        log0, log1 = node0.log_tail(10**7), node1.log_tail(10**7)
    assert [c["prompt_token_ids"] for c in out] == prompts
    assert [c["token_ids"] for c in out] == pair_reference.tokens, (
        "two-launcher PP=2 DSpark output differs from PP=1 no-spec"
    )
    assert [c["finish_reason"] for c in out] == pair_reference.finish_reasons
    print(f"two launchers, PP=2 DSpark: {metrics}")
    assert metrics == pair_pp1.metrics, (
        f"spec-decode counters differ from PP=1 DSpark:\n  PP=1: {pair_pp1.metrics}\n"
        f"  got:  {metrics}"
    )
    # Each launcher ran its own stage, and the handshake ran across them.
    assert "headless multiproc executor" in log1
    assert "DP group leader: node_rank=0" in log0 and "world_size=2, local_world_size=1" in log0
    assert "PP handshake: 2 ranks agree (protocol" in log0 + log1
    assert "k=7" in (log0 + log1).split("PP handshake: 2 ranks agree", 1)[1].splitlines()[0]
    # each stage names the exchange's transport (the one-GPU tier requires nccl there)
    for log in (log0, log1):
        line = log.split("DSpark PP exchange:", 1)[1].splitlines()[0]
        assert line.endswith(" over gloo"), line


def test_four_launchers_tp2_pp2_dspark_parity(tmp_path, pair_reference, pair_pp1):
    dep = pp_launch.deployment(
        "tp2pp2",
        tiny_pair.TARGET,
        pp=2,
        tp=2,
        spec=tiny_pair.spec_config(),
        log_dir=tmp_path,
        extra=engines.pair_serve_args(),
        env={DIGEST_ENV: str(DIGEST_EVERY)},
    )
    t0 = time.monotonic()
    try:
        dep.start()
        try:
            ready_s = dep.wait_ready(READY_TIMEOUT_S)
        except Exception as exc:
            pytest.fail(f"{exc}\n{_logs(*dep.nodes)}")
        prompts = tiny_pair.heldout_prompts(engines.PAIR_NUM_PROMPTS)
        t1 = time.monotonic()
        out = serve_demo.complete(dep.url, tiny_pair.TARGET, prompts, engines.PAIR_MAX_TOKENS)
        serve_s = time.monotonic() - t1
        metrics = serve_demo.spec_metrics(dep.url)
        dead = dep.dead_nodes()
        logs = [n.log_tail(10**7) for n in dep.nodes]
    finally:
        left = dep.stop()
    print(
        f"four launchers, TP=2 x PP=2 DSpark: ready {ready_s:.0f} s, served in {serve_s:.0f} s, "
        f"{time.monotonic() - t0:.0f} s in all; {metrics}"
    )
    assert not left, f"launchers left processes behind: {left}"
    assert not dead, f"launchers died while serving: {dead}"
    assert [c["token_ids"] for c in out] == pair_reference.tokens, (
        "TP=2 x PP=2 DSpark output differs from PP=1 no-spec"
    )
    assert [c["finish_reason"] for c in out] == pair_reference.finish_reasons
    assert metrics == pair_pp1.metrics, (
        f"spec-decode counters differ from PP=1 DSpark:\n  PP=1: {pair_pp1.metrics}\n"
        f"  got:  {metrics}"
    )
    # Every launcher held exactly its own rank of the 4-rank world (rank = pp_rank * 2 + tp_rank).
    placed = pp_launch.rank_assignments(logs)
    assert placed == [[(r, 4, r // 2, r % 2)] for r in range(4)], placed
    assert "world_size=4, local_world_size=1" in logs[0]
    assert all("headless multiproc executor" in log for log in logs[1:])
    # the handshake ran: one line per PP group (2 ranks) or one over the world (4)
    sizes = pp_launch.handshake_sizes(logs)
    assert sizes and set(sizes) <= {2, 4}, sizes
    # every rank runs the exchange with its own PP group's last rank (global rank 2 + TP rank)
    for rank, log in enumerate(logs):
        want = f"broadcasts from PP rank {2 + rank % 2} over gloo"
        assert want in log, f"launcher {rank}: no '{want}' line"
    # every TP rank of the last stage drafted, and every rank of stage 0 received, the same
    # drafts: all four ranks log the same running digest after the same number of draft posts
    # (the control that the comparison can fail: tests/unit/protocol/test_draft_digest.py)
    per_rank = draft_digest.parse_lines("\n".join(logs))
    assert len(per_rank) == 4, sorted(per_rank)
    assert draft_digest.disagreements(per_rank) == []
    counts = sorted(set.intersection(*(set(v) for v in per_rank.values())))
    print(f"drafts digest: 4 ranks agree after {counts[-1]} draft posts ({len(counts)} lines each)")


def _expect_start_failure(node0, node1, limit_s: float) -> tuple[float, str]:
    t0 = time.monotonic()
    rc = node0.wait_exit(limit_s)
    took = time.monotonic() - t0
    assert rc is not None, (
        f"node 0 still running {limit_s:.0f} s after start: a HANG, not a start-up failure\n"
        f"{_logs(node0, node1)}"
    )
    assert rc != 0, f"node 0 exited with 0\n{_logs(node0)}"
    return took, node0.log_tail(10**7)


def test_node_without_plugin_fails_at_start_naming_the_rank(tmp_path):
    env = {handshake.TIMEOUT_ENV: str(SILENT_TIMEOUT_S)}
    # Node 1 (PP rank 1, the last) loads no plugin: it never answers the handshake.
    with two_nodes(tmp_path, env0=env, env1={**env, "VLLM_PLUGINS": "no-such-plugin"}) as (n0, n1):
        wait = SILENT_TIMEOUT_S + handshake.verdict_grace_s(SILENT_TIMEOUT_S)
        took, log0 = _expect_start_failure(n0, n1, wait + 120.0)  # + start-up up to the runner
        log1 = n1.log_tail(10**7)
    print(f"node 0 failed {took:.0f} s after start (handshake wait {wait:.0f} s)")
    assert "HandshakeError" in log0, log0[-4000:]
    assert "PP rank 1 (last) sent no verdict" in log0, log0[-4000:]
    assert "install the same vllm-dspark-pp on every node" in log0
    assert "PP handshake" not in log1  # node 1 really ran without the plugin


@pytest.mark.e2e_full(
    covered_by="tests/unit/protocol/test_protocol_handshake.py::"
    "test_mismatched_k_fails_every_rank (the handshake's k check and message, 3 gloo ranks); "
    "the handshake across launchers: test_node_without_plugin_fails_at_start_naming_the_rank "
    "(two launchers) and test_four_launchers_tp2_pp2_dspark_parity (four)"
)
def test_nodes_disagreeing_on_k_fail_at_start(tmp_path):
    spec1 = dict(tiny_pair.spec_config(), num_speculative_tokens=5)
    env = {handshake.TIMEOUT_ENV: str(HANDSHAKE_TIMEOUT_S)}
    with two_nodes(tmp_path, spec1=spec1, env0=env, env1=env) as (n0, n1):
        took, log0 = _expect_start_failure(n0, n1, HANDSHAKE_TIMEOUT_S + 120.0)
    print(f"node 0 failed {took:.0f} s after start")
    assert (
        "PP rank 0 has num_speculative_tokens=7 but PP rank 1 (last) has num_speculative_tokens=5"
        in log0
    ), log0[-4000:]
    assert "get the same --speculative-config" in log0


def _ray_unavailable_reason() -> str | None:
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:
        return (
            f"vLLM 0.34.0's {current_platform.device_name} platform has no Ray device key "
            "(Platform.ray_device_key is empty for CpuPlatform), so "
            "vllm/v1/executor/ray_utils.py initialize_ray_cluster raises 'current platform cpu "
            "does not support ray' for --distributed-executor-backend ray (seen here with "
            "ray 2.60.0 from PyPI); Ray PP needs GPU nodes: docs/multi-node.md"
        )
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install ray)"
    return None


def test_ray_pp2_dspark_parity(tmp_path, pair_reference, pair_pp1):
    """PP=2 DSpark under vLLM's Ray executor (Ray started by vLLM on this host): the same parity
    as the two-launcher test. Skipped where vLLM's platform cannot use Ray (the CPU platform)."""
    why = _ray_unavailable_reason()
    if why:
        pytest.skip(why)
    port = free_port()
    argv = serve_argv(
        tiny_pair.TARGET,
        pp=2,
        spec=tiny_pair.spec_config(),
        port=port,
        extra=engines.pair_serve_args() + ["--distributed-executor-backend", "ray"],
    )
    server = Server(
        argv, tmp_path / "ray.log", env={"RAY_USAGE_STATS_ENABLED": "0"}, port=port, name="ray"
    )
    try:
        server.start()
        server.wait_ready(READY_TIMEOUT_S)
        prompts = tiny_pair.heldout_prompts(engines.PAIR_NUM_PROMPTS)
        out = serve_demo.complete(server.url, tiny_pair.TARGET, prompts, engines.PAIR_MAX_TOKENS)
        metrics = serve_demo.spec_metrics(server.url)
    finally:
        server.stop()
    assert [c["token_ids"] for c in out] == pair_reference.tokens
    assert metrics == pair_pp1.metrics
