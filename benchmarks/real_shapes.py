"""Config-only model folders at real deployment shapes (no trained weights): Qwen3 targets + Qwen3
DSpark drafts of the published block-7 shape, for timing with ``load_format="dummy"``. The one
tensor ever written beside them is a random draft ``fc.weight`` (:func:`write_context_linear`),
on the machine that serves, for the PP tap partials (they read it from the draft checkpoint).

    python -m benchmarks.real_shapes --out /tmp/shapes [--shape qwen3-8b] [--check]

writes ``OUT/<shape>/target/config.json`` and ``OUT/<shape>/dspark-draft/config.json`` (plus
``generation_config.json``); ``--check`` builds vLLM's engine config from each pair on this
machine (``EngineArgs(...).create_engine_config()``, dummy load format, no tokenizer) and prints
what vLLM resolved (layers, taps, k, draft architecture).

No tokenizer is written: a 151,936-token Qwen3 vocabulary has no local tokenizer here, so the
benchmark runs with ``skip_tokenizer_init=True`` and token-id prompts (vLLM accepts
``{"prompt_token_ids": [...]}`` without a tokenizer).

Sources of the shapes (public configs; the numbers are copied into SHAPES below):

* Qwen3-8B target: Qwen/Qwen3-8B ``config.json`` (36 layers, hidden 4096, intermediate 12288,
  32 query / 8 KV heads, head_dim 128, vocab 151936, rope_theta 1e6, max_position_embeddings
  40960, untied LM head), e.g. as copied in
  https://huggingface.co/thejaminator/qwen-hook-layer-9/commit/478fb720f1f3ced834fce0275b55b2732d438edc
* Qwen3-4B target: Qwen/Qwen3-4B ``config.json`` (36 layers, hidden 2560, intermediate 9728,
  32 / 8 heads, head_dim 128, vocab 151936, tied embeddings), e.g. as copied in
  https://huggingface.co/MultiRL/qwen3_4b_instruct_sft/blob/main/config.json
* Draft (both sizes): DeepSeek's ``deepseek-ai/dspark_qwen3_{4b,8b}_block7`` (the pairs the
  DeepSpec release names; vLLM 0.34.0 cites the 8B one in
  ``v1/worker/gpu/spec_decode/dspark/config.py``): block size 7, 5 draft layers, target feature
  layers [1, 9, 17, 25, 33], vanilla Markov head of rank 256, confidence head with Markov
  features, mask token 151669, embedding and LM head owned by the target (the draft ships
  none). 8B: NVIDIA-NeMo/RL ``docs/guides/dflash-dspark-speculative-decoding.md`` (its DSpark
  block for ``deepseek-ai/dspark_qwen3_8b_block7``: block_size 7, num_layers 5,
  target_hidden_state_layer_ids [1, 9, 17, 25, 33], markov_rank 256, vanilla,
  confidence_with_markov); 4B: https://huggingface.co/alice1001/dspark_qwen3_4b_block7 (model
  card: block size 7, 5 draft layers, target feature layers [1, 9, 17, 25, 33], hidden 2560,
  vanilla Markov rank 256, confidence head with Markov features). The draft layers use the
  target's layer shape (DFlash/DSpark drafts are Qwen3 decoder layers of the target's width).

How vLLM 0.34.0 reads the draft config (``qwen3_dspark.py`` / ``qwen3_dflash.py`` and the
speculative config): ``architectures=["DSparkDraftModel"]`` with ``model_type="qwen3"`` is
rewritten to ``Qwen3DSparkModel``; the method is detected from ``dspark`` in the folder name;
``target_layer_ids`` are zero-based layer outputs (vLLM taps id ``L + 1``); ``block_size`` sets
``num_speculative_tokens``; ``markov_rank``, ``enable_confidence_head`` and
``confidence_head_with_markov`` size the heads; with ``load_format="dummy"`` no
``has_own_embed_tokens``/``has_own_lm_head`` flag is set, so vLLM shares the target's embedding
and LM head (as with the published drafts, which ship neither).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

QWEN3_VOCAB = 151936
QWEN3_MASK_TOKEN_ID = 151669
QWEN3_EOS = 151645


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    vocab_size: int = QWEN3_VOCAB
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    # The published block-7 DSpark draft of this target.
    draft_layers: int = 5
    target_layer_ids: tuple[int, ...] = (1, 9, 17, 25, 33)
    block_size: int = 7
    markov_rank: int = 256
    sources: tuple[str, ...] = field(default_factory=tuple)


SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape(
        "qwen3-8b",
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        sources=(
            "Qwen/Qwen3-8B config.json",
            "deepseek-ai/dspark_qwen3_8b_block7 via "
            "NVIDIA-NeMo/RL docs/guides/dflash-dspark-speculative-decoding.md",
        ),
    ),
    "qwen3-4b": Shape(
        "qwen3-4b",
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        sources=("Qwen/Qwen3-4B config.json", "huggingface.co/alice1001/dspark_qwen3_4b_block7"),
    ),
}


def _qwen3_config(shape: Shape, layers: int) -> dict:
    return {
        "model_type": "qwen3",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": QWEN3_EOS,
    }


def target_config(shape: Shape) -> dict:
    cfg = _qwen3_config(shape, shape.num_layers)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    return cfg


def draft_config(shape: Shape) -> dict:
    cfg = _qwen3_config(shape, shape.draft_layers)
    cfg["tie_word_embeddings"] = False
    cfg.update(
        {
            "architectures": ["DSparkDraftModel"],
            "target_layer_ids": list(shape.target_layer_ids),
            "target_hidden_size": shape.hidden_size,
            "num_target_layers": shape.num_layers,
            "block_size": shape.block_size,
            "mask_token_id": QWEN3_MASK_TOKEN_ID,
            "markov_rank": shape.markov_rank,
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            "sample_from_anchor": True,
            "use_aux_hidden_state": True,
        }
    )
    return cfg


@dataclass(frozen=True)
class ShapePaths:
    shape: str
    target: str
    draft: str


def write_shape(shape: Shape | str, root: str | Path) -> ShapePaths:
    """Write ``root/<name>/target`` and ``root/<name>/dspark-draft`` (config files only)."""
    if isinstance(shape, str):
        shape = SHAPES[shape]
    base = Path(root) / shape.name
    tdir, ddir = base / "target", base / "dspark-draft"  # "dspark" in the path selects the method
    gen = {"bos_token_id": 151643, "eos_token_id": QWEN3_EOS}
    for d, cfg in ((tdir, target_config(shape)), (ddir, draft_config(shape))):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return ShapePaths(shape.name, str(tdir), str(ddir))


#: The draft's first linear on the concatenated taps (``families`` Qwen3 ``context_linear``), as
#: the tap partials look it up in the draft checkpoint (protocol/tap_partials.find_linear).
CONTEXT_LINEAR_KEY = "fc.weight"


def write_context_linear(
    paths: ShapePaths, shape: Shape | str, *, seed: int = 0, write: bool = True
) -> dict:
    """A random bf16 ``fc.weight`` (``hidden x taps * hidden``, normal with std 0.02, seeded) as
    the shape draft folder's ``model.safetensors``, and what it is (a dict for the run's record).

    With ``--load-format dummy`` vLLM reads no file, so a config-only draft has no checkpoint and
    ``VLLM_DSPARK_PP_TAP_PARTIALS`` keeps raw taps (its launchers log why). With this one tensor
    the stages before the last read their column blocks of ``W`` from it and the last stage its
    own (protocol/tap_partials.py: under dummy weights the checkpoint's ``W`` stands in for the
    dummy one), so the partials run at the real shape: bytes, waits and step times are the real
    ones; the draft's tokens are as meaningless as with any dummy weights (the synthetic sampler
    decides acceptance). Every other deployment of the folder is unaffected (vLLM's dummy loader
    reads no file and raw taps never open the checkpoint). ``write=False`` (a dry run) only
    describes it. About 66 MB at the Qwen3-4B shape, 168 MB at 8B: never committed."""
    import torch

    if isinstance(shape, str):
        shape = SHAPES[shape]
    rows, cols = shape.hidden_size, len(shape.target_layer_ids) * shape.hidden_size
    path = Path(paths.draft) / "model.safetensors"
    info = {
        "file": str(path),
        "key": CONTEXT_LINEAR_KEY,
        "shape": [rows, cols],
        "dtype": "bfloat16",
        "init": "normal(0, 0.02)",
        "seed": seed,
        "bytes": rows * cols * 2,
        "written": write,
    }
    if write:
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(seed)
        w = torch.empty(rows, cols).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
        tmp = path.with_suffix(".tmp")
        save_file({CONTEXT_LINEAR_KEY: w}, str(tmp), metadata={"format": "pt"})
        tmp.replace(path)  # whole or absent, also for a server that starts beside it
    return info


def engine_kwargs(
    paths: ShapePaths,
    *,
    spec: bool,
    k: int = 7,
    acceptance_length: float | None = None,
    max_model_len: int = 1024,
    max_num_seqs: int = 64,
    **extra,
) -> dict:
    """``LLM``/``EngineArgs`` keyword arguments for one engine of this shape (dummy weights, no
    tokenizer)."""
    kw = dict(
        model=paths.target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=0,
    )
    if spec:
        sc = {"method": "dspark", "model": paths.draft, "num_speculative_tokens": k}
        if acceptance_length is not None:
            sc["rejection_sample_method"] = "synthetic"
            sc["synthetic_acceptance_length"] = acceptance_length
        kw["speculative_config"] = sc
    kw.update(extra)
    return kw


def check_engine_config(paths: ShapePaths, **kw) -> dict:
    """Build vLLM's VllmConfig for the pair on this machine and report what vLLM resolved."""
    from vllm.engine.arg_utils import EngineArgs

    args = engine_kwargs(paths, spec=True, acceptance_length=3.99, **kw)
    cfg = EngineArgs(**args).create_engine_config()
    mc, sc = cfg.model_config, cfg.speculative_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    return {
        "shape": paths.shape,
        "target_layers": mc.get_total_num_hidden_layers(),
        "hidden_size": mc.get_hidden_size(),
        "vocab_size": mc.get_vocab_size(),
        "method": sc.method,
        "num_speculative_tokens": sc.num_speculative_tokens,
        "draft_architecture": sc.draft_model_config.architectures[0],
        "draft_layers": sc.draft_model_config.hf_config.num_hidden_layers,
        "aux_taps": sorted(get_eagle3_aux_layers_from_config(sc) or ()),
        "rejection_sample_method": sc.rejection_sample_method,
        "synthetic_acceptance_rates": sc.synthetic_acceptance_rates,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--check", action="store_true", help="build vLLM's engine config for each")
    a = ap.parse_args(argv)
    for name in a.shape or sorted(SHAPES):
        paths = write_shape(name, a.out)
        print(f"[real_shapes] {name}: target {paths.target}, draft {paths.draft}", flush=True)
        if a.check:
            print(json.dumps(check_engine_config(paths), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
