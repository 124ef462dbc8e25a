"""Load the draft family's context-KV-only class (producer/families.py names it) through vLLM's
DSpark loading path.

The build is logged (one ``Built the context-KV-only DSpark drafter: {json}`` line per worker
that builds one: class, KV-cache layers, parameter names and bytes, ``held_bytes``: the
distinct storages holding its weights, derived ones included, and ``place``: the worker's global
rank, PP rank and TP rank, so that a TP x PP producer's logs say which ranks built one); tests read
that line from the log instead of a report file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm_dspark_pp.producer.drafter import held_weight_bytes, is_context_kv_only
from vllm_dspark_pp.producer.families import context_kv_class_for

if TYPE_CHECKING:
    from torch import nn
    from vllm.config import VllmConfig

logger = init_logger("vllm.dspark_pp.producer.load")

#: The log line of a context-KV-only build (followed by ``: {json}``).
BUILT_LINE = "Built the context-KV-only DSpark drafter"


# --------------------------------------------------------------------------- loading
@contextlib.contextmanager
def _initialize_as(model_class: type) -> Iterator[None]:
    """Make vLLM's model loader instantiate ``model_class`` for the next model it creates."""
    import functools

    from vllm.model_executor.model_loader import base_loader

    original = base_loader.initialize_model
    base_loader.initialize_model = functools.partial(original, model_class=model_class)
    try:
        yield
    finally:
        base_loader.initialize_model = original


def _drop_shared_modules(model: nn.Module) -> None:
    """vLLM's DSpark loader aliases the target's embedding/LM head onto the drafter; the
    context-only drafter does not use them, so drop the references."""
    for owner, attr in ((model, "lm_head"), (getattr(model, "model", None), "embed_tokens")):
        if owner is not None and attr in owner._modules:
            del owner._modules[attr]


def worker_place() -> dict[str, int] | None:
    """This worker's global rank, PP rank and size, TP rank and size (vLLM's model-parallel
    groups), or None before they exist."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    pp, tp = ps.get_pp_group(), ps.get_tp_group()
    return {
        "rank": tp.rank,
        "pp_rank": pp.rank_in_group,
        "pp_size": pp.world_size,
        "tp_rank": tp.rank_in_group,
        "tp_size": tp.world_size,
    }


def load_context_kv_model(target_model: nn.Module, vllm_config: VllmConfig) -> nn.Module:
    """Build and load the context-KV-only drafter through vLLM's own DSpark loading path
    (``dspark/utils.py::load_dspark_model``: draft-local PP=1 config, attention backend,
    KV-cache dtype and load config), with the context-only class instantiated."""
    from vllm.v1.worker.gpu.spec_decode.dspark import utils as dspark_utils

    spec = vllm_config.speculative_config
    assert spec is not None
    cls = context_kv_class_for(spec)
    with _initialize_as(cls):
        model = dspark_utils.load_dspark_model(target_model, vllm_config)
    if not is_context_kv_only(model):
        raise RuntimeError(f"expected a context-KV-only drafter, vLLM built {type(model)}")
    _drop_shared_modules(model)
    build = {
        "class": type(model).__name__,
        "layers": model.get_draft_kv_cache_layer_names(),  # type: ignore[operator]
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "held_bytes": held_weight_bytes(model),
        "params": sorted(n for n, _ in model.named_parameters()),
        "place": worker_place(),
    }
    logger.info("%s: %s", BUILT_LINE, json.dumps(build))
    return model


def builds_in_log(log_text: str) -> list[dict]:
    """Every context-KV-only build a log reports (for tests and operators)."""
    out = []
    for line in log_text.splitlines():
        i = line.find(BUILT_LINE + ": {")
        if i >= 0:
            out.append(json.loads(line[i + len(BUILT_LINE) + 2 :]))
    return out
