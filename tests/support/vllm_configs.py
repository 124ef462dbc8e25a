"""Session fixtures of the in-process CPU unit tests that build real vLLM objects (the producer
and connector tests): the plugin registered, the random-weight tiny pair, a ``VllmConfig`` built
through ``EngineArgs`` and a one-process gloo world. Loaded from tests/conftest.py's
``pytest_plugins`` so that both directories share one instance of each (the gloo world can be
initialised once per process); importing this module imports no vLLM."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(scope="session")
def plugin():
    import vllm_dspark_pp

    vllm_dspark_pp.register()
    return vllm_dspark_pp


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny-producer"))


@pytest.fixture(scope="session")
def make_vllm_config(plugin, tiny_pair):
    """Build a real VllmConfig for the tiny pair through EngineArgs (no engine started)."""

    def make(kv_transfer_config=None, pp: int = 1, **kwargs):
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(
            model=tiny_pair.target,
            speculative_config={"method": "dspark", "model": tiny_pair.draft},
            kv_transfer_config=kv_transfer_config,
            pipeline_parallel_size=pp,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            enforce_eager=True,
            distributed_executor_backend="mp",
            **kwargs,
        )
        return args.create_engine_config()

    return make


@pytest.fixture(scope="session")
def dist_env(make_vllm_config):
    """A one-process gloo 'distributed' world with TP=PP=1, as vLLM layers need."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    cfg = make_vllm_config()
    path = tempfile.mktemp(prefix="dspark-pp-dist-")
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{path}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    return cfg


def build_model(cfg, cls):
    """``cls`` instantiated on CPU as vLLM would, with ``cfg`` as the current config and a layer
    registry of its own (a copy of ``cfg`` whose ``static_forward_context`` starts empty, so
    several models can be built from one config). Returns ``(model, the config it was built
    with)``."""
    import copy

    import torch
    from vllm.config import set_current_vllm_config

    c = copy.copy(cfg)
    c.compilation_config = copy.copy(cfg.compilation_config)
    c.compilation_config.static_forward_context = {}
    with set_current_vllm_config(c), torch.device("cpu"):
        model = cls(vllm_config=c, prefix="")
    return model, c
