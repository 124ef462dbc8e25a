"""How a control deployment's start is read: the stock-vLLM control of tests/gpu/test_dsv41_pp.py.

vLLM 0.34.0 without the plugin, asked for DSpark on a DeepSeek-V4.1 target split over PP > 1, must
refuse at start: its last stage loads the model, vLLM's aux-hidden-state check finds no
``supports_aux_hidden_states_over_pp`` on the V4.1 decoder and raises ``DeepseekV41ForCausalLM
does not support dspark with pipeline parallelism`` (vllm/v1/worker/gpu/spec_decode/eagle/
eagle3_utils.py, ``verify_supports_aux_hidden_states_over_pp``; shown on CPU by
tests/unit/producer/test_dsv41_pp_relay.py). The GPU control passes only when the deployment did
not serve, a launcher exited, and a log names that refusal: a start that failed for another reason
(a missing kernel, an out-of-memory) is no evidence that stock vLLM refuses, and a deployment that
served means the premise of the plugin's patch is gone.
"""

from __future__ import annotations

#: vLLM 0.34.0's refusal (the start of the message is the model's class name)
STOCK_PP_REFUSAL = "does not support dspark with pipeline parallelism"

REFUSED = "REFUSED"
SERVED = "SERVED"
FAILED = "FAILED OTHERWISE"
UNDETERMINED = "UNDETERMINED"
#: log lines kept as the evidence of a start that failed without the refusal
ERROR_MARKS = ("Error", "error:", "Traceback", "RuntimeError", "Exception")


def read_start(
    *,
    ready: bool,
    exited: list[str],
    logs: list[str],
    message: str = STOCK_PP_REFUSAL,
    keep: int = 6,
) -> dict:
    """The outcome of a control deployment's start, from what the caller saw before stopping it:
    ``ready`` (node 0 answered ``/health``), ``exited`` (the launchers that had exited, e.g.
    ``Deployment.dead_nodes()``) and every launcher's log (launcher ``i`` is ``logs[i]``).

    Returns ``{"outcome", "line", "evidence"}``: ``SERVED`` when it answered (whatever its logs
    say); ``REFUSED`` when a launcher exited and a log holds ``message``, ``line`` the first such
    line (``node<i>: ...``); ``FAILED OTHERWISE`` when a launcher exited and no log holds it,
    ``evidence`` the last error-looking lines; ``UNDETERMINED`` when it neither answered nor lost
    a launcher (the deadline passed first)."""
    hits = [
        f"node{i}: {line.strip()[:400]}"
        for i, log in enumerate(logs)
        for line in log.splitlines()
        if message in line
    ]
    errors = [
        f"node{i}: {line.strip()[:300]}"
        for i, log in enumerate(logs)
        for line in log.splitlines()
        if any(m in line for m in ERROR_MARKS)
    ]
    if ready:
        outcome = SERVED
    elif not exited:
        outcome = UNDETERMINED
    elif hits:
        outcome = REFUSED
    else:
        outcome = FAILED
    return {
        "outcome": outcome,
        "line": hits[0] if hits else None,
        "exited": list(exited),
        "evidence": hits[:keep] if hits else errors[-keep:],
    }
