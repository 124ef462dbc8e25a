"""CPU tests of the exchange accounting (issue 29 goal (e)): benchmarks/dspark_bench_hooks.py's
per-step records of the stage-to-stage tensors and the token broadcasts (driven through its
wrappers with stand-in PP group, worker class, handler and ``torch.distributed``), their
aggregation, and benchmarks/plot_pp_one_gpu.py's exchange table and goal (e) verdict from a small
recorded sample. Host clocks (no GPU); nothing is timed against a threshold."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from support.perf_records import serve_point, serve_run

from benchmarks import dspark_bench_hooks as hooks
from benchmarks import plot_pp_one_gpu as plot
from benchmarks import pp_projection


class _Group:
    """Stand-in PP group: what a non-first stage receives, what any stage sends."""

    world_size = 2

    def __init__(self, rows: int, hidden: int):
        self.rows, self.hidden, self.sent = rows, hidden, []

    def isend_tensor_dict(self, tensor_dict, **kw):
        self.sent.append(tensor_dict)
        return []

    def irecv_tensor_dict(self, **kw):
        # vLLM 0.34.0 hands back flat receive buffers (its all-gather path, even at TP=1)
        z = torch.zeros(self.rows * self.hidden, dtype=torch.bfloat16)
        return {"hidden_states": z, "residual": z.clone(), "aux_1": z.clone()}, [], []


class _Async:
    """Stand-in AsyncIntermediateTensors (the attribute vLLM's class checks): flat buffers until
    the wait, the sent shapes after it (as vLLM's all-gather post-processing leaves them)."""

    def __init__(self, rows: int = 32, hidden: int = 16):
        self._comm_waited = False
        self.tensors = {"hidden_states": torch.zeros(rows * hidden)}
        self._shape = (rows, hidden)

    def wait_for_comm(self):
        self.tensors = {"hidden_states": self.tensors["hidden_states"].view(self._shape)}
        self._comm_waited = True


class _Handler:
    """Posts through ``dist.broadcast`` in the order vLLM's handlers do."""

    def __init__(self, dist, n: int, k: int):
        self.dist, self.n, self.k = dist, n, k

    def broadcast(self):
        self.dist.broadcast(torch.zeros(self.n, self.k + 1, dtype=torch.int64))
        self.dist.broadcast(torch.zeros(2, self.n, dtype=torch.int32))

    def broadcast_drafts(self):
        self.dist.broadcast(torch.zeros(self.n, self.k, dtype=torch.int64))

    def receive(self):  # the other stages post the same three, in the same order
        self.dist.broadcast(torch.empty(self.n, self.k + 1, dtype=torch.int64))
        self.dist.broadcast(torch.empty(2, self.n, dtype=torch.int32))
        self.dist.broadcast(torch.empty(self.n, self.k, dtype=torch.int64))

    def get_prev_sampled_outputs(self):
        return {"sampled": True}


class _Runner:
    def __init__(self, handler, n: int, tokens: int, padded: int):
        self.pp_handler = handler
        self.execute_model_state = SimpleNamespace(
            input_batch=SimpleNamespace(
                num_reqs=n, num_tokens=tokens, num_draft_tokens=0, num_tokens_after_padding=padded
            )
        )

    def execute_model(self, intermediate):
        if intermediate is None:  # an empty step: nothing scheduled, no sample_tokens follows
            return
        intermediate.wait_for_comm()  # the forward's first use of the received tensors
        self.pp_handler.get_prev_sampled_outputs()

    def sample_tokens(self):
        self.pp_handler.receive()


@pytest.fixture
def stage(monkeypatch):
    """A non-first stage (batch 4 requests, k = 7: 32 tokens padded to 32) with the accounting
    installed as ``dspark_bench_ctl("enable")`` installs it."""
    monkeypatch.setattr(hooks, "_cuda", lambda: None)  # host clocks on any machine
    fresh = {"steps": [], "cur": None, "xpend": [], "xctx": None, "shape_logged": set()}
    monkeypatch.setattr(hooks, "_STATE", {**hooks._STATE, **fresh})
    dist = SimpleNamespace(broadcast=lambda t, *a, **kw: None)
    n, k = 4, 7
    group = _Group(rows=n * (k + 1), hidden=16)
    runner = _Runner(_Handler(dist, n, k), n, n * (k + 1), n * (k + 1))
    async_cls = type("AsyncIntermediateTensors", (_Async,), {})  # patched afresh each test
    installed = hooks._install_timers(runner) + hooks._install_exchange(
        runner, pp=group, async_cls=async_cls, dist=dist
    )
    assert {"pp_send_recv", "wait_for_comm", "exchange_broadcasts"} <= set(installed)

    def step(send: bool = False, empty_before: bool = False):
        # vLLM's worker: receive (before the model runner's step), forward, send, sample
        if empty_before:  # PP's batch queue schedules empty steps while batches are in flight
            runner.execute_model(None)
        td, _, _ = group.irecv_tensor_dict()
        runner.execute_model(async_cls())
        if send:
            group.isend_tensor_dict(td)
        runner.sample_tokens()

    return SimpleNamespace(step=step, n=n, k=k, hidden=16)


def test_each_step_records_the_bytes_per_key_and_per_broadcast(stage):
    for i in range(3):
        stage.step(send=True, empty_before=i > 0)
    steps = hooks._resolve()
    assert len(steps) == 3
    x = steps[-1]["x"]  # after an empty step, the receive still belongs to its own step
    act = stage.n * (stage.k + 1) * stage.hidden * 2  # bf16 rows of the received batch
    for key in ("hidden_states", "residual", "aux_1"):
        assert x[f"pp_recv_bytes:{key}"] == act  # received before the step began: still its own
        assert x[f"pp_send_bytes:{key}"] == act
    assert x["pp_recv_rows"] == stage.n * (stage.k + 1)  # rows once usable, not the flat size
    assert x["x_bytes:sampled"] == stage.n * (stage.k + 1) * 8
    assert x["x_bytes:counts"] == 2 * stage.n * 4
    assert x["x_bytes:drafts"] == stage.n * stage.k * 8
    for span in ("pp_recv_wait_ms", "pp_recv_ready_ms", "pp_recv_host_ms", "x_bcast_ms"):
        assert x[span] >= 0.0
    assert "x_wait_ms" in x


class _FakeCuda:
    """Stands in for ``torch`` on a GPU: events stamped in order on the stream that records
    them (a counter as their time), streams, the ``stream`` context, and NCCL works whose
    ``wait`` notes which stream was current."""

    def __init__(self):
        self.t, self.current, self.waits = 0.0, "main", []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                fake.t += 1.0
                self.at, self.stream = fake.t, stream or fake.current

            def elapsed_time(self, other):
                return other.at - self.at

        class Stream:
            def __repr__(self):
                return "timing"

        class StreamCtx:
            def __init__(self, stream):
                self.stream, self.before = stream, None

            def __enter__(self):
                self.before, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.before

        self.cuda = SimpleNamespace(Event=Event, Stream=Stream, stream=StreamCtx)

    def work(self, name):
        return SimpleNamespace(wait=lambda: self.waits.append((name, repr(self.current))))


class _CudaTensor:
    def __init__(self, numel: int, is_cuda: bool = True):
        self._n, self.is_cuda = numel, is_cuda

    def numel(self):
        return self._n

    def element_size(self):
        return 2


def test_the_sends_completion_is_waited_on_a_timing_stream_of_its_own(monkeypatch):
    """``pp_send_ms``: from the sender's forward end to its tensor sends' completion; only the
    CUDA tensors' works are waited, on the hook's own stream (a wait on vLLM's stream would
    change what is measured; on the metadata object's CPU work it would block the host)."""
    fake = _FakeCuda()
    monkeypatch.setattr(hooks, "_cuda", lambda: fake)
    monkeypatch.setitem(hooks._STATE, "send_stream", None)
    td = {"hidden_states": _CudaTensor(8), "empty": _CudaTensor(0), "meta": 3,
          "cpu_side": _CudaTensor(4, is_cuda=False), "residual": _CudaTensor(8)}  # fmt: skip
    handles = [fake.work("metadata"), fake.work("hidden"), fake.work("cpu"), fake.work("res")]
    done = hooks._sends_done(handles, td)
    assert fake.waits == [("hidden", "timing"), ("res", "timing")] and fake.current == "main"
    assert done[0] == "cuda" and repr(done[1].stream) == "timing"
    assert hooks._STATE["send_stream"] is not None  # made once, kept
    # not laid out as vLLM 0.34.0 returns them: measure nothing rather than the wrong works
    assert hooks._sends_done(handles[:3], td) is None
    assert hooks._sends_done([fake.work("m")], {"x": _CudaTensor(0)}) is None
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")  # there a wait would hold the host
    fake.waits.clear()
    assert hooks._sends_done(handles, td) is None and not fake.waits
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT")
    monkeypatch.setattr(hooks, "_cuda", lambda: None)
    assert hooks._sends_done(handles, td) is None  # host clocks: no such span


def test_a_sending_stage_records_its_send_span_per_step(monkeypatch):
    """Through the installed wrapper: the span starts before vLLM's ``isend_tensor_dict`` is
    called and ends at the timing stream's event, in the step's exchange records."""
    fake = _FakeCuda()
    monkeypatch.setattr(hooks, "_cuda", lambda: fake)
    fresh = {"steps": [], "cur": {}, "xpend": [], "xctx": None, "send_stream": None}
    monkeypatch.setattr(hooks, "_STATE", {**hooks._STATE, **fresh})

    class Group:
        world_size = 2

        def isend_tensor_dict(self, tensor_dict, **kw):
            fake.t += 5.0  # posting takes "5 ms" of stream time in this stand-in
            return [fake.work("metadata"), fake.work("hidden_states")]

        def irecv_tensor_dict(self, **kw):
            return {}, [], []

    group = Group()
    assert "pp_send_recv" in hooks._install_exchange(
        SimpleNamespace(), pp=group, async_cls=type("A", (_Async,), {})
    )
    group.isend_tensor_dict({"hidden_states": _CudaTensor(8)})
    spans = [r for r in hooks._STATE["cur"]["x"] if r.get("metric") == "pp_send_ms"]
    assert len(spans) == 1 and hooks._elapsed_ms(spans[0]["a"], spans[0]["b"]) == 6.0
    assert fake.waits == [("hidden_states", "timing")]

    def broken(handles, tensor_dict):
        raise RuntimeError("a torch that changed")

    monkeypatch.setattr(hooks, "_sends_done", broken)
    monkeypatch.setitem(sys.modules, "vllm.logger", SimpleNamespace(
        init_logger=lambda name: SimpleNamespace(warning=lambda *a: None)))  # fmt: skip
    out = group.isend_tensor_dict({"hidden_states": _CudaTensor(8)})  # the send still goes out
    assert len(out) == 2 and hooks._STATE["send_span_failed"] is True


def test_the_summary_gives_medians_and_the_stall_share_per_main_batch(stage):
    for _ in range(3):
        stage.step()
    summary = hooks.summarize_steps(hooks._resolve())
    xs = summary["exchange"]
    assert xs["steps"] == 3 and summary["main_num_reqs"] == stage.n
    assert xs["median"]["x_bytes:drafts"] == stage.n * stage.k * 8
    assert "pp_send_bytes:hidden_states" not in xs["median"]  # this stage sent nothing
    assert 0.0 <= xs["stall_share"] <= 1.0


def test_medians_and_share_from_recorded_steps():
    steps = [
        {"num_reqs": 8, "step_ms": 10.0, "x": {"pp_recv_wait_ms": w, "x_wait_ms": 0.1,
                                                 "pp_recv_bytes:hidden_states": 1024}}
        for w in (0.1, 0.2, 0.9)
    ] + [{"num_reqs": 2, "step_ms": 1.0, "x": {"pp_recv_wait_ms": 0.5}}]  # fmt: skip
    xs = hooks.summarize_exchange(steps, 8)
    assert xs["steps"] == 3
    assert xs["median"] == {
        "pp_recv_bytes:hidden_states": 1024, "pp_recv_wait_ms": 0.2, "x_wait_ms": 0.1
    }  # fmt: skip
    assert xs["stall_share"] == pytest.approx(0.03)  # (0.2 + 0.1) / 10, median of the steps
    assert hooks.summarize_exchange(steps, 64) is None


def _xsumm(batch, share, step_ms=10.0):
    return {
        "main_num_reqs": batch,
        "main": {"target_ms": 3.0, "draft_ms": None, "step_ms": step_ms},
        "exchange": {
            "steps": 5,
            "median": {"pp_send_bytes:hidden_states": 4096, "pp_send_bytes:residual": 4096,
                       "pp_recv_wait_ms": share * step_ms, "x_bytes:sampled": 64},
            "stall_share": share,
        },
    }  # fmt: skip


@pytest.mark.parametrize(
    ("share16", "verdict"), [(0.02, "met"), (0.05, "missed")], ids=["met", "missed"]
)
def test_goal_e_verdict_and_table_from_a_recorded_sample(tmp_path, share16, verdict):
    pts = []
    for c, share in ((4, 0.5), (8, 0.01), (16, share16)):
        p = serve_point("pp2_dspark", 3.99, c, 100.0 * c, measured=3.9)
        p["step_times"] = [_xsumm(c // 2, share), _xsumm(c // 2, share / 2)]
        pts.append(p)
    f = tmp_path / "serve_pp_one_gpu_pp2.json"
    f.write_text(json.dumps(serve_run(pts, concurrency=(4, 8, 16))))
    merged = plot.merge(plot.load([str(f)]))
    rows = plot.exchange_rows(merged)
    assert [(r["c"], r["rank"]) for r in rows] == [(4, 0), (4, 1), (8, 0), (8, 1), (16, 0), (16, 1)]
    assert rows[0]["pp_send_bytes"] == 8192 and rows[0]["x_bytes"] == 64
    g = plot.goal_e(rows)
    assert set(g["per_c"]) == {8, 16}  # C=4 (share 50%) is below the goal's range
    assert g["per_c"][16] == (verdict, share16) and g["verdict"] == verdict
    md = "\n".join(plot.exchange_section(merged))
    assert "## The exchange per step (goal e)" in md
    assert "**Goal (e)**" in md and f"**{verdict}**; C=8: met (1.0%)" in md


def test_goal_e_by_stage_splits_the_ranks_and_names_the_last_stage_draft(tmp_path):
    pts = []
    for c, share in ((4, 0.5), (16, 0.4)):
        p = serve_point("pp2_dspark", 3.99, c, 100.0 * c, measured=3.9)
        last = _xsumm(c // 2, 0.02)
        last["main"]["draft_ms"] = 3.5
        p["step_times"] = [_xsumm(c // 2, share), last]
        pts.append(p)
    f = tmp_path / "serve_pp_one_gpu_pp2.json"
    f.write_text(json.dumps(serve_run(pts, concurrency=(4, 16))))
    merged = plot.merge(plot.load([str(f)]))
    rows = plot.exchange_rows(merged)
    assert [r["draft_ms"] for r in rows] == [None, 3.5, None, 3.5]
    by = plot.goal_e_by_stage(rows)
    assert list(by) == [16]  # C=4 is below the goal's range
    assert by[16] == {0: {"share": 0.4, "draft_ms": None}, 1: {"share": 0.02, "draft_ms": 3.5}}
    md = "\n".join(plot.exchange_section(merged))
    assert "**missed**; C=16: missed (40.0%)" in md  # the verdict still takes every rank
    assert "C=16: rank 0 40.0%, rank 1 2.0% (draft 3.50 ms); last stage (rank 1) met" in md


# --------------------------------------------------------------------------- goal (e) estimated


def test_message_prices_interpolate_the_measured_one_gpu_points():
    price = pp_projection.nccl_p2p_ms
    for b, t in pp_projection.NCCL_P2P_ONE_GPU:
        assert price(b) == pytest.approx(t)
    assert price(16) == pytest.approx(0.04)  # below the smallest point: its latency
    assert price((512 + 4096) * 1024 / 2) == pytest.approx((0.26 + 1.5) / 2)
    assert price(8 * 1024 * 1024) == pytest.approx(1.5 + (1.5 - 0.26) * 4 / 3.5)  # last line


def test_exchange_bytes_per_request_step_are_exact_from_the_shape():
    est = pp_projection.exchange_estimate(c=16, k=7, hidden=4096, taps0=3, micro=2)
    assert est["act_bytes"] == 2 * 5 * (8 * 8 * 4096 * 2)  # 2 micro-batches x 5 keys x rows
    assert est["tok_bytes"] == 2 * (8 * 8 * 8 + 2 * 8 * 4 + 8 * 7 * 8)
    one = pp_projection.nccl_p2p_ms(8 * 8 * 4096 * 2)
    assert est["est_ms"] == pytest.approx(2 * (5 * one + 3 * 0.04))


def test_goal_e_from_what_exists_is_labelled_an_estimate_with_its_verdict():
    def row(c, share):
        return {"al": 3.99, "c": c, "x_act_bytes": 1e6, "x_tok_bytes": 1e3, "x_est_ms": share,
                "pp2_request_step_ms": 1.0, "x_est_share": share, "x_upper_share": 0.5}  # fmt: skip

    md = "\n".join(pp_projection.goal_e_markdown([row(4, 0.2), row(8, 0.01), row(16, 0.02)]))
    assert "ESTIMATED, not measured" in md and "ESTIMATED: **met**;" in md
    md = "\n".join(pp_projection.goal_e_markdown([row(8, 0.01), row(16, 0.04)]))
    assert "ESTIMATED: **missed** at AL 3.99 C=16 (4.0%)" in md
    assert "upper bound shows it at 0 of 2 points" in md


def test_the_served_driver_keeps_the_hooks_shape_log_line():
    from benchmarks import serve_pp_one_gpu as serve

    line = (
        "(Worker pid=7) INFO 12-04 15:00:00 dspark_bench: a step received intermediate tensors "
        "{'hidden_states': [32, 4096]} for a batch of 4 requests, 32 tokens (32 after padding)"
    )
    assert serve.useful_lines("noise\n" + line + "\nmore noise") == [line]


class _Side:
    """Stand-in DSpark tap side channel (protocol/tap_partials.TapSideChannel's three calls)."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width

    def send(self, rows):
        return torch.zeros(rows, self.width, dtype=torch.bfloat16)

    def post(self, batch):
        bufs = [torch.empty(batch.num_tokens, self.width, dtype=torch.bfloat16)] * 2  # 2 senders
        return SimpleNamespace(buffers=bufs)

    def take(self, batch):
        time.sleep(0.002)  # the last stage's stall on the side channel
        return torch.zeros(batch.num_tokens, self.width)


def test_the_tap_side_channel_records_its_bytes_and_the_last_stages_wait(stage, monkeypatch):
    """VLLM_DSPARK_PP_TAP_PARTIALS=side: what a sender sends and the last stage receives on the
    side channel, and the last stage's stall before its drafter, which joins the stall share."""
    side = _Side(32, 16)
    assert hooks._install_side(side) == ["tap_side_channel"]
    batch = SimpleNamespace(num_tokens=32)
    hooks._STATE["cur"] = {}
    side.send(32)
    side.post(batch)
    side.take(batch)
    x = step_exchange_of(hooks._STATE["cur"])
    assert x["side_send_bytes:dspark_tap_partial"] == 32 * 16 * 2
    assert x["side_recv_bytes:dspark_tap_partial"] == 2 * 32 * 16 * 2
    assert x["side_wait_ms"] >= 2.0
    steps = [{"num_reqs": 4, "step_ms": 10.0, "x": {"pp_recv_wait_ms": 0.1, "side_wait_ms": 0.2}}]
    assert hooks.summarize_exchange(steps, 4)["stall_share"] == pytest.approx(0.03)


def step_exchange_of(cur: dict) -> dict:
    return hooks.step_exchange(hooks._resolve_exchange(cur.get("x", [])))
