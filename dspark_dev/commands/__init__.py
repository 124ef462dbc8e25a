"""The ``vllm-dspark-pp`` subcommands that run development tooling: ``demo``, ``eval`` and
``train-tiny-pair`` (one module each, same shape as ``vllm_dspark_pp/cli/*.py``).

``vllm_dspark_pp.cli.main`` adds them when this checkout is importable and names them in
``CHECKOUT_COMMANDS``; from a wheel without the checkout they exit 2 with a message naming the fix.
"""
