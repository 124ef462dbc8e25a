"""Child of test_k3_equivalence.py: vLLM 0.34.0's own Kimi-K3 modules on CPU, fed the exported
tiny K3 pair, against the pure-torch training modules (dspark_dev/training/k3_models.py).

vLLM's CPU engine cannot serve Kimi-K3 in 0.34.0 (see the test's docstring), so this runs the
forwards composed from vLLM's own layers by ``dspark_dev.training.k3_vllm_layers`` (its docstring
names what runs as vLLM's code and the one reference piece, the MLA softmax) and compares every
component with the training module's output on the same input: each KDA / MLA / MoE / dense MLP
sublayer, the aux states, the target logits, the drafter's context, one draft block's logits with
the teacher-forced Markov bias, and its confidence logits.

Writes JSON: the names vLLM did not load, and per component the max |difference| to the training
module's output, plus the greedy tokens of both targets.

usage: k3_vllm_probe.py PAIR_DIR OUT_JSON [MUTATION]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from k3_pair import TRAINING_STATE, mutate_training_modules  # this script's dir: tests/support


def main(pair: str, out_json: str, mutation: str = "") -> int:
    from dspark_dev.training import k3_models
    from dspark_dev.training.export import K3_DRAFT_DIR, load_k3_pair
    from dspark_dev.training.k3_vllm_layers import K3VllmPair

    torch.manual_seed(0)
    # the training modules as they were exported (their own parameter layout, not re-read
    # through export.load_k3_pair, which would mirror a layout slip of the exporter)
    state_path = os.path.join(pair, TRAINING_STATE)
    if os.path.exists(state_path):
        with open(os.path.join(pair, K3_DRAFT_DIR, "training.json")) as f:
            extra = json.load(f)
        tcfg = k3_models.K3TargetConfig(**extra["target_config"])
        dcfg = k3_models.K3DraftConfig(**extra["draft_config"])
        target, draft = k3_models.TinyK3(tcfg), k3_models.TinyK3DSpark(tcfg, dcfg)
        state = torch.load(state_path, weights_only=True)
        target.load_state_dict(state["target"])
        draft.load_state_dict(state["draft"])
    else:  # a pair written by train_tiny_pair (by hand: python k3_vllm_probe.py PAIR OUT)
        target, draft = load_k3_pair(pair)
    mutate_training_modules(mutation)  # the controls
    target.eval()
    draft.eval()

    vp = K3VllmPair(pair)
    rep: dict = {"unloaded_target": vp.unloaded_target, "unloaded_draft": vp.unloaded_draft}
    rep["aux_layer_ids_vllm"] = list(vp.aux_layer_ids)
    rep["aux_layer_ids_training"] = list(draft.aux_layer_ids)
    diffs: dict[str, float] = {}
    scales: dict[str, float] = {}

    def diff(name, a, b):
        """vLLM's ``a`` vs the training module's ``b``: the max |a - b| and the max |b|."""
        diffs[name] = max(diffs.get(name, 0.0), float((a.float() - b.float()).abs().max()))
        scales[name] = max(scales.get(name, 0.0), float(b.float().abs().max()))

    def on_sublayer(i, kind, h, out):
        """The training module's sublayer ``kind`` of layer ``i`` on the same input ``h``."""
        mine, hh = target.layers[i], h.unsqueeze(0)
        if kind == "kda":
            ref = mine.self_attn(hh)[0]
        elif kind == "mla_nope":
            m = mine.self_attn
            ref = m.attend(m.q_of(hh), *m.kv_of(hh), causal=True)[0]
        else:
            ref = (mine.block_sparse_moe if kind == "moe" else mine.mlp)(h)
        diff(kind, out, ref)

    ids = torch.randint(3, target.cfg.vocab_size, (1, 24))
    with vp.running():
        # ---- target: the pure-torch forward vs vLLM's layers composed ----
        logits, _, aux = target(ids, draft.aux_layer_ids)
        v_logits, v_aux = vp.target_forward(ids[0], on_sublayer)
        diff("target_logits", v_logits, logits[0])
        rep["greedy_vllm_modules"] = v_logits.argmax(-1).tolist()
        rep["greedy_training"] = logits[0].argmax(-1).tolist()
        for j, (va, ma) in enumerate(zip(v_aux, aux, strict=True)):
            diff(f"aux{j}", va, ma[0])

        # ---- drafter: one block anchored at a, on the training target's aux states ----
        a_pos, N = 17, draft.dcfg.block_size
        ctx_mine = draft.context(aux)
        ctx_v = vp.context([t[0] for t in aux])
        diff("draft_context", ctx_v, ctx_mine[0])
        seq = torch.cat([ids, ids.new_zeros(1, N)], 1)
        ctx_pad = torch.cat([ctx_mine, ctx_mine.new_zeros(1, N, ctx_mine.shape[-1])], 1)
        d_logits, d_conf, _ = draft(seq, ctx_pad, torch.tensor([[a_pos]]), target.lm_head_weight)
        base, hidden = vp.draft_block(ctx_v, ids[0], a_pos)
        prev = seq[0, a_pos : a_pos + N]  # teacher-forced Markov input, as the training forward
        v_draft = base + vp.markov_bias(prev)
        diff("draft_logits", v_draft, d_logits[0, 0])
        diff("draft_confidence", vp.confidence_logits(hidden, prev), d_conf[0, 0])
        rep["draft_greedy_vllm_modules"] = v_draft.argmax(-1).tolist()
        rep["draft_greedy_training"] = d_logits[0, 0].argmax(-1).tolist()
    rep["max_abs_diff"] = diffs
    rep["max_abs_training"] = scales
    with open(out_json, "w") as f:
        json.dump(rep, f, indent=2)
    print(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
