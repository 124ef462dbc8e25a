"""The README's first command, as a test: ``python -m dspark_dev demo`` (what tools/quickstart.sh
runs after set-up) serves the trained pair with DSpark on a PP=2 target through ``vllm serve`` on
the CPU platform, asks one held-out question through ``/v1/completions`` and stops the server.

Checks: the answer equals the PP=1 no-speculation answer token for token (the session's
``pair_reference``, whose first prompt is the same held-out question), the mean acceptance length
read from ``/metrics`` is at least 6, the server stopped on SIGTERM and nothing of its process
group still runs. Measured on the 2-core machine: ready in about 20 s, 25 s from start to stop.
"""

from __future__ import annotations

import pytest
from support import tiny_pair

from dspark_dev import serve_demo

pytestmark = pytest.mark.e2e


def test_quickstart_serves_pp2_dspark_and_answers_losslessly(pair_reference, tmp_path):
    r = serve_demo.run_demo(
        tiny_pair.PAIR_DIR, pp=2, question_index=0, log_path=tmp_path / "serve.log"
    )
    print(serve_demo.format_result(r))
    # The server tokenized the same prompt as the reference (held-out problem 0, no BOS) ...
    assert r["prompt_token_ids"] == tiny_pair.heldout_prompts(1)[0]
    # ... and answered with exactly the PP=1 no-speculation tokens, to EOS.
    assert r["finish_reason"] == "stop" and pair_reference.finish_reasons[0] == "stop"
    assert r["token_ids"] == pair_reference.tokens[0], (
        f"PP=2 DSpark answer differs from PP=1 no-spec:\n  got {r['token_ids']}\n"
        f"  ref {pair_reference.tokens[0]}"
    )
    m = r["metrics"]
    k = tiny_pair.num_speculative_tokens()
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == k * m["num_drafts"], m
    assert (
        len(m["accepted_per_pos"]) == k and sum(m["accepted_per_pos"]) == m["num_accepted_tokens"]
    )
    assert r["mean_acceptance_length"] >= 6.0, m
    assert r["stopped_cleanly"], "the server needed SIGKILL after the SIGTERM grace period"
    assert r["leftover_pids"] == [], r["leftover_pids"]
