"""One-GPU tests of the DSpark prefill-only producer (marker ``gpu``; self-contained).

Run on the GPU machine:  pytest -m gpu tests/gpu/test_producer_gpu.py -v

1. ``test_materialize_context_kv_writes_full_drafter_kv``: a producer engine with the context-KV-
   only drafter (kv_role=kv_producer) and a reference engine with vLLM's full drafter (kv_both)
   run the same prompts with the test file connector of tests/e2e/producer (ExampleConnector +
   draft layers); every saved layer's KV, target and draft, must be bitwise equal. This compares
   the cache contents written by ``materialize_context_kv`` (CUDA kernels: rms_norm, rotary,
   ``do_kv_cache_update`` of the GPU attention backend) with the full drafter's path.
2. ``test_mooncake_producer_decoder_one_gpu``: producer (kv_producer, context-only draft) and
   decoder (kv_consumer, full draft) on one GPU over MooncakeConnector (TCP) vs an aggregated
   run: identical greedy tokens and acceptance. NEEDS the one-GPU PD harness (lead / GPU-tier
   helper): both engines up at once on one GPU (gpu_memory_utilization ~0.3 each), a proxy that
   sends each prompt to the producer with max_tokens=1 and kv_transfer_params
   ``{"do_remote_decode": true}``, then to the decoder with the returned kv_transfer_params, and
   the Mooncake transfer engine installed (``mooncake`` Python package). It is skipped with that
   reason until ``tests/gpu/pd_harness.py`` exists.

Each engine runs in its own subprocess with a hard timeout (no hang can outlive the test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONNECTOR_DIR = REPO / "tests" / "e2e" / "producer"
TIMEOUT_S = 420

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat near "
    "the door of an old house by the river where boats pass slowly in the morning light and "
    "birds sing"
).split()
PROMPTS = [" ".join((WORDS * 8)[i : i + 70 + 9 * i]) for i in range(3)]

_CHILD = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(**{"disable_log_stats": False, **spec["llm"]})
    outs = llm.generate(spec["prompts"], SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"],
                                                         ignore_eos=True))
    m = {}
    for x in llm.get_metrics():
        if x.name.startswith("vllm:spec_decode_num_") and hasattr(x, "value"):
            m[x.name] = m.get(x.name, 0) + int(x.value)
    json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "metrics": m},
              open(sys.argv[2], "w"))
    import os; os._exit(0)
    """
)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")


def _run(tmp: Path, name: str, llm: dict, max_tokens: int, env: dict | None = None) -> dict:
    spec, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec.write_text(json.dumps({"llm": llm, "prompts": PROMPTS, "max_tokens": max_tokens}))
    child = tmp / "child.py"
    child.write_text(_CHILD)
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(CONNECTOR_DIR), e.get("PYTHONPATH", "")])
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, str(child), str(spec), str(out)], env=e,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not out.exists():
        pytest.fail(f"{name} failed or hung; log tail:\n{log.read_text(errors='replace')[-5000:]}")
    return json.loads(out.read_text())


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
    report = tmp_path / "builds.jsonl"
    env = {"VLLM_DSPARK_PP_CONTEXT_KV_REPORT": str(report)}
    stores = {}
    for role in ("kv_both", "kv_producer"):
        store = tmp_path / role
        store.mkdir()
        stores[role] = store
        _run(tmp_path, role, dict(base, kv_transfer_config=_kv(role, store)), 1, env)
    builds = [json.loads(x) for x in report.read_text().splitlines()]
    assert len(builds) == 1 and builds[0]["attached_prefill_only"] is True, builds

    def load(store):
        return {(d.name, f.name): st.load_file(str(f))["kv_cache"]
                for d in store.iterdir() for f in d.iterdir()}

    ref, ctx = load(stores["kv_both"]), load(stores["kv_producer"])
    assert ref and set(ref) == set(ctx)
    draft_files = [k for k in ref if k[1].startswith("model.layers.6.")]
    assert len(draft_files) == len(PROMPTS)
    for k in ref:
        assert ref[k].float().abs().sum() > 0, k
        assert torch.equal(ref[k], ctx[k]), f"cache contents differ for {k}"


@needs_cuda
def test_mooncake_producer_decoder_one_gpu(tiny, tmp_path):
    pd = pytest.importorskip(
        "tests.gpu.pd_harness",
        reason="needs the one-GPU PD harness (tests/gpu/pd_harness.py, lead/GPU-tier helper)",
    )
    pytest.importorskip("mooncake", reason="needs the Mooncake transfer engine")
    base = {
        "model": tiny.target,
        "speculative_config": {"method": "dspark", "model": tiny.draft},
        "dtype": "bfloat16",
        "max_model_len": 512,
        "seed": 0,
    }
    agg = _run(tmp_path, "agg", dict(base, gpu_memory_utilization=0.3), 32)
    mooncake = {"kv_connector": "MooncakeConnector",
                "kv_connector_extra_config": {"protocol": "tcp"}}
    res = pd.run_pd(  # expected API of the harness: (producer_cfg, decoder_cfg, prompts, max_tokens)
        dict(base, kv_transfer_config=dict(mooncake, kv_role="kv_producer")),
        dict(base, kv_transfer_config=dict(mooncake, kv_role="kv_consumer")),
        PROMPTS,
        max_tokens=32,
    )
    assert res.tokens == agg["tokens"]
    assert res.decoder_metrics["vllm:spec_decode_num_accepted_tokens"] == agg["metrics"][
        "vllm:spec_decode_num_accepted_tokens"
    ]
