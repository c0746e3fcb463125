"""The disk tier on a shared host (docs/shared-pages.md, "Threat model"): an `offload_dir`
another user could write is refused at start (`UnsafeOffloadDirError`), unless shared with a
group on purpose (mode 2770); a file vattn would not have made (another user's, a FIFO, a
link, the wrong size) is a miss and removed, opened without blocking and never read whole.
The second user is uid 65534, as in tests/budget/test_budget_safety.py (root only)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

import vattn
from tests.conftest import SMALL, cached as cache_prompt, check
from tests.helpers import NOBODY
from vattn.errors import InvalidConfigError, UnsafeOffloadDirError
from vattn.prefix_cache import PrefixCache

KB, MB = 1 << 10, 1 << 20
BLOCK = 4 * 4 * KB  # a block's bytes in host memory (SMALL at 4 KiB pages)
PROMPT = list(range(100))  # 3 whole blocks (the last token is always computed)
PROMPT2 = list(range(1000, 1100))
SALT = "tiny-test-model"




@pytest.fixture
def public():
    """A fresh directory every user can make things in (as /tmp: mode 1777); removed after the test."""
    d = Path(tempfile.mkdtemp(prefix="vattn-test-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cache() -> vattn.KVCache:
    return vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False)


def tiers(c: vattn.KVCache, d: Path, host: int = MB) -> PrefixCache:
    return PrefixCache(c, salt=SALT, offload_bytes=host, offload_dir=d, offload_dir_bytes=16 * MB)


def cached(c: vattn.KVCache, pc: PrefixCache, prompt: list[int], tag: float) -> None:
    cache_prompt(c, pc, prompt, tag, flush=False)  # (these tests watch the tiers' writes themselves)


def hit(c: vattn.KVCache, pc: PrefixCache, prompt: list[int], tag: float) -> int:
    """Tokens a new request maps of `prompt`; what it maps must be `tag`'s data."""
    r = c.alloc_reqid()
    n = pc.map_prefix(r, prompt)
    check(c, r, n, tag)
    assert c.step({r: len(prompt)})
    c.free_reqid(r)
    return n


def on_disk(d: Path, tag: float, prompt: list[int] = PROMPT) -> list[Path]:
    """`prompt`'s blocks (`tag`'s data) written to files in `d` by a process that closed;
    their paths, block by block."""
    c = cache()
    pc = tiers(c, d)
    cached(c, pc, prompt, tag)
    keys = pc.block_hashes(prompt[:len(prompt) - 1])
    c.close()  # (the host tier's blocks go to disk)
    files = sorted(d.rglob("*.kv"))
    return [next(p for p in files if p.name.startswith(k.hex())) for k in keys]


# ---------------------------------------------------------------- the directory ----
def test_a_directory_another_user_could_write_is_refused(second_user, public):
    """The reviewer's attack: a second user makes the directory first, world-writable (or
    keeps it), and writes blocks there under a valid header and checksum. vattn refuses the
    directory at start, naming it, its owner and mode: no block of it is ever served."""
    clean = public / "mine"
    clean.mkdir(mode=0o700)
    poison = on_disk(clean, 7)  # valid files of these keys, with another prompt's data (tag 7)
    theirs = public / "vattn-offload"
    second_user(f"mkdir -m 0777 {theirs}")
    shutil.copytree(clean / poison[0].parent.parent.name, theirs / poison[0].parent.parent.name)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(theirs)], check=True)
    c = cache()
    try:
        with pytest.raises(UnsafeOffloadDirError, match=r"uid 65534.*mode 0777.*owned by uid 65534") as e:
            tiers(c, theirs)
        assert e.value.path == str(theirs) and isinstance(e.value, InvalidConfigError)
        clean.chmod(0o777)  # the user's own, made world-writable: anyone could have planted blocks
        with pytest.raises(UnsafeOffloadDirError, match=r"mode 0777\) is writable by every user"):
            tiers(c, clean)
        second_user(f"chmod 0755 {theirs}")  # another user's, even read-only to others
        with pytest.raises(UnsafeOffloadDirError, match="owned by uid 65534"):
            tiers(c, theirs)
        link = public / "link"
        link.symlink_to(theirs)  # a link to it: the directory it names is checked
        with pytest.raises(UnsafeOffloadDirError, match="owned by uid 65534"):
            tiers(c, link)
        mine = public / "group-writable"
        mine.mkdir()
        mine.chmod(0o770)  # shared by accident: no set-group-ID bit
        with pytest.raises(UnsafeOffloadDirError, match="without the set-group-ID bit"):
            tiers(c, mine)
        # the user's own directory serves the user's own blocks
        own = public / "own"
        own.mkdir(mode=0o700)
        pc = tiers(c, own)
        cached(c, pc, PROMPT, 3)
        c.trim()
        assert hit(c, pc, PROMPT + [1], 3) == 96
    finally:
        c.close()


def test_a_directory_vattn_made_that_another_user_took_is_refused(second_user, public):
    own = public / "own"
    own.mkdir(mode=0o700)
    files = on_disk(own, 1)
    shard = files[0].parent
    os.chown(shard, NOBODY, NOBODY)
    c = cache()
    try:
        with pytest.raises(UnsafeOffloadDirError, match="owned by uid 65534"):
            tiers(c, own)
    finally:
        c.close()


def test_a_group_directory_shares_on_purpose(second_user, public):
    """mode 2770 of a group the user is in (root is in every group): accepted; files are made
    0660 of that group, directories 2770, so members of the group read each other's blocks."""
    team = public / "team"
    team.mkdir()
    os.chown(team, 0, NOBODY)
    team.chmod(0o2770)
    files = on_disk(team, 2)
    for p in files:
        st = p.stat()
        assert st.st_gid == NOBODY and stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(p.parent.stat().st_mode) == 0o2770 and p.parent.stat().st_gid == NOBODY
    c = cache()
    try:
        pc = tiers(c, team)
        assert hit(c, pc, PROMPT + [1], 2) == 96 and pc.num_disk_hit_tokens == 96
    finally:
        c.close()


# --------------------------------------------------------------------- the files ----
def test_a_file_another_user_owns_is_a_miss_and_removed(second_user, tmp_path):
    """A block file of the right name, size, header and checksum but another user's (and
    another prompt's data): never served, removed."""
    files = on_disk(tmp_path, 4)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    poison = on_disk(other, 9)  # the same keys, tag 9's data
    shutil.copyfile(poison[1], files[1])
    os.chown(files[1], NOBODY, NOBODY)
    c = cache()
    try:
        pc = tiers(c, tmp_path)
        assert hit(c, pc, PROMPT + [1], 4) == 32  # the first block; the foreign one ends the hit
        assert not files[1].exists() and pc.tiers.disk.num_bad_files == 1
    finally:
        c.close()


def _read_with_deadline(pc: PrefixCache, c: vattn.KVCache, prompt: list[int], tag: float, fifo: Path) -> int:
    """`hit` in a thread that must end within 10 s; if it hangs (a FIFO opened for reading
    blocks until a writer comes), the FIFO is opened for writing to free it, and the test fails."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(hit(c, pc, prompt, tag)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("reading a FIFO planted as a block file hung the lookup")
    return out[0]


def test_a_fifo_planted_as_a_block_is_a_miss_at_start_and_while_running(tmp_path):
    files = on_disk(tmp_path, 5)
    later = on_disk(tmp_path, 5, PROMPT2)
    files[1].unlink()
    os.mkfifo(files[1], 0o600)  # at start: found by the scan
    c = cache()
    try:
        pc = tiers(c, tmp_path)
        assert pc.tiers.disk.locate(pc.block_hashes(PROMPT2)[0]) is not None
        assert _read_with_deadline(pc, c, PROMPT + [1], 5, files[1]) == 32
        assert not files[1].exists()
        later[1].unlink()
        os.mkfifo(later[1], 0o600)  # while running: a file the tier knows, replaced
        assert _read_with_deadline(pc, c, PROMPT2 + [1], 5, later[1]) == 32
        assert not later[1].exists()
    finally:
        c.close()


def test_a_large_file_planted_while_running_is_a_miss_never_read(tmp_path):
    """A sparse 256 MiB file in place of a block the tier knows: its size is not the
    layout's, so it is removed unread (bytes read by this process stay small)."""
    files = on_disk(tmp_path, 6)
    c = cache()
    try:
        pc = tiers(c, tmp_path)
        assert pc.tiers.disk.locate(pc.block_hashes(PROMPT[:96])[1]) is not None
        files[1].unlink()
        with open(files[1], "wb") as f:
            f.truncate(256 * MB)
        files[1].chmod(0o600)
        before = _bytes_read()
        assert hit(c, pc, PROMPT + [1], 6) == 32
        assert _bytes_read() - before < 8 * MB
        assert not files[1].exists()
    finally:
        c.close()


def test_a_symbolic_link_is_not_followed(tmp_path):
    """A block file replaced by a link to another (valid, this user's) block file: a miss;
    the link is removed, its target left alone."""
    files = on_disk(tmp_path, 8)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    target = on_disk(other, 9)[1]
    files[1].unlink()
    files[1].symlink_to(target)
    c = cache()
    try:
        pc = tiers(c, tmp_path)
        assert hit(c, pc, PROMPT + [1], 8) == 32
        assert not files[1].is_symlink() and target.exists()
    finally:
        c.close()


def test_files_are_made_private(tmp_path):
    files = on_disk(tmp_path, 1)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600 and p.stat().st_uid == os.geteuid()
        assert stat.S_IMODE(p.parent.stat().st_mode) & 0o077 == 0


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
