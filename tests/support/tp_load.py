"""Build a bundled tiny target (or its drafter) with vLLM's own classes at TP x PP on CPU, one gloo
process per rank, and load its checkpoint with vLLM's own loader and start-up check
(``DefaultModelLoader.load_weights`` with ``track_weights_loading``).

Each rank runs in a world made by vLLM's ``init_distributed_environment`` +
``ensure_model_parallel_initialized`` (gloo, a file rendezvous), builds the family's model with
its :class:`Family` hooks and writes ``<out>/rank<i>.json``:

* ``build_error``: None, or how the construction stopped (``vllm_stack``: the traceback's frames
  in vLLM's package, ``vllm/<path>:<line>``, outermost first); nothing else is recorded then;
* ``full``: vLLM's verdict on the whole checkpoint (None: passed; else the sorted names it says
  were not initialised);
* ``unfilled``: the parameters and persistent buffers the model registers that no checkpoint
  tensor filled (what ``load_weights`` reports loaded), less the family's shared names: vLLM's
  check exempts the parameters of modules whose quant method post-processes weights (every
  unquantized linear, embedding and head), this comparison exempts none;
* ``drops``: ``{substring: {"full": ..., "unfilled": ...}}``, the same load without the
  checkpoint tensors whose names hold ``substring`` (the controls: a tensor really missing is
  refused by vLLM's check, or at least seen unfilled where vLLM's check exempts it);
* whatever the family's ``extra`` hook adds (the Kimi-K3 KDA checks, tests/support/k3_tp_load.py).

Families name their hooks as ``"module:function"`` strings (the spawned ranks import them).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    """How a rank builds one model of a tiny pair.

    ``config``: ``(tp, pp, *config_args) -> VllmConfig``; ``build``: ``(cfg) -> nn.Module``,
    called inside ``set_current_vllm_config(cfg)`` and ``torch.device("cpu")`` after the world
    is up;
    ``model_config``: ``(cfg) -> ModelConfig`` the loader reads (default: the target's);
    ``extra``: ``(model, cfg, record, tp) -> None``, run after the checks of this module;
    ``shared``: names the model registers that another model fills (a drafter's embedding and
    head are the target's); ``env``: environment set in each rank before vLLM is imported;
    ``drops``: the substrings of the ``drops`` records (module docstring)."""

    name: str
    config: str
    build: str
    model_config: str | None = None
    extra: str | None = None
    shared: frozenset[str] = frozenset()
    env: tuple[tuple[str, str], ...] = ()
    drops: tuple[str, ...] = ()
    config_args: tuple[str, ...] = ()


def run(
    family: Family, world: int, tp: int, pp: int, out: Path, timeout_s: float = 240.0
) -> dict[int, dict]:
    """Spawn the ``world`` ranks, wait for them (killing any left after ``timeout_s``) and return
    each rank's record."""
    import torch.multiprocessing as tmp

    init = f"file://{out / 'dist-init'}"
    ctx = tmp.start_processes(
        _rank, args=(family, world, tp, pp, init, str(out)), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{family.name}: TP={tp} x PP={pp} load not done after {timeout_s:.0f} s"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def resolve(ref: str):
    """The object ``"module:attribute"`` names."""
    import importlib

    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _rank(rank: int, family: Family, world: int, tp: int, pp: int, init: str, out: str) -> None:
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    # distinct per rank: vLLM's CPU communicator keeps plain torch.distributed (no shm segments)
    os.environ["VLLM_DIST_IDENT"] = f"tp-load-{os.getpid()}"
    os.environ.update(dict(family.env))
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_pp_group,
        get_tensor_model_parallel_rank,
        init_distributed_environment,
    )

    torch.set_num_threads(1)
    cfg = resolve(family.config)(tp, pp, *family.config_args)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world, rank, init, rank, "gloo")
        ensure_model_parallel_initialized(tp, pp)
    record: dict = {
        "rank": rank,
        "tp_rank": get_tensor_model_parallel_rank(),
        "pp_rank": get_pp_group().rank_in_group,
        "build_error": None,
    }
    try:
        with set_current_vllm_config(cfg), torch.device("cpu"):
            model = resolve(family.build)(cfg)
    except Exception as e:
        record["build_error"] = {
            "type": type(e).__name__,
            "message": str(e),
            "vllm_stack": vllm_frames(e),
        }
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
        return
    model_config = resolve(family.model_config)(cfg) if family.model_config else cfg.model_config
    with set_current_vllm_config(cfg), torch.no_grad():
        loaded: set[str] = set()
        record["full"] = verdict(model, model_config, loaded=loaded)
        record["unfilled"] = sorted(registered(model) - loaded - family.shared)
        record["drops"] = {}
        for d in family.drops:
            got: set[str] = set()
            record["drops"][d] = {
                "full": verdict(model, model_config, drop=d, loaded=got),
                "unfilled": sorted(registered(model) - got - family.shared),
            }
        if family.extra:
            resolve(family.extra)(model, cfg, record, tp)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))


def vllm_frames(e: BaseException) -> list[str]:
    """``vllm/<path>:<line>`` of each traceback frame in vLLM's package, outermost first."""
    out = []
    for fr in traceback.extract_tb(e.__traceback__):
        _, sep, tail = fr.filename.rpartition("/site-packages/")
        if sep and tail.startswith("vllm/"):
            out.append(f"{tail}:{fr.lineno}")
    return out


def verdict(
    model, model_config, drop: str | None = None, loaded: set[str] | None = None
) -> list[str] | None:
    """vLLM's loader on the checkpoint (without the tensors whose names hold ``drop``): None when
    its check passes, else the sorted names it says were not initialised. ``loaded`` collects
    the names the model's ``load_weights`` reports filled."""
    import ast

    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    real = type(model).load_weights

    def filtered(weights):
        done = real(model, ((n, w) for n, w in weights if drop is None or drop not in n))
        if loaded is not None and done:
            loaded.update(done)
        return done

    model.load_weights = filtered
    try:
        DefaultModelLoader(LoadConfig(load_format="safetensors")).load_weights(model, model_config)
    except ValueError as e:
        head = "Following weights were not initialized from checkpoint: "
        if not str(e).startswith(head):
            raise
        return sorted(ast.literal_eval(str(e)[len(head) :]))
    finally:
        del model.load_weights
    return None


def registered(model) -> set[str]:
    """The names of the model's parameters and persistent buffers, each tensor once."""
    names = {n for n, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        for b, t in module.named_buffers(recurse=False):
            if t is not None and b not in module._non_persistent_buffers_set:
                names.add(f"{prefix}.{b}" if prefix else b)
    return names
