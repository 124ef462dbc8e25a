"""Development tooling: never imported by the runtime package (``vllm_dspark_pp`` minus ``dev``).

Process and server helpers, the engine-in-a-child runner, the spec-decode metrics reader, the PD
proxy, the GSM8K gate, the tiny-pair trainer and test-only model builders. They live here, not
under ``tests/``, because benchmarks, the ``vllm-dspark-pp eval`` / ``train-tiny-pair`` commands
and the several-GPU scripts use them too, and those must not import from ``tests/``. The runtime
imports nothing from here (``tests/unit/test_layering.py`` checks it). Extra dependencies:
``pip install vllm-dspark-pp[dev]``.
"""
