"""The one copy of every test helper (importable as ``support.*``: pytest's ``pythonpath``).

* ``support.env``: the CPU test environment (one dict), the device mode, the CPU kernel check;
* ``support.e2e``: ``run_generate`` (CPU end-to-end tier) over the one engine-in-a-child runner
  (``dspark_dev.engine``);
* ``support.gpu``: ``run_llm`` (one-GPU tier) over the same runner;
* ``support.engines``: the session-scoped engine runs the CPU e2e tests share (a pytest plugin);
* ``support.tiny_pair``: the trained tiny pair; ``support.parity_cpu``: the CPU (exact) parity
  rule (the GPU near-tie rule is ``dspark_dev.parity``, shared with the benchmarks);
* ``support.pd_run`` / ``support.pd_nixl``: prefiller + decoder + PD proxy over MooncakeConnector
  / NixlConnector;
* ``support.dflash_prepare_ref``: the reference of the DFlash input preparation (GPU test);
* ``support.wheel``: the packages ``pip install .`` puts in the wheel, and the wheel built;
* ``support.scripts``: import a script of ``tools/gpu/`` or ``tests/gpu/`` by its path;
* ``support.fake_vllm_serve``: a stand-in ``vllm serve`` process (no model) for the served
  benchmark's PD orchestration run on CPU; ``support.perf_records``: synthetic benchmark records.

Process groups with deadlines, ports, servers, the metrics reader and the PD proxy are in
``dspark_dev`` (benchmarks and the GSM8K command use them too, and must not import
from ``tests/``).
"""
