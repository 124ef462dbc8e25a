"""Draft tokens under synchronous scheduling with a PP batch queue: apply them only when settled.

With synchronous scheduling the engine core learns a request's new drafts by asking the workers
(``take_draft_token_ids``) and copies them into ``Request.spec_token_ids``; the next
``schedule()`` then verifies them. That is only correct once the batch that produced the drafts
has been folded back into the scheduler (``update_from_output`` appended its sampled token): the
drafts continue *after* that token. With pipeline parallelism the engine core keeps up to
``pp_size`` batches in flight (``EngineCore.batch_queue``), and vLLM 0.34.0 fetches and applies
drafts right after *scheduling* a batch, so a request still in flight gets drafts while its
sampled token is missing. The scheduler then schedules the drafts alone (``num_computed_tokens``
already covers the prompt, the sampled token is not there yet), and the model runner's
``prepare_inputs`` rejects the batch (``num_scheduled_tokens < num_logits``, i.e. k drafts
without the bonus position).

The rule implemented here, for every speculative method (and diffusion drafts), only when a
batch queue is used with synchronous scheduling:

* never fetch drafts after merely scheduling a batch (``post_step`` does nothing), and
* each time the engine core has processed a batch's output, fetch the workers' latest drafts and
  apply them to the requests that are **not** in any batch still in flight.

The workers keep the latest drafts per live request (``DraftTokensHandler._draft_tokens_by_req``),
so drafts skipped because their request was in flight are fetched again after that request's
batch is processed; applying the same drafts twice is idempotent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.dspark_pp.sync_drafts")


def defers_draft_application(core: Any) -> bool:
    """True for an engine core that must apply drafts only after a batch's output is processed."""
    return (
        getattr(core, "batch_queue", None) is not None
        and bool(getattr(core, "check_for_draft_tokens", False))
        and not getattr(core, "async_scheduling", False)
    )


def in_flight_request_ids(batch_queue: Iterable[tuple[Any, Any, Any]]) -> set[str]:
    """Request ids with tokens scheduled in a batch whose output was not processed yet."""
    ids: set[str] = set()
    for _future, scheduler_output, _exec_future in batch_queue:
        ids.update(r for r, n in scheduler_output.num_scheduled_tokens.items() if n > 0)
    return ids


def settled_drafts(draft_token_ids: Any, in_flight: set[str]) -> Any:
    """``draft_token_ids`` without the requests in ``in_flight`` (same DraftTokenIds type)."""
    keep = [
        (r, d)
        for r, d in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True)
        if r not in in_flight
    ]
    return type(draft_token_ids)([r for r, _ in keep], [d for _, d in keep])


def apply_settled_drafts(core: Any) -> int:
    """Fetch the workers' drafts and hand the settled ones to the scheduler; returns how many."""
    drafts = core.model_executor.take_draft_token_ids()
    if drafts is None:
        return 0
    drafts = settled_drafts(drafts, in_flight_request_ids(core.batch_queue))
    if drafts.req_ids:
        core.scheduler.update_draft_token_ids(drafts)
    return len(drafts.req_ids)
