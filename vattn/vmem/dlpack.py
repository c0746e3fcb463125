"""DLPack export of reserved memory for the CUDA backend (both driver paths).

`torch.from_dlpack` on such a capsule wraps reserved memory without a copy and without
asking the driver about the pointer (`__cuda_array_interface__` would, and a reserved
but not yet mapped CUDA address is not device memory to it). The exported view keeps
`owner` (the reservation) alive until torch lets go of the tensor; a capsule that is never
consumed (torch raised first, or nobody called from_dlpack) lets go of it when it dies.

The deleter and the capsule's destructor are C (`vattn._C.dlpack`). Torch calls the
deleter when the last view dies, also while an exception is being raised (a tensor freed
during unwinding); a ctypes callback cannot run then: ctypes fails to build its argument,
reports that, and the exception being raised is lost.
"""
from __future__ import annotations

from typing import Any, Sequence

KDL_CPU, KDL_CUDA = 1, 2


def to_capsule(owner: Any, offset: int, shape: Sequence[int], strides: Sequence[int], code: int, bits: int,
               device_type: int, device_id: int) -> Any:
    """A "dltensor" capsule viewing `owner.addr + offset` (strides in elements) on the given
    DLPack device. The view must lie inside `owner.size` bytes (checked)."""
    from vattn import _C

    return _C.dlpack(owner, offset, tuple(shape), tuple(strides), code, bits, device_type, device_id)
