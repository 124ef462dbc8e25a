"""Child of ``dsv4_check --spec`` (started with a deadline, its own process group): vLLM serves the
exported tiny DeepSeek-V4 with its DSpark draft (k from the command line), one request at a time,
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the hook below sees the speculator), and
records every draft step: the query block's positions and ids, the greedy drafts, the top-5
log-softmax of the base draft logits (``compute_draft_logits``, before the Markov bias) and the
confidences.

usage: python -m dspark_dev.training.dsv4_draft_probe MODEL_DIR PROMPTS_JSON OUT_JSON MAX_TOKENS K
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TOP = 5


def main(argv: list[str]) -> int:
    model_dir, prompts_json, out_json, max_tokens, k = (
        argv[0],
        argv[1],
        argv[2],
        *map(int, argv[3:5]),
    )
    result: dict = {"ok": False, "requests": []}
    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

        records: list[dict] = []
        orig = DSparkSpeculator._sample_sequential

        def probe(self, num_reqs, head_hidden):
            n = self.num_speculative_steps
            hidden = head_hidden[self.sample_indices[:n]]
            base = torch.log_softmax(self.model.compute_draft_logits(hidden).float(), -1)
            orig(self, num_reqs, head_hidden)
            drafts = self.draft_tokens[0].clone()
            anchor = self.input_buffers.input_ids[:1].clone()
            prev = torch.cat([anchor.to(drafts.dtype), drafts[:-1]])
            conf = self.model.compute_confidence(hidden, self.model.markov_embed(prev))
            top = torch.topk(base, TOP, dim=-1)
            records.append(
                {
                    "pos": self.input_buffers.positions[:n].tolist(),
                    "ids": self.input_buffers.input_ids[:n].tolist(),
                    "draft": drafts.tolist(),
                    "base_top_ids": top.indices.tolist(),
                    "base_top_lp": top.values.tolist(),
                    "conf": conf.float().tolist(),
                }
            )

        DSparkSpeculator._sample_sequential = probe
        llm = LLM(
            model=model_dir,
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=1,
            seed=0,
            enforce_eager=True,
            gpu_memory_utilization=0.1,
            kv_cache_memory_bytes=256 << 20,
            speculative_config={
                "method": "dspark",
                "model": model_dir,
                "num_speculative_tokens": k,
            },
        )
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        with open(prompts_json) as f:
            prompts = json.load(f)
        for p in prompts:
            records.clear()
            out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            result["requests"].append(
                {"tokens": list(out.outputs[0].token_ids), "records": list(records)}
            )
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-6000:]
    with open(out_json, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)  # skip the engine's teardown


if __name__ == "__main__":
    main(sys.argv[1:])
