"""Offload tiers under the prefix cache: host memory and disk (see `vattn.offload.tiers`).

- `host.py`: `HostStore`, the cache's one store of host memory (`KVCache.host`) for offloaded
  prefix blocks and swapped-out requests, under one budget (`offload_bytes`).
- `disk.py`: `DiskTier`, blocks in checked files under `offload_dir` (`offload_dir_bytes`),
  kept across restarts, shared safely by processes.
- `copier.py`: `Copier`, the copies between the cache's pages and host memory (a copy stream
  and events on CUDA).
- `tiers.py`: `Tiers`, what a `PrefixCache` keeps below device memory and how a hit is restored.
"""
from __future__ import annotations
