"""Worker bodies for the multi-process (gloo) tests. Each runs in a spawned process, reports one
result dict through a queue and exits hard (os._exit) so no pending gloo work can hold it."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

from dspark_dev.serve import free_port  # noqa: F401 - the tests take it from here


def _report(queue, result) -> None:
    queue.put(result)
    queue.close()
    queue.join_thread()  # flush before the hard exit
    os._exit(0)


def _init(rank: int, world: int, port: int, timeout_s: float = 60.0):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist


def exchange_worker(
    rank: int, world: int, port: int, seeds: list[int], corrupt_rank: int | None, queue
) -> None:
    """Replay seeded cases through the real patched PPHandler with real gloo broadcasts. In
    adaptive cases every rank also builds each verify step's token count from its admitted counts
    and checks it against the previous rank's (the activations check of protocol/adaptive.py);
    ``corrupt_rank`` keeps every received count + 1 (the control)."""
    result = {"rank": rank, "ok": False}
    try:
        import dataclasses
        from collections import deque

        import numpy as np
        import protocol_replay as pr
        import protocol_sim as ps

        dist = _init(rank, world, port)
        ps.apply_protocol_patches()
        log = []
        problems: list[str] = []
        steps = 0
        real_broadcast = dist.broadcast

        def recording_broadcast(tensor, src, group=None, async_op=False):
            log.append((len(log), tuple(tensor.shape), str(tensor.dtype)))
            return real_broadcast(tensor, src=src, group=group)

        dist.broadcast = recording_broadcast
        if corrupt_rank == rank:
            from vllm_dspark_pp.protocol import handler as exchange

            real_keep = exchange.DSparkExchange._keep_admitted
            exchange.DSparkExchange._keep_admitted = lambda self, col, idx: real_keep(
                self, col + 1, idx
            )
        result["verify_steps"] = 0
        last = world - 1
        with ps.cpu_streams():
            for seed in seeds:
                case = dataclasses.replace(ps.random_case(seed), pp_size=world)
                h = ps.make_handler(
                    rank,
                    world,
                    case.k,
                    case.max_num_reqs,
                    dist.group.WORLD,
                    case.adaptive,
                    case.admitted_lag,
                )
                ring = deque([None] * world)
                gen = np.zeros(case.max_num_reqs, dtype=np.int64)
                gen_at = {}
                expected_admitted: dict = {}
                for t, step in enumerate(case.steps):
                    steps += 1
                    if rank == last:
                        ps.last_rank_execute(h, step)
                    else:
                        out = ps.non_last_execute(h, step)
                        src = ring.popleft()
                        ring.append(None)
                        pr._check_delivery(case, rank, t, src, out, gen_at, gen, problems)
                    for slot in step.freed:
                        gen[slot] += 1
                    if case.adaptive:
                        adaptive_checks(
                            dist, case, t, step, rank, h, gen, expected_admitted, problems, result
                        )
                    if rank == last:
                        ps.last_rank_step(h, seed, t, step, case.k)
                    else:
                        ps.non_last_sample(h, step)
                        if h.queue[-1] is not None:
                            ring[-1] = t
                            gen_at[t] = gen[step.batch.idx_mapping_np].copy()
                            pr._check_received(case, rank, t, step, h.queue[-1], problems)
                    pr.keep_expected_admitted(case, t, step, gen, expected_admitted)
                if h.draft_digest is not None:  # VLLM_DSPARK_PP_DRAFT_DIGEST set by the test
                    result.setdefault("digests", []).append(
                        (seed, h.draft_digest.count, h.draft_digest.value())
                    )
        dist.barrier()
        result.update(ok=True, log=log, problems=problems, steps=steps)
    except Exception:
        result["error"] = traceback.format_exc()
    _report(queue, result)


def adaptive_checks(dist, case, t, step, rank, h, gen, expected, problems, result) -> None:
    """Before step t: this rank's admitted counts equal the last rank's sends; if the step
    verifies drafts, every rank builds its token count from them and compares it with the
    previous rank's (an all_gather that every rank posts, then a second one of the verdicts, so
    a rank that fails stops every rank at the same step instead of leaving them waiting)."""
    import protocol_replay as pr
    import torch

    from vllm_dspark_pp.protocol.adaptive import admitted_layout, check_activation_tokens

    pr.check_admitted(case, t, {rank: h}, gen, expected, problems)
    b = step.batch
    if b is None or int(b.num_drafts_np.sum()) == 0:
        return
    result["verify_steps"] += 1
    shipped = h.admitted_counts_for(b.idx_mapping_np)
    admitted = admitted_layout(b.num_drafts_np, shipped, 1 << 30)
    n = int((b.num_scheduled_tokens - b.num_drafts_np).sum() + admitted.sum())
    mine = torch.tensor([n], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    error = None
    try:
        if rank > 0:
            check_activation_tokens(t, n, int(every[rank - 1]), rank)
    except RuntimeError as e:
        error = e
    verdicts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(verdicts, torch.tensor([int(error is not None)], dtype=torch.int64))
    if error is not None:
        raise error
    if any(int(v) for v in verdicts):
        raise RuntimeError(f"step {t}: another rank found a batch-shape mismatch")


HANDSHAKE_SCENARIOS = {
    # name: (per-rank fact overrides, silent ranks)
    "agree": ({}, ()),
    "versions": ({0: {"protocol": 2, "vllm_version": "0.35.0"}}, ()),
    "k": ({1: {"num_speculative_tokens": 5}}, ()),
    "adaptive": ({0: {"adaptive_verification": True}}, ()),
    "lag": (
        {r: {"adaptive_verification": True, "admitted_lag": 0 if r == 1 else 1} for r in range(3)},
        (),
    ),
    "tap_partials": ({2: {"tap_partials": "0"}}, ()),
    # the side channel against partials in the intermediate tensors: the last stage would wait
    # for side-channel sends that never come, the first would send rows nobody copies
    "tap_side": (
        {0: {"tap_partials": "side"}, 1: {"tap_partials": "1"}, 2: {"tap_partials": "1"}},
        (),
    ),
    "silent_rank": ({}, (1,)),
    "silent_last": ({}, (2,)),
}


def handshake_worker(
    rank: int,
    world: int,
    port: int,
    names: list[str],
    timeout_s: float,
    silent_timeout_s: float,
    queue,
) -> None:
    """Run one PP start-up handshake per scenario (each in its own namespace, after a barrier); a
    silent rank joins the group but never handshakes, like a rank without the plugin: it goes
    straight on to the next scenario's barrier, where it waits (alive, still in the group) until
    the others have given up on it. Scenarios with a silent rank use ``silent_timeout_s`` (the
    others wait it, plus the verdict grace where the last rank is silent); the rest
    ``timeout_s``."""
    import time

    result = {"rank": rank, "scenarios": {}}
    try:
        dist = _init(rank, world, port)
        from vllm_dspark_pp.protocol import handshake

        for i, name in enumerate(names):
            overrides, silent = HANDSHAKE_SCENARIOS[name]
            facts = dict(
                protocol=1,
                plugin_version="0.1.0",
                vllm_version="0.34.0",
                pp_size=world,
                method="dspark",
                num_speculative_tokens=3,
                fixed_graph_batch=None,
                adaptive_verification=False,
            )
            facts.update(overrides.get(rank, {}))
            dist.barrier()
            out = {}
            t0 = time.monotonic()
            timeout = silent_timeout_s if silent else timeout_s
            if rank in silent:
                out["outcome"] = "silent"
            else:
                try:
                    handshake.run_handshake(
                        facts,
                        rank_in_group=rank,
                        ranks=list(range(world)),
                        store=handshake.default_store(),
                        timeout=timeout,
                        epoch=i + 1,
                    )
                    out["outcome"] = "ok"
                except Exception as e:  # noqa: BLE001
                    out.update(outcome="error", type=type(e).__name__, message=str(e))
            out["elapsed"] = time.monotonic() - t0
            result["scenarios"][name] = out
        dist.barrier()  # a silent rank of the last scenario stays in the group until the end
    except Exception:
        result["error"] = traceback.format_exc()
    _report(queue, result)


#: TP=2 x PP=2 world scenarios (tests/unit/protocol/test_world_handshake_watch.py): name ->
#: (k of each global rank that differs from 3, silent global ranks). Global rank g is TP rank
#: g % 2 and PP rank g // 2 (vLLM's layout); rank 3 (PP rank 1, TP rank 1) is the referee.
WORLD_SCENARIOS = {
    "agree": ({}, ()),
    "k_one_rank_other_column": ({1: 5}, ()),
    "k_whole_other_column": ({1: 5, 3: 5}, ()),
    "silent_rank": ({}, (2,)),
    "silent_referee": ({}, (3,)),
}
WORLD_TP, WORLD_PP = 2, 2


def _world_config(k: int):
    """What the handshake and the watch read from a VllmConfig (the parallel groups come from
    vLLM's real parallel state)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="dspark", num_speculative_tokens=k, enable_adaptive_verification=False
        ),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=WORLD_PP,
            tensor_parallel_size=WORLD_TP,
            distributed_executor_backend="mp",
            node_rank=0,
        ),
        additional_config={},
    )


def world_worker(
    rank: int,
    world: int,
    port: int,
    names: list[str],
    timeout_s: float,
    silent_timeout_s: float,
    victim: int,
    watch_wait_s: float,
    queue,
) -> None:
    """One rank of a TP=2 x PP=2 world built by vLLM's own ``init_distributed_environment`` and
    ``ensure_model_parallel_initialized`` (gloo, CPU). It runs the plugin's runtime entries, the
    model runner patch's calls: one ``run_pp_handshake`` per scenario (a silent rank skips it,
    like a rank without the plugin, and waits at the next barrier), recording every
    ``PP handshake:`` line the plugin logs; then ``start_pp_watch``. After a barrier the
    ``victim`` reports and SIGKILLs itself; every other rank reports when its watch names a lost
    rank (``on_lost``), or after ``watch_wait_s`` without one."""
    import logging
    import signal
    import time

    result: dict = {"rank": rank, "scenarios": {}}
    try:
        os.environ["VLLM_HOST_IP"] = "127.0.0.1"
        # Distinct per rank: vLLM's CPU communicator then keeps plain torch.distributed instead of
        # its shared-memory groups (nothing to leak when a rank is killed).
        os.environ["VLLM_DIST_IDENT"] = f"dspark-test-{port}-{rank}"
        import torch.distributed as dist
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        from vllm_dspark_pp.protocol import handshake, liveness

        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
            ensure_model_parallel_initialized(WORLD_TP, WORLD_PP)

        lines: list[str] = []

        class Lines(logging.Handler):
            def emit(self, record):
                if "PP handshake:" in record.getMessage():
                    lines.append(record.getMessage())

        hs_logger = logging.getLogger("vllm.dspark_pp.handshake")
        hs_logger.addHandler(Lines())
        hs_logger.setLevel(logging.INFO)  # whatever vLLM's logging setup in this child is
        for i, name in enumerate(names):
            ks, silent = WORLD_SCENARIOS[name]
            dist.barrier()
            del lines[:]
            out: dict = {}
            t0 = time.monotonic()
            if rank in silent:
                out["outcome"] = "silent"
            else:
                try:
                    handshake.run_pp_handshake(
                        _world_config(ks.get(rank, 3)),
                        timeout=silent_timeout_s if silent else timeout_s,
                        epoch=i + 1,
                    )
                    out["outcome"] = "ok"
                except Exception as e:  # noqa: BLE001
                    out.update(outcome="error", type=type(e).__name__, message=str(e))
            out["elapsed"] = time.monotonic() - t0
            out["lines"] = list(lines)
            result["scenarios"][name] = out

        dist.barrier()
        t0 = time.monotonic()

        def on_lost(me, peer, reason):
            result["watch"] = {
                "outcome": "lost",
                "peer": peer.name,
                "worker": peer.worker,
                "message": liveness.lost_message(me, peer, reason),
                "elapsed": time.monotonic() - t0,
            }
            _report(queue, result)

        watch = liveness.start_pp_watch(_world_config(3), on_lost=on_lost, epoch=1)
        result["watching"] = [] if watch is None else sorted(p.rank for p in watch.peers)
        dist.barrier()  # every rank watches
        t0 = time.monotonic()
        if rank == victim:
            time.sleep(0.3)
            result["watch"] = {"outcome": "victim"}
            queue.put(result)
            queue.close()
            queue.join_thread()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(watch_wait_s)
        result["watch"] = {"outcome": "nothing", "elapsed": time.monotonic() - t0}
    except Exception:
        result["error"] = traceback.format_exc()
    _report(queue, result)


def run_processes(target, world: int, args_for_rank, timeout_s: float) -> dict[int, dict]:
    """Spawn ``world`` processes, collect one result per rank; every join has a timeout and a
    process still alive after it is killed."""
    import multiprocessing as mp
    import queue as queue_mod
    import time

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, world, port, *args_for_rank(r), q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                res = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                results[res["rank"]] = res
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


# ------------------------------------------------------------------ the tap side channel
#: (tap counts per stage, hidden, partial width) of the side-channel worlds: the trained tiny
#: pair's PP=2 `3,1` split (two taps on stage 0) and its PP=3 split (one tap per stage).
TAP_SIDE_LAYOUTS = {2: ((2, 1), 8, 6), 3: ((1, 1, 1), 8, 6)}


def tap_side_script(seed: int, num_steps: int, fault_step: int | None = None) -> list[dict]:
    """The steps every rank replays alike: real forwards of 1..40 tokens (own taps padded by
    0..7 rows, as under CUDA graphs), dummy runs, and real steps whose drafter is skipped."""
    import random

    rng = random.Random(seed)
    steps = []
    for t in range(num_steps):
        kind = rng.choices(["real", "dummy", "skip"], weights=[8, 1, 1])[0]
        if t == fault_step:
            kind = "real"
        steps.append({"t": t, "kind": kind, "rows": rng.randint(1, 40), "pad": rng.randint(0, 7)})
    return steps


def _side_taps(step: dict, slot: int, hidden: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step["t"] + slot)
    return torch.randn(step["rows"] + step["pad"], hidden, generator=g)


def tap_side_worker(
    rank: int,
    world: int,
    port: int,
    seed: int,
    num_steps: int,
    depth: int,
    fault: str | None,
    timeout_s: float,
    queue,
) -> None:
    """One PP rank of a side-channel world (gloo): the relay, the runner hooks and the drafter
    hook of protocol/tap_partials.py on stand-in runner and speculator objects, replaying
    :func:`tap_side_script`. The last rank posts each step's receives when it "builds the
    batch" and takes them ``depth - 1`` steps later (the PP batch queue's micro-batches in
    flight); every partial it hands the drafter must equal, bit for bit, the sum the
    intermediate-tensor relay (``1``) would have delivered, and the drafter's first linear of
    ``[partial | own taps]`` the full linear of all taps. ``fault`` plants a control:
    ``zeros`` (the drafter reads a zero buffer), ``no_post`` (the last rank posts no receive),
    ``stop_send`` (stage 0 sends nothing from step 3 on)."""
    import time
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    result: dict = {"rank": rank, "ok": False, "checked": 0, "dummies": 0, "problems": []}
    try:
        dist = _init(rank, world, port, timeout_s=timeout_s + 30)
        group = dist.new_group(list(range(world)), backend="gloo")
        from vllm.sequence import IntermediateTensors

        from vllm_dspark_pp.protocol import tap_partials as tp

        counts, hidden, pw = TAP_SIDE_LAYOUTS[world]
        n_taps = sum(counts)
        weight = torch.randn(pw, n_taps * hidden, generator=torch.Generator().manual_seed(seed))
        bases = [sum(counts[:r]) for r in range(world)]
        upstream = tuple(sum(counts[: r + 1]) for r in range(world - 1))
        senders = tuple(r for r in range(world - 1) if counts[r])
        last = world - 1
        plans = [
            tp.TapPlan(n_taps, hidden, pw, bases[r], counts[r], r == 0, r == last, upstream)
            for r in range(world)
        ]
        plan = tp.TapPlan(
            n_taps, hidden, pw, bases[rank], counts[rank], rank == 0, rank == last, upstream,
            side=True, senders=senders,
        )  # fmt: skip
        block = tp.column_block(weight, plan.base, plan.count, hidden)
        side = tp.TapSideChannel(
            plan, group, range(world), "cpu", torch.float32, block=block, timeout_s=timeout_s
        )
        side.connect()  # what configure_stage does at start-up (every rank, before any step)
        result["connected"] = side.connected
        handler = SimpleNamespace(
            _dspark_tap_plan=plan, _dspark_tap_block=block, _dspark_tap_side=side
        )
        runner = SimpleNamespace(pp_handler=handler, execute_model_state=None)
        speculator = SimpleNamespace(_dspark_tap_side=side)
        if fault == "zeros" and rank == last:
            side.take = lambda batch: torch.zeros(batch.num_tokens, pw)
        script = tap_side_script(seed, num_steps, fault_step=3 if fault == "stop_send" else None)

        def own_taps(step, r):
            return [_side_taps(step, bases[r] + i, hidden) for i in range(counts[r])]

        def relay_reference(step):
            """What the last stage's drafter gets from the ``1`` relay (the chain of partial
            sums, stage by stage, as protocol/tap_partials.relay computes them)."""
            partial = None
            for r in range(world - 1):
                if not plans[r].sends:
                    continue
                blk = tp.column_block(weight, bases[r], counts[r], hidden) if counts[r] else None
                taps = [t[: step["rows"]] for t in own_taps(step, r)]
                partial = tp.partial_sum(taps, blk, partial)
            return partial

        def execute(step):
            dummy = step["kind"] == "dummy"
            batch = SimpleNamespace(
                num_tokens=step["rows"], num_tokens_after_padding=step["rows"] + step["pad"]
            )
            hs = torch.zeros(step["rows"] + step["pad"], hidden)
            if rank == last:
                if not dummy and fault != "no_post":
                    tp.after_prepare_inputs(runner, batch)  # the hook of prepare_inputs
                return batch
            out = IntermediateTensors(
                {
                    "hidden_states": hs,
                    "residual": hs,
                    **{
                        f"{tp.TAP_KEY}{bases[rank] + i}": t
                        for i, t in enumerate(own_taps(step, rank))
                    },
                }
            )
            received = IntermediateTensors({"hidden_states": hs, "residual": hs})
            sent = tp.relay(handler, received, out)
            if sorted(sent.tensors) != ["hidden_states", "residual"]:
                result["problems"].append(
                    f"step {step['t']}: the dict holds {sorted(sent.tensors)}"
                )
            runner.execute_model_state = SimpleNamespace(input_batch=batch)
            skip = fault == "stop_send" and rank == 0 and step["t"] >= 3
            tp.after_forward(runner, sent, dummy_run=dummy or skip)
            return batch

        def sample(step, batch):
            if rank != last or step["kind"] == "skip":
                return
            own = own_taps(step, last)
            aux = tp.drafter_taps(speculator, batch, own, dummy_run=step["kind"] == "dummy")
            partial, n = aux[0], step["rows"]
            if step["kind"] == "dummy":
                result["dummies"] += 1
                if aux[0].abs().sum() != 0 or aux[0].shape[0] != own[0].shape[0]:
                    result["problems"].append(f"step {step['t']}: dummy partial not zeros")
                return
            want = relay_reference(step)
            if partial.shape != want.shape or not torch.equal(partial, want):
                result["problems"].append(f"step {step['t']}: partial differs from the relay's")
            lin = tp.PartialSumLinear(
                tp.column_block(weight, bases[last], counts[last], hidden), pw
            )
            got = lin(torch.cat([partial[:n], *[t[:n] for t in aux[1:]]], dim=-1))
            full = F.linear(torch.cat([t[:n] for t in [*own_taps_all(step)]], dim=-1), weight)
            if not torch.allclose(got, full, rtol=1e-5, atol=1e-5):
                result["problems"].append(f"step {step['t']}: drafter input != full linear")
            result["checked"] += 1

        def own_taps_all(step):
            return [t for r in range(world) for t in own_taps(step, r)]

        t0 = time.monotonic()
        in_flight: list = []
        for step in script:
            if step["kind"] == "dummy":  # a dummy run: outside the batch queue, at once
                sample(step, execute(step))
                continue
            in_flight.append((step, execute(step)))
            if len(in_flight) >= depth:
                sample(*in_flight.pop(0))
        while in_flight:
            sample(*in_flight.pop(0))
        result["elapsed"] = time.monotonic() - t0
        result["stats"] = dict(side.stats)
        dist.barrier(group=group)
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    _report(queue, result)
