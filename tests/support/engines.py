"""Session-scoped engine runs shared by the CPU end-to-end tests (a pytest plugin: tests/conftest.py
loads it with ``pytest_plugins``), so each configuration starts one vLLM engine per session.

Trained tiny pair (``models/tiny-pair``, k=7), the first :data:`PAIR_NUM_PROMPTS` held-out
problems of its corpus (the GSM8K gate's ``builtin:tiny-heldout`` questions, token for token),
chunked prefill with a 128-token budget (prompts are split across steps; decode steps are never
cut: 16 running requests x (1 + k) tokens = the budget):

* ``pair_reference``: PP=1 without speculation (top-2 logprobs, to diagnose a mismatch);
* ``pair_pp1``: PP=1 DSpark; ``pair_pp2_sync`` / ``pair_pp3_sync``: PP=2/3 DSpark, synchronous
  scheduling (the CPU default); ``pair_pp2_async``: PP=2 DSpark with async scheduling forced on
  (its ``config["async_scheduling"]`` records what vLLM used). Aux taps: raw at PP=2 sync,
  partial sums in the intermediate tensors at PP=3 (:data:`PP3_ENV`), partial sums on the side
  channel at PP=2 async (:data:`PP2_ASYNC_ENV`).

Used by tests/e2e/test_pp_parity.py (tokens and counters) and tests/evals/gsm8k (accuracy and
acceptance gates of the ``ci: cpu`` configurations, scored from these same runs). ``pair_pp1``,
``pair_pp2_sync`` and ``pair_pp2_async`` then run a second wave, :func:`seeded_wave` (seeded
temperature-1 requests; tests/e2e/test_sampling.py compares their tokens across the three): its
``waves[1]``; everything else of the result is the first (greedy) wave's.

Random-weight pair (``tiny_models``, k=4), :data:`RANDOM_PROMPTS`: ``random_reference`` (PP=1
no-spec, chunked prefill with a 32-token budget), ``random_pp1`` (PP=1 DSpark, same budget),
``random_pp2_unchunked`` (PP=2 DSpark, chunked prefill off, sync).

Each run is computed once (:class:`SharedRuns`): the first one asked for starts every shared
run the session's tests will ask for, two at a time, longest first (``support.e2e.run_together``):
a full session's first e2e test that needs one waits for all of them (the eight above, the
protocol e2e case and the producer-decodes case, which their modules register with
:func:`shared_case`), and every later one finds its run done. Every synchronous run here has its
engine core in the case's own process (:data:`ONE_PROCESS`), and the PP=1 ones their worker too
(:data:`IN_PROCESS_WORKER`); ``pair_pp2_async`` keeps vLLM's engine-core process.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from support import tiny_pair
from support.e2e import Result, result_of, run_generate, run_together
from support.reliability import seeded_sampling_wave

# ------------------------------------------------------------------ trained pair
PAIR_NUM_PROMPTS = 32
PAIR_MAX_TOKENS = 64  # above every held-out answer of these prompts (23-56 tokens + EOS)
PAIR_LLM = {
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 128,
    "max_num_seqs": 16,
}
PAIR_SAMPLING = {"max_tokens": PAIR_MAX_TOKENS, "ignore_eos": False}
# The seeded wave (issue 28 case 4'): 4 prefixes x 2 seeds, the first token + one whole
# verification block (k + 1 = 8 tokens). Sampled steps are slow on the CPU platform (vLLM's Triton
# sampling and rejection kernels run in the Triton interpreter: about 5 ms per token row and step,
# 8 rows per request and step): 16 requests took 6.7 s at PP=1, 15.3 s at PP=2 sync and 12.1 s at
# PP=2 async (load 5), so the CI wave has 8: 4.4 / 6.4 / 12.4 s (load 5-6).
SEEDED_REQUESTS = 8
SEEDED_MAX_TOKENS = 9
SEEDED_SEED0 = 28_000


def seeded_wave() -> dict:
    return seeded_sampling_wave(
        SEEDED_REQUESTS, SEEDED_MAX_TOKENS, temperature=1.0, seed0=SEEDED_SEED0, per_prompt=2
    )


# ------------------------------------------------------------------ random pair
RANDOM_MAX_TOKENS = 16
# Token-id prompts of different lengths (3 .. 90 tokens) and text prompts (tokenizer path).
RANDOM_PROMPTS = [
    [11, 12, 13],
    "the quick brown fox jumps over the lazy dog while a small cat sleeps",
    [(7 * i + 3) % 500 + 4 for i in range(40)],
    [(13 * i + 5) % 500 + 4 for i in range(90)],
    "the quick brown fox",
    [5, 6, 7, 8, 9, 10, 11],
]
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
UNCHUNKED = {"enable_chunked_prefill": False, "max_num_batched_tokens": 512}


def pair_serve_args() -> list[str]:
    """:data:`PAIR_LLM` (the shared runs' scheduler settings) as ``vllm serve`` flags."""
    assert PAIR_LLM["enable_chunked_prefill"] is True
    return [
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(PAIR_LLM["max_num_batched_tokens"]),
        "--max-num-seqs",
        str(PAIR_LLM["max_num_seqs"]),
        "--seed",
        "0",
    ]


def plugin_env() -> dict:
    # Off switch used to show the failure on stock vLLM (any non-matching name disables ours).
    if os.environ.get("DSPARK_E2E_PLUGINS") == "none":
        return {"VLLM_PLUGINS": "no-such-plugin"}
    return {}


def pair_prompts() -> list[list[int]]:
    return tiny_pair.heldout_prompts(PAIR_NUM_PROMPTS)


def run_pair(timeout_s, *, pp, spec, sampling=PAIR_SAMPLING, env=None, extra=None, **kw):
    ok, why = tiny_pair.available()
    if not ok:
        pytest.fail(why)
    cfg = {"model": tiny_pair.TARGET, "pipeline_parallel_size": pp, **PAIR_LLM, **(extra or {})}
    if spec:
        cfg["speculative_config"] = tiny_pair.spec_config()
    env = {**plugin_env(), **(env or {})}
    return run_generate(cfg, pair_prompts(), timeout_s, sampling=sampling, env=env, **kw)


def run_random(tiny, timeout_s, *, pp, spec, extra=None, env=None, **kw):
    cfg = {"model": tiny.target, "pipeline_parallel_size": pp}
    if spec:
        cfg["speculative_config"] = {"method": "dspark", "model": tiny.draft}
    cfg.update(extra or {})
    kw.setdefault("sampling", {"max_tokens": RANDOM_MAX_TOKENS})
    return run_generate(cfg, RANDOM_PROMPTS, timeout_s, env={**plugin_env(), **(env or {})}, **kw)


def pytest_sessionfinish(session, exitstatus):
    """The engines whose vLLM shutdown ran on in the background (``support.e2e.run_generate``)
    have ended, their process groups killed, before pytest reports."""
    from dspark_dev.engine import wait_for_shutdowns

    wait_for_shutdowns()


@pytest.fixture(scope="session")
def e2e_timeout_s() -> float:
    """The hard per-case wall-clock limit (``DSPARK_E2E_TIMEOUT_S``, default 300 s; a case takes
    well under a minute on an idle 2-core machine; 90-160 s were measured on a host loaded 10x)."""
    return float(os.environ.get("DSPARK_E2E_TIMEOUT_S", "300"))


# The shared runs: name -> (its start-up cost in CI, seconds; build(request) -> the case, a call of
# run_generate; what a build needs from fixtures it resolves itself, never in a case's thread).
CASES: dict[str, tuple[float, Callable]] = {}
# Runs a test asks for through SharedRuns.get or request.getfixturevalue (not in its item's
# fixturenames): the end of that test's node id.
ASKED_BY: dict[str, str] = {
    "pair_pp2_sync": "test_pp_parity.py::test_pp_dspark_sync_scheduling_is_lossless[2]",
    "pair_pp3_sync": "test_pp_parity.py::test_pp_dspark_sync_scheduling_is_lossless[3]",
}


def shared_case(name: str, *, cost_s: float, asked_by: str | None = None):
    """Register ``build`` (request -> the case) as the shared run ``name`` (a test module may
    register its own: it then runs beside the others; ``asked_by``: the node id end of the test
    that asks for it through :meth:`SharedRuns.get`). ``cost_s`` orders the start (longest
    first, so the last pair of cases is the shortest)."""

    def register(build: Callable) -> Callable:
        CASES[name] = (cost_s, build)  # a module imported again registers the same case again
        if asked_by is not None:
            ASKED_BY[name] = asked_by
        return build

    return register


def _timeout(request) -> float:
    return request.getfixturevalue("e2e_timeout_s")


#: Synchronous runs keep their engine core in the case's own process (vLLM's in-process client,
#: the same ``EngineCore.step_fn``: one vLLM import less per case, 8-10 s of start-up on the
#: 2-core machine). The async run keeps vLLM's separate engine-core process (it steps ahead of
#: the client), and a separate engine core under synchronous PP is what every ``vllm serve`` of
#: the e2e tier runs (tests/e2e/test_multi_node.py, test_reliability.py, test_quickstart.py).
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

#: ... and a PP=1 (TP=1) run there has its one worker in that process too (vLLM's
#: ``UniProcExecutor``): no worker process, so one vLLM import in all (PP=1 DSpark pair case:
#: 26-28 s -> 20-21 s wall, start-up 15-16 -> 9 s, the same tokens and counters; 2-core machine,
#: 2026-12-06). Used by the PP=1 references and controls; a case's ``llm`` settings.
IN_PROCESS_WORKER = {"distributed_executor_backend": "uni"}

#: the PP=3 run relays its aux taps as partial sums (VLLM_DSPARK_PP_TAP_PARTIALS=1; the other
#: PP runs keep the default raw taps), so CI's PP=3 parity checks cover both relays' sum
PP3_ENV = {"VLLM_DSPARK_PP_TAP_PARTIALS": "1"}
#: ... and the PP=2 async run sends them on the side channel (straight to the last stage, outside
#: the intermediate tensors: protocol/tap_partials.py), so CI covers all three ways under async
#: scheduling and the seeded wave too
PP2_ASYNC_ENV = {"VLLM_DSPARK_PP_TAP_PARTIALS": "side"}


@shared_case("pair_pp3_sync", cost_s=50)
def _pair_pp3_sync(request):
    t = _timeout(request)
    return lambda: run_pair(t, pp=3, spec=True, env={**PP3_ENV, **ONE_PROCESS})


@shared_case("pair_pp2_async", cost_s=45)
def _pair_pp2_async(request):
    t = _timeout(request)
    return lambda: run_pair(
        t, pp=2, spec=True, async_scheduling=True, extra_waves=[seeded_wave()], env=PP2_ASYNC_ENV
    )


@shared_case("pair_pp2_sync", cost_s=44)
def _pair_pp2_sync(request):
    t = _timeout(request)
    return lambda: run_pair(t, pp=2, spec=True, env=ONE_PROCESS, extra_waves=[seeded_wave()])


@shared_case("pair_pp1", cost_s=37)
def _pair_pp1(request):
    t = _timeout(request)
    return lambda: run_pair(
        t, pp=1, spec=True, env=ONE_PROCESS, extra=IN_PROCESS_WORKER, extra_waves=[seeded_wave()]
    )


@shared_case("pair_reference", cost_s=37)
def _pair_reference(request):
    t = _timeout(request)
    sampling = {**PAIR_SAMPLING, "logprobs": 2}
    return lambda: run_pair(
        t, pp=1, spec=False, env=ONE_PROCESS, extra=IN_PROCESS_WORKER, sampling=sampling
    )


@shared_case("random_pp2_unchunked", cost_s=27)
def _random_pp2_unchunked(request):
    tiny, t = request.getfixturevalue("tiny_models"), _timeout(request)
    return lambda: run_random(tiny, t, pp=2, spec=True, extra=UNCHUNKED, env=ONE_PROCESS)


@shared_case("random_pp1", cost_s=25)
def _random_pp1(request):
    tiny, t = request.getfixturevalue("tiny_models"), _timeout(request)
    return lambda: run_random(
        tiny, t, pp=1, spec=True, extra={**CHUNKED, **IN_PROCESS_WORKER}, env=ONE_PROCESS
    )


@shared_case("random_reference", cost_s=23)
def _random_reference(request):
    tiny, t = request.getfixturevalue("tiny_models"), _timeout(request)
    sampling = {"max_tokens": RANDOM_MAX_TOKENS, "logprobs": 2}
    return lambda: run_random(
        tiny,
        t,
        pp=1,
        spec=False,
        extra={**CHUNKED, **IN_PROCESS_WORKER},
        sampling=sampling,
        env=ONE_PROCESS,
    )


def _asked_for(session, name: str) -> bool:
    """Whether a test of this session that is not skipped asks for the run ``name`` (a test that
    asks for it only through request.getfixturevalue and is missing from :data:`ASKED_BY` just
    gets it later, on its own)."""
    asked_by = ASKED_BY.get(name)
    for item in session.items:
        if item.get_closest_marker("skip"):
            continue
        if name in getattr(item, "fixturenames", ()) or (
            asked_by is not None and item.nodeid.endswith(asked_by)
        ):
            return True
    return False


class SharedRuns:
    """The session's shared engine runs: each computed once. The first one asked for starts
    every shared run the session's tests ask for, two at a time (``support.e2e.run_together``),
    longest first."""

    def __init__(self) -> None:
        self.results: dict = {}

    def get(self, name: str, request) -> Result:
        if name not in self.results:
            order = sorted(CASES, key=lambda n: -CASES[n][0])
            wanted = [
                n
                for n in order
                if n not in self.results and (n == name or _asked_for(request.session, n))
            ]
            self.results.update(run_together({n: CASES[n][1](request) for n in wanted}))
        return result_of(self.results, name)


_SESSION_RUNS: list[SharedRuns] = []  # the session's SharedRuns, once a test asked for it


def has_run(name: str) -> bool:
    """Whether the shared run ``name`` has ended in this session (a launcher that must not start
    beside the shared runs asks: support/early_start.py)."""
    return any(name in runs.results for runs in _SESSION_RUNS)


@pytest.fixture(scope="session")
def shared_runs() -> SharedRuns:
    runs = SharedRuns()
    _SESSION_RUNS[:] = [runs]
    return runs


@pytest.fixture(scope="session")
def pair_reference(shared_runs, request):
    ref = shared_runs.get("pair_reference", request)
    # Every answer ran to its EOS inside the limit (the corpus' answers end with '#### n' + EOS).
    assert ref.finish_reasons == ["stop"] * PAIR_NUM_PROMPTS, ref.finish_reasons
    assert all(10 <= len(t) < PAIR_MAX_TOKENS for t in ref.tokens), [len(t) for t in ref.tokens]
    return ref


@pytest.fixture(scope="session")
def pair_pp1(shared_runs, request):
    return shared_runs.get("pair_pp1", request)


@pytest.fixture(scope="session")
def pair_pp2_sync(shared_runs, request):
    return shared_runs.get("pair_pp2_sync", request)


@pytest.fixture(scope="session")
def pair_pp3_sync(shared_runs, request):
    return shared_runs.get("pair_pp3_sync", request)


@pytest.fixture(scope="session")
def pair_pp2_async(shared_runs, request):
    return shared_runs.get("pair_pp2_async", request)


@pytest.fixture(scope="session")
def random_reference(shared_runs, request):
    """Random pair, PP=1, no speculation (top-2 logprobs to diagnose any mismatch)."""
    ref = shared_runs.get("random_reference", request)
    assert [len(t) for t in ref.tokens] == [RANDOM_MAX_TOKENS] * len(RANDOM_PROMPTS)
    # The tiny target must not be degenerate, or parity would prove little.
    assert all(len(set(t)) >= 6 for t in ref.tokens), ref.tokens
    return ref


@pytest.fixture(scope="session")
def random_pp1(shared_runs, request):
    return shared_runs.get("random_pp1", request)


@pytest.fixture(scope="session")
def random_pp2_unchunked(shared_runs, request):
    return shared_runs.get("random_pp2_unchunked", request)
