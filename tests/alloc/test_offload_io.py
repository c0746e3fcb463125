"""The disk tier's I/O off the engine's thread (`vattn.offload.diskio`): a bounded write queue
that drops (counted) rather than block a step, warnings one line per kind, a limit that grows
back after a full disk, a complete copy replacing one saved with holes, a close that ends
within its bound; and the host store hands its victims to the tiers, knowing nothing of disk."""
from __future__ import annotations

import ast
import errno
import logging
import queue
import threading
import time
from pathlib import Path

import vattn
from tests.conftest import REPO, SMALL, cached as cache_prompt, fill
from vattn.offload import disk as disk_mod
from vattn.prefix_cache import PrefixCache

KB, MB = 1 << 10, 1 << 20
BLOCK = 4 * 4 * KB  # a block's bytes in host memory (SMALL at 4 KiB pages)
SALT = "tiny-test-model"


def cache() -> vattn.KVCache:
    return vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False)


def cached(c: vattn.KVCache, pc: PrefixCache, prompt: list[int], tag: float) -> None:
    cache_prompt(c, pc, prompt, tag, flush=False)  # (these tests watch the tiers' writes themselves)


def one_block(i: int) -> list[int]:
    """A prompt of one whole block (and one token more), different for each `i`."""
    return list(range(1000 * i, 1000 * i + 33))


def gated_writes(monkeypatch, gate: threading.Event, calls: list | None = None) -> None:
    real = disk_mod.write_file

    def write_file(path, parts, mode=0o600):
        if calls is not None:
            calls.append(threading.current_thread().name)
        gate.wait(5)
        real(path, parts, mode)

    monkeypatch.setattr(disk_mod, "write_file", write_file)


def test_the_host_store_knows_nothing_of_the_disk_tier():
    tree = ast.parse((REPO / "vattn/offload/host.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "DiskTier" not in names and "vattn.offload.disk" not in modules
    assert "disk" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def test_a_full_write_queue_drops_the_write_and_never_blocks_a_step(tmp_path, monkeypatch):
    """The disk stalls (every write waits): caching goes on at host speed; what the queue
    cannot hold is dropped and counted, and the writer writes the rest once the disk is back."""
    gate, calls = threading.Event(), []
    gated_writes(monkeypatch, gate, calls)
    c = cache()
    pc = PrefixCache(c, salt=SALT, offload_bytes=BLOCK, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
    io = pc.tiers.io
    io.writes = queue.Queue(2)
    try:
        t0 = time.monotonic()
        for i in range(10):  # one block each: every one after the first evicts the one before
            cached(c, pc, one_block(i), i)
        assert time.monotonic() - t0 < 2.0  # no step waited for the disk
        assert io.num_dropped_writes >= 9 - 2 - 1  # (the queue's 2, and one being written)
        assert set(calls) <= {"vattn-disk-writer"}
        gate.set()
        assert pc.tiers.flush()
        assert io.num_written == 9 - io.num_dropped_writes == len(list(tmp_path.rglob("*.kv")))
    finally:
        gate.set()
        c.close()


def test_a_read_only_disk_logs_one_line_not_one_per_block(tmp_path, monkeypatch, caplog):
    def write_file(path, parts, mode=0o600):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk_mod, "write_file", write_file)
    c = cache()
    pc = PrefixCache(c, salt=SALT, offload_bytes=BLOCK, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(20):
                cached(c, pc, one_block(i), i)
            assert pc.tiers.flush()
        assert pc.tiers.disk.num_write_failures == 19
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING and "offloaded block" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        c.close()


def test_the_limit_grows_back_once_writes_succeed_after_a_full_disk(tmp_path, monkeypatch):
    real, full = disk_mod.write_file, [True]

    def write_file(path, parts, mode=0o600):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, parts, mode)

    c = cache()
    limit = 64 * (BLOCK + 4 * KB)
    pc = PrefixCache(c, salt=SALT, offload_bytes=BLOCK, offload_dir=tmp_path, offload_dir_bytes=limit)
    disk = pc.tiers.disk
    try:
        full[0] = False
        for i in range(3):
            cached(c, pc, one_block(i), i)
        assert pc.tiers.flush() and disk.nbytes > 0
        full[0] = True
        monkeypatch.setattr(disk_mod, "write_file", write_file)
        for i in range(3, 6):
            cached(c, pc, one_block(i), i)
        assert pc.tiers.flush()
        assert disk.num_full >= 1 and disk.limit < limit
        full[0] = False  # the disk has room again
        for i in range(6, 9):
            cached(c, pc, one_block(i), i)
        assert pc.tiers.flush()
        assert disk.limit == limit and disk.nbytes > 0
    finally:
        c.close()


def test_a_complete_copy_replaces_one_saved_with_holes(tmp_path):
    """A block cached while a sliding window had given one of its pages back is kept without
    that part; cached again complete, the complete copy replaces it: in host memory, and on
    disk (the file with less is removed)."""
    prompt = list(range(33))

    def save(holes: bool) -> tuple[vattn.KVCache, PrefixCache, bytes]:
        c = cache()
        pc = PrefixCache(c, salt=SALT, offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
        r = c.alloc_reqid()
        assert c.step({r: 33})
        fill(c, r, 0, 33, 3)
        key = pc.block_hashes(prompt)[0]
        pc.tiers.save(r, [key], [[holes]])
        c.free_reqid(r)
        return c, pc, key

    c, pc, key = save(holes=True)
    assert pc.tiers.locate(key) == ("host", 0)  # a block of holes only
    r = c.alloc_reqid()
    assert c.step({r: 33})
    pc.tiers.save(r, [key], [[False]])
    assert pc.tiers.locate(key) == ("host", 1)  # complete now
    c.close()
    assert [p.name.split(".")[1] for p in tmp_path.rglob("*.kv")] == ["1"]

    for p in tmp_path.rglob("*.kv"):
        p.unlink()
    c, pc, key = save(holes=True)
    c.close()
    assert [p.name.split(".")[1] for p in tmp_path.rglob("*.kv")] == ["0"]  # the disk holds the holey one
    c, pc, key = save(holes=False)
    assert pc.tiers.locate(key) == ("host", 1)
    c.close()
    assert [p.name.split(".")[1] for p in tmp_path.rglob("*.kv")] == ["1"]  # replaced


def test_close_writes_within_its_bound_then_drops_the_rest(tmp_path, monkeypatch, caplog):
    real = disk_mod.write_file

    def slow(path, parts, mode=0o600):
        time.sleep(0.05)
        real(path, parts, mode)

    c = cache()
    pc = PrefixCache(c, salt=SALT, offload_bytes=64 * BLOCK, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
    for i in range(40):
        cached(c, pc, one_block(i), i)  # all in host memory: close writes them
    monkeypatch.setattr(disk_mod, "write_file", slow)
    io = pc.tiers.io
    io.close_s = 0.3
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
    assert took < 1.0, took
    assert 0 < io.num_written < 40 and io.num_dropped_at_close > 0
    lines = [r.getMessage() for r in caplog.records if "closing the disk tier" in r.getMessage()]
    assert len(lines) == 1 and "were not written" in lines[0]


def test_close_writes_every_block_when_the_disk_keeps_up(tmp_path):
    c = cache()
    pc = PrefixCache(c, salt=SALT, offload_bytes=64 * BLOCK, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
    for i in range(20):
        cached(c, pc, one_block(i), i)
    c.close()
    assert len(list(Path(tmp_path).rglob("*.kv"))) == 20 and pc.tiers.io.num_dropped_at_close == 0


def test_blocks_read_ahead_wait_in_the_host_budget_for_their_lookup(tmp_path, monkeypatch):
    """`PrefixCache.load` reads a prompt's blocks on disk only in the background; they wait
    for its lookup booked in the host tier's budget (never evicted by other blocks), the
    lookup takes them (a disk hit, no read on its thread), and one nobody takes goes after
    STAGE_S."""
    from vattn.offload import tiers as tiers_mod

    c = cache()
    pc = PrefixCache(c, salt=SALT, offload_bytes=2 * BLOCK, offload_dir=tmp_path, offload_dir_bytes=4 * MB)
    tiers, store = pc.tiers, c.host
    try:
        for i in range(4):
            cached(c, pc, one_block(i), i)  # blocks 0 and 1 go to disk
        assert tiers.flush()
        c.trim()
        key = pc.block_hashes(one_block(0))[0]
        assert tiers.locate(key) == ("disk", 1)
        assert pc.load(one_block(0) + [1])  # come back later: its read runs on the reader thread
        assert tiers.flush() and key in tiers.staged and store.leased == BLOCK
        for i in range(4, 7):
            cached(c, pc, one_block(i), i)  # the host tier turns over: the staged block stays
        assert key in tiers.staged and not pc.load(one_block(0) + [1])
        reads = tiers.io.num_reads
        r = c.alloc_reqid()
        assert pc.map_prefix(r, one_block(0) + [1]) == 32 and pc.num_disk_hit_tokens == 32
        c.free_reqid(r)
        assert not tiers.staged and store.leased == 0 and tiers.io.num_reads == reads
        key = pc.block_hashes(one_block(1))[0]
        assert pc.load(one_block(1) + [1]) and tiers.flush() and key in tiers.staged
        monkeypatch.setattr(tiers_mod, "STAGE_S", 0.0)  # nobody came for it
        tiers.poll()
        assert not tiers.staged and store.leased == 0
    finally:
        c.close()
