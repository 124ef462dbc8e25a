"""DeepSeek-V4.1 target under PP with DSpark: relay the aux taps, keep an embedding.

WHAT: On vLLM's CUDA DeepSeek-V4.1 decoder (``vllm.models.deepseek_v41.nvidia.model
.DeepseekV4Model``, the ``model`` of ``DeepseekV41LLMForCausalLM``):

* declares ``supports_aux_hidden_states_over_pp = True``;
* ``forward`` of a non-last PP stage adds the aux hidden states (the DSpark target-layer taps) it
  captured to the ``IntermediateTensors`` it returns, under vLLM's relay keys
  (``EagleModelMixin.pack_local_aux_hidden_states``); the last stage puts the taps of earlier
  stages (``collect_remote_aux_hidden_states``) before its own in what it returns. Middle stages
  pass upstream taps on through vLLM's own ``PPHandler.relay_aux_hidden_states``;
* ``__init__`` also builds the input embedding on the last stage when a drafter shares it
  (``spec_decode_needs_target_embed``), so the DSpark drafter, which has none of its own
  (``DSparkDeepseekV4ForCausalLM.has_own_embed_tokens = False``), finds one there.

WHY: vLLM 0.34.0 serves DeepSeek-V4.1 with PP and ships its DSpark drafter, but the two do not
meet. The decoder's forward collects the taps per layer (``aux_hidden_by_layer``,
deepseek_v41/nvidia/model.py:1118-1159) and a non-last stage returns only ``hidden_states`` and
``pre_mix`` (model.py:1161-1168), so the taps of earlier stages never reach the drafter; the class
leaves ``supports_aux_hidden_states_over_pp`` at the mixin's False (model.py:715), so
``verify_supports_aux_hidden_states_over_pp`` (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:47)
refuses the model at load ("does not support dspark with pipeline parallelism"); and
``embed_tokens`` exists on the first stage only (model.py:802-810), so ``maybe_share_target_embed``
(eagle/utils.py:102-109) would fail on the last stage next. vLLM's DeepSeek-V4 decoder does all
three (deepseek_v4/nvidia/model.py:824, 866, 999 and 1036-1041); this does the same for V4.1. The
hyper-connection pre-mix needs nothing: it already crosses stages, and a tap is the mean over the
hc copies of a layer's post, taken on the stage that ran the layer (layer ``L``'s tap is captured
by layer ``L``'s fused pre or, for a stage's last layer, its ``_collapse``; the first layer of a
later stage captures none), so the taps a stage holds are exactly those vLLM's slot base counts
as its own (``bisect_right(aux layers, start_layer)`` upstream). Decoder SWA bounded replay runs
only on the last stage (``_decoder_replay_supported``: the stage holding the last KV source must
hold every later layer), whose own replay-layer taps are already in its forward's output.

UPSTREAM: none yet (the DeepSeek-V4 decoder's relay, ported to V4.1's decoder).

RETIRE WHEN: vLLM's V4.1 decoder sets ``supports_aux_hidden_states_over_pp`` and packs its taps.

TESTED BY: tests/unit/producer/test_dsv41_pp_relay.py
"""

from __future__ import annotations

from typing import Any

TARGET = "vllm.models.deepseek_v41.nvidia.model"

#: Where the wrapped ``_collapse`` leaves the dict of this forward's taps (non-last stages).
_TAPS_ATTR = "_dspark_pp_taps_by_layer"


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(module) -> None:
    from vllm_dspark_pp.patches._util import wrap

    decoder = module.DeepseekV4Model
    decoder.supports_aux_hidden_states_over_pp = True
    wrap(decoder, "__init__", _make_init)
    wrap(decoder, "_collapse", _make_collapse)
    wrap(decoder, "forward", _make_forward)


def _make_init(orig):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        orig(self, vllm_config=vllm_config, prefix=prefix)
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.models.utils import PPMissingLayer, spec_decode_needs_target_embed

        if isinstance(self.embed_tokens, PPMissingLayer) and spec_decode_needs_target_embed(
            vllm_config
        ):
            # as model.py:803-808 builds it on the first stage
            self.embed_tokens = VocabParallelEmbedding(
                self.config.vocab_size,
                self.config.hidden_size,
                quant_config=self.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )

    return __init__


def _make_collapse(orig):
    def _collapse(self, hidden_states, residual, post_mix, res_mix, aux_hidden_by_layer, *a):
        # On a non-last stage forward calls this once, with the dict its layers filled.
        object.__setattr__(self, _TAPS_ATTR, aux_hidden_by_layer)
        return orig(self, hidden_states, residual, post_mix, res_mix, aux_hidden_by_layer, *a)

    return _collapse


def _make_forward(orig):
    def forward(self, input_ids, positions, intermediate_tensors, *args, **kwargs):
        object.__setattr__(self, _TAPS_ATTR, None)
        out = orig(self, input_ids, positions, intermediate_tensors, *args, **kwargs)
        taps = self.__dict__.pop(_TAPS_ATTR, None)
        return relay_taps(self, out, intermediate_tensors, taps)

    return forward


def relay_taps(decoder, out: Any, intermediate_tensors: Any, taps: dict | None) -> Any:
    """``out`` of the decoder's forward with the taps relayed: a non-last stage's
    ``IntermediateTensors`` gains its own taps (``taps``: layer id -> tensor), a last stage's
    output gets the upstream taps first."""
    from vllm.sequence import IntermediateTensors

    if isinstance(out, IntermediateTensors):
        own = [taps[i] for i in decoder.aux_hidden_state_layers if taps and i in taps]
        out.tensors.update(decoder.pack_local_aux_hidden_states(own))
        return out
    upstream = decoder.collect_remote_aux_hidden_states(intermediate_tensors)
    if not upstream:
        return out
    if isinstance(out, tuple):
        hidden_states, own = out
        return hidden_states, upstream + list(own)
    return out, upstream
