"""The DSpark draft families vLLM 0.34.0 serves that have no context-KV-only build yet.

They decode as usual (aggregated, or on a PD decoder); a prefill-only producer refuses them at
start with the list of supported families (``families.check_draft_supported``). Giving one of
them a build means moving it into its own module with a ``context_kv_class``
(docs/contributing.md).
"""

from __future__ import annotations

from vllm_dspark_pp.producer import families

for _name, _arch in (
    ("MiniMax-M3 DSpark", "DSparkMiniMaxDraftModel"),
    ("Gemma4 DSpark", "Gemma4DSparkModel"),
    # a Qwen3-Omni draft also lists Qwen3DSparkModel: the refusal wins (families.family_for)
    ("Qwen3-Omni DSpark", "Qwen3OmniDSparkModel"),
    ("Muse Spark DSpark", "MuseSparkDSparkModel"),
    ("Mistral Large 4 DSpark", "MistralLarge4DSparkModel"),
):
    families.register(families.DraftFamily(_name, (_arch,), __name__))
