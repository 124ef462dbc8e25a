"""Find the operations that would make the host wait for the GPU, without a GPU.

Run the code under test with its tensors on the ``meta`` device (no data, so nothing executes)
inside :func:`host_syncs`; every aten call goes through a dispatch mode that lists the calls
which, on a CUDA device, block the calling thread until the stream has drained:

* a copy from host memory to a device without ``non_blocking`` (PyTorch copies and then
  synchronizes the stream; from pageable memory even a ``non_blocking`` copy is staged, which
  is why callers pin first, but the pinning is not visible on ``meta``);
* a copy from a device to the host (the values are needed on the host);
* indexing or index assignment with a boolean mask (the kernel first counts the mask's true
  entries with ``nonzero``, whose size the host needs);
* ``nonzero`` and ``item`` (``_local_scalar_dense``) themselves.

The list names each hit with the op and why, so a failing assertion says what to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = torch.ops.aten
_DATA_DEPENDENT = {_ATEN.nonzero.default, _ATEN._local_scalar_dense.default}
_MASK_INDEXING = {
    _ATEN.index.Tensor,
    _ATEN.index_put.default,
    _ATEN.index_put_.default,
    _ATEN._index_put_impl_.default,
}


def _is_host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _why(func, args, kwargs) -> str | None:
    if func in _DATA_DEPENDENT:
        return "its result's size or value is needed on the host"
    if func in _MASK_INDEXING and len(args) > 1:
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in _MASKS]
        if masks:
            return "a boolean-mask index is expanded with nonzero first"
    if func is _ATEN._to_copy.default and args:
        dst = kwargs.get("device")
        src_host, dst_host = _is_host(args[0]), dst is None or torch.device(dst).type == "cpu"
        if src_host and not dst_host and not kwargs.get("non_blocking", False):
            return "a blocking host-to-device copy synchronizes the stream"
        if not src_host and dst_host and dst is not None:
            return "a device-to-host copy"
    if func is _ATEN.copy_.default and len(args) > 1:
        dst, src = args[0], args[1]
        if _is_host(src) and not _is_host(dst) and not kwargs.get("non_blocking", False):
            return "a blocking host-to-device copy synchronizes the stream"
        if not _is_host(src) and _is_host(dst):
            return "a device-to-host copy"
    return None


_MASKS = (torch.bool, torch.uint8)


class _Recorder(TorchDispatchMode):
    def __init__(self, hits: list[str]) -> None:
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None:
            self.hits.append(f"{func}: {why}")
        meta = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "meta"]
        if func in _DATA_DEPENDENT and meta:  # no data on meta: a stand-in result, recorded
            if func is _ATEN.nonzero.default:
                return torch.empty((0, meta[0].dim()), dtype=torch.int64, device="meta")
            return 0
        return func(*args, **kwargs)


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Yields a list that collects, in order, every call made inside that would make the host
    wait for a CUDA stream (see the module docstring)."""
    hits: list[str] = []
    with _Recorder(hits):
        yield hits
