"""The checkout commands, ``python -m dspark_dev <name>`` from the checkout root
(``dspark_dev/__main__.py``): ``demo``, ``eval`` and ``train-tiny-pair`` (one module each, same
shape as ``vllm_dspark_pp/cli/*.py``).

``vllm_dspark_pp.cli.main`` names them in ``CHECKOUT_COMMANDS`` without importing them: typed as
``vllm-dspark-pp <name>`` they exit 2 with a message naming this spelling.
"""
