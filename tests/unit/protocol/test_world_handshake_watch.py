"""The start-up handshake and the peer watch cover every rank of a TP=2 x PP=2 world, not one PP
group (issue 40 items 3 and 5).

Four gloo processes build vLLM's real parallel state (``init_distributed_environment`` +
``ensure_model_parallel_initialized(2, 2)``: global rank g is TP rank g % 2, PP rank g // 2; the
PP groups are [0, 2] and [1, 3]) and call the runtime entries the model runner patch calls
(``run_pp_handshake``, ``start_pp_watch``). With one handshake per PP group, the group [0, 2]
would pass every scenario below that concerns rank 1 or 3 and never watch them.
"""

from __future__ import annotations

import pytest
from protocol_gloo_workers import WORLD_SCENARIOS, run_processes, world_worker

WORLD = 4
TIMEOUT = 8.0  # handshake timeout where no rank is silent (nobody waits it out)
SILENT_TIMEOUT = 2.0  # ... where a rank is silent: the others wait it (plus 5 s grace)
GRACE = 5.0
SLACK = 10.0  # shared CI machines: "fast" means no wait beyond the bound, never a hang
VICTIM = 1  # PP rank 0, TP rank 1: in the other PP group than ranks 0 and 2
WATCH_WAIT = 20.0  # how long a survivor waits for its watch to name the victim
LABEL = {
    0: "PP rank 0, TP rank 0, global rank 0",
    1: "PP rank 0, TP rank 1, global rank 1",
    2: "PP rank 1, TP rank 0, global rank 2",
    3: "PP rank 1, TP rank 1, global rank 3",
}


@pytest.fixture(scope="module")
def results():
    names = list(WORLD_SCENARIOS)
    res = run_processes(
        world_worker,
        WORLD,
        lambda r: (names, TIMEOUT, SILENT_TIMEOUT, VICTIM, WATCH_WAIT),
        timeout_s=240,
    )
    assert sorted(res) == list(range(WORLD)), res
    for r in res.values():
        assert "error" not in r, r["error"]
    return res


def _scenario(results, name):
    return {r: results[r]["scenarios"][name] for r in results}


@pytest.mark.timeout(300)
def test_all_agree_one_line_names_four_ranks_and_the_shape(results):
    got = _scenario(results, "agree")
    assert [got[r]["outcome"] for r in range(WORLD)] == ["ok"] * WORLD, got
    lines = [line for r in range(WORLD) for line in got[r]["lines"]]
    assert len(lines) == 1, lines  # one line for the whole deployment (the referee's)
    assert got[3]["lines"] == lines
    assert lines[0].startswith("PP handshake: 4 ranks agree (protocol "), lines
    assert "k=3" in lines[0] and lines[0].endswith(") over TP=2 x PP=2"), lines


@pytest.mark.timeout(300)
def test_one_rank_of_the_other_tp_column_with_another_k_fails_every_rank(results):
    got = _scenario(results, "k_one_rank_other_column")
    for r in range(WORLD):
        assert got[r]["outcome"] == "error" and got[r]["type"] == "HandshakeError", (r, got[r])
        msg = got[r]["message"]
        assert f"{LABEL[1]} has num_speculative_tokens=5 but {LABEL[3]} (last) has " in msg, msg
        assert "num_speculative_tokens=3" in msg and "TP=2 x PP=2" in msg, msg
        for other in (0, 2):
            assert f"{LABEL[other]} has" not in msg, msg
        assert got[r]["elapsed"] < TIMEOUT, "a mismatch must not wait for the timeout"
    assert len({got[r]["message"] for r in range(WORLD)}) == 1, "one message on every rank"


@pytest.mark.timeout(300)
def test_tp_columns_that_disagree_as_a_whole_fail_every_rank(results):
    """Ranks 1 and 3 (TP rank 1 of both stages) agree with each other on k=5, ranks 0 and 2 on
    k=3: each PP group alone agrees."""
    got = _scenario(results, "k_whole_other_column")
    for r in range(WORLD):
        assert got[r]["outcome"] == "error", (r, got[r])
        msg = got[r]["message"]
        for other in (0, 2):
            assert f"{LABEL[other]} has num_speculative_tokens=3 but {LABEL[3]} (last)" in msg
        assert f"{LABEL[1]} has" not in msg, msg


@pytest.mark.timeout(300)
def test_a_rank_that_never_joins_fails_every_other_rank_naming_it(results):
    got = _scenario(results, "silent_rank")
    assert got[2]["outcome"] == "silent"
    for r in (0, 1, 3):
        assert got[r]["outcome"] == "error", (r, got[r])
        msg = got[r]["message"]
        assert f"{LABEL[2]} sent no handshake within 2 s" in msg, msg
        assert "without vllm-dspark-pp" in msg, msg
        assert got[r]["elapsed"] < SILENT_TIMEOUT + SLACK, got[r]["elapsed"]


@pytest.mark.timeout(300)
def test_a_referee_that_never_joins_fails_every_other_rank_naming_it(results):
    got = _scenario(results, "silent_referee")
    for r in (0, 1, 2):
        assert got[r]["outcome"] == "error", (r, got[r])
        msg = got[r]["message"]
        assert f"{LABEL[3]} (last) sent no verdict" in msg, msg
        assert got[r]["elapsed"] < SILENT_TIMEOUT + GRACE + SLACK, got[r]["elapsed"]


@pytest.mark.timeout(300)
def test_every_rank_watches_every_other_rank(results):
    for r in range(WORLD):
        assert results[r]["watching"] == [p for p in range(WORLD) if p != r], results[r]


@pytest.mark.timeout(300)
def test_a_killed_tp_rank_is_named_by_every_other_rank_at_once(results):
    assert results[VICTIM]["watch"] == {"outcome": "victim"}
    for r in (0, 2, 3):
        w = results[r]["watch"]
        assert w["outcome"] == "lost", (r, w)
        assert w["peer"] == LABEL[VICTIM] and w["worker"] == "Worker_PP0_TP1", w
        assert w["message"].startswith(f"DSpark PP: lost {LABEL[VICTIM]} (127.0.0.1:"), w
        assert f"This worker ({LABEL[r]}) exits with status 70" in w["message"], w
        assert "lines of Worker_PP0_TP1, pid " in w["message"], w
        # The socket closes with the process: seen long before the 30 s silence limit.
        assert w["elapsed"] < 10.0, w
