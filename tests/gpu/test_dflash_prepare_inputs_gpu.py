"""vLLM's own DFlash/DSpark prepare-inputs Triton kernel on CUDA, with CUDA-graph padding.

Batches of 1, 3, 5, 7 and 8 requests against ``max_num_reqs=8`` (a decode graph captured for 4 or
8 requests replays them padded): every padding row must come out as padding (``is_padding``,
zero ids/positions, PAD slots, ``-1`` sample mappings, ``seq_lens=0``), every real row as the
pure-torch reference says (see tests/support/dflash_prepare_ref.py), with the buffers poisoned
beforehand.
Both layouts: DSpark (sample from the anchor, N query rows) and DFlash (1 + N rows).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch: the GPU kernel test needs one")
    return torch


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["dspark", "dflash"])
@pytest.mark.parametrize("num_reqs", [1, 3, 5, 7, 8])
def test_prepare_inputs_matches_reference_with_padding_rows_poisoned(num_reqs, sample_from_anchor):
    _cuda_or_skip()
    from support import dflash_prepare_ref as ref

    problems = []
    for seed in range(3):
        case = ref.make_case(
            1000 * num_reqs + seed, num_reqs, sample_from_anchor=sample_from_anchor
        )
        problems += [f"{case.describe()}: {p}" for p in ref.check_case(case, "cuda")]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("num_reqs", [3, 7])
def test_padding_reaches_the_end_of_large_buffers(num_reqs):
    """max_num_tokens=8192 needs two passes of the 32 padding programs (stride 32 x 128)."""
    _cuda_or_skip()
    from support import dflash_prepare_ref as ref

    case = ref.make_case(
        77 + num_reqs, num_reqs, max_num_tokens=8192, max_num_reqs=64, block_size=32
    )
    problems = ref.check_case(case, "cuda")
    assert not problems, case.describe() + "\n" + "\n".join(problems[:20])
