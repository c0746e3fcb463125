"""The disk tier: prefix blocks evicted from host memory, in files under `offload_dir`, kept
across restarts and shared by the processes that use the same directory.

```
offload_dir/
  vattn-kv-<identity>/          one directory per identity: what makes a block valid
    3f/3f09...c1.3.kv           a block: <key>.<flags>.kv (flags: which parts it holds)
```
- **Keys.** A file is found by its block's chained key (the prefix cache's hash of every
  token up to the block's end, salted by the model) under the identity's directory: a hash
  of the salt (the engine's covers the model's config, dtype, a fingerprint of its weights
  and the tensor-parallel rank) and of the cache's layout (layer kinds, their buffers, dtype,
  page geometry, state bytes). A different model or geometry looks in another directory.
- **Files.** A header (magic, identity, key, flags, payload length, blake2b checksum of the
  payload), then each held kind's bytes and the states'. Written to a temporary file and
  renamed into place (atomic: a reader sees a whole file or none), never changed after. A
  file that is short, damaged, foreign (another identity or key) or unreadable is a miss,
  and removed.
- **Budget.** `offload_dir_bytes` over the files this process knows (found at start, written,
  read), least recently used first. A disk that fills up (ENOSPC) shrinks the tier to what it
  holds: its files are evicted to make room, the write is tried once more, then skipped.
  Nothing here fails a request: a block that cannot be written is not kept.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import struct
import time
from collections import OrderedDict
from typing import Any, Sequence

import torch

from vattn.errors import InvalidConfigError
from vattn.offload.copier import Copier
from vattn.offload.host import BlockLayout, HostBlock

logger = logging.getLogger(__name__)

MAGIC = b"VATTNKV1"
HEADER = struct.Struct("<8s16s16sIQ16s")  # magic, identity, key, flags, payload bytes, payload checksum
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died while writing
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class DiskTier:
    """Blocks in files (see the module docstring). `identity`: 16 bytes naming what makes a
    block valid; `copier`: the cache's (pinned host memory on CUDA). Raises
    InvalidConfigError when `path` is not a directory this process can write, or `limit`
    holds no block or more than the disk has free."""

    def __init__(self, path: str | os.PathLike, limit: int, identity: bytes, layout: BlockLayout,
                 copier: Copier) -> None:
        self.layout, self.copier, self.identity = layout, copier, identity
        self.limit = limit
        self.root = os.path.join(os.fspath(path), f"vattn-kv-{identity.hex()}")
        self.index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (flags, file bytes), LRU first
        self.nbytes = 0
        self.num_bad_files = 0  # short, damaged or foreign files found (misses)
        self.num_write_failures = 0  # blocks not written (a full disk, an I/O error)
        self.num_full = 0  # times the disk was full (the tier shrank)
        self._start(os.fspath(path))

    # ----------------------------------------------------------------- start ----
    def _start(self, path: str) -> None:
        block = HEADER.size + self.layout.nbytes(self.layout.full_flags)
        if self.limit < block:
            raise InvalidConfigError(
                f"offload_dir_bytes={self.limit} holds no block ({block} bytes a file); give at least that, or no "
                "offload_dir")
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            probe = os.path.join(self.root, f".probe.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, MAGIC)
            finally:
                os.close(fd)
                os.unlink(probe)
            free = os.statvfs(self.root)
        except OSError as e:
            raise InvalidConfigError(
                f"offload_dir={path!r} is not a directory this process can write ({e}); give a writable "
                "directory") from None
        self._scan()
        room = free.f_bavail * free.f_frsize + self.nbytes
        if self.limit > room:
            raise InvalidConfigError(
                f"offload_dir_bytes={self.limit} is more than {path!r} can hold ({room} bytes: what its disk has free "
                "and this model's files there); give less")
        self._make_room(0)

    def _scan(self) -> None:
        """Know the files earlier processes left (least recently used first, by mtime);
        remove temporary files of writers that died."""
        found = []
        now = time.time()
        for sub in _listdir(self.root):
            d = os.path.join(self.root, sub)
            for name in _listdir(d):
                full = os.path.join(d, name)
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                if name.startswith("."):
                    if name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        _unlink(full)
                    continue
                parsed = _parse_name(name)
                if parsed is not None:
                    found.append((st.st_mtime, parsed[0], parsed[1], st.st_size))
        for _, key, flags, size in sorted(found):
            self._remember(key, flags, size)

    # ---------------------------------------------------------------- blocks ----
    def locate(self, key: bytes) -> int | None:
        """The flags of the file that holds the block under `key`, or None."""
        entry = self.index.get(key)
        if entry is None:
            self._refresh(key)  # another process may have written it
            entry = self.index.get(key)
        return None if entry is None else entry[0]

    def holds(self, key: bytes, flags: int) -> bool:
        """Whether a file this tier knows holds every part `flags` names of `key`'s block."""
        entry = self.index.get(key)
        return entry is not None and entry[0] | flags == entry[0]

    def get(self, key: bytes) -> HostBlock | None:
        """The block under `key` read from its file (checked), or None: no file, or a bad
        one (removed)."""
        flags = self.locate(key)
        if flags is None:
            return None
        path = self._path(key, flags)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
        except FileNotFoundError:  # another process evicted it
            self._forget(key)
            return None
        except OSError as e:
            logger.warning("vattn: reading the offloaded block %s failed (%s); a miss", path, str(e))
            self._forget(key)
            return None
        block = self._decode(key, flags, memoryview(data)[:n])
        if block is None:
            self.num_bad_files += 1
            logger.warning("vattn: the offloaded block %s is damaged, short or foreign; a miss (removed)", path)
            self._forget(key)
            _unlink(path)
            return None
        self.index.move_to_end(key)
        try:
            os.utime(path)  # recently used for the other processes' scans too
        except OSError:
            pass
        return block

    def put(self, key: bytes, block: HostBlock) -> bool:
        """Write `block` under `key` (replacing a file of it that held less); False when it
        was not written (too big, a full disk even after shrinking, an I/O error)."""
        flags = block.flags(self.layout)
        if self.holds(key, flags):
            self.index.move_to_end(key)
            return True
        Copier.wait(block.ready)
        parts = [t for t in block.kinds if t is not None] + ([block.state] if block.state is not None else [])
        size = HEADER.size + sum(t.numel() for t in parts)
        if size > self.limit:
            return False
        old = self.index.get(key)
        self._forget(key)  # (its file stays until this one replaces it)
        self._make_room(size)
        views = [memoryview(t.numpy()) for t in parts]
        digest = hashlib.blake2b(digest_size=16)
        for v in views:
            digest.update(v)
        header = HEADER.pack(MAGIC, self.identity, key, flags, size - HEADER.size, digest.digest())
        path = self._path(key, flags)
        for attempt in range(2):
            try:
                write_file(path, [header, *views])
                break
            except OSError as e:
                full = e.errno in FULL_DISK
                if full:  # the disk holds no more than this tier has now: it shrinks to that
                    self.num_full += 1
                    self.limit = self.nbytes
                if not full or attempt or not self.index:
                    self.num_write_failures += 1
                    logger.warning("vattn: writing the offloaded block %s failed (%s); not kept", path, str(e))
                    if old is not None and os.path.exists(self._path(key, old[0])):
                        self._remember(key, *old)
                    return False
                logger.warning("vattn: the disk of offload_dir is full; the disk tier shrinks to %d bytes", self.limit)
                self._make_room(size)  # evict, then try once more
        if old is not None and old[0] != flags:
            _unlink(self._path(key, old[0]))
        self._remember(key, flags, size)
        return True

    def _decode(self, key: bytes, flags: int, data: memoryview) -> HostBlock | None:
        """The block a file's bytes hold, or None when they are not a whole, checked file of
        this key and identity."""
        layout = self.layout
        if len(data) < HEADER.size:
            return None
        magic, identity, file_key, file_flags, length, checksum = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if (magic != MAGIC or identity != self.identity or file_key != key or file_flags != flags
                or not layout.valid(flags) or length != len(payload) or length != layout.nbytes(flags)
                or hashlib.blake2b(payload, digest_size=16).digest() != checksum):
            return None
        raw = torch.frombuffer(payload, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        if self.copier.cuda:  # pinned host memory, as the host tier's
            pinned = self.copier.empty(length)
            pinned.copy_(raw)
            raw = pinned
        kinds: list[torch.Tensor | None] = []
        off = 0
        for k, (buffers, nbytes) in enumerate(layout.kinds):
            if flags >> k & 1:
                kinds.append(raw[off:off + buffers * nbytes].view(buffers, nbytes))
                off += buffers * nbytes
            else:
                kinds.append(None)
        state = raw[off:off + layout.state_bytes] if flags & layout.state_flag else None
        return HostBlock(kinds, state, on_disk=True)

    # ----------------------------------------------------------------- books ----
    def _path(self, key: bytes, flags: int) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], f"{h}.{flags:x}.kv")

    def _remember(self, key: bytes, flags: int, size: int) -> None:
        """Know the file of `key` with `flags`; of two files of one key, the one holding
        more (or the later) is kept and the other removed."""
        old = self.index.get(key)
        if old is not None and old[0] != flags:
            if old[0] | flags == old[0]:  # the known one holds all this one does
                _unlink(self._path(key, flags))
                return
            _unlink(self._path(key, old[0]))
        if old is not None:
            self.nbytes -= old[1]
        self.index[key] = (flags, size)
        self.index.move_to_end(key)
        self.nbytes += size

    def _forget(self, key: bytes) -> None:
        entry = self.index.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def _refresh(self, key: bytes) -> None:
        """Learn the files of `key`'s directory that other processes wrote."""
        d = os.path.join(self.root, key.hex()[:2])
        for name in _listdir(d):
            parsed = _parse_name(name)
            if parsed is None or parsed[0] in self.index and self.index[parsed[0]][0] == parsed[1]:
                continue
            try:
                size = os.stat(os.path.join(d, name)).st_size
            except OSError:
                continue
            self._remember(parsed[0], parsed[1], size)

    def _make_room(self, nbytes: int) -> None:
        """Remove files, least recently used first, until `nbytes` more fit the limit."""
        while self.index and self.nbytes + nbytes > self.limit:
            key, (flags, _) = next(iter(self.index.items()))
            self._forget(key)
            _unlink(self._path(key, flags))


def write_file(path: str, parts: Sequence[Any]) -> None:
    """Write `parts` (bytes-like) to `path` atomically: a temporary file in its directory,
    renamed into place (a reader sees the whole file or none). Raises OSError; leaves no
    temporary file behind."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _parse_name(name: str) -> tuple[bytes, int] | None:
    """(key, flags) of a block file's name `<key hex>.<flags hex>.kv`, or None."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "kv" or len(parts[0]) != 32:
        return None
    try:
        return bytes.fromhex(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = ["DiskTier", "HEADER", "MAGIC", "write_file"]
