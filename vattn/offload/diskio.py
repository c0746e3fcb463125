"""The disk tier's I/O, off the engine's thread: one writer thread behind a bounded queue, and
one reader thread for the reads a request waits for.

```
engine thread                          writer thread                  reader thread
host store evicts a block --put-->  [queue, WRITE_QUEUE] --> wait its d2h copy, write the file
  (O(1); a full queue drops it, counted)
scheduler admits a request --load-->  [keys] ---------------------------------> read, check
  (O(1) a block)                                                                   |
prefix cache `poll`s  <---------------------------- done (key, block or None) <----'
  -> read blocks into the host store; the request is admitted, its blocks host hits
```
- **Writes.** `put` queues a block the host store let go of (`pending` holds it until it is
  written, so that a lookup meanwhile still finds it); the writer waits for the block's copy
  to host memory (`Copier.wait`), then `DiskTier.put`. A full queue never blocks a step: the
  block is dropped (`num_dropped_writes`; it is only not kept).
- **Reads.** `load` queues keys; the reader reads each (`DiskTier.get`: checked, a bad file is
  a miss) and posts the result to `done`, which the engine's thread takes (`completed`): the
  host store belongs to that thread. A read that fails is a miss; it ends all the same.
- **Close.** `close` writes what is queued, and the blocks it is given, for at most
  `close_s`; what is left then is dropped (`num_dropped_at_close`, one log line).
Both threads are daemons started on first use.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Iterable

from vattn.offload.disk import DiskTier
from vattn.offload.files import Warnings
from vattn.offload.host import HostBlock

logger = logging.getLogger(__name__)

WRITE_QUEUE = 256  # blocks waiting for the writer; more are dropped
CLOSE_S = 10.0  # close writes what is queued for at most this long


class DiskIO:
    """The reader and writer threads of one `DiskTier` (see the module docstring); the host
    store's sink. `put`, `load`, `completed` are the engine thread's."""

    def __init__(self, disk: DiskTier, max_queue: int = WRITE_QUEUE, close_s: float = CLOSE_S) -> None:
        self.disk = disk
        self.close_s = close_s
        self.writes: queue.Queue[tuple[bytes, HostBlock] | None] = queue.Queue(max_queue)
        self.pending: dict[bytes, HostBlock] = {}  # blocks queued or being written (under `lock`)
        self.lock = threading.Lock()
        self.reads: queue.Queue[bytes | None] = queue.Queue()
        self.loading: set[bytes] = set()  # keys asked to be read, not taken back yet (engine thread)
        self.done: deque[tuple[bytes, HostBlock | None]] = deque()  # reads finished (reader -> engine)
        self.read_event = threading.Event()  # set when a read finished
        self.num_written = 0
        self.num_dropped_writes = 0  # blocks not written: the queue was full
        self.num_dropped_at_close = 0  # blocks not written: close ran out of time
        self.num_reads = 0
        self.warnings = Warnings(logger)
        self._deadline: float | None = None  # set by close: the writer drops what it cannot write by then
        self._closed = False
        self._writer: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    # ---------------------------------------------------------------- writes ----
    def put(self, key: bytes, block: HostBlock) -> None:
        """Queue `block` to be written under `key`, or drop it (counted) when the queue is
        full or the tier closed. Never blocks."""
        if self._closed:
            self.num_dropped_writes += 1
            return
        self._start_writer()
        with self.lock:
            self.pending[key] = block
        try:
            self.writes.put_nowait((key, block))
        except queue.Full:
            with self.lock:
                if self.pending.get(key) is block:
                    del self.pending[key]
            self.num_dropped_writes += 1
            self.warnings.warn("queue", f"the disk tier's write queue is full ({self.writes.maxsize} blocks); a "
                                        "block evicted from host memory is not kept")

    def pending_block(self, key: bytes) -> HostBlock | None:
        """The block of `key` waiting to be written (or being written), if any."""
        with self.lock:
            return self.pending.get(key)

    def flush(self, timeout: float = CLOSE_S) -> bool:
        """Wait until every queued block was written (or failed), at most `timeout` seconds.
        True when none is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self.pending and self.writes.empty():
                    return True
            time.sleep(0.002)
        return False

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            key, block = item
            try:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self.num_dropped_at_close += 1  # (close ran out of time: the rest is dropped)
                elif self.disk.put(key, block):
                    block.on_disk = True
                    self.num_written += 1
            except Exception as e:  # noqa: BLE001 - a block not kept, never a dead writer
                self.warnings.warn("writer", f"writing an offloaded block failed ({type(e).__name__}: {e}); not kept")
            finally:
                with self.lock:
                    if self.pending.get(key) is block:
                        del self.pending[key]

    # ----------------------------------------------------------------- reads ----
    def load(self, keys: Iterable[bytes]) -> None:
        """Read the blocks of `keys` in the background (`completed` gives them back)."""
        self._start_reader()
        for key in keys:
            if key not in self.loading:
                self.loading.add(key)
                self.reads.put(key)

    def completed(self) -> list[tuple[bytes, HostBlock | None]]:
        """The reads finished since the last call: (key, the block, or None: a miss)."""
        out = []
        while self.done:
            key, block = self.done.popleft()
            self.loading.discard(key)
            out.append((key, block))
        return out

    def wait_reads(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a read to finish (none is asked for: no wait)."""
        if self.loading and not self.done:
            self.read_event.wait(timeout)
        self.read_event.clear()

    def _read_loop(self) -> None:
        while True:
            key = self.reads.get()
            if key is None:
                return
            block = None
            try:
                block = self.disk.get(key)
            except Exception as e:  # noqa: BLE001 - a miss, never a dead reader
                self.warnings.warn("reader", f"reading an offloaded block failed ({type(e).__name__}: {e}); a miss")
            self.num_reads += 1
            self.done.append((key, block))
            self.read_event.set()

    # ----------------------------------------------------------------- close ----
    def close(self, blocks: Iterable[tuple[bytes, HostBlock]] = ()) -> None:
        """Write what is queued and `blocks` (a closing host store's), for at most `close_s`
        seconds; drop the rest (counted, one log line). Idempotent."""
        if self._closed:
            return
        self._deadline = deadline = time.monotonic() + self.close_s
        blocks = list(blocks)
        if blocks:
            self._start_writer()
        for i, (key, block) in enumerate(blocks):
            try:
                with self.lock:
                    self.pending[key] = block
                self.writes.put((key, block), timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                with self.lock:
                    self.pending.pop(key, None)
                self.num_dropped_at_close += len(blocks) - i
                break
        self._closed = True
        if self._writer is not None:
            self._stop(self._writer, self.writes, deadline)
            while True:  # out of time: what is still queued is dropped (the writer finishes the one it has)
                try:
                    item = self.writes.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.num_dropped_at_close += 1
                    with self.lock:
                        if self.pending.get(item[0]) is item[1]:
                            del self.pending[item[0]]
            if self._writer.is_alive():
                self.writes.put_nowait(None)
        if self._reader is not None:
            self._stop(self._reader, self.reads, None)
        if self.num_dropped_at_close:
            logger.warning("vattn: closing the disk tier took its %.1f s: %d offloaded blocks were not written",
                           self.close_s, self.num_dropped_at_close)

    @staticmethod
    def _stop(thread: threading.Thread, q: queue.Queue, deadline: float | None) -> None:
        """Ask `thread` to end after what `q` holds; wait for it until `deadline` (None: no wait)."""
        left = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            q.put(None, timeout=left)
        except queue.Full:
            return
        thread.join(left)

    @property
    def disk_bytes(self) -> int:
        return self.disk.nbytes

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="vattn-disk-writer", daemon=True)
            self._writer.start()

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="vattn-disk-reader", daemon=True)
            self._reader.start()


__all__ = ["CLOSE_S", "DiskIO", "WRITE_QUEUE"]
