"""The DeepSeek-V4 family of ``train_tiny_pair --family dsv4``: thin training views of
``dsv4_models.TinyDSV4`` / ``TinyDSV4Draft`` with the interface the shared loops call, and the
export of the single checkpoint directory vLLM serves (target + ``mtp.<i>.*`` draft).

Interface the loops use (the same as models.py's Qwen3 pair and k3_models' pair):
``target(ids, aux_layer_ids) -> (logits, None, aux)``, ``target.lm_head_weight``,
``target.hf_state_dict()``; ``draft_cls(tcfg, dcfg)``, ``draft.init_from_target(target)``,
``draft.aux_layer_ids``, ``draft.context(aux)``, ``draft(ids, ctx, anchors, head_weight) ->
(logits [B,M,N,V] with the teacher-forced Markov bias, confidence logits [B,M,N], the normed
hidden that the head multiplies)`` and ``draft.markov_w1`` / ``markov_w2``.

The draft predicts a block of N tokens from ``[anchor, noise x (N-1)]``: block position i gives
the token at a+i+1, exactly what ``dspark_loss`` scores. The confidence head reads the pre-norm
hidden and the Markov embedding of the previous token; it is trained with the loss's BCE against
1 - TV (teacher-forced previous token; vLLM feeds its previous greedy draft, which equals it
whenever the drafts so far are accepted). The noise token (``<|mask|>``) is never read by the
target, so its embedding row is the draft's own trained parameter, written into ``embed.weight``
of the checkpoint (as the K3 family does).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from dspark_dev.training import dsv4_models as M
from dspark_dev.training.export import training_table
from dspark_dev.training.tokenizer import EOS_ID, MASK_ID, PAD_ID

DSV4_DIR = "dsv4"


@dataclass
class DSV4TrainConfig(M.DSV4Config):
    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DSV4DraftView:
    """The draft's knobs (they live in the one DeepSeek-V4 config; logged in training.json)."""

    block_size: int
    n_mtp_layers: int
    markov_rank: int
    noise_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


#: ``--dsv4-geometry``: ``train`` = ``dsv4_fields(gpu=True, train=True)`` (8 query heads, one
#: output group, q-LoRA 32: an 8.3 MiB checkpoint), ``gpu`` = the dummy-weight GPU tests' sizes
#: (64 heads, 8 groups, q-LoRA 64: 31.3 MiB).
DSV4_GEOMETRIES = ("train", "gpu")


def build_dsv4_configs(
    vocab: int, block_size: int, markov_rank: int, draft_layers: int, geometry: str = "train"
):
    """The tiny config of ``tiny_mla_targets.dsv4_fields`` (``geometry``: see
    ``DSV4_GEOMETRIES``) with the corpus tokenizer's vocab, the corpus' noise token and the
    requested block / Markov rank / stages."""
    from dspark_dev import tiny_mla_targets as t

    if geometry not in DSV4_GEOMETRIES:
        raise ValueError(f"unknown DeepSeek-V4 geometry {geometry!r}: {DSV4_GEOMETRIES}")
    d = t.dsv4_fields(gpu=True, train=geometry == "train")
    return train_configs(d, DSV4TrainConfig, vocab, block_size, markov_rank, draft_layers)


def train_configs(
    d: dict, cfg_cls: type[M.DSV4Config], vocab, block_size, markov_rank, draft_layers: int
):
    """(``cfg_cls`` of the config.json fields ``d`` with the corpus tokenizer's vocab, its noise
    token and the requested block / Markov rank / stages, the draft's ``DSV4DraftView``)."""
    d.update(
        vocab_size=vocab,
        dspark_block_size=block_size,
        dspark_markov_rank=markov_rank,
        dspark_noise_token_id=MASK_ID,
        n_mtp_layers=draft_layers,
    )
    cfg = cfg_cls.from_dict(d)
    view = DSV4DraftView(
        block_size, draft_layers, markov_rank, MASK_ID, list(cfg.dspark_target_layer_ids)
    )
    return cfg, view


#: the pure-torch (target, draft) classes of the DeepSeek-V4 family
V4_PAIR = (M.TinyDSV4, M.TinyDSV4Draft)


def _seeded_init(target, draft, seed: int, pair=V4_PAIR) -> None:
    """``init_pair``'s seeded ranges (it needs both models; a throwaway one of ``pair`` fills the
    gap)."""
    cfg = (target or draft).cfg
    M.init_pair(target or pair[0](cfg), draft or pair[1](cfg), seed=seed)


class DSV4TrainTarget(M.TinyDSV4):
    #: the family's pure-torch (target, draft) classes (``dsv41_train``: V4.1's)
    pair = V4_PAIR

    def __init__(self, cfg: DSV4TrainConfig, seed: int = 0):
        super().__init__(cfg)
        _seeded_init(self, None, seed, self.pair)

    def forward(self, ids, aux_layers=(), kv_quant=None):  # type: ignore[override]
        logits, aux = super().forward(ids, aux_layers, kv_quant)
        return logits, None, aux

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.head.weight

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.vllm_state_dict()


class _TargetView:
    """What ``TinyDSV4Draft.forward`` reads of the target: ``embed`` (with the draft's noise
    row) and ``head``."""

    def __init__(self, embed_w, mask_row, noise_id, head_w):
        self._e, self._m, self._id, self._h = embed_w, mask_row, noise_id, head_w

    def embed(self, ids):
        e = F.embedding(ids, self._e)
        return torch.where((ids == self._id).unsqueeze(-1), self._m.to(e.dtype), e)

    def head(self, x):
        return F.linear(x, self._h.to(x.dtype))


class DSV4TrainDraft(nn.Module):
    pair = V4_PAIR  # as ``DSV4TrainTarget``'s

    def __init__(self, tcfg: DSV4TrainConfig, dcfg: DSV4DraftView, seed: int = 1):
        super().__init__()
        self.tcfg, self.dcfg = tcfg, dcfg
        self.core = self.pair[1](tcfg)
        _seeded_init(None, self.core, seed, self.pair)
        self.mask_embedding = nn.Parameter(torch.zeros(tcfg.hidden_size))
        self._target: list[DSV4TrainTarget] = []  # not a submodule: frozen, not exported here

    def init_from_target(self, target: DSV4TrainTarget) -> None:
        self._target[:] = [target]
        with torch.no_grad():
            self.mask_embedding.copy_(target.embed.weight[self.dcfg.noise_token_id])

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.core.aux_layers

    @property
    def markov_w1(self) -> nn.Module:
        return self.core.markov_w1

    @property
    def markov_w2(self) -> nn.Module:
        return self.core.markov_w2

    def context(self, aux):
        return self.core.context(aux)

    def forward(self, ids, ctx, anchors, head_weight):
        view = _TargetView(
            self._target[0].embed.weight, self.mask_embedding, self.dcfg.noise_token_id, head_weight
        )
        logits, conf, hidden = self.core(
            view,  # type: ignore[arg-type]
            ids,
            ctx,
            anchors,
            block_size=self.dcfg.block_size,
        )
        return logits, conf, self.core.norm(hidden)

    def target_embed_with_mask(self, target: DSV4TrainTarget) -> torch.Tensor:
        emb = target.embed.weight.detach().clone()
        emb[self.dcfg.noise_token_id] = self.mask_embedding.detach().to(emb.dtype)
        return emb

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        return self.core.vllm_state_dict()


def dsv4_hf_config(cfg: DSV4TrainConfig) -> dict:
    """The exported config.json: ``dsv4_fields(gpu=True)`` with every size the trained model
    has (so the training geometry's heads, groups and ranks come from ``cfg`` itself)."""
    from dspark_dev import tiny_mla_targets as t

    return hf_config(t.dsv4_fields(gpu=True), cfg)


def hf_config(d: dict, cfg: DSV4TrainConfig) -> dict:
    """The config.json fields ``d`` with every value ``cfg`` has for them, the vocab, the DSpark
    knobs and the corpus' special tokens."""
    d.update({k: v for k, v in cfg.to_dict().items() if k in d})
    d.update(
        vocab_size=cfg.vocab_size,
        dspark_block_size=cfg.dspark_block_size,
        dspark_markov_rank=cfg.dspark_markov_rank,
        dspark_noise_token_id=cfg.dspark_noise_token_id,
        n_mtp_layers=cfg.n_mtp_layers,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        bos_token_id=EOS_ID,
    )
    return d


def dsv4_checkpoint(target: DSV4TrainTarget, draft: DSV4TrainDraft) -> dict[str, torch.Tensor]:
    """The one checkpoint (target names + ``mtp.<i>.*``), floats in bfloat16, with the draft's
    noise-token row in ``embed.weight``."""
    sd = M.vllm_checkpoint(target, draft.core)
    sd["embed.weight"] = draft.target_embed_with_mask(target)
    return {
        k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
        for k, v in sd.items()
    }


def write_dsv4_pair(
    out: str, target, draft, tokenizer_json: str, extra: dict | None = None
) -> tuple[str]:
    config, sd = dsv4_hf_config(target.cfg), dsv4_checkpoint(target, draft)
    card = lambda: dsv4_model_card(target, draft, extra)  # noqa: E731
    return write_pair(out, DSV4_DIR, config, sd, card, tokenizer_json, extra)


def write_pair(out: str, name: str, config: dict, sd, card, tokenizer_json: str, extra):
    """``<out>/<name>``: config, checkpoint ``sd``, tokenizer, training.json; ``<out>/README.md``:
    ``card()``."""
    from dspark_dev.training.export import write_model_dir

    path = write_model_dir(os.path.join(out, name), config, sd, tokenizer_json, extra)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card())
    return (path,)


def _named_tensors(export) -> dict[str, torch.Tensor]:
    """``export()`` (a ``vllm_state_dict``) with ``dsv4_models._export`` bypassed: the checkpoint
    names mapped to the modules' own parameters and buffers, not to copies."""
    from unittest import mock

    with mock.patch.object(M, "_export", lambda sd: sd):
        return export()


def load_dsv4_pair(out: str):
    """Rebuild (target, draft) DeepSeek-V4 training modules (float32) from a ``write_dsv4_pair``
    directory: the configs from ``dsv4/training.json``, every tensor of the one checkpoint by its
    exported name (the draft's ``mtp.*``, its noise-token row from ``embed.weight``). Fails on a
    tensor missing from either side or of another shape."""
    return load_pair(os.path.join(out, DSV4_DIR), DSV4TrainConfig, DSV4TrainTarget, DSV4TrainDraft)


def load_pair(d: str, cfg_cls, target_cls, draft_cls, fixed: dict | None = None):
    """(target, draft) of ``target_cls`` / ``draft_cls`` from the model directory ``d``: the
    configs from its ``training.json``, every tensor by its exported name. ``fixed``: tensors
    the checkpoint also holds that no training module has (V4.1's vision stand-in); each must be
    in the checkpoint with exactly this value."""
    import json

    from safetensors.torch import load_file

    with open(os.path.join(d, "training.json")) as f:
        extra = json.load(f)
    cfg = cfg_cls.from_dict(extra["target_config"])
    target, draft = (
        target_cls(cfg),
        draft_cls(cfg, DSV4DraftView(**extra["draft_config"])),
    )
    sd = load_file(os.path.join(d, "model.safetensors"))
    for name, value in (fixed or {}).items():
        if name not in sd or not torch.equal(sd.pop(name), value):
            raise ValueError(f"{d}: {name} is not in the checkpoint or differs from the export")
    refs = _named_tensors(target.vllm_state_dict)
    refs.update(_named_tensors(draft.core.vllm_state_dict))
    if set(refs) != set(sd):
        raise ValueError(
            f"{d}: checkpoint and modules differ: only in the checkpoint "
            f"{sorted(set(sd) - set(refs))[:5]}, "
            f"only in the modules {sorted(set(refs) - set(sd))[:5]}"
        )
    with torch.no_grad():
        for name, ref in refs.items():
            if name.endswith("tid2eid"):  # exported as an int32 copy of the int64 table
                ref = _hash_table(target, draft, name)
            if ref.shape != sd[name].shape:
                raise ValueError(
                    f"{name}: checkpoint {tuple(sd[name].shape)}, module {tuple(ref.shape)}"
                )
            ref.copy_(sd[name].to(ref.dtype))
    draft.init_from_target(target)
    return target, draft


def _hash_table(target, draft, name: str) -> torch.Tensor:
    """The ``tid2eid`` buffer that checkpoint tensor ``name`` (``[mtp.]<i>.ffn.gate.tid2eid``)
    came from."""
    parts = name.split(".")
    if parts[0] == "mtp":
        layer = draft.core.layers[int(parts[1])]
    else:
        layer = target.layers[int(parts[1])]
    return layer.ffn.tid2eid


def dsv4_model_card(target, draft, extra: dict | None) -> str:
    c, d = target.cfg, draft.dcfg
    e = extra or {}
    n_t = sum(v.numel() for v in target.vllm_state_dict().values())
    n_d = sum(v.numel() for v in draft.vllm_state_dict().values())
    lines = [
        "# Tiny DeepSeek-V4 pair (trained): DeepseekV4ForCausalLM target + DSpark draft",
        "",
        "Made by `python3 -m dspark_dev.training.train_tiny_pair --family dsv4` (vllm-dspark-pp)",
        "on the seeded synthetic GSM8K-style corpus and BPE tokenizer of models/tiny-pair. One",
        f"directory, `{DSV4_DIR}/`, holds both (the draft as `mtp.<i>.*`); bfloat16 safetensors.",
        "",
        f"* target: {n_t} parameters. {c.num_hidden_layers} layers {c.layer_types}, hidden "
        f"{c.hidden_size}, {c.num_attention_heads} query heads x {c.head_dim}, sliding window "
        f"{c.sliding_window}, {c.n_routed_experts} experts top {c.num_experts_per_tok} + "
        f"{c.n_shared_experts} shared (layer 0 hash-routed), hc_mult {c.hc_mult}; vocab "
        f"{c.vocab_size}.",
        f"* draft: {n_d} parameters. {d.n_mtp_layers} MTP stages fed by target layers "
        f"{d.target_layer_ids}; block {d.block_size}, Markov rank {d.markov_rank}, confidence "
        f"head; noise token id {d.noise_token_id} (`<|mask|>`, its embedding row trained by the "
        "draft and stored in `embed.weight`; the target never reads it).",
        "",
        'Serve: model `<dir>/dsv4` with `--speculative-config \'{"method": "dspark", "model": '
        f'"<dir>/dsv4", "num_speculative_tokens": {d.block_size}}}\'`.',
    ]
    return "\n".join(lines + training_table(e)) + "\n"


def check_written(model_dir: str) -> dict[str, list[str]]:
    """Load ``<out>/dsv4/model.safetensors`` into vLLM's DeepSeek-V4 target and DSpark drafter
    built on the CPU (``dsv4_check.load_problems``, as ``dsv4_check --dry-run`` does) and list,
    per model, every parameter whose name, shape or value does not match the checkpoint."""
    from pathlib import Path

    from safetensors.torch import load_file

    from dspark_dev.training.dsv4_check import load_problems

    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    return load_problems(Path(model_dir), sd)


if __name__ == "__main__":
    import json
    import sys

    problems = check_written(sys.argv[1])
    print(json.dumps(problems, indent=1))
    raise SystemExit(1 if any(problems.values()) else 0)
