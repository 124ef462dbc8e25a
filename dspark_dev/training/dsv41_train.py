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
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

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
    return d


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


#: ``dsv4_checkpoint``: the one checkpoint (target names + ``mtp.<i>.*``) in bfloat16 (V4.1 has
#: no integer tensor), with the draft's noise-token row in ``embed.weight``
dsv41_checkpoint = V4T.dsv4_checkpoint


def write_dsv41_pair(out: str, target, draft, tokenizer_json: str, extra=None) -> tuple[str]:
    config, sd = dsv41_hf_config(target.cfg), dsv41_checkpoint(target, draft)
    card = lambda: dsv41_model_card(target, draft, extra)  # noqa: E731
    return V4T.write_pair(out, DSV41_DIR, config, sd, card, tokenizer_json, extra)


def load_dsv41_pair(out: str):
    """Rebuild (target, draft) float32 training modules from a ``write_dsv41_pair`` directory;
    fails on a tensor missing from either side or of another shape."""
    d = os.path.join(out, DSV41_DIR)
    return V4T.load_pair(d, DSV41TrainConfig, DSV41TrainTarget, DSV41TrainDraft)


def dsv41_model_card(target, draft, extra: dict | None) -> str:
    c, d = target.cfg, draft.dcfg
    e = extra or {}
    n_t = sum(v.numel() for v in target.vllm_state_dict().values())
    n_d = sum(v.numel() for v in draft.vllm_state_dict().values())
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
        "",
        f'Serve: model `<dir>/{DSV41_DIR}` with `--speculative-config \'{{"method": "dspark", '
        f'"model": "<dir>/{DSV41_DIR}", "num_speculative_tokens": {d.block_size}}}\'`.',
    ]
    return "\n".join(lines + training_table(e)) + "\n"
