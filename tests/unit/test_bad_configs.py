"""Bad configurations fail at start through vLLM's real config path (docs/bad-configs.md).

Every row of the table in docs/bad-configs.md that fails while vLLM builds its config is checked
here through ``EngineArgs.create_engine_config`` (what ``vllm serve`` and ``LLM(...)`` call first)
with the plugin registered, on the trained pair's real config files; the message must name the fix.
The wrong-vLLM-version row runs in a subprocess (it must fail before any patch is applied). The
rows that fail only once the PP ranks meet (a node without the plugin, ranks disagreeing on k) are
engine starts in tests/e2e/test_multi_node.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "models" / "tiny-pair"
TARGET = str(PAIR / "target")
DRAFT = str(PAIR / "dspark-draft")
KEY = "dspark_pp_fixed_graph_batch"


@pytest.fixture(scope="module")
def engine_config():
    import vllm_dspark_pp

    vllm_dspark_pp.register()

    def make(spec: dict | None, *, pp: int = 2, kv=None, **kw):
        from vllm.engine.arg_utils import EngineArgs

        args = dict(
            model=TARGET,
            speculative_config=spec,
            pipeline_parallel_size=pp,
            kv_transfer_config=kv,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
            enforce_eager=True,
            distributed_executor_backend="mp",
        )
        args.update(kw)
        return EngineArgs(**args).create_engine_config()

    return make


def _draft_copy(tmp_path: Path, edit) -> str:
    """A copy of the pair's draft with its config.json edited by ``edit(dict)``."""
    out = tmp_path / "edited-dspark-draft"  # 'dspark' in the name, as vLLM's matcher expects
    shutil.copytree(DRAFT, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _spec(**kw) -> dict:
    return {"method": "dspark", "model": DRAFT, "num_speculative_tokens": 7, **kw}


def test_good_config_is_accepted(engine_config):
    cfg = engine_config(_spec(**{KEY: 4}))
    assert cfg.speculative_config.num_speculative_tokens == 7
    assert cfg.additional_config["vllm_dspark_pp"]["fixed_graph_batch"] == 4


def test_k_larger_than_the_draft_block_size(engine_config):
    with pytest.raises(
        Exception,
        match=r"num_speculative_tokens=8 exceeds the DSpark drafter's "
        r"block_size=7.*Set num_speculative_tokens to at most 7",
    ):
        engine_config(_spec(num_speculative_tokens=8))


def test_non_dspark_draft_with_method_dspark(engine_config):
    # The target itself (a plain Qwen3ForCausalLM) given as the DSpark draft.
    with pytest.raises(
        Exception,
        match=r"is not a self-contained DSpark drafter.*this target is "
        r"'qwen3'. Point 'model' at a DSpark draft checkpoint",
    ):
        engine_config(_spec(model=TARGET, num_speculative_tokens=3))


def test_non_dspark_checkpoint_under_a_dspark_path(engine_config, tmp_path):
    # A plain causal LM in a directory whose name says dspark: vLLM still relabels it (its
    # architecture has no DSpark speculator config), and the same check refuses it.
    draft = _draft_copy(tmp_path, lambda c: c.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(
        Exception,
        match=r"edited-dspark-draft' is not a self-contained DSpark "
        r"drafter.*Point 'model' at a DSpark draft checkpoint",
    ):
        engine_config(_spec(model=draft))


def test_draft_taps_beyond_the_target_depth(engine_config, tmp_path):
    def deeper(cfg):
        cfg["target_layer_ids"] = cfg["dflash_config"]["target_layer_ids"] = [0, 2, 9]

    with pytest.raises(
        Exception,
        match=r"taps target layers \[9\].*has 4 layers.*use the DSpark "
        r"drafter trained for this target",
    ):
        engine_config(_spec(model=_draft_copy(tmp_path, deeper)))


@pytest.mark.parametrize("bad", [0, -1, "8", 2.5, True], ids=repr)
def test_fixed_graph_batch_not_a_positive_integer(engine_config, bad):
    with pytest.raises(
        Exception,
        match=rf"{KEY}' must be a positive integer.*between 1 and "
        r"--max-num-seqs.*or remove the key",
    ):
        engine_config(_spec(**{KEY: bad}))


def test_fixed_graph_batch_above_max_num_seqs(engine_config):
    with pytest.raises(
        Exception, match=rf"{KEY}'=5 exceeds --max-num-seqs=4; use a value of at most 4"
    ):
        engine_config(_spec(**{KEY: 5}))


def test_fixed_graph_batch_without_dspark(engine_config):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, KEY: 2}
    with pytest.raises(
        Exception, match=r"applies to method 'dspark' only.*remove the key or use DSpark"
    ):
        engine_config(spec)


def test_nixl_with_a_pp2_prefill_only_producer(engine_config):
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer")
    with pytest.raises(NotImplementedError, match="Use MooncakeConnector"):
        engine_config(_spec(), kv=kv)


def test_unsupported_dspark_family_as_producer(engine_config, tmp_path):
    from vllm.config import KVTransferConfig

    draft = _draft_copy(tmp_path, lambda c: c.update(architectures=["Gemma4DSparkModel"]))
    kv = KVTransferConfig(kv_connector="MooncakeConnector", kv_role="kv_producer")
    with pytest.raises(
        NotImplementedError,
        match=r"no context-KV-only drafter for Gemma4 DSpark.*"
        r"Run this instance with kv_role='kv_both'",
    ):
        engine_config(_spec(model=draft), kv=kv)


def test_nnodes_with_the_ray_backend(engine_config):
    """vLLM's own check (the multi-node recipe, docs/multi-node.md): --nnodes is for mp only."""
    with pytest.raises(
        Exception,
        match=r"nnodes > 1 can only be set when distributed executor "
        r"backend is mp",
    ):
        engine_config(_spec(), nnodes=2, distributed_executor_backend="ray")


_WRONG_VERSION = f"""
import vllm
vllm.__version__ = "0.35.0"  # what another installed release reports
from vllm.engine.arg_utils import EngineArgs
EngineArgs(model={TARGET!r}, dtype="float32", max_model_len=256, enforce_eager=True,
           speculative_config={{"method": "dspark", "model": {DRAFT!r}}},
           pipeline_parallel_size=2).create_engine_config()
print("STARTED")
"""


def test_wrong_vllm_version_refused_at_start():
    """create_engine_config loads the general plugins; register() must refuse another release."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _WRONG_VERSION], env=env, capture_output=True, text=True, timeout=180
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in out, out[-3000:]
    assert "UnsupportedVLLMVersionError" in out, out[-3000:]
    assert "supports vLLM 0.34.0 only, but vLLM 0.35.0 is installed" in out
    assert "pip install vllm==0.34.0" in out
