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

Used through ``kv_connector_module_path`` by tests/e2e/producer/test_pd_producer_cpu.py.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.utils.torch_utils import token_ids_to_tensor


class DSparkDraftKVFileConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._registered: dict[str, torch.Tensor] = {}
        self._saved_in_forward: set[str] = set()

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
