"""DLPack export in pure Python (ctypes), for the paths that run without vattn._C.

`torch.from_dlpack` on such a capsule wraps reserved memory without a copy and without
asking the driver about the pointer (`__cuda_array_interface__` would, and a reserved
but not yet mapped CUDA address is not device memory to it). The exported view keeps
`owner` (the reservation) alive until torch lets go of the tensor.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Sequence

KDL_CPU, KDL_CUDA = 1, 2


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_live: dict[int, tuple[Any, ...]] = {}  # address of the DLManagedTensor -> what it keeps alive
_lock = threading.Lock()


@_Deleter
def _delete(ptr: Any) -> None:  # called by the consumer (with the GIL: ctypes takes it)
    with _lock:
        _live.pop(ctypes.addressof(ptr.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def to_capsule(owner: Any, addr: int, shape: Sequence[int], strides: Sequence[int], code: int, bits: int,
               device_type: int, device_id: int) -> Any:
    """A "dltensor" capsule viewing `addr` (strides in elements); consume it at once."""
    nd = len(shape)
    dims = (ctypes.c_int64 * nd)(*shape)
    strd = (ctypes.c_int64 * nd)(*strides)
    m = _Managed()
    m.dl_tensor = _Tensor(addr, _Device(device_type, device_id), nd, _DType(code, bits, 1),
                          ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)),
                          ctypes.cast(strd, ctypes.POINTER(ctypes.c_int64)), 0)
    m.deleter = _delete
    with _lock:
        _live[ctypes.addressof(m)] = (m, dims, strd, owner)
    return _capsule_new(ctypes.addressof(m), b"dltensor", None)
