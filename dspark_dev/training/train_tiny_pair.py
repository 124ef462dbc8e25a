"""Train the tiny Qwen3 target, then the DSpark drafter against the frozen target, and write both.

Depends on torch and the standard library only (safetensors is used when importable). One command
on a GPU rebuilds the pair:

    python3 -m dspark_dev.training.train_tiny_pair --device cuda --out $OUT/pair

and the same runs on CPU with small step counts (``--target-steps 20 --draft-steps 20``).
Seeded: the corpus, the initial weights, the batches and the anchors all come from ``--seed``;
the step counts are fixed (``--minutes`` is only a safety cap, and training.json records the steps
actually run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

from dspark_dev.training import corpus
from dspark_dev.training.greedy_dspark import anchor_walk, markov_chain, summarize
from dspark_dev.training.models import (
    DraftConfig,
    TargetConfig,
    TinyDSparkDraft,
    TinyQwen3,
    dspark_loss,
    gpt_lr,
    num_params,
)
from dspark_dev.training.tokenizer import EOS_ID, PAD_ID, PurePythonBPE

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOKENIZER = os.path.join(REPO_ROOT, "models", "tiny-pair", "target", "tokenizer.json")


def log(msg: str) -> None:
    print(f"[train-tiny-pair {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (gets target/ and dspark-draft/)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer.json (trained by `tokenizer.py`)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train-docs", type=int, default=200000)
    p.add_argument("--heldout-docs", type=int, default=corpus.DEFAULT_HELDOUT_SIZE)
    p.add_argument("--seq-len", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--target-steps", type=int, default=8000)
    p.add_argument("--draft-steps", type=int, default=8000)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--anchors-per-row", type=int, default=8)
    p.add_argument(
        "--gamma", type=float, default=4.0, help="DSpark position-weight decay exp(-i/gamma)"
    )
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--tv-weight", type=float, default=0.9)
    p.add_argument("--conf-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument(
        "--eval-prompts", type=int, default=64, help="held-out prompts for the simulated acceptance"
    )
    p.add_argument(
        "--minutes", type=float, default=7.0, help="safety cap on the whole run's wall time"
    )
    p.add_argument(
        "--amp",
        choices=["auto", "bf16", "off"],
        default="auto",
        help="bf16 autocast (auto: on for cuda)",
    )
    p.add_argument(
        "--family",
        choices=["qwen3", "k3", "dsv4", "dsv41"],
        default="qwen3",
        help="qwen3: the Qwen3 pair (models.py); k3: the Kimi-K3 pair (k3_models.py: "
        "KimiLinearForCausalLM target + K3DSparkModel drafter, bfloat16 checkpoints); dsv4: the "
        "DeepSeek-V4 pair (dsv4_train.py: tiny_mla_targets.dsv4_fields sizes, see "
        "--dsv4-geometry; the draft as mtp.<i>.* in the target's bfloat16 checkpoint; of the "
        "size flags only --block-size, --markov-rank and --draft-layers apply); dsv41: the "
        "DeepSeek-V4.1 pair (dsv41_train.py: V4's training geometry with V4.1's layer topology, "
        "docs/dsv41-pure-torch.md; the same size flags apply)",
    )
    p.add_argument(
        "--dsv4-geometry",
        choices=["train", "gpu"],
        default="train",
        help="dsv4: train = dsv4_fields(gpu=True, train=True), 8 query heads in one output group "
        "and q-LoRA 32 (8.3 MiB bf16 checkpoint); gpu = the dummy-weight GPU tests' 64 heads in 8 "
        "groups, q-LoRA 64 (31.3 MiB). docs/dsv4-pure-torch.md: what vLLM's H200 path accepts",
    )
    # sizes (k3: --hidden and the intermediate sizes default to k3_models' configs)
    p.add_argument("--hidden", type=int, default=None, help="default 128")
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--target-inter", type=int, default=None, help="qwen3: 384; k3: 256 (dense)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-inter", type=int, default=None, help="qwen3: 384; k3: 256")
    p.add_argument(
        "--mla-heads",
        type=int,
        default=None,
        help="k3: MLA heads of the target and the drafter (default 2: kv_b_proj is 512 x heads "
        "x 256, the bulk of the checkpoint)",
    )
    p.add_argument(
        "--kda-heads",
        type=int,
        default=None,
        help="k3: KDA heads (default 16); vLLM loads the checkpoint only if "
        "4*heads*head_dim + head_dim + heads is a multiple of 16",
    )
    p.add_argument("--kda-head-dim", type=int, default=None, help="k3: KDA head size (default 16)")
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument(
        "--target-layer-ids", default="", help="comma list; default: first, second to last, last"
    )


def encode_docs(bpe: PurePythonBPE, problems: list[corpus.Problem], seq_len: int):
    """Rows of one document each: ids [D,T] (doc + EOS, PAD after), doc_len [D] (incl. EOS),
    prompt_len [D] (tokens of ``format_prompt``)."""
    ids = torch.full((len(problems), seq_len), PAD_ID, dtype=torch.long)
    doc_len = torch.zeros(len(problems), dtype=torch.long)
    prompt_len = torch.zeros(len(problems), dtype=torch.long)
    for i, p in enumerate(problems):
        toks = bpe.encode(corpus.format_document(p)) + [EOS_ID]
        if len(toks) > seq_len:
            raise ValueError(f"document of {len(toks)} tokens exceeds --seq-len {seq_len}")
        ids[i, : len(toks)] = torch.tensor(toks)
        doc_len[i] = len(toks)
        prompt_len[i] = len(bpe.encode(corpus.format_prompt(p.question)))
    return ids, doc_len, prompt_len


def lm_loss(logits, ids, doc_len, from_pos=None):
    """Mean next-token CE over real tokens (optionally only labels at positions > from_pos)."""
    T = ids.shape[1]
    pos = torch.arange(T - 1, device=ids.device).view(1, -1)
    valid = pos + 1 < doc_len.view(-1, 1)
    if from_pos is not None:
        valid &= pos + 1 > from_pos.view(-1, 1) - 1
    ce = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        ids[:, 1:].reshape(-1),
        reduction="none",
    ).view(ids.shape[0], -1)
    return (ce * valid).sum() / valid.sum()


def sample_anchors(gen: torch.Generator, doc_len, prompt_len, m: int):
    """Anchors a in [prompt_len, last answer token] (the positions vLLM drafts from); [B,m]."""
    lo = prompt_len.float()
    hi = (doc_len - 2).float()  # last real token before EOS
    u = torch.rand(doc_len.shape[0], m, generator=gen)
    return (lo.view(-1, 1) + u * (hi - lo + 1).view(-1, 1)).floor().long()


def draft_batch(draft, target, ids, doc_len, anchors, gamma, weights, amp_ctx):
    N = draft.dcfg.block_size
    with torch.no_grad(), amp_ctx():
        tlogits, _, aux = target(ids, draft.aux_layer_ids)
    with amp_ctx():
        ctx = draft.context([a.detach() for a in aux])
        logits, conf, _ = draft(ids, ctx, anchors, target.lm_head_weight.detach())
    T = ids.shape[1]
    offs = torch.arange(N, device=ids.device)
    lab_pos = anchors.unsqueeze(-1) + offs + 1  # [B,M,N]
    valid = lab_pos < doc_len.view(-1, 1, 1)
    lab_pos_c = lab_pos.clamp(max=T - 1)
    B, M = anchors.shape
    labels = ids.gather(1, lab_pos_c.flatten(1)).view(B, M, N)
    tprobs = tlogits.float().softmax(-1)
    tp = tprobs.gather(1, (lab_pos_c - 1).flatten(1).unsqueeze(-1).expand(-1, -1, tprobs.shape[-1]))
    tp = tp.view(B, M, N, -1)
    return dspark_loss(
        logits,
        conf,
        labels,
        tp,
        valid,
        gamma=gamma,
        ce_weight=weights[0],
        tv_weight=weights[1],
        conf_weight=weights[2],
    )


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new: int, device) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        logits, _, _ = target(torch.tensor([seq], device=device))
        nxt = int(logits[0, -1].float().argmax())
        if nxt == EOS_ID:
            break
        seq.append(nxt)
    return seq[len(prompt) :]


@torch.no_grad()
def training_drafts(draft, target, seq: list[int], prompt_len: int, device, context=None):
    """The greedy drafts (``greedy_dspark.markov_chain``) of the training modules for every anchor
    of ``seq`` (positions ``prompt_len .. len(seq) - 2``) on the target's teacher-forced context:
    (drafts [A][N], the blocks' base logits [A,N,V] without the Markov bias, or None if A = 0).
    ``context(aux) -> ctx`` replaces ``draft.context`` (``pd_control_sim``'s perturbed ones)."""
    N = draft.dcfg.block_size
    P, L = prompt_len, len(seq)
    ids = torch.tensor([seq + [PAD_ID] * (N + 1)], device=device)
    _, _, aux = target(ids, draft.aux_layer_ids)
    ctx = (context or draft.context)(aux)
    anchors = torch.arange(P, L - 1, device=device).view(1, -1)  # anchors before the final token
    if anchors.numel() == 0:
        return [], None
    _, _, hidden = draft(ids, ctx, anchors, target.lm_head_weight)
    hidden = hidden[0].float()  # [A,N,H]
    base = hidden @ target.lm_head_weight.float().t()
    drafts = markov_chain(
        base, ids[0, anchors[0]], lambda prev: draft.markov_w2(draft.markov_w1(prev)).float()
    )
    return drafts, base


@torch.no_grad()
def simulate_acceptance(draft, target, prompts: list[list[int]], max_new: int, device):
    """Greedy DSpark as vLLM runs it (``greedy_dspark``: the sequential Markov chain over each
    block, the anchor walk) on the target's own greedy continuation of each prompt. Returns (mean
    acceptance length incl. bonus, per-position acceptance rates, number of steps, completions)."""
    walks = []
    completions = []
    for prompt in prompts:
        gen = greedy_generate(target, prompt, max_new, device)
        completions.append(gen)
        seq = prompt + gen + [EOS_ID]
        drafts, _ = training_drafts(draft, target, seq, len(prompt), device)
        walks.append(anchor_walk(seq, len(prompt), drafts))
    mean_len, per_pos, steps = summarize(walks, draft.dcfg.block_size)
    return mean_len, per_pos, steps, completions


def answer_value(text: str):
    if "####" not in text:
        return None
    tail = text.split("####")[-1].strip().split()
    if not tail:
        return None
    try:
        return int(tail[0].replace(",", ""))
    except ValueError:
        return None


_FIT_FROM, _FIT_AT = 20, 70
_fit_t: dict[str, float] = {}


def _fit_steps(what: str, step: int, total: int, t0: float, end: float) -> int:
    """Time steps 20..70 (after warm-up and the first evaluation) and shrink ``total`` if the
    measured step time says it would overrun ``end``, so that the learning-rate schedule still
    completes (logged; training.json records the steps run)."""
    if step not in (_FIT_FROM, _FIT_AT):
        return total
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if step == _FIT_FROM:
        _fit_t[what] = time.time()
        return total
    per_step = (time.time() - _fit_t[what]) / (_FIT_AT - _FIT_FROM)
    fit = int(step + (end - time.time()) / per_step * 0.9)
    if fit < total:
        log(
            f"{what}: {per_step * 1000:.1f} ms/step; {total} steps would overrun the time cap, "
            f"running {fit}"
        )
        return fit
    log(f"{what}: {per_step * 1000:.1f} ms/step; {total} steps fit in the time cap")
    return total


def build_configs(args, vocab: int):
    """(target config, draft config, target class, draft class) of ``--family``."""
    L = args.target_layers
    layer_ids = (
        [int(x) for x in args.target_layer_ids.split(",")]
        if args.target_layer_ids
        else sorted({0, max(0, L - 2), L - 1})
    )
    hidden = args.hidden or 128
    if args.family == "dsv4":
        import functools

        from dspark_dev.training.dsv4_train import (
            DSV4TrainDraft,
            DSV4TrainTarget,
            build_dsv4_configs,
        )

        tc, dc = build_dsv4_configs(
            vocab, args.block_size, args.markov_rank, args.draft_layers, args.dsv4_geometry
        )
        return (
            tc,
            dc,
            functools.partial(DSV4TrainTarget, seed=args.seed),
            functools.partial(DSV4TrainDraft, seed=args.seed + 1),
        )
    if args.family == "dsv41":
        import functools

        from dspark_dev.training.dsv41_train import (
            DSV41TrainDraft,
            DSV41TrainTarget,
            build_dsv41_configs,
        )

        tc, dc = build_dsv41_configs(vocab, args.block_size, args.markov_rank, args.draft_layers)
        return (
            tc,
            dc,
            functools.partial(DSV41TrainTarget, seed=args.seed),
            functools.partial(DSV41TrainDraft, seed=args.seed + 1),
        )
    if args.family == "k3":
        from dspark_dev.training.k3_models import (
            K3DraftConfig,
            K3TargetConfig,
            TinyK3,
            TinyK3DSpark,
            check_kda_geometry,
        )

        kt = K3TargetConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=L)
        if args.mla_heads:
            kt.num_attention_heads = args.mla_heads
        if args.kda_heads:
            kt.kda_num_heads = args.kda_heads
        if args.kda_head_dim:
            kt.kda_head_dim = args.kda_head_dim
        check_kda_geometry(kt.kda_num_heads, kt.kda_head_dim)  # before any training time is spent
        if args.target_inter:
            kt.intermediate_size = args.target_inter
        kd = K3DraftConfig(
            num_hidden_layers=args.draft_layers,
            block_size=args.block_size,
            markov_rank=args.markov_rank,
            target_layer_ids=layer_ids,
        )
        if args.draft_inter:
            kd.intermediate_size = args.draft_inter
        return kt, kd, TinyK3, TinyK3DSpark
    tcfg = TargetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=args.target_inter or 384,
        num_hidden_layers=L,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
    )
    dcfg = DraftConfig(
        num_hidden_layers=args.draft_layers,
        intermediate_size=args.draft_inter or 384,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        block_size=args.block_size,
        markov_rank=args.markov_rank,
        target_layer_ids=layer_ids,
    )
    return tcfg, dcfg, TinyQwen3, TinyDSparkDraft


def _write(args, target, draft, extra, device, t_start) -> None:
    from dspark_dev.training.export import write_k3_pair, write_pair

    target.cpu().float()
    draft.cpu().float()
    os.makedirs(args.out, exist_ok=True)
    write = write_k3_pair if args.family == "k3" else write_pair
    if args.family == "dsv4":
        from dspark_dev.training.dsv4_train import write_dsv4_pair as write
    if args.family == "dsv41":
        from dspark_dev.training.dsv41_train import write_dsv41_pair as write
    paths = write(args.out, target, draft, args.tokenizer, extra)
    with open(os.path.join(args.out, "training_summary.json"), "w") as f:
        json.dump({k: v for k, v in extra.items() if not k.endswith("history")}, f, indent=2)
    size = sum(os.path.getsize(p_) for p_ in paths)
    log(f"wrote {paths} ({size / 2**20:.2f} MiB); total {time.time() - t_start:.0f}s")


def main(args) -> int:
    t_start = time.time()
    deadline = t_start + 60 * args.minutes
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    use_amp = args.amp == "bf16" or (args.amp == "auto" and device.type == "cuda")

    def amp_ctx():
        if use_amp:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=device.type, enabled=False)

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(
        f"torch {torch.__version__} device {device} amp={'bf16' if use_amp else 'off'} seed "
        f"{args.seed}"
    )

    bpe = PurePythonBPE(args.tokenizer)
    vocab = int(math.ceil(bpe.vocab_size / 64) * 64)
    heldout = corpus.heldout_problems(args.heldout_docs)
    train = corpus.train_problems(args.num_train_docs, args.heldout_docs)
    tr_ids, tr_len, tr_plen = encode_docs(bpe, train, args.seq_len)
    ho_ids, ho_len, ho_plen = encode_docs(bpe, heldout, args.seq_len)
    log(
        f"corpus: {len(train)} train docs ({int(tr_len.sum())} tokens), {len(heldout)} held-out "
        f"docs; "
        f"tokenizer vocab {bpe.vocab_size} (model vocab {vocab}); "
        f"encode took {time.time() - t_start:.1f}s"
    )

    tcfg, dcfg, target_cls, draft_cls = build_configs(args, vocab)
    gen = torch.Generator().manual_seed(args.seed)
    target = target_cls(tcfg).to(device)
    n_target = num_params(target.hf_state_dict())
    log(f"target: {n_target} params {tcfg.to_dict()}")

    # ---- target ----
    opt = torch.optim.AdamW(
        target.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    ho_ids_d, ho_len_d, ho_plen_d = ho_ids.to(device), ho_len.to(device), ho_plen.to(device)

    def eval_target():
        target.eval()
        with torch.no_grad(), amp_ctx():
            lg, _, _ = target(ho_ids_d)
            all_l = lm_loss(lg, ho_ids_d, ho_len_d).item()
            ans_l = lm_loss(lg, ho_ids_d, ho_len_d, from_pos=ho_plen_d).item()
        target.train()
        return all_l, ans_l

    t0 = time.time()
    target_steps_run = 0
    history = []
    total = args.target_steps
    target_end = deadline - 0.45 * 60 * args.minutes
    step = 0
    while step < total:
        if time.time() > target_end:
            log(f"target: time cap reached at step {step}")
            break
        total = _fit_steps("target", step, total, t0, target_end)
        idx = torch.randint(0, tr_ids.shape[0], (args.batch_size,), generator=gen)
        ids, dl = tr_ids[idx].to(device), tr_len[idx].to(device)
        for g in opt.param_groups:
            g["lr"] = gpt_lr(step, total, args.target_lr, min(200, total // 10 + 1))
        with amp_ctx():
            logits, _, _ = target(ids)
        loss = lm_loss(logits, ids, dl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        target_steps_run = step + 1
        step += 1
        if (step - 1) % args.eval_every == 0 or step == total:
            all_l, ans_l = eval_target()
            history.append(
                {"step": step, "train": loss.item(), "heldout": all_l, "heldout_answer": ans_l}
            )
            log(
                f"target step {step}/{total} train {loss.item():.4f} held-out {all_l:.4f} "
                f"(answer tokens {ans_l:.4f}) {time.time() - t0:.0f}s"
            )
    target_loss, target_ans_loss = eval_target()
    target_time = time.time() - t0
    log(
        f"target done: {target_steps_run} steps in {target_time:.0f}s, held-out loss "
        f"{target_loss:.4f} "
        f"(answer tokens {target_ans_loss:.4f})"
    )

    # ---- draft ----
    target.eval()
    for p_ in target.parameters():
        p_.requires_grad_(False)
    draft = draft_cls(tcfg, dcfg).to(device)
    draft.init_from_target(target)
    trainable = [p_ for p_ in draft.parameters() if p_.requires_grad]
    n_draft = num_params(draft.vllm_state_dict())
    log(
        f"draft: {n_draft} params in checkpoint ({sum(p_.numel() for p_ in trainable)} trained) "
        f"{dcfg.to_dict()}"
    )
    opt = torch.optim.AdamW(trainable, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = (args.ce_weight, args.tv_weight, args.conf_weight)

    def eval_draft():
        draft.eval()
        g2 = torch.Generator().manual_seed(12345)
        anchors = sample_anchors(g2, ho_len, ho_plen, args.anchors_per_row).to(device)
        with torch.no_grad():
            loss, parts = draft_batch(
                draft, target, ho_ids_d, ho_len_d, anchors, args.gamma, weights, amp_ctx
            )
        draft.train()
        return loss.item(), {k: v.item() for k, v in parts.items()}

    t0 = time.time()
    draft_steps_run = 0
    dhistory = []
    total = args.draft_steps
    draft_end = deadline - 0.08 * 60 * args.minutes
    step = 0
    while step < total:
        if time.time() > draft_end:
            log(f"draft: time cap reached at step {step}")
            break
        total = _fit_steps("draft", step, total, t0, draft_end)
        idx = torch.randint(0, tr_ids.shape[0], (args.batch_size,), generator=gen)
        ids, dl, pl = tr_ids[idx].to(device), tr_len[idx].to(device), tr_plen[idx]
        anchors = sample_anchors(gen, tr_len[idx], pl, args.anchors_per_row).to(device)
        for g in opt.param_groups:
            g["lr"] = gpt_lr(step, total, args.draft_lr, min(200, total // 10 + 1))
        loss, parts = draft_batch(draft, target, ids, dl, anchors, args.gamma, weights, amp_ctx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        draft_steps_run = step + 1
        step += 1
        if (step - 1) % args.eval_every == 0 or step == total:
            hl, hp = eval_draft()
            dhistory.append(
                {
                    "step": step,
                    "train": loss.item(),
                    "heldout": hl,
                    **{f"heldout_{k}": v for k, v in hp.items()},
                }
            )
            log(
                f"draft step {step}/{total} train {loss.item():.4f} (ce {parts['ce'].item():.3f} "
                f"tv {parts['tv'].item():.3f} conf {parts['conf'].item():.3f}) held-out {hl:.4f} "
                f"(ce {hp['ce']:.3f} tv {hp['tv']:.3f} conf {hp['conf']:.3f}) "
                f"{time.time() - t0:.0f}s"
            )
    draft_time = time.time() - t0
    d_loss, d_parts = eval_draft()

    # ---- write (before the acceptance simulation, so a failure there loses no weights) ----
    if args.family in ("k3", "dsv4", "dsv41"):
        # the checkpoint is bfloat16: the simulation below must use the shipped values
        from dspark_dev.training.export import round_to_bf16_

        round_to_bf16_(target, draft)
    extra = {
        "target_config": tcfg.to_dict(),
        "draft_config": dcfg.to_dict(),
        "seed": args.seed,
        "args": {
            k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("out",)
        },
        "torch": torch.__version__,
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "target_params": n_target,
        "draft_params": n_draft,
        "target_steps_run": target_steps_run,
        "draft_steps_run": draft_steps_run,
        "target_time_s": round(target_time, 1),
        "draft_time_s": round(draft_time, 1),
        "target_heldout_loss": target_loss,
        "target_heldout_answer_loss": target_ans_loss,
        "draft_heldout_loss": d_loss,
        "draft_heldout_parts": d_parts,
        "target_history": history,
        "draft_history": dhistory,
    }
    _write(args, target, draft, extra, device, t_start)

    # ---- held-out acceptance (simulated exactly as vLLM's greedy DSpark steps) ----
    draft.to(device).eval()
    target.to(device).eval()
    prompts = [bpe.encode(corpus.format_prompt(p.question)) for p in heldout[: args.eval_prompts]]
    t0 = time.time()
    mean_len, per_pos, steps, completions = simulate_acceptance(
        draft, target, prompts, 64, device
    )  # float32
    correct = sum(
        answer_value(bpe.decode(c)) == p.value for c, p in zip(completions, heldout, strict=False)
    )
    log(
        f"held-out ({len(prompts)} prompts, {steps} steps): simulated mean acceptance length "
        f"{mean_len:.3f}, "
        f"per position {[round(x, 3) for x in per_pos]}; target accuracy {correct}/{len(prompts)} "
        f"({time.time() - t0:.0f}s)"
    )
    extra.update(
        {
            "simulated_mean_acceptance_length": mean_len,
            "simulated_per_position_acceptance": per_pos,
            "simulated_steps": steps,
            "simulated_prompts": len(prompts),
            "target_heldout_accuracy": correct / max(1, len(prompts)),
        }
    )
    _write(args, target, draft, extra, device, t_start)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
