"""Benchmarks of a vllm-dspark-pp checkout (not in the wheel). Each is a module run from the
checkout root, ``.venv/bin/python -m benchmarks.<name> ...`` (``python -m`` puts the working
directory first on the import path, so ``benchmarks``, ``dspark_dev`` and this checkout's
``vllm_dspark_pp`` are found without editing ``sys.path``); they import each other as
``benchmarks.<name>``. The one exception is ``dspark_bench_hooks``, which vLLM's engine processes
load as a general plugin by its top-level name (its folder on their ``PYTHONPATH``)."""
