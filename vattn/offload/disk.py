"""The disk tier: prefix blocks evicted from host memory, in files under `offload_dir`, kept
across restarts and shared by the processes of one user (or of a group that shares the
directory on purpose) that use the same directory.

```
offload_dir/                    yours, writable by no one else (see `vattn.offload.files`)
  vattn-kv-<identity>/          one directory per identity: what makes a block valid
    3f/3f09...c1.3.kv           a block: <key>.<flags>.kv (flags: which parts it holds)
```
- **Keys.** A file is found by its block's chained key (the prefix cache's hash of every
  token up to the block's end, salted by the model) under the identity's directory: a hash
  of the salt (the engine's covers the model's config, dtype, a fingerprint of its weights
  and the tensor-parallel rank) and of the cache's layout (layer kinds, their buffers, dtype,
  page geometry, state bytes). A different model or geometry looks in another directory.
  The key is public (anyone with the model can compute it): what keeps another user's bytes
  out is the directory's owner and mode, checked at start (`UnsafeOffloadDirError`).
- **Files.** A header (magic, identity, key, flags, payload length, blake2b checksum of the
  payload), then each held kind's bytes and the states'. Written to a new temporary file
  (`O_EXCL`, 0600) and renamed into place (atomic: a reader sees a whole file or none), never
  changed after. A file is opened without trust (`O_NOFOLLOW | O_NONBLOCK`, then `fstat`: a
  regular file of this user of exactly its layout's size) and checked; one that is not, or
  is short, damaged, foreign (another identity or key) or unreadable, is a miss, and removed.
- **Threads.** `get` and `put` do the file I/O and are called off the engine's thread (the
  tiers' reader and writer, `vattn.offload.tiers`); the index (which files this process
  knows) is guarded by a lock, held for book-keeping only, never across a read or a write.
- **Budget.** `offload_dir_bytes` over the files this process knows (found at start, written,
  read), least recently used first. A disk that fills up (ENOSPC) shrinks the tier to what it
  holds: its files are evicted to make room, the write is tried once more, then skipped; once
  writes succeed again the limit grows back (to what the disk has free, at most
  `offload_dir_bytes`). Nothing here fails a request: a block that cannot be written is not
  kept. Warnings are rate-limited (one line per kind every few seconds, with a count).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict

import torch

from vattn.errors import InvalidConfigError, UnsafeOffloadDirError
from vattn.offload import files
from vattn.offload.copier import Copier
from vattn.offload.files import write_file  # (a seam: tests make the disk fill up)
from vattn.offload.host import BlockLayout, HostBlock

logger = logging.getLogger(__name__)

MAGIC = b"VATTNKV1"
HEADER = struct.Struct("<8s16s16sIQ16s")  # magic, identity, key, flags, payload bytes, payload checksum
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died while writing
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class DiskTier:
    """Blocks in files (see the module docstring). `identity`: 16 bytes naming what makes a
    block valid; `copier`: the cache's (pinned host memory on CUDA). Raises
    UnsafeOffloadDirError when another user could write in `path`, InvalidConfigError when
    it is not a directory this process can write, or `limit` holds no block or more than
    the disk has free. Thread-safe (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, limit: int, identity: bytes, layout: BlockLayout,
                 copier: Copier) -> None:
        self.layout, self.copier, self.identity = layout, copier, identity
        self.limit = limit  # what the tier may hold now (less than max_limit after a full disk)
        self.max_limit = limit  # offload_dir_bytes
        self.index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (flags, file bytes), LRU first
        self.nbytes = 0
        self.num_bad_files = 0  # short, damaged, foreign or unsafe files found (misses, removed)
        self.num_write_failures = 0  # blocks not written (a full disk, an I/O error)
        self.num_full = 0  # times the disk was full (the tier shrank)
        self.lock = threading.RLock()  # the index and its figures: the engine's, reader's and writer's threads
        self.warnings = files.Warnings(logger)
        self._dirs: set[str] = set()  # block directories made and checked
        self._start(os.fspath(path))

    # ----------------------------------------------------------------- start ----
    def _start(self, path: str) -> None:
        block = HEADER.size + self.layout.nbytes(self.layout.full_flags)
        if self.limit < block:
            raise InvalidConfigError(
                f"offload_dir_bytes={self.limit} holds no block ({block} bytes a file); give at least that, or no "
                "offload_dir")
        try:
            self.place = files.place(path)
            self.root = os.path.join(self.place.root, f"vattn-kv-{self.identity.hex()}")
            files.make_dir(self.place, self.root)
            probe = os.path.join(self.root, ".probe.tmp")
            files.write_file(probe, [MAGIC], self.place.file_mode)
            files.unlink(probe)
            free = os.statvfs(self.root)
        except UnsafeOffloadDirError:
            raise
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
        for p in self._make_room(0):
            files.unlink(p)

    def _scan(self) -> None:
        """Know the files earlier processes left (least recently used first, by mtime);
        remove temporary files of writers that died, and files that are not block files of
        this place (a FIFO, a link, another user's, the wrong size). UnsafeOffloadDirError
        for a block directory another user could write."""
        found = []
        now = time.time()
        for sub in files.listdir(self.root):
            d = os.path.join(self.root, sub)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            why = files.dir_problem(self.place, st)
            if why is not None:
                if len(sub) == 2:  # a block directory (vattn's names): another user's, or a link
                    raise files.unsafe(d, d, why, st)
                continue
            self._dirs.add(d)
            for name in files.listdir(d):
                full = os.path.join(d, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                if name.startswith("."):
                    if name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        files.unlink(full)
                    continue
                parsed = self._known(full, name, st)
                if parsed is not None:
                    found.append((st.st_mtime, parsed[0], parsed[1], st.st_size))
        with self.lock:
            for _, key, flags, size in sorted(found):
                self._remember(key, flags, size)

    def _known(self, path: str, name: str, st: os.stat_result) -> tuple[bytes, int] | None:
        """(key, flags) of the block file `path` (its `lstat` `st`), or None: not a block
        file's name, or not a block file of this place (removed, counted, warned about)."""
        parsed = _parse_name(name)
        if parsed is None:
            return None
        why = files.file_problem(self.place, st, self._file_bytes(parsed[1]))
        if why is not None:
            self._bad(path, why)
            files.unlink(path)
            return None
        return parsed

    def _file_bytes(self, flags: int) -> int:
        """The bytes of a file of a block holding `flags` (-1: flags this layout has not)."""
        return HEADER.size + self.layout.nbytes(flags) if self.layout.valid(flags) else -1

    def _bad(self, path: str, why: str) -> None:
        with self.lock:
            self.num_bad_files += 1
        self.warnings.warn("bad", f"the offloaded block {path} is {why}; a miss (removed)")

    # ---------------------------------------------------------------- blocks ----
    def locate(self, key: bytes) -> int | None:
        """The flags of the file that holds the block under `key`, or None."""
        with self.lock:
            entry = self.index.get(key)
        if entry is None:
            self._refresh(key)  # another process may have written it
            with self.lock:
                entry = self.index.get(key)
        return None if entry is None else entry[0]

    def holds(self, key: bytes, flags: int) -> bool:
        """Whether a file this tier knows holds every part `flags` names of `key`'s block."""
        with self.lock:
            entry = self.index.get(key)
        return entry is not None and entry[0] | flags == entry[0]

    def get(self, key: bytes) -> HostBlock | None:
        """The block under `key` read from its file (opened without trust, checked), or
        None: no file, or a bad one (removed). File I/O: call it off the engine's thread."""
        flags = self.locate(key)
        if flags is None:
            return None
        path = self._path(key, flags)
        try:
            data, why = files.read_block(self.place, path, self._file_bytes(flags))
        except OSError as e:
            self.warnings.warn("read", f"reading the offloaded block {path} failed ({e}); a miss")
            self._forget(key, flags)
            return None
        block = None
        if data is not None:
            block = self._decode(key, flags, memoryview(data))
            if block is None:
                why = "damaged, or another block's"
                files.unlink(path)
        if block is None:
            if why is not None:
                self._bad(path, why)
            self._forget(key, flags)  # (gone: another process evicted it)
            return None
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(path)  # recently used for the other processes' scans too
        except OSError:
            pass
        return block

    def put(self, key: bytes, block: HostBlock) -> bool:
        """Write `block` under `key` (replacing a file of it that held less) once its copy to
        host memory finished; False when it was not written (too big, a full disk even after
        shrinking, an I/O error). File I/O: call it off the engine's thread."""
        flags = block.flags(self.layout)
        if self.holds(key, flags):
            with self.lock:
                if key in self.index:
                    self.index.move_to_end(key)
            return True
        Copier.wait(block.ready)
        parts = [t for t in block.kinds if t is not None] + ([block.state] if block.state is not None else [])
        size = HEADER.size + sum(t.numel() for t in parts)
        if size > self.max_limit:
            return False
        path = self._path(key, flags)
        try:
            self._make_dir(os.path.dirname(path))
        except (OSError, UnsafeOffloadDirError) as e:
            with self.lock:
                self.num_write_failures += 1
            self.warnings.warn("write", f"writing the offloaded block {path} failed ({e}); not kept")
            return False
        with self.lock:
            old = self.index.get(key)
            self._forget(key)  # (its file stays until this one replaces it)
            evicted = self._make_room(size)
        for p in evicted:
            files.unlink(p)
        views = [memoryview(t.numpy()) for t in parts]
        digest = hashlib.blake2b(digest_size=16)
        for v in views:
            digest.update(v)
        header = HEADER.pack(MAGIC, self.identity, key, flags, size - HEADER.size, digest.digest())
        if not self._write(path, [header, *views], key, size, old):
            return False
        with self.lock:
            if old is not None and old[0] != flags:
                files.unlink(self._path(key, old[0]))
            self._remember(key, flags, size)
            if self.limit < self.max_limit:  # writes succeed again: the limit grows back
                self.limit = min(self.max_limit, max(self.limit, self.nbytes + _free_bytes(self.root)))
        return True

    def _write(self, path: str, chunks: list[bytes | memoryview], key: bytes, size: int,
               old: tuple[int, int] | None) -> bool:
        """Write the file of `key` (`size` bytes); on a full disk the tier shrinks to what it
        holds, evicts for room and tries once more. False when it was not written: then the
        entry of the file it replaced (`old`: flags, size) is kept if that file still exists."""
        for attempt in range(2):
            try:
                write_file(path, chunks, self.place.file_mode)
                return True
            except OSError as e:
                full = e.errno in FULL_DISK
                with self.lock:
                    if full:  # the disk holds no more than this tier has now: it shrinks to that
                        self.num_full += 1
                        self.limit = self.nbytes
                    again = full and not attempt and bool(self.index)
                    evicted = self._make_room(size) if again else []  # evict, then try once more
                    if not again:
                        self.num_write_failures += 1
                        if old is not None and os.path.exists(self._path(key, old[0])):
                            self._remember(key, *old)
                if not again:
                    self.warnings.warn("full" if full else "write",
                                       f"writing the offloaded block {path} failed ({e}); not kept")
                    return False
                self.warnings.warn("shrink", f"the disk of offload_dir is full; the disk tier shrinks to "
                                             f"{self.limit} bytes")
                for p in evicted:
                    files.unlink(p)
        return False  # (not reached: the second attempt writes or returns)

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
        return HostBlock(kinds, state, on_disk=True, from_disk=True)

    # ----------------------------------------------------------------- books ----
    def _path(self, key: bytes, flags: int) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], f"{h}.{flags:x}.kv")

    def _make_dir(self, d: str) -> None:
        if d not in self._dirs:
            files.make_dir(self.place, d)
            self._dirs.add(d)

    def _remember(self, key: bytes, flags: int, size: int) -> None:
        """Know the file of `key` with `flags`; of two files of one key, the one holding
        more (or the later) is kept and the other removed. (Lock held.)"""
        old = self.index.get(key)
        if old is not None and old[0] != flags:
            if old[0] | flags == old[0]:  # the known one holds all this one does
                files.unlink(self._path(key, flags))
                return
            files.unlink(self._path(key, old[0]))
        if old is not None:
            self.nbytes -= old[1]
        self.index[key] = (flags, size)
        self.index.move_to_end(key)
        self.nbytes += size

    def _forget(self, key: bytes, flags: int | None = None) -> None:
        """Forget `key`'s file (only the one of `flags`, if given). (Takes the lock.)"""
        with self.lock:
            entry = self.index.get(key)
            if entry is not None and (flags is None or entry[0] == flags):
                del self.index[key]
                self.nbytes -= entry[1]

    def _refresh(self, key: bytes) -> None:
        """Learn the files of `key`'s directory that other processes wrote (block files of
        this place only: anything else there is removed)."""
        d = os.path.join(self.root, key.hex()[:2])
        for name in files.listdir(d):
            parsed = _parse_name(name)
            with self.lock:
                if parsed is None or parsed[0] in self.index and self.index[parsed[0]][0] == parsed[1]:
                    continue
            full = os.path.join(d, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if self._known(full, name, st) is not None:
                with self.lock:
                    self._remember(parsed[0], parsed[1], st.st_size)

    def _make_room(self, nbytes: int) -> list[str]:
        """Forget files, least recently used first, until `nbytes` more fit the limit; returns
        their paths, for the caller to remove outside the lock. (Lock held.)"""
        paths = []
        while self.index and self.nbytes + nbytes > self.limit:
            key, (flags, _) = next(iter(self.index.items()))
            self._forget(key)
            paths.append(self._path(key, flags))
        return paths


def _parse_name(name: str) -> tuple[bytes, int] | None:
    """(key, flags) of a block file's name `<key hex>.<flags hex>.kv`, or None."""
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "kv" or len(parts[0]) != 32:
        return None
    try:
        return bytes.fromhex(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


__all__ = ["DiskTier", "HEADER", "MAGIC", "write_file"]
