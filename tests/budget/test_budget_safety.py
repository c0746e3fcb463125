"""A shared budget on a host that other users share (issue 29): who may join, files that
are not tables, numbers past the table, and leaving a damaged table.

Where another user matters, the files are planted by a second user (uid 65534, "nobody",
run with `subprocess.run(user=)`), as a local user would; those tests skip where this
process cannot switch users (not root). Every file made outside the test's own temporary
directory is in a fresh directory of /dev/shm, removed after the test.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import vattn
from tests.conftest import REPO
from tests.helpers import NOBODY
from vattn.budget import shared as budget_shared
from vattn.budget.shared import directory as directory_mod
from vattn.budget.shared import table as table_mod
from vattn.budget.shared import wake

MAX = (1 << 63) - 1  # a table's largest byte value
MiB = 1 << 20


@pytest.fixture(autouse=True)
def budget_dir(tmp_path, monkeypatch):
    """Every test's budgets in its own private directory (0700, as pytest makes it)."""
    d = tmp_path / "budgets"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(budget_shared.DIR_ENV, str(d))
    return d




@pytest.fixture
def shm():
    """A fresh directory in /dev/shm (the temporary directory where there is none), that
    other users can enter; removed with all in it after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="vattn-test-", dir=base))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def group_dir(shm, second_user, monkeypatch):
    """The opt-in to budgets shared between users: a directory root shares with nobody's
    group (owner root, group 65534, mode 2770), named by VATTN_BUDGET_DIR."""
    d = shm / "team"
    d.mkdir()
    os.chown(d, 0, NOBODY)
    d.chmod(0o2770)
    monkeypatch.setenv(budget_shared.DIR_ENV, str(d))
    return d


def _join(name: str = "x", limit: int | None = MiB, **kw) -> vattn.Budget:
    return vattn.Budget.shared(name, limit, device="cpu", **kw)


# -------------------------------------------------------- 1. links are not followed ----
def test_a_link_another_user_plants_is_never_followed(group_dir, second_user, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's data")
    victim.chmod(0o600)
    table = budget_shared.table_path("x", "host")
    second_user(f"ln -s {victim} {table}")
    with pytest.raises(vattn.InvalidConfigError, match="a symbolic link") as e:
        _join()
    assert str(table) in str(e.value) and f"uid {NOBODY}" in str(e.value) and "remove it" in str(e.value)
    assert victim.read_bytes() == b"root's data"  # neither grown nor written
    assert table.is_symlink()  # left as it was: not this process's to remove


def test_a_squatted_user_directory_is_refused(shm, second_user, monkeypatch, tmp_path):
    """Without VATTN_BUDGET_DIR the tables are in this user's own directory of a
    world-writable one (/dev/shm/vattn-UID): one another user made first is refused."""
    shm.chmod(0o1777)  # like /dev/shm
    monkeypatch.delenv(budget_shared.DIR_ENV)
    monkeypatch.setattr(directory_mod, "SHM", shm)
    mine = shm / f"vattn-{os.geteuid()}"
    assert budget_shared.budget_dir() == mine
    second_user(f"ln -s {tmp_path} {mine}")  # a link to a directory of root's
    with pytest.raises(vattn.InvalidConfigError, match="a symbolic link, not a directory"):
        _join()
    assert list(tmp_path.iterdir()) == [tmp_path / "budgets"]  # nothing made through the link
    second_user(f"rm {mine} && mkdir -m 0777 {mine}")  # a directory of its own
    with pytest.raises(vattn.InvalidConfigError, match=f"owned by uid {NOBODY}") as e:
        _join()
    assert "mode 0777" in str(e.value) and str(mine) in str(e.value)
    assert list(mine.iterdir()) == []
    shutil.rmtree(mine)  # gone: this user's own is made, 0700, its tables 0600
    b = _join()
    try:
        assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o700 and os.lstat(mine).st_uid == os.geteuid()
        assert b.path.parent == mine and stat.S_IMODE(os.stat(b.path).st_mode) == 0o600
    finally:
        b.close()


# ------------------------------------------- 2. a table someone else made is not joined ----
@pytest.mark.parametrize("mode", [0o666, 0o600])
def test_a_table_another_user_made_first_is_never_adopted(group_dir, second_user, mode):
    table = budget_shared.table_path("x", "host")
    second_user(f"touch {table} && chmod {mode:o} {table}")
    with pytest.raises(vattn.InvalidConfigError) as e:
        _join()
    msg = str(e.value)
    assert str(table) in msg and f"owner uid {NOBODY}" in msg and f"mode {mode:04o}" in msg and "remove it" in msg
    assert os.stat(table).st_size == 0  # not grown, not written


def test_a_directory_anyone_can_write_is_refused(shm, monkeypatch, budget_dir):
    shm.chmod(0o1777)  # the flat /dev/shm of earlier versions
    monkeypatch.setenv(budget_shared.DIR_ENV, str(shm))
    with pytest.raises(vattn.InvalidConfigError, match="writable by every user"):
        _join()
    assert list(shm.iterdir()) == []
    budget_dir.chmod(0o770)  # group-writable, no set-group-ID bit: not shared on purpose
    monkeypatch.setenv(budget_shared.DIR_ENV, str(budget_dir))
    with pytest.raises(vattn.InvalidConfigError, match="chmod 2770"):
        _join()


def test_a_group_directory_shares_budgets_on_purpose(group_dir, second_user):
    """The opt-in: in a 2770 directory the tables are the group's (0660); a member of the
    group may start a table (here an empty one, as if its creator had died) that root joins."""
    second_user(f"touch {group_dir}/vattn-budget-team@host && chmod 660 {group_dir}/vattn-budget-team@host")
    b = _join("team")
    try:
        st = os.stat(b.path)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, NOBODY, NOBODY)
        assert b.try_take(4096) and b.budget_limit == MiB
        second_user(f"test -r {b.path} && test -w {b.path}")  # the group reads and writes it
        (shown,) = budget_shared.list_budgets("team")
        assert shown["used"] == 4096
        b.give(4096)
    finally:
        b.close()
    c = _join("made")  # made here: the group's too
    try:
        st = os.stat(c.path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
    finally:
        c.close()


# ------------------------------------------------ 3. readers skip what is not a table ----
def _plant_strays(d: Path) -> dict[str, str]:
    """Files named like tables that are not ones: name -> what the skipped line says."""
    strays = {"vattn-budget-junk@host": "is not a budget table", "vattn-budget-zeros@host": "is not a budget table",
              "vattn-budget-dir@host": "a directory", "vattn-budget-fifo@host": "a FIFO",
              "vattn-budget-link@host": "a symbolic link"}
    (d / "vattn-budget-junk@host").write_bytes(b"garbage")
    (d / "vattn-budget-zeros@host").write_bytes(b"VATTNBDG" + os.urandom(table_mod._SIZE - 8))
    (d / "vattn-budget-dir@host").mkdir()
    os.mkfifo(d / "vattn-budget-fifo@host", 0o600)
    (d / "vattn-budget-link@host").symlink_to("/dev/zero")
    for p in d.iterdir():
        if not p.is_symlink() and p.is_file():
            p.chmod(0o600)
    if os.geteuid() == 0:  # another user's table (0600): root can make one
        other = d / "vattn-budget-other@host"
        other.write_bytes(bytes(table_mod._SIZE))
        other.chmod(0o600)
        os.chown(other, NOBODY, NOBODY)
        strays[other.name] = f"owned by uid {NOBODY}"
    return strays


def test_readers_list_the_budgets_beside_stray_files(budget_dir):
    b = _join("good", 4 * MiB)
    try:
        strays = _plant_strays(budget_dir)
        seen = budget_shared.survey()
        assert [x["name"] for x in seen.budgets] == ["good"] == [x["name"] for x in budget_shared.list_budgets()]
        why = {Path(s.path).name: s.why for s in seen.skipped}
        assert set(why) == set(strays)
        for name, words in strays.items():
            assert words in why[name], (name, why[name])
        env = dict(os.environ, PYTHONPATH=str(REPO))
        out = subprocess.run([sys.executable, "-m", "vattn", "top", "--json"], capture_output=True, text=True,
                             cwd=REPO, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)  # valid JSON, the skipped files in their own list
        assert [x["name"] for x in shown["budgets"]] == ["good"]
        assert {Path(s["path"]).name for s in shown["skipped"]} == set(strays)
        text = subprocess.run([sys.executable, "-m", "vattn", "top", "--once"], capture_output=True, text=True,
                              cwd=REPO, timeout=120, env=env)
        assert text.returncode == 0, text.stderr
        assert "budget good on host: limit 4.0 MiB" in text.stdout
        assert f"skipped: {budget_dir / 'vattn-budget-fifo@host'}, a FIFO, not a budget table" in text.stdout
        assert text.stdout.count("skipped: ") == len(strays)
        out = subprocess.run([sys.executable, "-m", "vattn", "budget", "set-limit", "good", "2M"],
                             capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        assert b.budget_limit == 2 * MiB
    finally:
        b.close()
    assert (budget_dir / "vattn-budget-dir@host").is_dir() and stat.S_ISFIFO(
        os.lstat(budget_dir / "vattn-budget-fifo@host").st_mode)  # readers remove no stray


# ------------------------------------- 4. something else at the table's path: an error ----
@pytest.mark.parametrize("kind", ["directory", "fifo", "link to /dev/zero", "garbage", "another mode"])
def test_joining_over_something_else_is_a_clear_error(budget_dir, kind):
    path = budget_shared.table_path("odd", "host")
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"not a table")
        path.chmod(0o600 if kind == "garbage" else 0o644)
    words = {"directory": "a directory", "fifo": "a FIFO", "link to /dev/zero": "a symbolic link",
             "garbage": "is not a budget table", "another mode": "mode 0644, not 0600"}[kind]
    with pytest.raises(vattn.InvalidConfigError, match=words) as e:
        _join("odd")
    assert str(path) in str(e.value)
    assert os.path.lexists(path) and len(list(budget_dir.iterdir())) == 1  # left as it was
    if kind in ("garbage", "another mode"):
        assert path.read_bytes() == b"not a table"


# ----------------------------------------------- 5. numbers are checked before packing ----
@pytest.mark.parametrize("field", ["limit", "member_limit"])
@pytest.mark.parametrize("value", [1 << 63, np.uint64((1 << 64) - 1), -1], ids=["2**63", "uint64-max", "-1"])
def test_a_byte_value_the_table_cannot_hold_is_refused_before_joining(budget_dir, field, value):
    with pytest.raises(vattn.InvalidConfigError, match=rf"{field} must be an int of bytes in \[0, {MAX}\]"):
        vattn.Budget.shared("big", device="cpu", **{field: value})
    assert list(budget_dir.iterdir()) == []  # no table, no row left behind


def test_limits_set_at_run_time_are_checked_too(budget_dir):
    b = _join("big")
    try:
        with pytest.raises(vattn.InvalidConfigError, match=rf"limit must be an int of bytes in \[0, {MAX}\]"):
            b.set_limit(1 << 63)
        with pytest.raises(vattn.InvalidConfigError, match=rf"member_limit must be .*{MAX}"):
            b.set_member_limit(np.uint64((1 << 64) - 1))
        with pytest.raises(vattn.InvalidConfigError, match=rf"limit must be .*{MAX}"):
            budget_shared.set_limit("big", 1 << 63)
        with pytest.raises(vattn.InvalidRequestError, match=rf"nbytes must be an int in \[0, {MAX}\]"):
            b.try_take(1 << 63)
        b.set_limit(MAX)  # the largest is fine
        assert b.budget_limit == MAX and b.try_take(MAX) and not b.try_take(1)
        b.give(MAX)
        out = subprocess.run([sys.executable, "-m", "vattn", "budget", "set-limit", "big", "99999999999T"],
                             capture_output=True, text=True, cwd=REPO, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert out.returncode == 2 and f"at most {MAX} bytes" in out.stderr and "Traceback" not in out.stderr
        assert b.budget_limit == MAX
    finally:
        b.close()


@pytest.mark.parametrize("device", [7, "nonsense", "cuda:3"])
def test_the_device_must_exist(budget_dir, device):
    if device == "cuda:3" and torch.cuda.device_count() > 3:
        pytest.skip("this host has a cuda:3")
    words = "no CUDA device|has [0-9]+ CUDA device" if device == "cuda:3" else "device must be"
    with pytest.raises(vattn.InvalidConfigError, match=words):
        vattn.Budget.shared("dev", MiB, device=device)
    assert list(budget_dir.iterdir()) == []


@pytest.mark.parametrize("how", ["label", "argv", "again"])
def test_a_label_utf8_cannot_hold_shows_escaped(budget_dir, monkeypatch, how):
    """A lone surrogate (what sys.argv holds for a byte that is not UTF-8), in the label given,
    in the command the default label is taken from, or in the label of a second join, is
    written escaped: the join works, `vattn top` shows it, leaving removes the table."""
    monkeypatch.setattr(sys, "argv", ["caf\udce9.py"] if how == "argv" else ["serve.py"])
    first = "caf\udce9" if how == "label" else None
    b = _join("lbl", label=first)
    try:
        if how == "again":  # the same member, its label changed
            assert _join("lbl", label="caf\udce9") is b
        label = budget_shared.list_budgets("lbl")[0]["members"][0]["label"]
        assert label == ("caf\\udce9.py" if how == "argv" else "caf\\udce9"), label
    finally:
        b.close()
    assert list(budget_dir.iterdir()) == []  # nothing left behind


# ------------------------------------------------------ 6. leaving always works ----
_LEAVE = textwrap.dedent("""
    import json, logging, os, sys
    import numpy as np
    import vattn
    from vattn.budget.shared import table
    from vattn.vmem.host import process_page_bytes

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    damage = sys.argv[1]
    b = vattn.Budget.shared("dmg", 1 << 20, device="cpu", label="victim")
    c = vattn.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=2, max_context_len=512,
                      dtype="float32", device="cpu", page_size=4096, prefetch=False, budget=b)
    pool = vattn.ElasticPool(64, (32, 2, 16), "float32", 4, device="cpu", page_size=4096, budget=b)
    r = c.alloc_reqid()
    assert c.step({r: 256}) and pool.alloc(8) is not None
    held = process_page_bytes(os.getpid())
    with open(b.path, "r+b") as f:
        if damage == "zeroed":
            f.write(bytes(table._SIZE))
        elif damage == "garbage":
            f.write(os.urandom(table._SIZE))
        elif damage == "row taken":  # another process's row where this one's was
            f.seek(table._HEADER_BYTES + b._row * table.ROW.itemsize + 16)
            f.write(np.int64(12345).tobytes())
        elif damage == "cut short":
            f.truncate(0)
    try:
        c.step({r: 512, c.alloc_reqid(): 512})  # more than the pages made so far: a take
        grew = "no error"
    except vattn.VattnError as e:
        grew = type(e).__name__
    c.close()
    pool.close()
    b.close()
    print(json.dumps({"held": held, "after": process_page_bytes(os.getpid()), "closed": b.closed, "grew": grew,
                      "participants": len(b._participants)}))
""")


@pytest.mark.parametrize("damage", ["zeroed", "garbage", "row taken", "cut short"])
def test_leaving_a_damaged_table_gives_the_memory_back(budget_dir, damage):
    """A cache and an elastic pool on the budget, the table damaged under them: closing them
    and the budget works and their memory goes back to the kernel. In a child process (a
    table cut short would kill a process that read past its end)."""
    out = subprocess.run([sys.executable, "-c", _LEAVE, damage], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.splitlines()[-1])
    assert res["held"] > 0 and res["after"] == 0 and res["closed"] and res["participants"] == 0, res
    assert res["grew"] == "DamagedTableError", res  # never a take on books that are not this member's
    assert "WARNING:vattn.budget" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    path = budget_shared.table_path("dmg", "host")
    b = _join("dmg")  # a new budget where the damaged one was
    try:
        assert [m["label"] for m in budget_shared.list_budgets("dmg")[0]["members"]] != ["victim"]
        assert b.try_take(4096)
        b.give(4096)
    finally:
        b.close()
    assert not path.exists()


# ------------------------------------------------------------------- wake-ups ----
def test_wake_ups_from_a_user_who_may_not_join_are_dropped(second_user):
    """Any local process can send to a member's abstract socket; the kernel names the
    sender, and only those of this user (or the shared directory's group) wake it."""
    import select
    import socket

    where = budget_shared.place(create=True)
    nonce = 0x5EED
    sock = wake.listen(nonce)
    if sock is None:
        pytest.skip("no abstract sockets here")
    try:
        def send(as_nobody: bool) -> None:
            pid = os.fork()
            if pid == 0:  # the child: become nobody (or stay), send one wake-up, exit
                code = 1
                try:
                    if as_nobody:
                        os.setgroups([])
                        os.setresgid(NOBODY, NOBODY, NOBODY)
                        os.setresuid(NOBODY, NOBODY, NOBODY)
                    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                        s.sendto(b"!", wake.wake_address(os.getppid(), nonce))
                    code = 0
                finally:
                    os._exit(code)
            assert os.waitpid(pid, 0)[1] == 0
            assert select.select([sock], [], [], 5)[0]

        send(as_nobody=True)
        assert not wake.drain(sock, where)  # read, and not counted
        send(as_nobody=False)
        assert wake.drain(sock, where)
    finally:
        sock.close()


# ------------------------------------------------------------- the import circle ----
def test_budget_and_budget_shared_import_no_circle():
    """Issue 30: `vattn.budget.shared` builds on `vattn.budget.base` through public names;
    `vattn.budget` imports it only inside `Budget.shared`, never at import time."""
    def module_level(path: Path) -> list[ast.ImportFrom | ast.Import]:
        return [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]

    for node in module_level(REPO / "vattn" / "budget" / "__init__.py"):
        names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        assert not any(str(n).startswith("vattn.budget.shared") for n in names)
    for path in (REPO / "vattn" / "budget" / "shared").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("vattn.budget", "vattn.budget.base"):
                assert not [a.name for a in node.names if a.name.startswith("_")], path
