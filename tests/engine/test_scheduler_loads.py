"""The scheduler and disk reads ahead (`PrefixCache.load`, as vLLM's WAITING_FOR_REMOTE_KVS):
a request whose cached blocks are being read waits in its place while the requests behind it
are admitted; it is admitted once its reads end, or after LOAD_PATIENCE_S, never later; a
schedule with nothing else to run waits a little for a read rather than spin. Plain Python: a
fake prefix cache that says which requests are still reading."""
from __future__ import annotations

import time

import pytest

from tests.helpers import FakeKV, fake_advance, make_seq
from vattn.engine import scheduler as sched_mod
from vattn.engine.scheduler import Scheduler, SchedulerConfig


class Reads:
    """A prefix cache whose `load` says "still reading" for prompts of the lengths in `busy`."""

    def __init__(self, *busy: int) -> None:
        self.busy = set(busy)
        self.loads: list[int] = []  # prompt lengths asked
        self.waits = 0
        self.mapped: list[int] = []

    def load(self, token_ids: list[int]) -> bool:
        self.loads.append(len(token_ids))
        return len(token_ids) in self.busy

    def wait_loads(self, timeout: float) -> None:
        self.waits += 1

    def map_prefix(self, reqid: int, token_ids: list[int]) -> int:
        self.mapped.append(len(token_ids))
        return 0

    def insert(self, reqid: int, token_ids: list[int]) -> None:
        pass


def test_a_request_waiting_for_its_reads_lets_the_ones_behind_it_go_first() -> None:
    cache = Reads(10)  # request 0 (10 tokens) waits for its blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), FakeKV(4), prefix_cache=cache)
    a, b, c = make_seq(0, 10), make_seq(1, 11), make_seq(2, 12)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [b, c]  # a keeps its place, the others run
    assert list(sched.waiting) == [a] and a.seq_id in sched.loading
    assert cache.loads[0] == 10
    fake_advance(sched, out)
    out = sched.schedule()  # still reading
    assert a not in [s.seq for s in out.scheduled] and cache.loads[-1] == 10
    fake_advance(sched, out)
    cache.busy.clear()  # its reads ended
    out = sched.schedule()
    assert a in [s.seq for s in out.scheduled] and not sched.loading and cache.mapped[-1] == 10


def test_a_request_is_admitted_after_its_patience_even_if_its_reads_never_end(monkeypatch) -> None:
    monkeypatch.setattr(sched_mod, "LOAD_PATIENCE_S", 0.05)
    cache = Reads(10)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), FakeKV(4), prefix_cache=cache)
    a = make_seq(0, 10)
    sched.add(a)
    out = sched.schedule()
    assert not out.scheduled and cache.waits == 1  # nothing else to run: it waited for a read, not spun
    time.sleep(0.06)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a] and not sched.loading


def test_an_aborted_waiting_request_leaves_no_read_behind() -> None:
    cache = Reads(10)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), FakeKV(4), prefix_cache=cache)
    a = make_seq(0, 10)
    sched.add(a)
    sched.schedule()
    assert a.seq_id in sched.loading
    sched.abort([0])
    assert not sched.loading and not sched.waiting


@pytest.mark.parametrize("error", [RuntimeError("reader died"), OSError(5, "I/O error")])
def test_a_load_that_raises_admits_the_request(error) -> None:
    class Broken(Reads):
        def load(self, token_ids: list[int]) -> bool:
            raise error

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), FakeKV(4), prefix_cache=Broken())
    a = make_seq(0, 10)
    sched.add(a)
    assert [s.seq for s in sched.schedule().scheduled] == [a]
