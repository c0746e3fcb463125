"""`vattn.Budget.shared`: one memory budget for several processes, with real processes.

Each member is a child process (tests/budget/budget_member.py) with a host `KVCache` on the
budget, driven one command at a time and idle in between. Physical memory is measured
from outside, independently of vattn's books: the allocated bytes of each child's
`vattn-pages` memfd (/proc/PID/fd), the memory the host backend maps.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import vattn
from tests.conftest import REPO
from vattn.budget import shared as budget_shared
from vattn.budget.cli import format_budgets, human
from vattn.budget.shared import list_budgets
from vattn.vmem.host import process_page_bytes as memfd_bytes  # physical bytes, read from /proc

GROUP = 16 << 10  # tests/budget/budget_member.py: 2 layers x K/V x 4 KiB; 32 tokens of a slot
LIMIT = 32 * GROUP  # one whole slot (1024 tokens); a cache grows by 16 groups where there is room


@pytest.fixture(autouse=True)
def budget_dir(tmp_path, monkeypatch):
    """Every test's budgets in its own directory (the children inherit it)."""
    monkeypatch.setenv(budget_shared.DIR_ENV, str(tmp_path))
    return tmp_path


class Member:
    """A child process in the budget; `call(op, ...)` -> its JSON answer."""

    def __init__(self, name: str, *args: str) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.budget.budget_member", name, *args], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.pid = self._read(120)["ready"]

    def call(self, op: str, timeout: float = 60, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.log.seek(0)
            raise AssertionError(f"member {self.proc.pid} did not answer within {timeout} s:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture
def member():
    started: list[Member] = []

    def start(name: str, *args: str) -> Member:
        started.append(Member(name, *args))
        return started[-1]

    yield start
    for m in started:
        m.stop()


def books_and_memory(name: str, pids: list[int]) -> tuple[int, int]:
    """(bytes taken by all members, physical bytes of `pids`), read under the books' lock:
    no member can take meanwhile, and each creates pages only after taking, so the
    physical sum of one reading is bounded by the limit too."""
    path = budget_shared.table_path(name, "host")
    with budget_shared._reading(path) as t:
        assert t is not None, f"budget {name} is gone"
        return t.used(), sum(memfd_bytes(p) for p in pids)


def live_pids(name: str) -> list[int]:
    """The members' pids as the books have them, read without clearing dead ones (unlike
    `list_budgets`): what the members themselves did."""
    with budget_shared._reading(budget_shared.table_path(name, "host")) as t:
        return [int(t.rows["pid"][i]) for i in t.live()]


def wait_for(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def row(name: str, pid: int) -> dict | None:
    for b in list_budgets(name):
        for m in b["members"]:
            if m["pid"] == pid:
                return m
    return None


def _state(pid: int, tid: str) -> str:
    """The scheduler state letter of thread `tid` of `pid` (R, S, T for stopped, ...)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def fill_and_free(m: Member, tokens: int, tag: float = 1) -> None:
    """A request of `tokens` that writes them all and ends: its pages stay cached."""
    r = m.call("alloc")["out"]
    assert m.call("step", lens={r: tokens})["out"]["ok"]
    m.call("fill", r=r, n=tokens, tag=tag)
    m.call("free", r=r)


def step_until_ok(m: Member, lens: dict, timeout: float) -> tuple[int, float]:
    """Step until it is backed: (failed steps before, seconds)."""
    t0, failed = time.monotonic(), 0
    while not m.call("step", lens=lens)["out"]["ok"]:
        failed += 1
        assert time.monotonic() - t0 < timeout, f"still short after {timeout} s"
    return failed, time.monotonic() - t0


# ------------------------------------------------------------------ give-back ----
def test_an_idle_member_gives_its_cached_pages_to_another_process(member):
    a = member("burst", "--limit", str(LIMIT), "--label", "model-a")
    b = member("burst", "--label", "model-b")
    fill_and_free(a, 1024)  # the whole budget, cached once the request ended
    assert memfd_bytes(a.pid) == LIMIT and books_and_memory("burst", [a.pid, b.pid]) == (LIMIT, LIMIT)
    rb = b.call("alloc")["out"]
    first = b.call("step", lens={rb: 512})
    assert not first["out"]["ok"] and first["out"]["oom"]  # refused: a shortage now, as with vattn.Budget
    second = b.call("step", lens={rb: 512})  # asks a, which answers while idle (no call reaches it)
    assert second["out"]["ok"] and second["s"] < 1.0, second
    b.call("fill", r=rb, n=512, tag=2)
    assert b.call("intact", r=rb, n=512, tag=2)["out"]
    used, physical = books_and_memory("burst", [a.pid, b.pid])
    assert used == physical == LIMIT
    assert memfd_bytes(a.pid) == LIMIT - 16 * GROUP  # a's memory really went back to the kernel, what b needed
    m = row("burst", a.pid)
    assert m["label"] == "model-a" and m["gave"] == m["last_give_back_bytes"] == 16 * GROUP
    assert row("burst", b.pid)["refusals"] >= 1


def test_a_short_member_asks_for_a_share_of_the_budget_at_once(member):
    """A member one page group short asks the others for an eighth of the limit (of what they
    cache): the rest of its burst then takes without another round trip to their responders."""
    a = member("share", "--limit", str(LIMIT))
    b = member("share")
    fill_and_free(a, 1024)  # the whole budget cached by a
    wait_for(lambda: row("share", a.pid)["cached"] == LIMIT, 10)  # as a's responder publishes it
    b.call("reclaim", n=GROUP)  # (what it returns: what a gave within ANSWER_S, 0 on a loaded host)
    wait_for(lambda: row("share", a.pid)["gave"] == LIMIT // 8, 10)  # 4 groups asked, not 1
    assert memfd_bytes(a.pid) == LIMIT - LIMIT // 8


def test_pages_under_live_data_are_never_taken(member):
    a = member("live", "--limit", str(LIMIT))
    b = member("live")
    ra = a.call("alloc")["out"]
    assert a.call("step", lens={ra: 768})["out"]["ok"]  # 24 groups, in use
    a.call("fill", r=ra, n=768, tag=1)
    rb = b.call("alloc")["out"]
    for _ in range(3):  # asking does not help: a has nothing cached
        res = b.call("step", lens={rb: 512})["out"]
        assert not res["ok"] and res["oom"]
    assert b.call("step", lens={rb: 256})["out"]["ok"]  # what is left fits
    assert a.call("intact", r=ra, n=768, tag=1)["out"]
    assert books_and_memory("live", [a.pid, b.pid])[1] == LIMIT


def test_a_member_killed_mid_burst_gives_its_share_back(member):
    a = member("crash", "--limit", str(LIMIT))
    b = member("crash")
    rb = b.call("alloc")["out"]
    assert b.call("step", lens={rb: 512})["out"]["ok"]
    b.call("fill", r=rb, n=512, tag=5)
    ra = a.call("alloc")["out"]
    assert a.call("step", lens={ra: 512})["out"]["ok"]  # the rest, in use
    rb2 = b.call("alloc")["out"]
    assert not b.call("step", lens={rb: 512, rb2: 256})["out"]["ok"]
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(timeout=20)
    _, seconds = step_until_ok(b, {rb: 512, rb2: 256}, timeout=5)
    assert seconds < 3  # its lease ended with it
    assert b.call("intact", r=rb, n=512, tag=5)["out"]  # nothing of b's was lost
    (budget,) = list_budgets("crash")
    assert [m["pid"] for m in budget["members"]] == [b.pid] and budget["used"] <= LIMIT


def test_the_books_are_never_left_locked(member, budget_dir):
    b = member("locked", "--limit", str(LIMIT))
    rb = b.call("alloc")["out"]
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, vattn\n"
        "b = vattn.Budget.shared('locked')\n"
        "assert b.try_take(4096)\n"
        "with b._table.locked():\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(600)\n")], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "holding"
        b.proc.stdin.write(json.dumps({"op": "step", "lens": {rb: 64}}) + "\n")  # waits for the books
        b.proc.stdin.flush()
        # it must not answer while the books are locked: watched for 0.3 s (a negative wait on another
        # process, which no event can replace; it fails at once if an answer comes)
        assert not select.select([b.proc.stdout], [], [], 0.3)[0]
        holder.kill()  # kill -9 while holding the books' lock
        assert b._read(5)["out"]["ok"]
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    wait_for(lambda: live_pids("locked") == [b.pid], 3)  # b cleared the dead member's row
    assert list_budgets("locked")[0]["used"] == memfd_bytes(b.pid) > 0  # the killed member's 4096 bytes are back


def test_a_member_that_never_answers_is_waited_for_once(member):
    a = member("stuck", "--limit", str(LIMIT))
    b = member("stuck")
    fill_and_free(a, 1024)
    os.kill(a.pid, signal.SIGSTOP)  # its responder cannot answer
    try:
        wait_for(lambda: all(_state(a.pid, t) == "T" for t in os.listdir(f"/proc/{a.pid}/task")), 2)  # every thread
        rb = b.call("alloc")["out"]
        assert not b.call("step", lens={rb: 512})["out"]["ok"]  # refused
        slow = b.call("step", lens={rb: 512})  # asks a and waits for it, ANSWER_S at most
        assert not slow["out"]["ok"] and budget_shared.ANSWER_S - 0.1 < slow["s"] < budget_shared.ANSWER_S + 1
        fast = b.call("step", lens={rb: 512})  # a left an ask unanswered: asked, not waited for
        assert not fast["out"]["ok"] and fast["s"] < 0.3, fast
        assert row("stuck", a.pid)["unresponsive"]
    finally:
        os.kill(a.pid, signal.SIGCONT)
    step_until_ok(b, {rb: 512}, timeout=5)  # once it runs again it answers
    assert not row("stuck", a.pid)["unresponsive"]


# --------------------------------------------------------------------- limits ----
def test_a_member_limit_is_never_exceeded_and_changes_at_run_time(member):
    a = member("caps", "--limit", str(LIMIT), "--member-limit", str(6 * GROUP))
    r = a.call("alloc")["out"]
    for _ in range(2):
        res = a.call("step", lens={r: 224})  # 7 groups: over its own limit, though the budget has room
        assert not res["out"]["ok"] and res["member_used"] <= 6 * GROUP
    assert a.call("step", lens={r: 192})["out"]["ok"]
    a.call("free", r=r)  # 6 groups cached
    out = subprocess.run([sys.executable, "-m", "vattn", "budget", "set-limit", "caps", "64KiB", "--pid",
                          str(a.pid)], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert f"member {a.pid} of budget caps" in out.stdout
    wait_for(lambda: memfd_bytes(a.pid) <= 4 * GROUP, 2)  # its responder gave back what was over
    assert row("caps", a.pid)["limit"] == 4 * GROUP and row("caps", a.pid)["mapped"] <= 4 * GROUP
    r = a.call("alloc")["out"]
    assert not a.call("step", lens={r: 160})["out"]["ok"]  # 5 groups
    assert memfd_bytes(a.pid) <= 4 * GROUP


def test_lowering_the_budget_s_limit_takes_cached_memory_back(member):
    a = member("shrink", "--limit", str(LIMIT))
    b = member("shrink")
    fill_and_free(a, 1024)
    rb = b.call("alloc")["out"]
    assert not b.call("step", lens={rb: 32})["out"]["ok"]
    out = subprocess.run([sys.executable, "-m", "vattn", "budget", "set-limit", "shrink", str(16 * GROUP)],
                         capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    wait_for(lambda: memfd_bytes(a.pid) <= 16 * GROUP, 2)  # a, idle, gave back what was over
    assert list_budgets("shrink")[0]["limit"] == 16 * GROUP
    step_until_ok(b, {rb: 32}, timeout=3)
    assert books_and_memory("shrink", [a.pid, b.pid])[1] <= 16 * GROUP


# ------------------------------------------------------------------ many, at once ----
def test_processes_churning_at_once_never_exceed_the_limit(member):
    members = [member("churn", "--limit", str(LIMIT), "--label", f"m{i}") for i in range(3)]
    for i, m in enumerate(members):  # each runs random requests for 3 s on its own, checking its data
        m.proc.stdin.write(json.dumps({"op": "churn", "seconds": 3, "seed": i}) + "\n")
        m.proc.stdin.flush()
    samples = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        samples.append(books_and_memory("churn", [m.pid for m in members]))
        time.sleep(0.005)
    results = [m._read(30)["out"] for m in members]
    assert len(samples) > 50
    assert max(u for u, _ in samples) <= LIMIT and max(p for _, p in samples) <= LIMIT, max(samples)
    assert max(p for _, p in samples) >= LIMIT // 2  # they did fill it
    assert all(r["ok"] > 5 for r in results), results  # each got memory, the others' cached pages included
    assert sum(row("churn", m.pid)["gave"] for m in members) > 0


def test_two_engines_in_two_processes_take_turns(member):
    """`LLM(budget=Budget.shared(...))` in two processes: the second engine serves its
    requests with the pages the first, idle, gives back; outputs equal transformers'."""
    pytest.importorskip("transformers")
    from tests.helpers import reference

    limit = 8 * GROUP  # the tiny models' 16 KiB groups: each engine alone needs more, so it preempts
    a = member("engines", "--limit", str(limit), "--llm", "llama")
    b = member("engines", "--llm", "qwen2")
    out_a = a.call("generate", timeout=120)
    assert out_a["out"]["tokens"] == [list(r) for r in reference("llama")]
    held = out_a["created"]
    assert held > 0 and out_a["budget_used"] <= limit
    out_b = b.call("generate", timeout=120)
    assert out_b["out"]["tokens"] == [list(r) for r in reference("qwen2")]
    assert out_b["created"] > limit - held and out_b["budget_used"] <= limit
    assert row("engines", a.pid)["mapped"] < held  # a gave b its free pages
    assert books_and_memory("engines", [a.pid, b.pid])[1] <= limit


# ---------------------------------------------------------------- vattn top ----
def test_vattn_top_shows_the_members(member):
    a = member("shown", "--limit", str(LIMIT), "--label", "tiny-a")
    b = member("shown", "--label", "tiny-b")
    fill_and_free(a, 128)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "vattn", "top", "--json"], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["skipped"] == []
    (budget,) = shown["budgets"]
    assert budget["name"] == "shown" and budget["device"] == "host" and budget["limit"] == LIMIT
    rows = {m["pid"]: m for m in budget["members"]}
    assert set(rows) == {a.pid, b.pid}
    assert rows[a.pid]["label"] == "tiny-a" and rows[a.pid]["mapped"] == memfd_bytes(a.pid) == 16 * GROUP
    wait_for(lambda: row("shown", a.pid)["cached"] == 16 * GROUP, 1)  # published by its responder
    assert row("shown", a.pid)["used"] == 0  # the request ended: all cached
    assert rows[b.pid]["mapped"] == 0 and budget["used"] == 16 * GROUP
    text = subprocess.run([sys.executable, "-m", "vattn", "top", "--once"], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=env).stdout
    assert "budget shown on host: limit 512.0 KiB, used 256.0 KiB (50 %), 2 members" in text
    assert f"{a.pid}" in text and "tiny-a" in text and "tiny-b" in text


def test_vattn_top_shows_what_the_offload_tiers_hold(budget_dir):
    """A member's host tier (here a swapped-out request; prefix blocks count the same) is
    shown beside the budget, not in it: HOST in `vattn top`, "host" in `list_budgets`."""
    b = vattn.Budget.shared("tiers", LIMIT, label="tiered")
    try:
        with vattn.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=2, max_context_len=512,
                           dtype="float32", device="cpu", page_size=4096, prefetch=False, budget=b) as c:
            r = c.alloc_reqid()
            assert c.step({r: 96})
            h = c.swap_out(r, 96)  # held while its handle lives
            held = c.stats().host_bytes
            assert held > 0 and b.tier_bytes() == (held, 0)
            wait_for(lambda: row("tiers", os.getpid())["host"] == held, 1)  # published by the responder
            assert row("tiers", os.getpid())["disk"] == 0
            text = format_budgets(list_budgets("tiers"))
            assert "HOST" in text and "DISK" in text and human(held) in text
            del h
        assert b.tier_bytes() == (0, 0)  # the cache closed: its tiers left the budget
        wait_for(lambda: row("tiers", os.getpid())["host"] == 0, 1)
    finally:
        b.close()


# ------------------------------------------------------------- in one process ----
def test_one_member_per_process_and_what_it_checks():
    b = vattn.Budget.shared("solo", 4 * GROUP, label="x")
    try:
        assert vattn.Budget.shared("solo", label="y") is b  # joined once per process
        assert isinstance(b, vattn.Budget) and b.limit == 4 * GROUP and b.used == 0
        assert b.try_take(3 * GROUP) and not b.try_take(2 * GROUP)
        b.set_member_limit(3 * GROUP)
        s = b.stats()
        assert (s.limit, s.budget_limit, s.member_limit, s.member_used) == (3 * GROUP, 4 * GROUP, 3 * GROUP, 3 * GROUP)
        assert not b.try_take(1) and b.reclaimable() == 0
        b.set_member_limit(None)
        with pytest.raises(vattn.InvalidRequestError, match="more than the"):
            b.give(4 * GROUP)
        b.give(3 * GROUP)
        with vattn.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=2, max_context_len=512,
                           dtype="float32", device="cpu", page_size=4096, prefetch=False, budget=b) as c:
            with pytest.raises(vattn.InvalidRequestError, match="close them first"):
                b.close()
            r = c.alloc_reqid()
            assert c.step({r: 64})
            assert b.used == c.stats().num_created_pages * GROUP
        assert b.used == 0
    finally:
        b.close()
    assert b.closed and not b.try_take(1)
    assert list_budgets("solo") == []  # the budget ended with its last member
    for bad in ("", "a b", "-x", "x" * 65, 3):
        with pytest.raises(vattn.InvalidConfigError, match="name"):
            vattn.Budget.shared(bad)


def test_a_forked_child_is_told_to_join_itself():
    b = vattn.Budget.shared("forked", GROUP)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the parent's membership is not its own
            code = 1
            try:
                b.try_take(1)
            except vattn.ClosedError as e:
                code = 0 if "must call vattn.Budget.shared itself" in str(e) else 2
            os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert b.used == 0
    finally:
        b.close()


@pytest.mark.gpu
def test_two_processes_share_a_gpu_budget(member):
    """On a GPU: the budget is the GPU's (its UUID in the key), and device memory given back
    by an idle process is taken by another (2 MiB pages: a slot of the members is one
    8 MiB page group)."""
    import torch

    key = budget_shared.device_key("cuda")
    assert key.startswith("cuda-") and key != "cuda-", key
    group = 4 * (2 << 20)
    a = member("gpu", "--device", "cuda", "--limit", str(4 * group))
    b = member("gpu", "--device", "cuda")
    rs = [a.call("alloc")["out"] for _ in range(4)]
    assert a.call("step", lens={r: 1024 for r in rs})["out"]["ok"]  # the whole budget
    for r in rs:
        a.call("fill", r=r, n=1024, tag=1)
        assert a.call("intact", r=r, n=1024, tag=1)["out"]
        a.call("free", r=r)
    free_before = torch.cuda.mem_get_info()[0]
    rb = b.call("alloc")["out"]
    assert not b.call("step", lens={rb: 1024})["out"]["ok"]
    res = b.call("step", lens={rb: 1024})
    assert res["out"]["ok"] and res["s"] < 1.0, res  # a, idle, gave its device memory back
    b.call("fill", r=rb, n=1024, tag=2)
    assert b.call("intact", r=rb, n=1024, tag=2)["out"]
    (budget,) = list_budgets("gpu")
    assert budget["device"] == key and budget["used"] <= 4 * group
    assert abs(torch.cuda.mem_get_info()[0] - free_before) <= 2 * group  # moved, not added
