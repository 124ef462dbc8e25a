"""Tiny, locally generated Qwen3 target + Qwen3 DSpark draft checkpoints for tests and demos.

:func:`make_tiny_models` writes two Hugging Face style directories (``config.json``,
``model.safetensors``, a ``tokenizers`` tokenizer, ``generation_config.json``) with seeded random
weights. Nothing is downloaded. The same seed and options give byte-identical files.

The pair, as vLLM 0.34.0 sees it:

* **target** (``Qwen3ForCausalLM``): ``num_layers`` decoder layers (default 6, so pipeline sizes
  1, 2, 3 and 6 split it evenly), untied ``lm_head``.
* **draft** (``architectures=["DSparkDraftModel"]``, ``model_type="qwen3"``): vLLM's
  ``SpeculativeConfig.hf_config_override`` rewrites this to ``Qwen3DSparkModel``, which the model
  registry maps to ``qwen3_dspark.Qwen3DSparkForCausalLM`` (a DFlash Qwen3 backbone plus DSpark's
  Markov and confidence heads). The directory name contains ``dspark`` because
  ``DSparkSpeculatorConfig.matches`` selects the method from the draft path.

Draft config fields and the rules behind them (vLLM 0.34.0 sources):

* ``target_layer_ids`` (zero-based target layers whose *output* the draft reads). vLLM adds 1
  (``eagle3_utils.get_eagle3_aux_layers_from_config``: "Dense DSpark (e.g. Qwen3)"), and
  ``Qwen2Model.forward`` captures aux id ``k`` after layer ``k-1``. The default ``(1, 3, 5)``
  gives aux ids ``(2, 4, 6)``: with PP=2 (layers 0-2 | 3-5) one tap on stage 0, two on stage 1;
  with PP=3 (0-1 | 2-3 | 4-5) one tap on every stage, so the aux relay over PP is exercised.
* ``block_size``: DSpark's parallel width; ``num_speculative_tokens`` defaults to it
  (``DSparkSpeculatorConfig.resolve_num_speculative_tokens``).
* ``mask_token_id``: the id fed to masked query slots (``spec_decode.utils.get_parallel_drafting_
  token_id``); it is a real vocabulary row (``<|mask|>`` in the tokenizer).
* ``markov_rank``: rank of the Markov head (``markov_w1``: V x r embedding, ``markov_w2``: V x r).
* ``enable_confidence_head`` / ``confidence_head_with_markov``: the confidence head (a 1-wide
  linear with bias on ``hidden [+ r]``), on by default so its weights are loaded and exercised.
* ``sample_from_anchor`` (default True in ``DSparkSpeculator``): written explicitly.
* ``target_hidden_size``: width of each aux feature; ``fc`` maps ``len(target_layer_ids) *
  target_hidden_size`` to the draft's hidden size.

Embedding and LM head of the draft: the draft checkpoint ships its **own** ``embed_tokens`` and
``lm_head`` (copies of the target's tensors). With PP>1 vLLM only aliases the target's
embedding into the draft when the draft declares ``has_own_embed_tokens``
(``spec_decode/eagle/utils.maybe_share_target_embed``), and the target's embedding does not live
on the last PP stage at all unless spec decode asks for it; shipping the tensors makes the draft
self-contained on whichever stage drafts, with the same numbers as sharing would give.

Weights are shaped so that drafting is neither hopeless nor perfect: the target's LM head is a
row permutation of its embedding (plus noise), so with weak layers the target would walk a fixed
token cycle; with the default ``layer_scale=1.0`` its layers pull it off that cycle about 40% of
the time (measured with transformers, seed 0), so outputs depend on the context (KV cache,
positions) and not only on the last token. The draft shares embedding and head values and has
weak layers (``draft_layer_scale``), so its first block slot tends to predict the cycle's next
token: acceptance is non-zero but well below the block size (tests compare acceptance counts, so
they must not all be zero).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DRAFT_DIR_NAME = "tiny-qwen3-dspark-draft"
TARGET_DIR_NAME = "tiny-qwen3-target"

SPECIAL_TOKENS = ("<|pad|>", "<|unk|>", "<|endoftext|>", "<|mask|>")

# A small built-in text: its words become the tokenizer's vocabulary (plus filler tokens up to
# the model's vocab size), so prompts written in these words tokenize without <|unk|>.
_CORPUS = """
the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat near the
door of an old house by the river where boats pass slowly in the morning light and birds sing
one two three four five six seven eight nine ten eleven twelve many few some all none every
red green blue yellow black white orange purple gray pink big little long short high low
tree leaf branch root seed flower grass stone rock hill mountain valley lake sea ocean rain
snow wind cloud sun moon star sky day night week month year time hour minute second today
we you they he she it is are was were be been being have has had do does did can could will
would shall should may might must not no yes and or but if then else when where why how what
who which that this these those here there up down in out on off over under again further
once more most other such only own same so than too very just now go goes went gone come came
see saw seen look looked find found give gave take took make made know knew think thought
tell told ask asked work worked call called try tried need needed feel felt become became
leave left put mean meant keep kept let begin began seem seemed help helped talk turn start
show hear play run move live believe hold bring happen write provide sit stand lose pay meet
include continue set learn change lead understand watch follow stop create speak read allow
add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain suggest raise pass sell require report decide
pull model token draft target verify accept reject block pipeline stage rank layer cache
"""


@dataclass(frozen=True)
class TinyModelPaths:
    """Where :func:`make_tiny_models` wrote the pair."""

    target: str
    draft: str

    @property
    def root(self) -> str:
        return os.path.dirname(self.target)


def _vocab_words(vocab_size: int) -> list[str]:
    words: list[str] = list(SPECIAL_TOKENS)
    seen = set(words)
    for w in _CORPUS.split():
        if w not in seen:
            seen.add(w)
            words.append(w)
    if len(words) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the built-in corpus ({len(words)})"
        )
    words += [f"tok{i}" for i in range(len(words), vocab_size)]
    return words


def _write_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = _vocab_words(vocab_size)
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "pad_token": "<|pad|>",
        "unk_token": "<|unk|>",
        "eos_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(
        out / "special_tokens_map.json",
        {
            "pad_token": "<|pad|>",
            "unk_token": "<|unk|>",
            "eos_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
        },
    )
    return ids


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _qwen3_fields(
    *, vocab_size, hidden, intermediate, layers, heads, kv_heads, head_dim, max_pos, dtype_name, ids
) -> dict:
    return {
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|pad|>"],
    }


def make_tiny_models(
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    dtype: str = "float32",
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 6,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    max_position_embeddings: int = 2048,
    draft_layers: int = 1,
    target_layer_ids: tuple[int, ...] = (1, 3, 5),
    block_size: int = 4,
    markov_rank: int = 8,
    confidence_head: bool = True,
    layer_scale: float = 1.0,
    draft_layer_scale: float = 0.3,
    lm_head_noise: float = 0.3,
) -> TinyModelPaths:
    """Write the tiny target and DSpark draft under ``out_dir``; return their directories.

    ``dtype`` is ``float32`` (CPU parity runs need it) or ``bfloat16``/``float16`` (GPU use).
    ``head_dim`` must be one vLLM's CPU attention backend supports (32, 64, 80, ...).
    ``layer_scale`` is the standard deviation of the projection weights relative to
    ``1/sqrt(fan_in)``; small values make every layer a weak perturbation of the residual stream.
    """
    import torch
    from safetensors.torch import save_file

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if any(not 0 <= i < num_layers for i in target_layer_ids):
        raise ValueError(f"target_layer_ids {target_layer_ids} must lie in [0, {num_layers})")
    if list(target_layer_ids) != sorted(set(target_layer_ids)):
        raise ValueError("target_layer_ids must be unique and increasing")
    tdtype = dtypes[dtype]

    root = Path(out_dir)
    tdir, ddir = root / TARGET_DIR_NAME, root / DRAFT_DIR_NAME
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)

    ids = _write_tokenizer(tdir, vocab_size)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def proj_(out_f, in_f, scale=None):
        return randn(out_f, in_f, std=(layer_scale if scale is None else scale) / in_f**0.5)

    def norm(n):
        return 1.0 + randn(n, std=0.05)

    def decoder_layer(prefix: str, scale: float | None = None) -> dict[str, torch.Tensor]:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim

        def proj(out_f, in_f):
            return proj_(out_f, in_f, scale)

        return {
            f"{prefix}.input_layernorm.weight": norm(hidden_size),
            f"{prefix}.post_attention_layernorm.weight": norm(hidden_size),
            f"{prefix}.self_attn.q_proj.weight": proj(q, hidden_size),
            f"{prefix}.self_attn.k_proj.weight": proj(kv, hidden_size),
            f"{prefix}.self_attn.v_proj.weight": proj(kv, hidden_size),
            f"{prefix}.self_attn.o_proj.weight": proj(hidden_size, q),
            f"{prefix}.self_attn.q_norm.weight": norm(head_dim),
            f"{prefix}.self_attn.k_norm.weight": norm(head_dim),
            f"{prefix}.mlp.gate_proj.weight": proj(intermediate_size, hidden_size),
            f"{prefix}.mlp.up_proj.weight": proj(intermediate_size, hidden_size),
            f"{prefix}.mlp.down_proj.weight": proj(hidden_size, intermediate_size),
        }

    # Target. The LM head is the embedding plus noise, so a weak-residual target mostly, but
    # not always, continues in a way the draft's first slot can guess.
    embed = randn(vocab_size, hidden_size)
    perm = torch.randperm(vocab_size, generator=gen)
    lm_head = embed[perm] + randn(vocab_size, hidden_size, std=lm_head_noise)
    target: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(num_layers):
        target.update(decoder_layer(f"model.layers.{i}"))
    target["model.norm.weight"] = norm(hidden_size)
    target["lm_head.weight"] = lm_head

    # Draft (checkpoint names as Qwen3DSparkForCausalLM.load_weights expects them: no "model."
    # prefix except lm_head, which stays top-level).
    n_aux = len(target_layer_ids)
    draft: dict[str, torch.Tensor] = {
        "embed_tokens.weight": embed.clone(),
        "lm_head.weight": lm_head.clone(),
        "fc.weight": proj_(hidden_size, n_aux * hidden_size, draft_layer_scale),
        "hidden_norm.weight": norm(hidden_size),
        "norm.weight": norm(hidden_size),
        "markov_head.markov_w1.weight": randn(vocab_size, markov_rank, std=0.5),
        "markov_head.markov_w2.weight": randn(vocab_size, markov_rank, std=0.5),
    }
    for i in range(draft_layers):
        draft.update(decoder_layer(f"layers.{i}", draft_layer_scale))
    conf_in = hidden_size + markov_rank
    if confidence_head:
        draft["confidence_head.proj.weight"] = randn(1, conf_in, std=1.0 / conf_in**0.5)
        draft["confidence_head.proj.bias"] = torch.zeros(1)

    def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
        out = {}
        for k in sorted(tensors):
            t = tensors[k]
            # The confidence head is created with params_dtype=float32 in vLLM; keep it float32.
            keep32 = k.startswith("confidence_head.")
            out[k] = t.to(torch.float32 if keep32 else tdtype).contiguous()
        save_file(out, str(path), metadata={"format": "pt"})

    save(target, tdir / "model.safetensors")
    save(draft, ddir / "model.safetensors")

    common = dict(
        vocab_size=vocab_size,
        hidden=hidden_size,
        intermediate=intermediate_size,
        heads=num_heads,
        kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_pos=max_position_embeddings,
        dtype_name=dtype,
        ids=ids,
    )
    tcfg = _qwen3_fields(layers=num_layers, **common)
    tcfg["architectures"] = ["Qwen3ForCausalLM"]
    _write_json(tdir / "config.json", tcfg)

    dcfg = _qwen3_fields(layers=draft_layers, **common)
    dcfg.update(
        {
            "architectures": ["DSparkDraftModel"],
            "target_layer_ids": list(target_layer_ids),
            "target_hidden_size": hidden_size,
            "num_target_layers": num_layers,
            "block_size": block_size,
            "mask_token_id": ids["<|mask|>"],
            "markov_rank": markov_rank,
            "enable_confidence_head": confidence_head,
            "confidence_head_with_markov": True,
            "sample_from_anchor": True,
            "use_aux_hidden_state": True,
        }
    )
    _write_json(ddir / "config.json", dcfg)

    gen_cfg = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|pad|>"],
    }
    _write_json(tdir / "generation_config.json", gen_cfg)
    _write_json(ddir / "generation_config.json", gen_cfg)
    readme = (
        "Generated by vllm_dspark_pp.tiny_models.make_tiny_models "
        f"(seed={seed}, dtype={dtype}). Random weights: for tests only.\n"
    )
    (tdir / "README.md").write_text(readme)
    (ddir / "README.md").write_text(readme)
    return TinyModelPaths(target=str(tdir), draft=str(ddir))


def speculative_config(paths: TinyModelPaths, **extra) -> dict:
    """The ``speculative_config`` dict for the tiny DSpark draft (method auto-detected as
    dspark)."""
    cfg = {"method": "dspark", "model": paths.draft}
    cfg.update(extra)
    return cfg
