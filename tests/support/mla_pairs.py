"""The trained tiny Kimi-K3, DeepSeek-V4 (issue 26) and DeepSeek-V4.1 (issue 42) pairs for the GPU
groups: the DSV4/K3 trained mode (``DSPARK_DSV4K3_WEIGHTS=trained``: tests/gpu/
test_dsv4_k3_engine.py, test_dsv4_k3_pp.py), test_pd_pp_producer.py and tests/gpu/test_dsv41_pp.py.

* Kimi-K3: ``models/k3-pair/{k3-target,k3-dspark}`` (``dspark_dev.training.export.write_k3_pair``,
  what ``train_tiny_pair --family k3`` writes), block size in the draft's ``block_size``.
* DeepSeek-V4: ``models/dsv4-pair/dsv4``, one checkpoint with the target and its ``mtp.*`` draft
  (``dspark_dev.training.dsv4_train.write_dsv4_pair``), block size in ``dspark_block_size``.
* DeepSeek-V4.1: ``models/dsv41-pair/dsv41``, laid out as DeepSeek-V4's (``train_tiny_pair
  --family dsv41``); vLLM serves it on the GPU only (no CPU implementation of V4.1).

Both are bfloat16 safetensors trained on the seeded GSM8K-style corpus of models/tiny-pair with
its tokenizer (each directory carries a copy): :func:`heldout_waves` gives held-out prompts (never
trained on), encoded with the pair's own ``tokenizer.json``. :func:`trained_acceptance_problems`
is the trained-mode acceptance rule: mean acceptance length >= 3.0 at the trained block size and
an accepted token at every draft position.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_dev.tiny_mla_targets import TinyPair

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / "models"
#: family -> (pair directory, target subdirectory, draft subdirectory, block-size key, family name)
LAYOUT = {
    "k3": ("k3-pair", "k3-target", "k3-dspark", "block_size", "kimi-k3"),
    "dsv4": ("dsv4-pair", "dsv4", "dsv4", "dspark_block_size", "deepseek-v4"),
    "dsv41": ("dsv41-pair", "dsv41", "dsv41", "dspark_block_size", "deepseek-v4.1"),
}
#: family -> what writes its bundle (named when it is missing)
WRITER = {
    "k3": "train_tiny_pair --family k3",
    "dsv4": "dsv4_train",
    "dsv41": "train_tiny_pair --family dsv41",
}
#: family -> ``vllm.LLM`` keyword arguments every engine of the family's tiny pair needs. vLLM
#: 0.34.0 registers DeepSeek-V4.1 as a vision-language model (its ``vl_model.py`` wrapper builds
#: the vision tower and the ``image_*`` parameters unconditionally, and the first PP rank profiles
#: the image encoder at start with dummy images, which needs the image token: the tiny pair's
#: tokenizer has none, so that start stops with ``Token not found in tokenizer``). The tiny pair is
#: text only, and ``language_model_only`` is vLLM's own switch for a text-only deployment (the
#: vision part becomes a placeholder, and PD connectors treat the model as text only).
ENGINE_KWARGS: dict[str, dict] = {"dsv41": {"language_model_only": True}}


def engine_kwargs(fam: str) -> dict:
    """:data:`ENGINE_KWARGS` of ``fam`` (a copy; empty for a family that needs none)."""
    return dict(ENGINE_KWARGS.get(fam, {}))


def serve_args(fam: str) -> list[str]:
    """:func:`engine_kwargs` as ``vllm serve`` flags (each is a boolean switch that is on)."""
    out = []
    for key, value in engine_kwargs(fam).items():
        if value is not True:
            raise ValueError(f"{fam}: {key}={value!r} has no serve spelling here")
        out.append("--" + key.replace("_", "-"))
    return out


#: issue 26: what a trained pair must reach in vLLM
MIN_ACCEPTANCE_LENGTH = 3.0
TRAINED_K = 7


def trained_pair(fam: str, models: Path | None = None) -> tuple[TinyPair | None, str]:
    """(pair, "") when the family's trained pair is complete under ``models`` (default: the
    repo's models/), else (None, why)."""
    root, tdir, ddir, _, name = LAYOUT[fam]
    base = Path(models or MODELS) / root
    for d in {tdir, ddir}:
        p = base / d
        need = [p / "config.json", p / "tokenizer.json"]
        missing = [str(x) for x in need if not x.exists()]
        if not missing and not list(p.glob("*.safetensors")):
            missing.append(f"{p}/*.safetensors")
        if missing:
            return None, (
                f"the trained {name} pair is not bundled: {', '.join(missing)} missing "
                f"({'issue 42' if fam == 'dsv41' else 'issue 26'}; {WRITER[fam]} writes it)"
            )
    return TinyPair(str(base / tdir), str(base / ddir), name), ""


def block_size(pair: TinyPair, fam: str) -> int:
    """The draft block the pair was trained for (its ``num_speculative_tokens``)."""
    cfg = json.loads((Path(pair.draft) / "config.json").read_text())
    return int(cfg[LAYOUT[fam][3]])


def heldout_waves(pair: TinyPair, sizes=(3, 5, 7)) -> list[list[list[int]]]:
    """Distinct held-out corpus prompts as token ids of the pair's tokenizer, one list per wave
    (waves of 3, 5 and 7 requests replay padded decode graphs of 4 and 8)."""
    from tokenizers import Tokenizer

    from dspark_dev.training import corpus

    tok = Tokenizer.from_file(str(Path(pair.target) / "tokenizer.json"))
    probs = corpus.heldout_problems(max(sum(sizes), corpus.DEFAULT_HELDOUT_SIZE))
    ids = [tok.encode(corpus.format_prompt(p.question)).ids for p in probs[: sum(sizes)]]
    out, at = [], 0
    for n in sizes:
        out.append(ids[at : at + n])
        at += n
    return out


def acceptance_length(m: dict) -> float:
    """Mean tokens per draft step, the bonus token included (1 + accepted / drafts)."""
    n = int(m.get("num_drafts", 0))
    return 1.0 + int(m.get("num_accepted_tokens", 0)) / n if n else float("nan")


def trained_acceptance_problems(m: dict, k: int) -> list[str]:
    """What keeps spec-decode counters ``m`` from a trained pair's acceptance at block ``k``:
    mean acceptance length below :data:`MIN_ACCEPTANCE_LENGTH`, per-position counters missing or
    of another length than ``k``, or a draft position that never accepted."""
    out = []
    if not m.get("num_drafts"):
        return [f"no drafts at all: {m}"]
    al = acceptance_length(m)
    if not al >= MIN_ACCEPTANCE_LENGTH:
        out.append(f"mean acceptance length {al:.3f} < {MIN_ACCEPTANCE_LENGTH}")
    per = list(m.get("accepted_per_pos") or [])
    if len(per) != k:
        out.append(f"accepted per position {per}: want {k} positions")
    zero = [i for i, x in enumerate(per) if not x > 0]
    if zero:
        out.append(f"draft positions {zero} never accepted: {per}")
    return out


# ------------------------------------------------------------------------------- TP > 1 copies
#: families whose bundled pair has fewer output groups (``o_groups``) than a TP size needs
REGROUPED = ("dsv4", "dsv41")


def tp_groups(o_groups: int, tp: int) -> int:
    """The fewest output groups, a multiple of ``o_groups``, that ``tp`` ranks split evenly."""
    import math

    return math.lcm(o_groups, tp)


def regroup_wo(wo_a, wo_b, o_groups: int, groups: int):
    """``(wo_a, wo_b)`` of a DeepSeek-V4 attention with ``o_groups`` output groups as the same
    projection with ``groups`` (a multiple): each group's heads split into ``groups / o_groups``
    contiguous parts, each part's ``wo_a`` rows the group's columns for its heads, and ``wo_b``'s
    columns of the group repeated for each part. ``wo_b @ wo_a`` per group is unchanged:
    ``W_b (W_a^1 o_1 + W_a^2 o_2) = [W_b W_b] [W_a^1 o_1; W_a^2 o_2]``."""
    m = groups // o_groups
    if groups % o_groups or wo_a.shape[1] % m:
        raise ValueError(f"{o_groups} groups of {wo_a.shape[1]} inputs do not split in {groups}")
    rank = wo_a.shape[0] // o_groups
    a = wo_a.reshape(o_groups, rank, m, wo_a.shape[1] // m).transpose(1, 2)
    b = wo_b.reshape(wo_b.shape[0], o_groups, 1, rank).expand(-1, o_groups, m, rank)
    return a.reshape(groups * rank, -1).contiguous(), b.reshape(wo_b.shape[0], -1).contiguous()


def tp_pair(fam: str, pair: TinyPair, tp: int, out: Path) -> TinyPair:
    """The pair vLLM 0.34.0 builds at TP=``tp``: ``pair`` itself, or, where its ``o_groups`` does
    not split over ``tp`` ranks (the DeepSeek-V4 / V4.1 pairs were trained with one group, vLLM's
    ``DeepseekV4GroupedWoA`` asserts ``o_groups % tp == 0``: deepseek_v4/common/grouped_wo_a.py:26),
    a copy under ``out`` whose attention outputs are regrouped by :func:`regroup_wo` (every layer,
    the draft's ``mtp.*`` included; config.json and training.json say the new ``o_groups``). The
    trained weights are the same numbers: only how the sum over heads is split into groups
    changes (bf16 rounding of the partial sums aside)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if fam not in REGROUPED:
        return pair
    src = Path(pair.target)
    cfg = json.loads((src / "config.json").read_text())
    groups = tp_groups(int(cfg["o_groups"]), tp)
    if groups == cfg["o_groups"]:
        return pair
    dst = Path(out) / f"{src.parent.name}-o{groups}" / src.name  # the bundle's layout
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    for name in [n for n in sd if n.endswith(".attn.wo_a.weight")]:
        b = name.replace(".wo_a.", ".wo_b.")
        sd[name], sd[b] = regroup_wo(sd[name], sd[b], int(cfg["o_groups"]), groups)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for meta, key in (("config.json", None), ("training.json", "target_config")):
        p = dst / meta
        if p.exists():
            d = json.loads(p.read_text())
            (d[key] if key else d)["o_groups"] = groups
            p.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    draft = str(dst) if pair.draft == pair.target else pair.draft
    return TinyPair(str(dst), draft, pair.family)
