"""Subprocess body of test_dspark_equivalence: run vLLM (CPU, in-process engine) with the pair and
record, for every DSpark draft step of request 0, the query block (positions, input ids), the base
draft logits, the greedy drafts and the confidence head's output.

usage: python vllm_draft_probe.py PAIR_DIR OUT_JSON PROMPT MAX_TOKENS
"""

import json
import os
import sys

os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # engine in this process: the hook sees it


def main() -> int:
    pair, out_json, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    records = []
    orig = DSparkSpeculator._sample_sequential

    def probe(self, num_reqs, head_hidden):
        n = self.num_speculative_steps
        hidden = head_hidden[self.sample_indices[:n]]
        base = self.model.compute_draft_logits(hidden)
        orig(self, num_reqs, head_hidden)
        drafts = self.draft_tokens[0].clone()
        anchor = self.input_buffers.input_ids[:1].clone()
        prev = torch.cat([anchor.to(drafts.dtype), drafts[:-1]])
        conf = self.model.compute_confidence(hidden, self.model.markov_embed(prev))
        records.append(
            {
                "pos": self.input_buffers.positions[:n].tolist(),
                "ids": self.input_buffers.input_ids[:n].tolist(),
                "draft": drafts.tolist(),
                "base": base.float().tolist(),
                "conf": conf.float().tolist(),
            }
        )

    DSparkSpeculator._sample_sequential = probe
    llm = LLM(
        model=f"{pair}/target",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=1,
        enforce_eager=True,
        speculative_config={
            "method": "dspark",
            "model": f"{pair}/dspark-draft",
            "num_speculative_tokens": 7,
        },
    )
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    with open(out_json, "w") as f:
        json.dump(
            {
                "prompt": list(out.prompt_token_ids),
                "out": list(out.outputs[0].token_ids),
                "records": records,
            },
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
