"""Virtual-memory backends: `host` (Linux mmap/memfd) and `cuda` (CUDA driver VMM)."""
from __future__ import annotations

import torch

from vattn.vmem.base import Backend


def make_backend(device: torch.device, cuda_driver: str = "auto") -> Backend:
    """The backend for a torch device: host for 'cpu', CUDA for 'cuda[:N]'."""
    if device.type == "cpu":
        from vattn.vmem.host import HostBackend

        return HostBackend()
    from vattn.vmem.cuda import CudaBackend

    index = device.index if device.index is not None else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return CudaBackend(index, cuda_driver)


__all__ = ["Backend", "make_backend"]
