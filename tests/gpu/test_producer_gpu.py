"""One-GPU tests of the DSpark prefill-only producer (marker ``gpu``; self-contained).

Run on the GPU machine:  pytest -m gpu tests/gpu/test_producer_gpu.py -v

1. ``test_materialize_context_kv_writes_full_drafter_kv``: a producer engine with the context-KV-
   only drafter (kv_role=kv_producer) and a reference engine with vLLM's full drafter (kv_both)
   run the same prompts with the test file connector of tests/e2e/producer (ExampleConnector +
   draft layers); every saved layer's KV, target and draft, must be bitwise equal. This compares
   the cache contents written by ``materialize_context_kv`` (CUDA kernels: rms_norm, rotary,
   ``do_kv_cache_update`` of the GPU attention backend) with the full drafter's path. The
   producer's build log line must report ``held_bytes`` equal to plan's context-only rule (the
   drafter holds no fused K/V copy; tests/gpu/test_producer_memory_gpu.py measures it with the
   allocator at the Qwen3-8B shape).
2. ``test_producer_decodes_like_a_plain_engine``: the same producer asked for 16 tokens per
   request (async scheduling, eager like its reference) decodes exactly like the non-speculative
   engine and
   schedules no draft (the CUDA form of tests/e2e/producer/test_producer_decodes_cpu.py; before
   the fix the draft slots fed token id -1 to the target and CUDA asserted).

PD over MooncakeConnector on one GPU (producer with the context-only drafter + decoder) is
tests/gpu/test_pd_mooncake_gpu.py.

Each engine runs in its own subprocess with a hard timeout (no hang can outlive the test).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.gpu import run_llm

from vllm_dspark_pp.producer import memory
from vllm_dspark_pp.producer.load import builds_in_log

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONNECTOR_DIR = REPO / "tests" / "e2e" / "producer"
TIMEOUT_S = float(os.environ.get("DSPARK_PRODUCER_GPU_TIMEOUT_S", "420"))  # per engine

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat near "
    "the door of an old house by the river where boats pass slowly in the morning light and "
    "birds sing"
).split()
PROMPTS = [" ".join((WORDS * 8)[i : i + 70 + 9 * i]) for i in range(3)]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")


def _run(tmp: Path, name: str, llm: dict, max_tokens: int, env: dict | None = None) -> dict:
    """One engine through the shared runner (own process group, hard deadline)."""
    # Prepend, never replace: on the GPU machine vLLM itself is on PYTHONPATH (/tmp/site); the
    # H200 suite run of 2026-12-03 failed both tests with "No module named 'vllm'" in the child.
    path = [str(CONNECTOR_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**(env or {}), "PYTHONPATH": os.pathsep.join(path)}
    res = run_llm(
        name,
        {"disable_log_stats": False, **llm},
        [PROMPTS],
        timeout_s=TIMEOUT_S,
        sampling={"max_tokens": max_tokens, "ignore_eos": True},
        env=env,
    )
    return {"tokens": res.tokens, "metrics": res.metrics(), "log": res.log_text}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("tiny-gpu"), dtype="bfloat16")


def _kv(role: str, store: Path) -> dict:
    return {
        "kv_connector": "DSparkDraftKVFileConnector",
        "kv_connector_module_path": "dspark_pp_draft_kv_connector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


@needs_cuda
def test_materialize_context_kv_writes_full_drafter_kv(tiny, tmp_path):
    import safetensors.torch as st
    import torch

    base = {
        "model": tiny.target,
        "speculative_config": {"method": "dspark", "model": tiny.draft},
        "dtype": "bfloat16",
        "max_model_len": 512,
        "gpu_memory_utilization": 0.3,
        "enforce_eager": True,
        "seed": 0,
    }
    stores, builds = {}, {}
    for role in ("kv_both", "kv_producer"):
        store = tmp_path / role
        store.mkdir()
        stores[role] = store
        out = _run(tmp_path, role, dict(base, kv_transfer_config=_kv(role, store)), 1)
        builds[role] = builds_in_log(out["log"])
    assert builds["kv_both"] == [] and len(builds["kv_producer"]) == 1, builds
    # the producer's drafter holds each weight once (no fused K/V copy): plan's rule, exactly
    rule = memory.draft_load_bytes(
        json.loads(Path(tiny.draft, "config.json").read_text()), 2, True, True
    )
    assert builds["kv_producer"][0]["held_bytes"] == rule["context_only"], (builds, rule)

    def load(store):
        return {
            (d.name, f.name): st.load_file(str(f))["kv_cache"]
            for d in store.iterdir()
            for f in d.iterdir()
        }

    ref, ctx = load(stores["kv_both"]), load(stores["kv_producer"])
    assert ref and set(ref) == set(ctx)
    draft_files = [k for k in ref if k[1].startswith("model.layers.6.")]
    assert len(draft_files) == len(PROMPTS)
    for k in ref:
        assert ref[k].float().abs().sum() > 0, k
        assert torch.equal(ref[k], ctx[k]), f"cache contents differ for {k}"


@needs_cuda
def test_producer_decodes_like_a_plain_engine(tiny, tmp_path):
    common = {
        "model": tiny.target,
        "dtype": "bfloat16",
        "max_model_len": 512,
        "gpu_memory_utilization": 0.3,
        "seed": 0,
        "enforce_eager": True,
    }
    plain = _run(tmp_path, "plain", common, 16)
    store = tmp_path / "store"
    store.mkdir()
    prod = _run(
        tmp_path,
        "producer_decoding",
        dict(
            common,
            speculative_config={"method": "dspark", "model": tiny.draft},
            kv_transfer_config=_kv("kv_producer", store),
            async_scheduling=True,
        ),
        16,
    )
    print("plain:", plain["tokens"], "\nproducer:", prod["tokens"], "\nmetrics:", prod["metrics"])
    assert all(len(t) == 16 for t in prod["tokens"])
    assert prod["tokens"] == plain["tokens"]
    assert prod["metrics"]["num_draft_tokens"] == 0, prod["metrics"]
