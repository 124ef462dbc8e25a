"""Development tooling of a vllm-dspark-pp checkout; not part of the wheel, never imported by the
runtime package ``vllm_dspark_pp``.

Process and server helpers, the engine-in-a-child runner, the spec-decode metrics reader, the PD
proxy, the GSM8K gate, the tiny-pair trainer, test-only model builders and the checkout commands
(``commands/``; their front door is ``python -m dspark_dev demo|eval|train-tiny-pair`` from the
checkout root, ``__main__.py``). They live here, at the repository root, not under ``tests/``,
because benchmarks, those commands and the several-GPU scripts use them too, and those must not
import from ``tests/``. The runtime imports nothing from here (``tests/unit/repo/test_layering.py``
checks it). Extra dependencies: ``pip install -e .[dev]`` in the checkout.
"""
