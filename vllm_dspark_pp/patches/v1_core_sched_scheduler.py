"""The DSpark scheduler schedules only drafts that a drafter proposed.

WHAT: Wraps ``Scheduler.__init__`` (so ``AsyncScheduler`` too), two cases:

1. On a DSpark prefill-only producer (``roles.is_dspark_prefill_only``) the speculative token
   count is set to 0 and dynamic speculative decoding is switched off: every ``SchedulerOutput``
   carries ``num_spec_tokens_to_schedule == 0``, no request gets draft placeholders and no decode
   step verifies drafts. The KV-cache layout (draft KV groups included) is untouched.
2. On every other DSpark engine with drafts, the scheduler gets a per-batch-size draft schedule
   that gives every batch size the configured ``k`` (:class:`SameDraftCountForEveryBatch`).
   ``num_spec_tokens_to_schedule`` stays ``k``; what changes is that a request resumed with one
   token left to compute (a PD decoder after a remote KV load, a full prefix-cache hit) is
   scheduled as that one token instead of being padded with ``k`` placeholder drafts.

WHY: (1) The producer's drafter is context-KV-only and proposes nothing, yet vLLM 0.34.0's async
scheduler gives every decoding request ``num_speculative_tokens`` placeholder drafts
(``vllm/v1/core/sched/async_scheduler.py:22-41``); the runner fills them from a draft buffer a
zero-draft propose leaves at ``-1`` (``vllm/v1/worker/gpu/model_runner.py:2388-2390``) and the
target embeds token id ``-1`` (``IndexError`` on CPU, a device-side assert on CUDA).
(2) ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py:1357-1377``) pads a newly admitted
request with one token left to ``1 + k`` tokens with ``k`` placeholder drafts, to keep the step a
uniform decode batch for full CUDA graphs, unless ``dynamic_sd_lookup`` is set. No drafter ever
proposed those drafts (the request's first token is sampled in that very step), so they are
always rejected, yet verified and counted: a MooncakeConnector decoder (which always resumes
with one token left, ``scheduler.py:3662-3665``) made one extra, never-accepted draft of ``k``
tokens per request, and reported 72% acceptance where the aggregated engine had 90% with the
same accepted tokens (issue 13). Dropping the padding costs that one step its full-graph
uniformity (it runs as a mixed batch, like the prefill step of an aggregated engine); the
drafts it removes were never useful.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP) for (1); none yet for (2).

RETIRE WHEN: (1) upstream's scheduler knows that a DSpark prefill-only producer has no drafter;
(2) upstream pads resumed requests only when a drafter proposed drafts for them.

TESTED BY: tests/unit/producer/test_runner_patches.py (both cases; case 2 on vLLM's own Scheduler),
tests/e2e/producer/test_producer_decodes_cpu.py (1),
tests/e2e/producer/test_pd_producer_cpu.py (2: the decoder's drafts, accepted tokens and
per-position counts equal the aggregated engine's, sync and async),
tests/gpu/test_pd_mooncake_gpu.py (2, on the GPU).
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.core.sched.scheduler"


class SameDraftCountForEveryBatch:
    """A per-batch-size draft schedule (what ``Scheduler.dynamic_sd_lookup`` holds, indexed by the
    number of scheduled requests) that answers the static ``k`` for every batch size."""

    def __init__(self, num_spec_tokens: int):
        self.num_spec_tokens = num_spec_tokens

    def __getitem__(self, num_scheduled_requests: int) -> int:
        return self.num_spec_tokens

    def __repr__(self) -> str:
        return f"SameDraftCountForEveryBatch({self.num_spec_tokens})"


def producer_schedules_no_drafts(scheduler, vllm_config) -> bool:
    """Zero the draft count of ``scheduler`` when ``vllm_config`` is a DSpark prefill-only
    producer; return whether it did."""
    from vllm_dspark_pp.producer.roles import prefill_only_role

    if not prefill_only_role(vllm_config):
        return False
    scheduler.num_spec_tokens = 0
    scheduler.dynamic_sd_lookup = None
    return True


def schedules_no_placeholder_drafts(scheduler, vllm_config) -> bool:
    """Give a drafting DSpark ``scheduler`` the constant draft schedule (case 2 of the module
    docstring); return whether it did. A user's own dynamic schedule is left alone."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dspark" or scheduler.num_spec_tokens <= 0:
        return False
    if scheduler.dynamic_sd_lookup is not None:
        return False
    scheduler.dynamic_sd_lookup = SameDraftCountForEveryBatch(scheduler.num_spec_tokens)
    return True


def _patch(module) -> None:
    from vllm.logger import init_logger

    logger = init_logger("vllm.dspark_pp.scheduler")

    def make_init(orig):
        def __init__(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            if producer_schedules_no_drafts(self, vllm_config):
                logger.info(
                    "DSpark prefill-only producer: the scheduler schedules no draft tokens "
                    "(the context-KV-only drafter writes context KV and proposes nothing)."
                )
            elif schedules_no_placeholder_drafts(self, vllm_config):
                logger.info(
                    "DSpark: requests resumed with one token left are not padded with "
                    "placeholder drafts (%d per step otherwise).",
                    self.num_spec_tokens,
                )

        return __init__

    wrap(module.Scheduler, "__init__", make_init)


def apply() -> None:
    when_imported(TARGET, _patch)
