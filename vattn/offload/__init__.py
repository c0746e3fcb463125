"""Offload tiers under the prefix cache: host memory and disk (see `vattn.offload.tiers`).

- `host.py`: `HostStore`, the cache's one store of host memory (`KVCache.host`) for offloaded
  prefix blocks and swapped-out requests, under one budget (`offload_bytes`).
- `disk.py`: `DiskTier`, blocks in checked files under `offload_dir` (`offload_dir_bytes`),
  kept across restarts, shared safely by the processes of one user (or of a group, on purpose).
- `files.py`: whose directories and files the disk tier trusts (`UnsafeOffloadDirError`), and
  how it opens a file it did not just make (no link followed, no FIFO waited on, the size checked).
- `diskio.py`: `DiskIO`, the disk tier's writer thread (a bounded queue) and reader thread:
  no disk I/O on the engine's thread.
- `copier.py`: `Copier`, the copies between the cache's pages and host memory (a copy stream
  and events on CUDA).
- `tiers.py`: `Tiers`, what a `PrefixCache` keeps below device memory, the cascade between the
  tiers, and how a hit is restored.
"""
from __future__ import annotations
