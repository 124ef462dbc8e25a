"""The DeepSeek-V4.1 family of ``train_tiny_pair --family dsv41``: training views of
``dsv41_models.TinyDSV41`` / ``TinyDSV41Draft`` with the interface the shared loops call (the same
as ``dsv4_train``'s, whose draft wrapper, embedding view and bf16 export this module reuses), and
the export of the one checkpoint directory vLLM serves (target + ``mtp.<i>.*`` draft).

Geometry: DeepSeek-V4's training geometry (``tiny_mla_targets.dsv4_fields(gpu=True,
train=True)``: hidden 256, 8 query heads of 512 in one output group, q-LoRA 32, o-LoRA 32, 4
experts top-2 + 1 shared of width 64, hc_mult 2, sliding window 128) with V4.1's layer topology:
2 target layers, ``compress_ratios`` [0, 1] (layer 0 sliding window only, layer 1 a full-length
ratio-1 compressed cache, its own kv and index source) and 0 for the MTP stages, no hash-routed
layer, taps ``dspark_target_layer_ids`` [1, 2] (the streams entering layer 1 and the final ones).
The draft's block is the config's ``dspark_block_size``, which vLLM's DSpark config reads as
``num_speculative_tokens`` when the speculative config gives none
(``v1/worker/gpu/spec_decode/dspark/config.py``, ``resolve_num_speculative_tokens``).

The vision stand-in: vLLM 0.34.0 serves ``DeepseekV41ForCausalLM`` only as its vision-language
class (``models/deepseek_v41/nvidia/vl_model.py``), which always registers a vision tower, an
aligner and three learned image-delimiter vectors beside the text model, and its loader refuses a
checkpoint that leaves the tower's norm or the delimiters unset (``default_loader.py``,
``track_weights_loading``). No config field makes it text-only (``--language-model-only`` is an
engine argument, and even then the delimiters stay registered). So the config carries a
``vision_config`` with no ViT block (``num_hidden_layers`` 0, which keeps every text-path switch
off: vLLM reads ``vision_n_layers``) and a 16-wide tower, and the checkpoint holds its tensors
(:func:`vision_tensors`, seeded, never trained, unread by text requests).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from dspark_dev.training import dsv4_train as V4T
from dspark_dev.training import dsv41_models as M
from dspark_dev.training.export import training_table

DSV41_DIR = "dsv41"
#: the V4.1 topology of the trained pair (see the module docstring)
DSV41_LAYERS = {
    "num_hidden_layers": 2,
    "compress_ratios": [0, 1],
    "kv_source_layer_ids": [1],
    "index_source_layer_ids": [1],
    "dspark_target_layer_ids": [1, 2],
}
#: the exported ``vision_config`` (see the module docstring): no ViT block, a 16-wide tower; the
#: patch size, downsample ratio and image-token budget are left at vLLM's defaults
VISION_CONFIG = {"num_hidden_layers": 0, "hidden_size": 16, "num_attention_heads": 1,
                 "intermediate_size": 16}  # fmt: skip
#: what vLLM's ``DeepseekV41Config`` takes when ``vision_config`` does not say
#: (``transformers_utils/configs/deepseek_v41.py``)
VISION_DEFAULTS = {"patch_size": 14, "downsample_ratio": 3}
#: the seed of :func:`vision_tensors` (a generator of its own: the training's RNG is untouched)
VISION_SEED = 41
#: V4-only fields the V4.1 config does not carry (V4.1 reads ``compress_ratios``)
_V4_ONLY = ("layer_types", "mlp_layer_types", "compress_rates", "transformers_version")


@dataclass
class DSV41TrainConfig(M.DSV41Config):
    def to_dict(self) -> dict:
        return asdict(self)


def dsv41_fields(n_mtp_layers: int) -> dict:
    """The V4.1 config.json fields before the vocab / DSpark knobs: V4's training geometry with
    ``DSV41_LAYERS`` (``compress_ratios`` padded with 0 for the MTP stages)."""
    from dspark_dev import tiny_mla_targets as t

    d = t.dsv4_fields(gpu=True, train=True)
    for key in _V4_ONLY:
        d.pop(key, None)
    d.update(DSV41_LAYERS)
    d["compress_ratios"] = list(DSV41_LAYERS["compress_ratios"]) + [0] * n_mtp_layers
    d.update(architectures=["DeepseekV41ForCausalLM"], model_type="deepseek_v41")
    d["n_mtp_layers"] = n_mtp_layers
    d["vision_config"] = dict(VISION_CONFIG)
    return d


def vision_tensors(hidden_size: int, vision_config: dict | None = None) -> dict:
    """The checkpoint tensors of vLLM's vision tower, aligner and image delimiters for a target
    of width ``hidden_size`` and the exported ``vision_config``, bfloat16, from a generator seeded
    with ``VISION_SEED`` (the same tensors at every export): the delimiters and projections
    N(0, 0.02), biases 0, the tower's RMSNorm weight 1. With no ViT block the tower is the patch
    projection (3 x patch^2 -> width) and the norm; the aligner merges downsample^2 patches into
    ``hidden_size`` (w1) and projects again (w2)."""
    vc = {**VISION_DEFAULTS, **(VISION_CONFIG if vision_config is None else vision_config)}
    if vc["num_hidden_layers"] != 0:
        raise NotImplementedError("the vision stand-in has no ViT block")
    width, h = vc["hidden_size"], hidden_size
    merged = width * vc["downsample_ratio"] ** 2
    gen = torch.Generator().manual_seed(VISION_SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {
        "image_start": normal(h),
        "image_end": normal(h),
        "image_newline": normal(h),
        "vision.patch_embed.proj.weight": normal(width, 3 * vc["patch_size"] ** 2),
        "vision.patch_embed.proj.bias": torch.zeros(width),
        "vision.norm.weight": torch.ones(width),
        "aligner.w1.weight": normal(h, merged),
        "aligner.w1.bias": torch.zeros(h),
        "aligner.w2.weight": normal(h, h),
        "aligner.w2.bias": torch.zeros(h),
    }
    return {k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}


def build_dsv41_configs(vocab: int, block_size: int, markov_rank: int, draft_layers: int):
    d = dsv41_fields(draft_layers)
    d["mlp_layer_types"] = ["moe"] * d["num_hidden_layers"]
    return V4T.train_configs(d, DSV41TrainConfig, vocab, block_size, markov_rank, draft_layers)


#: the pure-torch (target, draft) classes the V4 training views wrap here
V41_PAIR = (M.TinyDSV41, M.TinyDSV41Draft)


class DSV41TrainTarget(V4T.DSV4TrainTarget, M.TinyDSV41):
    """``DSV4TrainTarget`` (the loops' interface, seeded init) of a ``TinyDSV41``."""

    pair = V41_PAIR


class DSV41TrainDraft(V4T.DSV4TrainDraft):
    """``DSV4TrainDraft`` (noise-token row, embedding/head view) around a ``TinyDSV41Draft``."""

    pair = V41_PAIR


def dsv41_hf_config(cfg: DSV41TrainConfig) -> dict:
    """The exported config.json: ``dsv41_fields`` with every size the trained model has."""
    return V4T.hf_config(dsv41_fields(cfg.n_mtp_layers), cfg)


def dsv41_checkpoint(target, draft) -> dict[str, torch.Tensor]:
    """``dsv4_checkpoint`` (target names + ``mtp.<i>.*`` in bfloat16, V4.1 has no integer
    tensor, the draft's noise-token row in ``embed.weight``) with :func:`vision_tensors`."""
    sd = V4T.dsv4_checkpoint(target, draft)
    sd.update(vision_tensors(target.cfg.hidden_size))
    return sd


def write_dsv41_pair(out: str, target, draft, tokenizer_json: str, extra=None) -> tuple[str]:
    config, sd = dsv41_hf_config(target.cfg), dsv41_checkpoint(target, draft)
    card = lambda: dsv41_model_card(target, draft, extra)  # noqa: E731
    return V4T.write_pair(out, DSV41_DIR, config, sd, card, tokenizer_json, extra)


def load_dsv41_pair(out: str):
    """Rebuild (target, draft) float32 training modules from a ``write_dsv41_pair`` directory;
    fails on a tensor missing from either side or of another shape, and on vision tensors other
    than :func:`vision_tensors` of the directory's ``vision_config``."""
    import json

    d = os.path.join(out, DSV41_DIR)
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    vision = vision_tensors(hf["hidden_size"], hf.get("vision_config"))
    return V4T.load_pair(d, DSV41TrainConfig, DSV41TrainTarget, DSV41TrainDraft, fixed=vision)


def dsv41_model_card(target, draft, extra: dict | None) -> str:
    c, d = target.cfg, draft.dcfg
    e = extra or {}
    n_t = sum(v.numel() for v in target.vllm_state_dict().values())
    n_d = sum(v.numel() for v in draft.vllm_state_dict().values())
    n_v = sum(v.numel() for v in vision_tensors(c.hidden_size).values())
    lines = [
        "# Tiny DeepSeek-V4.1 pair (trained): DeepseekV41ForCausalLM target + DSpark draft",
        "",
        "Made by `python3 -m dspark_dev.training.train_tiny_pair --family dsv41` (vllm-dspark-pp)",
        "on the seeded synthetic GSM8K-style corpus and BPE tokenizer of models/tiny-pair. One",
        f"directory, `{DSV41_DIR}/`, holds both (the draft as `mtp.<i>.*`, vLLM's",
        "`DSparkV41DraftModel`); bfloat16 safetensors.",
        "",
        f"* target: {n_t} parameters. {c.num_hidden_layers} layers, compress_ratios "
        f"{c.compress_ratios[: c.num_hidden_layers]} (kv / index source {c.kv_source_layer_ids}), "
        f"hidden {c.hidden_size}, {c.num_attention_heads} query heads x {c.head_dim}, sliding "
        f"window {c.sliding_window}, {c.n_routed_experts} experts top {c.num_experts_per_tok} + "
        f"{c.n_shared_experts} shared (no hash layer), hc_mult {c.hc_mult} with V4.1's delayed "
        f"pre-mix (no hc_head); vocab {c.vocab_size}.",
        f"* draft: {n_d} parameters. {d.n_mtp_layers} MTP stages (sliding window) fed by the "
        f"streams entering target layers {d.target_layer_ids}; block {d.block_size} "
        f"(`dspark_block_size`), Markov rank {d.markov_rank}, confidence head; noise token id "
        f"{d.noise_token_id} (`<|mask|>`, its embedding row trained by the draft and stored in "
        "`embed.weight`; the target never reads it).",
        f"* vision stand-in: {n_v} parameters, seeded, not trained, read by no text request "
        "(`dsv41_train.vision_tensors`). vLLM 0.34.0 builds `DeepseekV41ForCausalLM` only as its "
        "vision-language class and requires the vision tower's norm and the image delimiters "
        "from the checkpoint, so `vision_config` declares a tower without ViT blocks, "
        f"{VISION_CONFIG['hidden_size']} wide, and the checkpoint holds it with the aligner and "
        "the delimiters.",
        "",
        f'Serve: model `<dir>/{DSV41_DIR}` with `--speculative-config \'{{"method": "dspark", '
        f'"model": "<dir>/{DSV41_DIR}", "num_speculative_tokens": {d.block_size}}}\'`.',
    ]
    return "\n".join(lines + training_table(e)) + "\n"
