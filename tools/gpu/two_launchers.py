"""PP=2 DSpark across two vLLM multiprocessing launchers on one 2-GPU host (NCCL between them).

The GPU form of tests/e2e/test_multi_node.py (docs/multi-node.md): node 0 is `vllm serve
--nnodes 2 --node-rank 0 --master-addr 127.0.0.1` on GPU 0, node 1 the same with `--node-rank 1
--headless` on GPU 1, one PP stage each, the trained tiny pair (float32, eager), 16 held-out
prompts. Phases, each a fresh set of `vllm serve` process groups, stopped whatever happens:

  ref        PP=1, no speculation (GPU 0)             -> reference tokens
  pp1_spec   PP=1 DSpark (GPU 0)                      -> reference acceptance counters
  two_nodes  PP=2 DSpark over the two launchers       -> tokens == ref, acceptance within 2 points
  no_plugin  node 1 with VLLM_PLUGINS leaving us out  -> node 0 fails at start naming PP rank 1

GPU machine (kit booted; nvidia-h200-x2):
  source /tmp/site/env.sh && python3 -m pip install -q --no-deps --no-index --no-build-isolation \
    --target /tmp/site . && python3 tools/gpu/two_launchers.py --out $OUT
CPU dry run of the whole flow (same phases on the CPU platform):
  PYTHONPATH=. .venv/bin/python tools/gpu/two_launchers.py --cpu --out /tmp/two-launchers
Writes $OUT/two_launchers.json, $OUT/summary.txt and the server logs of the last two phases
(6 files); prints the summary table last; exit 0 only if every phase passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support import engines, tiny_pair  # noqa: E402

from dspark_dev import serve_demo  # noqa: E402
from dspark_dev.serve_demo import Server, free_port, say, serve_argv  # noqa: E402
from vllm_dspark_pp.protocol import handshake  # noqa: E402

SILENT_TIMEOUT_S = 15.0


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = Path(args.logs or (self.out / "logs"))
        self.deadline = time.monotonic() + args.budget
        self.rows: list[tuple[str, bool, float, str]] = []
        self.data: dict = {"device": "cpu" if args.cpu else "gpu"}
        self.prompts = tiny_pair.heldout_prompts(engines.PAIR_NUM_PROMPTS)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def server(self, name: str, argv: list[str], gpu: str | None, env=None, port=None) -> Server:
        env = dict(env or {})
        if not self.args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu or "0"
        return Server(
            argv, self.logs / f"{name}.log", env=env, port=port, name=name, cpu=self.args.cpu
        )

    def gpu_args(self) -> list[str]:
        return [] if self.args.cpu else ["--gpu-memory-utilization", "0.3"]

    def ask(self, srv: Server) -> tuple[list, list, dict]:
        out = serve_demo.complete(srv.url, tiny_pair.TARGET, self.prompts, engines.PAIR_MAX_TOKENS)
        return (
            [c["token_ids"] for c in out],
            [c["finish_reason"] for c in out],
            serve_demo.spec_metrics(srv.url),
        )

    def single(self, name: str, spec: dict | None) -> tuple[list, list, dict]:
        port = free_port()
        argv = serve_argv(
            tiny_pair.TARGET,
            pp=1,
            spec=spec,
            port=port,
            extra=engines.pair_serve_args() + self.gpu_args(),
        )
        srv = self.server(name, argv, "0", port=port).start()
        try:
            srv.wait_ready(min(300.0, self.left()))
            return self.ask(srv)
        finally:
            srv.stop()

    def two_nodes(self, name: str, env1=None, env=None) -> tuple[Server, Server]:
        spec = tiny_pair.spec_config()
        api, master = free_port(), free_port()
        common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
        common += engines.pair_serve_args() + self.gpu_args()
        n0 = self.server(
            f"{name}_node0",
            serve_argv(
                tiny_pair.TARGET, pp=2, spec=spec, port=api, extra=common + ["--node-rank", "0"]
            ),
            "0",
            env=env,
            port=api,
        )
        n1 = self.server(
            f"{name}_node1",
            serve_argv(
                tiny_pair.TARGET, pp=2, spec=spec, port=None, extra=common + ["--node-rank", "1"]
            ),
            "1",
            env={**(env or {}), **(env1 or {})},
        )
        return n0.start(), n1.start()

    def phase(self, name: str, fn) -> None:
        t0 = time.monotonic()
        say(f"phase {name} ({self.left():.0f} s of budget left)")
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            ok, detail = False, f"{type(exc).__name__}: {exc}"[:300]
        self.rows.append((name, ok, round(time.monotonic() - t0, 1), detail))
        say(f"phase {name}: {'PASS' if ok else 'FAIL'} {detail}")

    # ------------------------------------------------------------------ phases
    def p_ref(self):
        tokens, reasons, _ = self.single("ref", None)
        self.data["ref"] = {"tokens": tokens, "finish_reasons": reasons}
        return all(
            r == "stop" for r in reasons
        ), f"{sum(map(len, tokens))} tokens, finish {set(reasons)}"

    def p_pp1_spec(self):
        tokens, _, m = self.single("pp1_spec", tiny_pair.spec_config())
        self.data["pp1_spec"] = {"tokens": tokens, "metrics": m}
        same = tokens == self.data["ref"]["tokens"]
        return same and m["num_drafts"] > 0, f"tokens == ref: {same}; {_describe(m)}"

    def p_two_nodes(self):
        n0, n1 = self.two_nodes("two_nodes")
        try:
            n0.wait_ready(min(300.0, self.left()))
            tokens, _, m = self.ask(n0)
        finally:
            for n in (n0, n1):
                n.stop(grace_s=10)
        logs = n0.log_tail(10**7) + n1.log_tail(10**7)
        ref_m = self.data["pp1_spec"]["metrics"]
        diff = _rate(m) - _rate(ref_m)
        first = _first_diff(self.data["ref"]["tokens"], tokens)
        self.data["two_nodes"] = {
            "tokens": tokens,
            "metrics": m,
            "rate_diff": diff,
            "first_token_diff": first,
            "counters_equal": m == ref_m,
        }
        agreed = "PP handshake: 2 ranks agree" in logs
        ok = first is None and abs(diff) <= 0.02 and agreed
        return ok, (
            f"tokens == ref: {first is None}{'' if first is None else f' (first diff {first})'}; "
            f"{_describe(m)}; acceptance rate diff {diff:+.4f} vs PP=1 DSpark "
            f"(counters equal: {m == ref_m}); handshake across launchers: {agreed}"
        )

    def p_no_plugin(self):
        env = {handshake.TIMEOUT_ENV: str(SILENT_TIMEOUT_S)}
        n0, n1 = self.two_nodes("no_plugin", env=env, env1={"VLLM_PLUGINS": "no-such-plugin"})
        limit = SILENT_TIMEOUT_S + handshake.verdict_grace_s(SILENT_TIMEOUT_S) + 240.0
        t0 = time.monotonic()
        try:
            rc = n0.wait_exit(min(limit, self.left()))
        finally:
            for n in (n0, n1):
                n.stop(grace_s=5)
        took = time.monotonic() - t0
        log0 = n0.log_tail(10**7)
        named = "PP rank 1 (last) sent no verdict" in log0
        self.data["no_plugin"] = {"rc": rc, "took_s": round(took, 1), "names_rank": named}
        return (
            rc not in (None, 0) and named,
            f"node 0 exit {rc} after {took:.0f} s; message names PP rank 1: {named}",
        )

    def finish(self) -> int:
        lines = ["phase       result  wall_s  detail"]
        lines += [f"{n:<11} {'PASS' if ok else 'FAIL':<7} {w:>6}  {d}" for n, ok, w, d in self.rows]
        summary = "\n".join(lines)
        (self.out / "summary.txt").write_text(summary + "\n")
        self.data["rows"] = self.rows
        (self.out / "two_launchers.json").write_text(json.dumps(self.data, indent=1))
        for name in ("two_nodes_node0", "two_nodes_node1", "no_plugin_node0", "no_plugin_node1"):
            src = self.logs / f"{name}.log"
            if src.exists() and self.logs != self.out:
                shutil.copy(src, self.out / f"{name}.log")
        print("\n" + summary, flush=True)
        return 0 if self.rows and all(ok for _, ok, _, _ in self.rows) else 1


def _rate(m: dict) -> float:
    return m["num_accepted_tokens"] / m["num_draft_tokens"] if m["num_draft_tokens"] else 0.0


def _describe(m: dict) -> str:
    d = m["num_drafts"]
    mal = 1 + m["num_accepted_tokens"] / d if d else 0.0
    return f"{d} drafts, {m['num_accepted_tokens']}/{m['num_draft_tokens']} accepted, MAL {mal:.3f}"


def _first_diff(ref: list, got: list):
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            pos = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            return [i, pos]
    return None if len(ref) == len(got) else [len(got), 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--logs", default=None, help="server logs (default OUT/logs; only 4 are copied to OUT)"
    )
    ap.add_argument("--cpu", action="store_true", help="dry run on vLLM's CPU platform")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all phases")
    args = ap.parse_args()
    if args.logs is None:
        args.logs = "/tmp/two-launchers-logs"
    run = Run(args)
    run.phase("ref", run.p_ref)
    if run.rows[-1][1]:
        run.phase("pp1_spec", run.p_pp1_spec)
        run.phase("two_nodes", run.p_two_nodes)
    run.phase("no_plugin", run.p_no_plugin)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
