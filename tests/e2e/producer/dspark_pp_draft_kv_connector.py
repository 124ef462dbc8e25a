"""Test-only KV connector: vLLM's file-based ExampleConnector plus the layers whose KV is written
outside the attention forward (the DSpark draft's context KV).

ExampleConnector saves a layer from the attention forward hook (``maybe_transfer_kv_layer``);
the DSpark drafter writes its context KV with ``precompute_and_store_context_kv`` (a direct
cache update, no attention forward), so ExampleConnector alone never saves the draft layers and
its decode side would find no file for them. This subclass saves, in ``wait_for_save`` (which
the model runner defers until the drafter has run: ``defer_kv_finalize`` in
``GPUModelRunner.sample_tokens``), every registered layer the forward did not save this step,
with ExampleConnector's own file format and naming. Loading is ExampleConnector's unchanged
(it injects every layer that has a KV cache, draft layers included).

On the load side it also offers every token the store holds. ExampleConnector saves
``(len(prompt) - 1) // block_size`` whole blocks but offers one token fewer to load
(``(len(prompt) - 2) // block_size`` blocks), so a decoder behind it always computes at least two
prompt tokens. MooncakeConnector hands over the whole prompt, and the decoder's scheduler then
resumes the request with exactly one token left to compute. To reach that state on CPU, this
connector offers the whole stored prefix: a prompt of ``n * block_size + 1`` tokens resumes with
one token left, like a Mooncake decoder (issue 13).

Under TP it stores one file per TP shard. ExampleConnector names a layer's file after the layer
and the prompt only (``{folder}/{layer}.safetensors``), so the TP ranks of one PP stage, each
holding its own KV heads, write the same file (the last writer's shard survives) and every decoder
rank reads that one file. Here a worker of a TP > 1 engine names its file
``{layer}.tp{rank}of{size}.safetensors`` (:func:`shard_file_name`) on both sides, so decoder TP
rank r reads what producer TP rank r of the layer's stage wrote. The decoder must have the
producer's TP size: a decoder of another TP size finds no file of its own naming and fails at its
first load (FileNotFoundError) instead of reading wrong heads; this connector does not re-shard
heads (vLLM's MooncakeConnector does: docs/producer.md). A TP=1 engine keeps ExampleConnector's
names.

Used through ``kv_connector_module_path`` by tests/e2e/producer/test_pd_producer_cpu.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.utils.torch_utils import token_ids_to_tensor


def shard_file_name(layer_name: str, tp_rank: int, tp_size: int) -> str:
    """The store file's name (without ``.safetensors``) of ``layer_name`` written or read by TP
    rank ``tp_rank`` of ``tp_size``: the layer's name itself at TP=1."""
    return layer_name if tp_size == 1 else f"{layer_name}.tp{tp_rank}of{tp_size}"


class DSparkDraftKVFileConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._registered: dict[str, torch.Tensor] = {}
        self._saved_in_forward: set[str] = set()

    def _generate_filename_debug(self, layer_name, token_ids, mm_hashes) -> str:
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():  # a worker (the scheduler side names folders only)
            tp = ps.get_tp_group()
            layer_name = shard_file_name(layer_name, tp.rank_in_group, tp.world_size)
        return super()._generate_filename_debug(layer_name, token_ids, mm_hashes)

    def _stored_prefix_len(self, prompt_token_ids) -> int:
        """Tokens the store side saved for this prompt: whole blocks of ``prompt[:-1]``."""
        return (len(prompt_token_ids) - 1) // self._block_size * self._block_size

    def _found_match_for_prompt(self, prompt_token_ids, mm_hashes) -> bool:
        n = self._stored_prefix_len(prompt_token_ids)
        if n == 0:
            return False
        folder = self._generate_foldername_debug(
            token_ids_to_tensor(prompt_token_ids)[:n], mm_hashes, create_folder=False
        )
        return os.path.exists(folder)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self._found_match_for_request(request):
            return 0, False
        return self._stored_prefix_len(request.prompt_token_ids or []) - num_computed_tokens, False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._registered = dict(kv_caches)
        super().register_kv_caches(kv_caches)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._saved_in_forward.add(layer_name)
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        if self._saved_in_forward and self.has_connector_metadata():
            for name, cache in self._registered.items():
                if name not in self._saved_in_forward:
                    super().save_kv_layer(name, cache, None)
        self._saved_in_forward.clear()
        super().wait_for_save()
