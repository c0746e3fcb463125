"""The offload tiers under the slot API's prefix cache (`vattn.offload`): blocks copied to
host memory when cached, restored page by page into a new request after device memory let
them go; evicted from host memory to files that outlive the process; every fault a miss,
never wrong data. Data is checked through the cache's own tensors (`fill` / `check`)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vattn
from tests.conftest import REPO, SMALL, cached, check, fill
from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError
from vattn.offload import disk as disk_mod
from vattn.prefix_cache import PrefixCache

KB = 1 << 10
TPP = 32  # SMALL at 4 KiB pages: 128-byte tokens, 32 a page; a block is one page of each of 4 buffers
BLOCK = 4 * 4 * KB  # a block's bytes (host tier) on the host; its file adds a header
PROMPT = list(range(100))  # 3 whole blocks (the last token is always computed)
MB = 1 << 20
SALT = "tiny-test-model"  # a disk tier needs a salt naming the weights


def blk(cache: vattn.KVCache) -> int:
    """A block's bytes (one page group: the fake CUDA driver's pages are larger, as many tokens)."""
    return cache.geometry.group_bytes


def hit(cache: vattn.KVCache, pc: PrefixCache, prompt: list[int], tag: float | None) -> int:
    """A new request looks `prompt` up; what it mapped must hold `tag`'s data (checked
    through its own row), and it runs on to its end. Returns the tokens mapped."""
    r = cache.alloc_reqid()
    n = pc.map_prefix(r, prompt)
    if tag is not None:
        if cache.host.copier.cuda:  # a restore runs on the copy stream: the request's step waits for it, so do we
            cache.host.copier.wait_slots([r])
        check(cache, r, n, tag)
    cache.allocator.check_invariants()
    assert cache.step({r: len(prompt)})
    cache.free_reqid(r)
    return n


# ------------------------------------------------------------------------- host tier ----
def test_evicted_blocks_come_back_from_host_memory(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 1)
    assert c.host.nbytes == 3 * blk(c) and c.stats().host_bytes == 3 * blk(c)  # written through when cached
    assert c.trim() and c.stats().num_pinned_pages == 0  # device memory let them go
    assert hit(c, pc, PROMPT + [5], 1) == 96  # restored, page by page, into a new slot
    assert (pc.num_hit_tokens, pc.num_host_hit_tokens, pc.num_disk_hit_tokens) == (96, 96, 0)
    assert c.stats().num_pinned_pages == 3  # in device memory again: the next hit maps them, no copy
    assert hit(c, pc, PROMPT + [6], 1) == 96 and pc.num_host_hit_tokens == 96
    c.allocator.check_invariants()


def test_a_restore_takes_only_what_the_request_can_run_with(make_cache):
    """`map_prefix(fits=)`: blocks are restored from a lower tier only up to the longest prefix
    the request can then run with (the scheduler asks `KVCache.can_step`); refused, nothing is
    restored or mapped. `uncount` takes a lookup's counts back (a request left waiting)."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 1)
    c.trim()
    q = pc.num_query_tokens
    asked: list[int] = []
    r = c.alloc_reqid()
    assert pc.map_prefix(r, PROMPT + [5], fits=lambda n: asked.append(n) or False) == 0
    assert asked[0] == 96 and c.allocator.num_tokens(r) == 0 and c.stats().num_pinned_pages == 0
    assert pc.num_host_hit_tokens == 0 and pc.num_restores_held_back == 1
    pc.uncount(r)
    assert pc.num_query_tokens == q
    c.free_reqid(r)
    r = c.alloc_reqid()
    assert pc.map_prefix(r, PROMPT + [5], fits=lambda n: n <= 2 * TPP) == 2 * TPP  # the most that fits
    check(c, r, 2 * TPP, 1)
    assert (pc.num_query_tokens, pc.num_hit_tokens, pc.num_host_hit_tokens) == (q + 101, 64, 64)
    pc.uncount(r)
    pc.uncount(r)  # (once)
    assert (pc.num_query_tokens, pc.num_hit_tokens, pc.num_host_hit_tokens) == (q, 0, 0)
    c.free_reqid(r)
    assert hit(c, pc, PROMPT + [6], 1) == 96  # two blocks mapped from device memory, one restored
    assert pc.num_host_hit_tokens == TPP


def test_can_step_plans_without_mapping(make_cache):
    """`KVCache.can_step`: what `step` would back, from the books alone (nothing maps)."""
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=4 * BLOCK)
    a, b = c.alloc_reqid(), c.alloc_reqid()
    assert c.can_step({a: 4 * TPP}) and not c.can_step({a: 4 * TPP, b: 1})
    assert c.stats().num_mapped_pages == 0
    assert c.step({a: 2 * TPP})
    assert c.can_step({a: 2 * TPP, b: 2 * TPP}) and not c.can_step({a: 3 * TPP, b: 2 * TPP})
    assert c.step({a: 2 * TPP, b: 2 * TPP})


def test_device_blocks_then_host_blocks_make_one_hit(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=8 * BLOCK)
    pc = PrefixCache(c, offload_bytes=64 * blk(c))
    long = list(range(200))  # 6 whole blocks
    cached(c, pc, long, 2)
    cached(c, pc, long[:97], 2)  # its first 3 blocks are the most recently used
    other = c.alloc_reqid()  # 5 groups of 8: two free tail pages, then the least recently used pins
    assert c.step({other: 5 * TPP})
    c.free_reqid(other)
    assert c.stats().num_pinned_pages == 3
    n = hit(c, pc, long + [1], 2)
    assert n == 6 * TPP and pc.num_host_hit_tokens == 3 * TPP  # device blocks, then host blocks


def test_the_host_tier_evicts_least_recently_used_blocks_to_nothing_without_disk(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, offload_bytes=4 * blk(c))
    a, b = list(range(65)), list(range(1000, 1065))  # two blocks each
    cached(c, pc, a, 1)
    cached(c, pc, b, 2)
    cached(c, pc, a, 1)  # a is the most recently used
    cached(c, pc, list(range(2000, 2065)), 3)  # evicts b
    assert c.host.nbytes == 4 * blk(c) and c.host.num_evicted == 2
    c.trim()
    assert hit(c, pc, a, 1) == 64 and hit(c, pc, b, None) == 0


# ------------------------------------------------------------------------- disk tier ----
def disk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv"))


def test_blocks_go_to_disk_and_survive_a_restart(make_cache, tmp_path):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=2 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 4)  # three blocks, two fit in host memory: the first goes to disk
    assert len(disk_files(tmp_path)) == 1 and c.stats().disk_bytes > blk(c)
    c.trim()
    assert hit(c, pc, PROMPT + [9], 4) == 96
    assert pc.num_disk_hit_tokens == 32 and pc.num_host_hit_tokens == 64
    c.close()  # the host tier's blocks go to disk too (close waits for the writes)
    assert len(disk_files(tmp_path)) == 3

    again = make_cache(page_size=4 * KB, prefetch=False)
    pc2 = PrefixCache(again, salt="m", offload_bytes=64 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    assert pc2.tiers.disk_bytes == sum(p.stat().st_size for p in disk_files(tmp_path))
    assert hit(again, pc2, PROMPT + [9], 4) == 96 and pc2.num_disk_hit_tokens == 96


@pytest.mark.parametrize("change", ["salt", "page_size", "dtype", "heads"])
def test_another_model_or_geometry_never_matches(tmp_path, change):
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=MB)
    cached(c, pc, PROMPT, 5)
    c.close()
    kw = dict(page_size=4 * KB, prefetch=False)
    salt = "m"
    if change == "salt":
        salt = "another model"
    elif change == "page_size":
        kw["page_size"] = 8 * KB
    elif change == "dtype":
        kw["dtype"] = "float16"
    else:
        kw["num_kv_heads"] = 4
    other = vattn.KVCache(**{**SMALL, **kw}, device="cpu")
    pc2 = PrefixCache(other, salt=salt, offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=MB)
    assert pc2.tiers.disk_bytes == 0  # another identity: another directory
    assert hit(other, pc2, PROMPT + [1], None) == 0
    other.close()
    assert len(list(tmp_path.glob("vattn-kv-*"))) == 2


def corrupt(path: Path, how: str, other: Path) -> None:
    data = path.read_bytes()
    if how == "flipped":
        i = len(data) - 100
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:])
    elif how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "header":
        path.write_bytes(b"NOTVATTN" + data[8:])
    else:  # foreign: another block's whole, valid file under this block's name
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("how", ["flipped", "truncated", "empty", "header", "foreign"])
def test_a_damaged_or_foreign_file_is_a_miss_never_wrong_data(make_cache, tmp_path, how):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt=SALT, offload_bytes=64 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 6)
    c.close()
    files = disk_files(tmp_path)
    keys = pc.block_hashes(PROMPT[:96])
    second = next(p for p in files if p.name.startswith(keys[1].hex()))
    corrupt(second, how, next(p for p in files if p.name.startswith(keys[2].hex())))
    again = make_cache(page_size=4 * KB, prefetch=False)
    pc2 = PrefixCache(again, salt=SALT, offload_bytes=64 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    assert hit(again, pc2, PROMPT + [3], 6) == 32  # the first block; the bad one ends the hit
    assert pc2.tiers.disk.num_bad_files == 1 and not second.exists()  # removed
    assert hit(again, pc2, PROMPT + [3], 6) == 32  # (and it stays a miss)


def test_an_unwritable_dir_or_a_byte_count_that_does_not_fit_is_refused_at_start(tmp_path):
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidConfigError, match="not a directory this process can write"):
        PrefixCache(c, salt=SALT, offload_bytes=MB, offload_dir=blocker / "kv", offload_dir_bytes=MB)
    with pytest.raises(InvalidConfigError, match="holds no prefix block"):
        PrefixCache(c, offload_bytes=BLOCK - 1)
    with pytest.raises(InvalidConfigError, match="more than the host has available"):
        PrefixCache(c, offload_bytes=1 << 60)
    with pytest.raises(InvalidConfigError, match="holds no block"):
        PrefixCache(c, salt=SALT, offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=BLOCK)
    with pytest.raises(InvalidConfigError, match="more than"):
        PrefixCache(c, salt=SALT, offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=1 << 62)
    for kw, msg in ((dict(offload_dir=tmp_path, offload_dir_bytes=MB), "needs offload_bytes"),
                    (dict(offload_bytes=MB, offload_dir=tmp_path), "needs offload_dir_bytes"),
                    (dict(offload_bytes=MB, offload_dir_bytes=MB), "needs offload_dir"),
                    (dict(offload_bytes=0), "offload_bytes must be"),
                    (dict(offload_bytes=MB, offload_dir=3, offload_dir_bytes=MB), "offload_dir must be"),
                    (dict(offload_bytes=MB, offload_dir=tmp_path, offload_dir_bytes=MB), "give salt= naming")):
        with pytest.raises(InvalidConfigError, match=msg):
            PrefixCache(c, **kw)
    c.close()


def test_a_full_disk_shrinks_the_tier_and_fails_no_request(make_cache, tmp_path, monkeypatch):
    """ENOSPC from the writes (a seam: the real thing needs a small filesystem, below): the
    tier evicts its own files and tries once more, then skips; requests never see it."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt=SALT, offload_bytes=blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    real, full = disk_mod.write_file, []

    def write_file(path, parts, mode=0o600):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, parts, mode)

    monkeypatch.setattr(disk_mod, "write_file", write_file)
    cached(c, pc, list(range(65)), 1)  # two blocks: one in host memory, one on disk
    disk = pc.tiers.disk
    assert disk.nbytes and len(disk_files(tmp_path)) == 1
    full.append(True)
    cached(c, pc, list(range(500, 565)), 2)  # the disk is full: evict, try again, skip
    assert disk.num_full >= 1 and disk.limit <= disk.nbytes + 1 and disk.num_write_failures >= 1
    assert not list(tmp_path.rglob("*.tmp"))  # no temporary file left behind
    c.trim()
    assert hit(c, pc, list(range(500, 566)), 2) in (0, 32, 64)
    assert hit(c, pc, list(range(65)) + [1], 1) in (0, 32, 64)


def _mount_tmpfs(path: Path, size: str) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_really_full_disk(tmp_path):
    """A 160 KiB tmpfs that another file fills after the start (root only: skipped elsewhere)."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "160k"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    try:
        c = vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False)
        pc = PrefixCache(c, salt=SALT, offload_bytes=BLOCK, offload_dir=mnt, offload_dir_bytes=128 * KB)
        cached(c, pc, list(range(97)), 1)  # 3 blocks: 2 to disk
        (mnt / "filler").write_bytes(b"x" * (160 * KB - 3 * 4 * KB - 2 * (BLOCK + 4 * KB)))
        for i in range(6):
            cached(c, pc, list(range(1000 * (i + 2), 1000 * (i + 2) + 97)), i + 2)  # the disk fills
        disk = pc.tiers.disk
        assert disk.num_full >= 1 and disk.nbytes <= disk.limit
        for p in disk_files(mnt):  # every file left is whole
            assert p.stat().st_size == disk_mod.HEADER.size + BLOCK
        c.trim()
        assert hit(c, pc, list(range(7000, 7097)), 7) >= 32  # the newest blocks are there
        c.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_restore_that_fails_computes_the_tokens(make_cache, monkeypatch):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, offload_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 1)
    c.trim()

    def broken(*args, **kw):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(pc.tiers, "restore", broken)
    assert hit(c, pc, PROMPT + [1], None) == 0 and pc.num_restore_failures == 1
    c.allocator.check_invariants()
    monkeypatch.undo()
    assert hit(c, pc, PROMPT + [1], 1) == 96  # the blocks are still in host memory


def test_processes_share_one_offload_dir(tmp_path):
    """Two processes write and read the same blocks of one directory at once: every read is
    a whole, checked block (or a miss); none is torn."""
    script = f"""
import sys, vattn
sys.path.insert(0, {str(REPO)!r})
from tests.conftest import SMALL, fill, check
from vattn.prefix_cache import PrefixCache
tag = int(sys.argv[1])
c = vattn.KVCache(**SMALL, device="cpu", page_size=4096, prefetch=False)
pc = PrefixCache(c, salt="shared", offload_bytes={BLOCK}, offload_dir={str(tmp_path)!r}, offload_dir_bytes={MB})
hits = 0
for round in range(30):
    prompt = list(range(round % 5 * 1000, round % 5 * 1000 + 97))
    r = c.alloc_reqid()
    n = pc.map_prefix(r, prompt)
    check(c, r, n, round % 5)  # the same data whoever wrote it
    hits += n
    c.step({{r: 97}})
    fill(c, r, n, 97, round % 5)
    pc.insert(r, prompt)
    c.free_reqid(r)
    c.trim()
c.close()
print(hits, pc.tiers.disk.num_bad_files)
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for i in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(int(bad) == 0 for _, bad in outs) and sum(int(h) for h, _ in outs) > 0


# ------------------------------------------------------------------- swap, one store ----
def test_swapped_requests_and_blocks_share_one_host_budget(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    BLOCK = blk(c)  # noqa: N806
    pc = PrefixCache(c, offload_bytes=6 * BLOCK)
    cached(c, pc, PROMPT, 1)  # 3 blocks
    r = c.alloc_reqid()
    assert c.step({r: 96})
    fill(c, r, 0, 96, 2)
    h = c.swap_out(r, 96)  # 3 pages of 4 buffers: the store evicts no block yet
    assert c.host.leased == 3 * BLOCK and c.host.nbytes == 6 * BLOCK and len(c.host.blocks) == 3
    s = c.alloc_reqid()
    assert c.step({s: 64})
    h2 = c.swap_out(s, 64)  # two more: two blocks are evicted for it
    assert len(c.host.blocks) == 1 and c.host.nbytes <= 6 * BLOCK
    q = c.alloc_reqid()
    assert c.step({q: 128})
    with pytest.raises(OutOfPhysicalMemoryError, match="bytes other swapped-out requests hold"):
        c.swap_out(q, 128)  # full of swapped-out requests: the scheduler recomputes instead
    assert len(c.host.blocks) == 1 and c.host.num_evicted == 2  # a refusal evicts nothing
    back = c.swap_in(h)
    check(c, back, 96, 2)
    del h, h2
    assert c.host.leased == 0  # their bytes went back with the handles
    c.free_reqid(back)
    c.free_reqid(q)


def test_a_swap_out_larger_than_the_host_store_is_refused_before_evicting_a_block(make_cache, tmp_path):
    """A refused swap_out changes nothing: the host tier keeps every block (it used to push
    them all out first, to disk or to nothing), and the request stays live and whole."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=8 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 1)  # 3 blocks in host memory
    big = c.alloc_reqid()
    assert c.step({big: 10 * TPP})  # 10 pages of 4 buffers: more than offload_bytes
    fill(c, big, 0, 10 * TPP, 2)
    with pytest.raises(OutOfPhysicalMemoryError, match=f"more than offload_bytes={8 * blk(c)}"):
        c.swap_out(big, 10 * TPP)
    assert len(c.host.blocks) == 3 and c.host.num_evicted == 0 and c.host.leased == 0 and not disk_files(tmp_path)
    check(c, big, 10 * TPP, 2)
    c.free_reqid(big)
    c.trim()
    assert hit(c, pc, PROMPT + [5], 1) == 96 and pc.num_host_hit_tokens == 96


def test_host_and_disk_blocks_make_one_hit(make_cache, tmp_path):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="m", offload_bytes=2 * blk(c), offload_dir=tmp_path, offload_dir_bytes=64 * blk(c))
    cached(c, pc, PROMPT, 8)
    c.trim()
    assert hit(c, pc, PROMPT + [2], 8) == 96
    assert pc.num_host_hit_tokens == 64 and pc.num_disk_hit_tokens == 32


def test_window_blocks_keep_only_what_the_window_held():
    """A window kind gives back pages behind its window before the prompt is cached: those
    blocks keep the full kind's part only, and a hit restores them only where the query after
    it reads none of the missing pages."""
    with vattn.KVCache(num_layers=2, num_kv_heads=1, head_dim=64, max_batch_size=3, max_context_len=512,
                       dtype="float32", device="cpu", page_size=4 * KB, layer_windows=(None, 16), prefetch=False,
                       background=False) as c:
        pc = PrefixCache(c, offload_bytes=MB)
        prompt = list(range(200))  # 16 tokens a page: 12 whole blocks
        r = c.alloc_reqid()
        for n in [*range(16, 200, 16), 200]:  # chunks: the window gives pages back as it goes
            assert c.step({r: n})
        for layer in range(2):  # (the window layer's pages behind its window are unmapped)
            lo = 0 if layer == 0 else 176
            c.k_cache(layer)[r, lo:200] = torch.arange(lo, 200.)[:, None, None] + layer
        pc.insert(r, prompt)
        c.free_reqid(r)
        flags = [c.host.blocks[k].flags(pc.tiers.layout) for k in pc.block_hashes(prompt)]
        assert flags[0] == 0b01 and flags[-1] == 0b11  # early blocks: the full kind only
        c.trim()
        s = c.alloc_reqid()
        n = pc.map_prefix(s, prompt + [1])
        assert n == 192  # the window's last pages were held: the whole chain
        for layer in range(2):
            k = c.k_cache(layer)[s]
            lo = 0 if layer == 0 else 192 - 16
            assert torch.equal(k[lo:192, 0, 0], torch.arange(lo, 192.) + layer)
        c.allocator.check_invariants()
        assert c.step({s: 201})
        t = c.alloc_reqid()  # the window's pages of the first blocks were never kept: computed
        assert pc.map_prefix(t, prompt[:40] + [1, 2]) == 0
        c.allocator.check_invariants()
