"""The DSpark tap side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``, protocol/tap_partials.py):
partial sums sent straight to the last PP stage, outside the tensors the next stage's forward
waits for.

With real collectives: 2 and 3 gloo processes replay seeded steps (real forwards of varying
token counts with padded taps, dummy runs, steps whose drafter is skipped, micro-batches in
flight) through the relay, the two runner hooks and the drafter hook; every partial the last
stage's drafter reads must equal, bit for bit, what the intermediate-tensor relay (``1``) would
have delivered, and the dict between stages must hold only the target's tensors. The controls
plant a drafter reading a zero buffer, a last stage that posts no receive and a sender that stops
sending: each must fail, and fail without hanging. Then the mode's choice and fallbacks, the
patched ``collect_remote_aux_hidden_states``, the drafter patch's argument handling, the runner
patch's dummy-run rule and the start-up lines.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from protocol_gloo_workers import run_processes, tap_side_script, tap_side_worker

from vllm_dspark_pp.protocol import tap_partials as tp

SEED, STEPS = 7, 40


def _run(world, depth, fault=None, timeout_s=20.0, limit_s=150):
    return run_processes(
        tap_side_worker, world, lambda r: (SEED, STEPS, depth, fault, timeout_s), timeout_s=limit_s
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "depth"), [(2, 2), (3, 3), (3, 1)])
def test_side_channel_delivers_the_relays_partial_bit_for_bit(world, depth):
    script = tap_side_script(SEED, STEPS)
    kinds = [s["kind"] for s in script]
    assert {"real", "dummy", "skip"} <= set(kinds)
    results = _run(world, depth)
    assert sorted(results) == list(range(world)), f"ranks missing: {results}"
    for r, res in results.items():
        assert res["ok"], f"rank {r} failed:\n{res.get('error')}"
        assert res["problems"] == [], f"rank {r}: {res['problems'][:5]}"
        assert res["connected"], f"rank {r} did not connect the side channel"
    last = results[world - 1]
    assert last["checked"] == kinds.count("real")
    assert last["dummies"] == kinds.count("dummy")
    forwards = kinds.count("real") + kinds.count("skip")
    assert last["stats"]["recv_steps"] == forwards
    # a skipped drafter's receives are drained by the next drafter (the last step's, if any,
    # stays queued)
    assert last["stats"]["stale_steps"] >= kinds[:-1].count("skip")
    senders = [r for r in range(world - 1)]
    for r in senders:
        assert results[r]["stats"]["sent_steps"] == forwards, results[r]["stats"]
    print(f"world={world} depth={depth}: {last['checked']} partials checked, {last['stats']}")


@pytest.mark.timeout(120)
def test_control_a_drafter_reading_a_zero_buffer_fails():
    results = _run(2, 2, fault="zeros")
    last = results[1]
    assert last["ok"], last.get("error")
    assert len(last["problems"]) >= last["checked"] > 0, last["problems"][:3]


@pytest.mark.timeout(120)
def test_control_no_receive_posted_fails_at_once_without_waiting():
    """The drafter of a step whose forward posted no receive raises (it does not wait)."""
    results = _run(2, 2, fault="no_post", timeout_s=60.0)
    err = results[1].get("error") or ""
    assert not results[1]["ok"] and "no partial was received on the side channel" in err, err
    assert results[1].get("elapsed") is None  # failed inside the replay


@pytest.mark.timeout(120)
def test_control_missing_sends_stop_the_last_stage_within_its_timeout():
    """Stage 0 stops sending at step 3: the last stage's drafter waits for that step's partial
    at most ``VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S`` (here 5 s) and stops with the side channel's
    error naming the knob; it does not wait forever."""
    import time

    t0 = time.monotonic()
    results = _run(2, 2, fault="stop_send", timeout_s=5.0, limit_s=45)
    elapsed = time.monotonic() - t0
    assert 1 in results, f"the last rank never reported (hung?) after {elapsed:.0f} s: {results}"
    err = results[1].get("error") or ""
    assert not results[1]["ok"] and "waited 5 s for the partial of PP rank 0" in err, err
    assert "VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S" in err and "VLLM_DSPARK_PP_TAP_PARTIALS=1" in err
    print(f"stopped after {elapsed:.0f} s (process start-up included)")


# ------------------------------------------------------------------ the choice


@pytest.mark.parametrize(
    ("aux", "starts", "layers", "side", "senders"),
    [
        ((1, 3, 4), (0, 3), 4, True, (0,)),  # the tiny pair at PP=2 3,1
        ((1, 3, 4), (0, 1, 3), 4, True, (0, 1)),  # ... at PP=3
        ((1, 3, 4), (0, 2), 4, True, (0,)),  # ... at PP=2 2,2
        ((1, 2, 3), (0, 3), 5, False, ()),  # the last stage makes no tap: fall back to 1
        ((0, 5), (0, 2, 4), 6, True, (0,)),  # a middle stage without taps sends nothing
    ],
)
def test_side_layout(aux, starts, layers, side, senders):
    got_side, got_senders, why = tp.side_layout(aux, starts, layers)
    assert (got_side, got_senders) == (side, senders), why
    if not side:
        assert "as with 1" in why


def test_side_falls_back_under_prefill_context_parallelism():
    pc = types.SimpleNamespace(prefill_context_parallel_size=2)
    side, _, why = tp.side_layout((1, 3, 4), (0, 3), 4, pc)
    assert not side and "prefill context parallelism" in why


def test_knob_accepts_side():
    from vllm_dspark_pp import envs

    assert envs.parse_tap_partials(" Side ") == "side"
    with pytest.raises(ValueError, match="side"):
        envs.parse_tap_partials("sidechannel")
    assert tp.choose_mode("side", [1])[0] and not tp.choose_mode("side", [0])[0]


def _plan(**kw):
    base = dict(
        num_taps=3,
        tap_width=4,
        partial_width=5,
        base=0,
        count=2,
        is_first=True,
        is_last=False,
        upstream=(2,),
        side=True,
        senders=(0,),
    )
    return tp.TapPlan(**{**base, **kw})


def test_side_plans_send_and_receive_nothing_in_the_dict():
    first, last = _plan(), _plan(base=2, count=1, is_first=False, is_last=True)
    assert first.side_sends and not first.sends and not first.receives
    assert not last.side_sends and not last.receives and not last.sends
    assert not _plan(count=0).side_sends
    in_dict = _plan(side=False, senders=())
    assert in_dict.sends and not in_dict.side_sends


# ------------------------------------------------------------------ start-up: connect()


class _Work:
    def __init__(self, log, op, peer, buf):
        self.log, self.op, self.peer, self.buf = log, op, peer, buf

    def wait(self, timeout=None):
        self.log.append(("wait", self.op, self.peer))
        if self.op == "irecv":
            self.buf.fill_(1)  # what the sender's probe holds
        return True

    def is_completed(self):
        return True


def _recording_p2p(monkeypatch):
    log = []

    def isend(t, dst, group=None):
        log.append(("isend", dst))
        return _Work(log, "isend", dst, t)

    def irecv(t, src, group=None):
        log.append(("irecv", src))
        return _Work(log, "irecv", src, t)

    monkeypatch.setattr(torch.distributed, "isend", isend)
    monkeypatch.setattr(torch.distributed, "irecv", irecv)
    return log


@pytest.mark.parametrize(
    ("stage", "count", "want"),
    [
        (0, 2, [("isend", 12), ("wait", "isend", 12)]),
        (1, 1, [("isend", 12), ("wait", "isend", 12)]),
        (1, 0, []),  # a stage without taps of its own sends nothing on the side channel
        (2, 1, [("irecv", 10), ("wait", "irecv", 10), ("irecv", 11), ("wait", "irecv", 11)]),
    ],
)
def test_connect_makes_every_sender_to_last_link_at_start_up_in_stage_order(
    monkeypatch, stage, count, want
):
    """A torch NCCL group makes a pair's communicator at the pair's first send or receive and
    blocks both hosts until both joined; inside a step that first contact waited on itself on an
    H200 (2026-12-06, PP=3 never ready). connect() makes it at start-up: each sender one probe
    to the last stage, which takes them in stage order, one at a time."""
    log = _recording_p2p(monkeypatch)
    senders = (0, 1) if not (stage == 1 and count == 0) else (0,)
    plan = _plan(
        base=stage, count=count, is_first=stage == 0, is_last=stage == 2,
        upstream=(2, 3), senders=senders,
    )  # fmt: skip
    side = tp.TapSideChannel(plan, None, (10, 11, 12), "cpu", torch.float32, timeout_s=1.0)
    side.connect()
    assert log == (want if stage == 2 or count else [])
    assert side.connected
    side.connect()  # once only
    assert log == (want if stage == 2 or count else [])


def _cuda_side(monkeypatch, stage, timeout_s):
    """A side channel that takes the CUDA path of connect() on this CPU machine (the helper
    thread; its device and the host wait's event stand in)."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tp.TapSideChannel, "_wait", lambda self, work, what, host=False: None)
    plan = _plan(
        base=stage, count=1, is_first=stage == 0, is_last=stage == 2, upstream=(1, 2),
        senders=(0, 1),
    )  # fmt: skip
    side = tp.TapSideChannel(plan, None, (10, 11, 12), "cpu", torch.float32, timeout_s=timeout_s)
    side.on_cuda = True  # its tensors stay on the CPU
    return side


@pytest.mark.parametrize(("stage", "peers"), [(0, "PP rank 12"), (2, "PP ranks 10, 11")])
def test_connect_on_cuda_fails_naming_the_peer_when_its_link_never_comes(monkeypatch, stage, peers):
    """On CUDA the first send or receive of a pair makes its NCCL communicator and blocks the
    host until the peer joins, with no timeout of torch's: a peer that never comes must end
    start-up with an error naming it, not hold it forever."""
    never = threading.Event()

    def blocked(*args, **kwargs):  # a pair whose other end never joins
        never.wait(30)
        raise AssertionError("unblocked")

    monkeypatch.setattr(torch.distributed, "isend", blocked)
    monkeypatch.setattr(torch.distributed, "irecv", blocked)
    side = _cuda_side(monkeypatch, stage, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(tp.TapPartialsError, match=f"start-up link with {peers} did not come"):
        side.connect()
    assert time.monotonic() - t0 < 5 and not side.connected
    never.set()


def test_connect_on_cuda_makes_the_links_on_a_helper_thread_and_passes_errors_on(monkeypatch):
    log = _recording_p2p(monkeypatch)
    threads = []
    real_isend = torch.distributed.isend

    def isend(t, dst, group=None):
        threads.append(threading.current_thread().name)
        return real_isend(t, dst, group)

    monkeypatch.setattr(torch.distributed, "isend", isend)
    side = _cuda_side(monkeypatch, 0, timeout_s=5.0)
    side.connect()
    assert side.connected and log == [("isend", 12)]
    assert threads == ["dspark-tap-side-connect"]

    def failing(*args, **kwargs):
        raise RuntimeError("NCCL error: remote process exited")

    monkeypatch.setattr(torch.distributed, "irecv", failing)
    last = _cuda_side(monkeypatch, 2, timeout_s=5.0)
    with pytest.raises(RuntimeError, match="remote process exited"):
        last.connect()
    assert not last.connected


def test_a_side_channel_used_before_connect_on_cuda_fails_instead_of_waiting(monkeypatch):
    log = _recording_p2p(monkeypatch)
    side = tp.TapSideChannel(_plan(), None, (10, 11), "cpu", torch.float32, timeout_s=1.0)
    side.on_cuda = True  # the guard is for CUDA groups (gloo links exist from the group's start)
    side.stage_taps([torch.ones(3, 4)])
    with pytest.raises(tp.TapPartialsError, match="used before connect"):
        side.send(3)
    last = _plan(base=2, count=1, is_first=False, is_last=True)
    side = tp.TapSideChannel(last, None, (10, 11), "cpu", torch.float32, timeout_s=1.0)
    side.on_cuda = True
    with pytest.raises(tp.TapPartialsError, match="used before connect"):
        side.post(types.SimpleNamespace(num_tokens=3))
    assert log == []


# ------------------------------------------------------------------ the patches' glue


class _Side(tp.TapSideChannel):
    """A side channel without a group: records what the hooks ask of it."""

    def __init__(self, plan):
        self.plan = plan
        self.calls = []
        self.partial_width = plan.partial_width

    def post(self, batch):
        self.calls.append(("post", batch))

    def send(self, rows):
        self.calls.append(("send", rows))

    def drop_taps(self):
        self.calls.append(("drop",))

    def take(self, batch):
        self.calls.append(("take", batch))
        return torch.full((batch.num_tokens, 5), 7.0)

    def dummy_partial(self, rows):
        return torch.zeros(rows, 5)


def test_runner_patch_sends_only_for_real_steps_and_posts_on_the_last_stage():
    from vllm.sequence import IntermediateTensors

    from vllm_dspark_pp.patches import v1_worker_gpu_model_runner__tap_partials as patch

    outs = iter([IntermediateTensors({}), IntermediateTensors({}), None])

    class Runner:
        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            return next(outs)

        def prepare_inputs(self, *args):
            return "batch"

    patch._patch(types.SimpleNamespace(GPUModelRunner=Runner))
    sender, last = _Side(_plan()), _Side(_plan(base=2, count=1, is_first=False, is_last=True))
    batch = types.SimpleNamespace(num_tokens=9)
    r = Runner()
    r.pp_handler = types.SimpleNamespace(_dspark_tap_side=sender)
    r.execute_model_state = types.SimpleNamespace(input_batch=batch)
    r.execute_model("so", None)  # a real step: what the worker sends
    r.execute_model("so", None, dummy_run=True)  # profile / capture / padding
    r.execute_model("so", None)  # returned no IntermediateTensors: the worker sends nothing
    assert sender.calls == [("send", 9), ("drop",), ("drop",)]
    r.prepare_inputs("so")  # a non-last stage posts nothing
    r.pp_handler = types.SimpleNamespace(_dspark_tap_side=last)
    assert r.prepare_inputs("so") == "batch"
    assert last.calls == [("post", "batch")]


def test_drafter_patch_puts_the_partial_first_and_passes_the_call_on_as_it_came():
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_dspark_pp.patches import (
        v1_worker_gpu_spec_decode_dspark_speculator__tap_partials as p,
    )

    seen = []

    class Spec(DFlashSpeculator):
        def __init__(self):
            pass

        def load_model(self, target_model):
            pass

    def propose(self, *args, **kwargs):  # stands in for vLLM's propose: records its call
        seen.append((args, kwargs))

    Spec.propose = propose
    Spec.propose.__vllm_dspark_pp_original__ = DFlashSpeculator.propose  # the signature's source
    p._patch(types.SimpleNamespace(DSparkSpeculator=Spec))
    s = Spec()
    own = [torch.ones(12, 4)]
    batch = types.SimpleNamespace(num_tokens=9, num_tokens_after_padding=12)
    s.propose(batch, "meta", "slots", "h", own, "ns", "nr", "ls", "np", "t", "s")  # positional
    args, kwargs = seen[-1]
    assert args == (batch, "meta", "slots", "h", own, "ns", "nr", "ls", "np", "t", "s")
    assert kwargs == {} and args[4] is own  # no side channel: the call as it came
    s._dspark_tap_side = side = _Side(_plan(base=2, count=1, is_first=False, is_last=True))
    s.propose(batch, "meta", "slots", "h", own, "ns", "nr", "ls", "np", "t", "s")
    args, kwargs = seen[-1]
    assert side.calls == [("take", batch)] and float(args[4][0][0, 0]) == 7.0
    assert len(args) == 11 and kwargs == {} and args[4][1] is own[0]  # positions kept
    assert args[:4] == (batch, "meta", "slots", "h") and args[5:] == (
        "ns",
        "nr",
        "ls",
        "np",
        "t",
        "s",
    )
    s.propose(input_batch=batch, aux_hidden_states=own, dummy_run=True)  # _dummy_run's call
    _, kwargs = seen[-1]
    assert kwargs["dummy_run"] is True and "input_batch" in kwargs  # still keywords
    assert torch.equal(kwargs["aux_hidden_states"][0], torch.zeros(12, 5))
    assert side.calls == [("take", batch)]  # a dummy run takes nothing
