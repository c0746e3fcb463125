"""SGLang's scheduler loop on vattn memory with a device that refuses pages under load
(no SGLang, no GPU: the allocators and prefill budget of `tests/integrations/test_sglang_integration.py`,
host backend).

The loop is SGLang's, cut down: each step either a prefill pass (the prefill budget admits
waiting requests FCFS while `check_prefill` says they fit, continues a chunked request
by `available_chunk_tokens`, then the batch is allocated after evicting the radix cache) or
a decode step (the decode gate `check_decode_capacity`; when it fails, SGLang's retract
loop: the newest requests are released and requeued until the rest fits, the last one
aborted with an error if even it does not). An allocation that fails after its gate passed
raises SGLang's "Prefill/Decode out of memory" (the scheduler would stop). Finished
requests go into a page-level radix cache whose prefixes later requests reuse.

The model writes each token into every layer's K and V through the request's slots and
computes the next token from what it reads back: a page lost, moved or unmapped under a
request (or a cached prefix) changes its output. Outputs are compared with the same loop
on SGLang's own memory (`torch.zeros` buffers, no vattn). `tests/integrations/test_sglang_patch.py`
(slow) runs this loop on SGLang's real allocators, prefill budget and radix cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.integrations.test_sglang_integration import (L, VPAGE, MHATokenToKVPool, PagedTokenToKVPoolAllocator,
                                           PrefillBudget, TokenToKVPoolAllocator, check_books, chunk0, whole)
from vattn.errors import OutOfPhysicalMemoryError
from vattn.integrations import sglang as vs
from vattn.vmem.host import HostBackend


class Tenant:
    """Another process on the device: while `blocked`, every page creation is refused;
    with `left` set, creations beyond that many page groups are."""

    def __init__(self) -> None:
        self.blocked = False
        self.left: int | None = None
        self.refused = 0
        self.calls = 0


def refusing_backend(tenant: Tenant) -> HostBackend:
    class Refusing(HostBackend):
        def _create(self, n, num_buffers, page_size):
            tenant.calls += 1
            if tenant.blocked or (tenant.left is not None and n > tenant.left):
                tenant.refused += 1
                raise OutOfPhysicalMemoryError("injected: another process holds the device's memory")
            if tenant.left is not None:
                tenant.left -= n
            return super()._create(n, num_buffers, page_size)

    return Refusing()


# ------------------------------------------------------------- the radix cache ----
@dataclass
class _Node:
    locs: torch.Tensor  # the KV slots of one page of tokens
    parent: tuple | None
    ref: int = 0
    children: int = 0
    last: int = 0


class PageRadix:
    """SGLang's radix cache at page granularity: a node per page of a cached prefix
    (key: the tokens up to its end), locked along the path while a request uses it,
    evicted least recently used leaf first into the allocator."""

    def __init__(self, alloc, page_size: int) -> None:
        self.alloc, self.ps = alloc, page_size
        self.nodes: dict[tuple, _Node] = {}
        self.clock = 0

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_mamba(self) -> bool:
        return False

    def evictable_size(self) -> int:
        return sum(self.ps for n in self.nodes.values() if n.ref == 0)

    def match(self, tokens: list[int]) -> tuple[torch.Tensor, list[tuple]]:
        """The longest cached prefix of `tokens` (at least one token left to compute)."""
        path, locs = [], []
        self.clock += 1
        for k in range(1, (len(tokens) - 1) // self.ps + 1):
            key = tuple(tokens[:k * self.ps])
            node = self.nodes.get(key)
            if node is None:
                break
            node.last = self.clock
            path.append(key)
            locs.append(node.locs)
        return (torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)), path

    def lock(self, path: list[tuple] | None) -> None:
        for key in path or ():
            self.nodes[key].ref += 1

    def unlock(self, path: list[tuple] | None) -> None:
        for key in path or ():
            self.nodes[key].ref -= 1

    def insert(self, tokens: list[int], locs: torch.Tensor) -> int:
        """Cache the whole pages of `tokens` (slots `locs`); returns how many tokens were
        cached already (their slots in `locs` are the caller's to free, or the tree's own)."""
        present = 0
        for k in range(1, len(tokens) // self.ps + 1):
            key = tuple(tokens[:k * self.ps])
            if key in self.nodes:
                present = k * self.ps
                continue
            parent = tuple(tokens[:(k - 1) * self.ps]) if k > 1 else None
            self.nodes[key] = _Node(locs[(k - 1) * self.ps:k * self.ps].clone(), parent, last=self.clock)
            if parent is not None:
                self.nodes[parent].children += 1
        return present

    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens:
            leaves = [(n.last, key) for key, n in self.nodes.items() if n.ref == 0 and n.children == 0]
            if not leaves:
                break
            _, key = min(leaves)
            node = self.nodes.pop(key)
            if node.parent is not None:
                self.nodes[node.parent].children -= 1
            self.alloc.free(node.locs)
            freed += self.ps
        return freed

    def evict_for_alloc(self, params) -> None:  # SGLang's call (its allocators' evict_to_free_tokens)
        self.evict(params.num_tokens)

    def all_locs(self) -> list[torch.Tensor]:
        return [n.locs for n in self.nodes.values()]


# ------------------------------------------------------------------ requests ----
@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)
    path: object = None  # the radix-cache handle of the locked prefix (PageRadix: its keys)
    n_cached: int = 0  # tokens whose slots are the radix cache's
    locs: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # slots of computed tokens
    retracted: int = 0
    error: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new or bool(self.error)


class Model:
    """Writes token `t` at position `i` as (t % 120 + 1) into every layer's K (minus in V),
    reads the request's whole KV back and folds it into the next token."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def forward(self, req: Req, start: int, end: int) -> int:
        locs = req.locs[:end]
        vals = torch.tensor([t % 120 + 1 for t in req.tokens[start:end]], dtype=torch.float32)
        for layer in range(L):
            self.pool.k_buffer[layer][locs[start:end]] = vals[:, None, None]
            self.pool.v_buffer[layer][locs[start:end]] = -vals[:, None, None]
        s = 0
        seen = [self.pool.k_buffer[layer][locs][:, 0, 0] for layer in range(L)]
        for layer in range(L):
            assert torch.equal(seen[layer], seen[0]), f"{req.rid}: layers disagree"
            assert torch.equal(self.pool.v_buffer[layer][locs][:, 0, 0], -seen[0]), f"{req.rid}: K and V disagree"
        for i, v in enumerate(seen[0].tolist()):
            s = (s * 31 + int(v) * (i + 1)) % 1_000_003
        return s % 50 + 1


class Extend:
    """The allocation calls in SGLang's call shapes of the cut-down allocators."""

    @staticmethod
    def extend(alloc, prefix_lens, seq_lens, last_loc):
        return alloc.alloc_extend(prefix_lens, seq_lens, last_loc)

    @staticmethod
    def decode(alloc, seq_lens, last_loc):
        return alloc.alloc_decode(seq_lens, last_loc)


# --------------------------------------------------------------- the scheduler ----
class Scheduler:
    """SGLang's scheduling, cut down (see the module docstring)."""

    def __init__(self, alloc, tree, pool, *, budget_cls=PrefillBudget, calls=Extend, chunk: int = 64,
                 max_running: int = 8, ratio: float = 0.1) -> None:
        self.alloc, self.tree, self.model = alloc, tree, Model(pool)
        self.budget_cls, self.calls = budget_cls, calls
        self.ps = alloc.page_size
        self.chunk, self.max_running = chunk, max_running
        self.ratio = ratio  # SGLang's new-token ratio (it decays from 0.7 towards 0.1 under load)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.stats = {"prefill": 0, "decode": 0, "retracted": 0, "no_token": 0, "chunk_waits": 0, "aborted": 0}

    # -- prefill ----------------------------------------------------------------
    def _admit(self) -> list[tuple[Req, int, int]]:
        budget = self.budget_cls(self.alloc, self.tree, num_mixed_decode_tokens=0)
        budget.total_offset += sum(min(r.max_new - len(r.out), 4096) * self.ratio for r in self.running)
        rem_chunk = self.chunk
        batch = []
        if self.chunked is not None:
            req = self.chunked
            n = budget.available_chunk_tokens(rem_chunk)
            if n is None:
                self.stats["chunk_waits"] += 1
            else:
                start = len(req.locs)
                end = min(len(req.tokens), start + n)
                budget.reserve(end - start, 0 if end < len(req.tokens) else req.max_new, is_chunked_continuation=True)
                rem_chunk -= end - start
                batch.append((req, start, end))
        for req in list(self.waiting):
            if len(self.running) + len(batch) >= self.max_running or rem_chunk <= 0:
                break
            locs, path = self.tree.match(req.tokens)
            self.tree.lock(path)
            extend = len(req.tokens) - len(locs)
            ok, limit = budget.check_prefill(extend_input_len=extend, total_tokens=extend + req.max_new + self.ps,
                                             max_new_tokens=req.max_new, input_tokens=len(req.tokens),
                                             swa_host_hit_length=0, chunk_limit=rem_chunk)
            if not ok:
                self.tree.unlock(path)
                self.stats["no_token"] += 1
                break
            take = extend
            if limit is not None and extend > limit:
                if self.chunked is not None:  # one chunked request at a time
                    self.tree.unlock(path)
                    break
                take = max(self.ps, limit // self.ps * self.ps)
            req.path, req.n_cached, req.locs = path, len(locs), locs
            budget.reserve(take, req.max_new if take == extend else 0)
            rem_chunk -= take
            self.waiting.remove(req)
            if take < extend:
                self.chunked = req
            batch.append((req, len(locs), len(locs) + take))
        return batch

    def prefill(self) -> bool:
        if not self.waiting and self.chunked is None:
            return False
        batch = self._admit()
        if not batch:
            return False
        extend = sum(e - s for _, s, e in batch)  # SGLang evicts for this, then allocates
        self.alloc.evict_to_free_tokens(self.tree, extend if self.ps == 1 else extend + len(batch) * self.ps)
        if self.ps == 1:
            got = self.alloc.alloc(extend)
        else:
            got = self.calls.extend(self.alloc, [s for _, s, _ in batch], [e for _, _, e in batch],
                                    [int(r.locs[s - 1]) if s else -1 for r, s, _ in batch])
        if got is None:
            raise RuntimeError("Prefill out of memory. Try to lower your batch size.")
        pos = 0
        for req, s, e in batch:
            req.locs = torch.cat((req.locs[:s], got[pos:pos + e - s]))
            pos += e - s
            token = self.model.forward(req, s, e)
            if e == len(req.tokens):  # the prompt (and any earlier output) is in: one new token
                if self.chunked is req:
                    self.chunked = None
                req.out.append(token)
                self.running.append(req)
                self._maybe_finish(req)
        self.stats["prefill"] += 1
        return True

    # -- decode -----------------------------------------------------------------
    def _decode_tokens(self, reqs: list[Req]) -> int:
        return sum(1 for r in reqs if len(r.locs) % self.ps == 0) * self.ps

    def decode(self) -> None:
        if not self.running:
            return
        if not self.alloc.check_decode_capacity(num_tokens=self._decode_tokens(self.running), tree_cache=self.tree):
            keep = sorted(self.running, key=lambda r: (len(r.out), -len(r.prompt)), reverse=True)
            first = True
            while first or not self.alloc.check_decode_capacity(num_tokens=self._decode_tokens(keep),
                                                                tree_cache=self.tree):
                if len(keep) == 1:
                    break
                first = False
                self._retract(keep.pop())
            if len(keep) == 1 and not self.alloc.check_decode_capacity(num_tokens=self._decode_tokens(keep),
                                                                        tree_cache=self.tree):
                last = keep.pop()
                last.error = "Out of memory even after retracting all other requests in the decode batch."
                self._release(last)
                self.running.remove(last)
                self.stats["aborted"] += 1
        if not self.running:
            return
        reqs = list(self.running)
        self.alloc.evict_to_free_tokens(self.tree, len(reqs) * self.ps)
        seq = [len(r.locs) + 1 for r in reqs]
        if self.ps == 1:
            got = self.alloc.alloc(len(reqs))
        else:
            got = self.calls.decode(self.alloc, seq, [int(r.locs[-1]) for r in reqs])
        if got is None:
            raise RuntimeError("Decode out of memory. Try to lower your batch size.")
        for req, loc in zip(reqs, got.tolist()):
            req.locs = torch.cat((req.locs, torch.tensor([loc], dtype=torch.int64)))
            n = len(req.locs)
            req.out.append(self.model.forward(req, n - 1, n))
            self._maybe_finish(req)
        self.stats["decode"] += 1

    # -- finishing and retracting -----------------------------------------------------
    def _release(self, req: Req) -> None:
        """Free the request's own slots (not the radix cache's), unlock its prefix."""
        own = req.locs[req.n_cached:]
        if len(own):
            self.alloc.free(own)
        self.tree.unlock(req.path)
        req.path, req.n_cached, req.locs = None, 0, torch.empty(0, dtype=torch.int64)

    def _retract(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        req.retracted += 1
        self.waiting.insert(0, req)
        self.stats["retracted"] += 1

    def _maybe_finish(self, req: Req) -> None:
        if not req.done:
            return
        self.running.remove(req)
        computed = req.tokens[:len(req.locs)]
        whole = len(computed) // self.ps * self.ps
        present = self.tree.insert(computed[:whole], req.locs[:whole])
        if present > req.n_cached:  # cached meanwhile by another request: ours are duplicates
            self.alloc.free(req.locs[req.n_cached:present])
        if len(req.locs) > whole:
            self.alloc.free(req.locs[whole:])
        self.tree.unlock(req.path)

    def step(self) -> None:
        if not self.prefill():
            self.decode()

    def in_use(self) -> list[torch.Tensor]:
        own = [r.locs[r.n_cached:] for r in self.running + ([self.chunked] if self.chunked else [])]
        return own + self.tree.all_locs()


def requests(n: int) -> list[Req]:
    shared = [(3 * j) % 47 + 1 for j in range(40)]  # a shared system prompt: radix-cache hits
    return [Req(f"r{i}", (shared if i % 3 == 0 else []) + [(7 * i + j) % 50 + 1 for j in range(15 + 11 * i % 90)],
                6 + 11 * (i % 5)) for i in range(n)]


def serve(page_size: int, size: int, *, settings: vs.KVSettings | None = None, tenant: Tenant | None = None,
          block_steps=range(0), n_req: int = 16, max_steps: int = 2000, clock=None, make=None, check_every: int = 8):
    """Serve `n_req` requests (four at once, then one every other step); returns
    (outputs, errors, scheduler, the ElasticKV or None)."""
    if make is None:
        pool = MHATokenToKVPool(size, page_size, settings)
        alloc = (TokenToKVPoolAllocator(size, pool) if page_size == 1
                 else PagedTokenToKVPoolAllocator(size, page_size, pool))
        vs.bind(pool, alloc)
        sched = Scheduler(alloc, PageRadix(alloc, page_size), pool)
    else:
        pool, alloc, sched = make(page_size, size, settings)
    kv = pool.vattn if isinstance(getattr(pool, "vattn", None), vs.ElasticKV) else None
    reqs = requests(n_req)
    sched.waiting += reqs[:4]
    pending = reqs[4:]
    for step in range(max_steps):
        if tenant is not None:
            tenant.blocked = step in block_steps
        if clock is not None:
            clock[0] += 0.25
        if pending and step % 2 == 0:
            sched.waiting.append(pending.pop(0))
        sched.step()
        if kv is not None and step % check_every == 0:
            check_books(kv, alloc, sched.in_use())
        if not (sched.running or sched.waiting or pending or sched.chunked):
            break
    assert all(r.done for r in reqs), [r.rid for r in reqs if not r.done]
    if kv is not None:
        check_books(kv, alloc, sched.in_use())
    return ({r.rid: r.out for r in reqs if not r.error}, {r.rid: r.error for r in reqs if r.error}, sched, kv)


@pytest.fixture
def tenant(monkeypatch):
    t = Tenant()
    monkeypatch.setattr(vs.backing, "make_backend", lambda device: refusing_backend(t))  # where ElasticKV looks it up
    clock = [1000.0]
    monkeypatch.setattr(vs.backing.time, "monotonic", lambda: clock[0])  # the loop advances it: 4 steps a second
    t.clock = clock
    return t


SETTINGS = vs.KVSettings(page_size=VPAGE, idle_trim_s=None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_refused_pages_under_load_are_waits_and_outputs_equal_stock(tenant, page_size):
    """The device refuses every page creation for 60 steps while requests run: the
    scheduler keeps serving (no "out of memory"), requests wait and decodes retract by
    SGLang's own policy, every request finishes, and every output equals the output on
    SGLang's own memory."""
    size = whole(page_size, 2048)
    stock, errors, s0, _ = serve(page_size, size)
    assert not errors and s0.stats["retracted"] == s0.stats["no_token"] == 0
    out, errors, sched, kv = serve(page_size, size, settings=SETTINGS, tenant=tenant, block_steps=range(6, 66),
                                   clock=tenant.clock)
    assert not errors, errors
    assert out == stock
    assert tenant.refused > 0 and kv.num_refusals > 0
    assert sched.stats["no_token"] > 0 and sched.stats["retracted"] > 0, sched.stats
    assert not kv.refused  # the device backed pages again once the other tenant let go
    kv.pool.check_invariants()
    # the requests are done; the radix cache still holds its prefixes; flushing it gives all back
    for locs in sched.tree.all_locs():
        sched.alloc.free(locs)
    kv.trim()
    assert kv.stats().mapped_bytes == chunk0(kv)


def test_a_device_that_refuses_everything_from_the_start(tenant):
    """Nothing but chunk 0 can ever be mapped: requests that fit in chunk 0's pages run,
    the rest wait; when the device lets go they run, every output equal to stock."""
    size = whole(1, 2048)
    stock, _, _, _ = serve(1, size)
    out, errors, sched, kv = serve(1, size, settings=SETTINGS, tenant=tenant, block_steps=range(0, 40),
                                   clock=tenant.clock)
    assert not errors and out == stock
    assert kv.num_refusals >= 1 and sched.stats["no_token"] > 0


def test_without_the_gates_a_refusal_stops_the_scheduler(tenant, monkeypatch):
    """What the gates prevent: without `realize` the allocation after a passed gate meets
    the refusal, and SGLang raises "out of memory" (its scheduler stops)."""
    monkeypatch.setattr(vs.ElasticKV, "realize", lambda self, alloc, pages, evictable_pages=0: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        serve(16, whole(16, 2048), settings=SETTINGS, tenant=tenant, block_steps=range(6, 66), clock=tenant.clock)


def test_a_limit_and_a_refusal_together(tenant):
    """Under a memory limit the same loop evicts and retracts by the limit, and a refusal
    on top of it is still a wait."""
    size = whole(16, 2048)
    stock, _, _, _ = serve(16, size)
    limited = vs.KVSettings(page_size=VPAGE, idle_trim_s=None, memory_limit=24 * 2 * L * VPAGE)
    out, errors, sched, kv = serve(16, size, settings=limited, tenant=tenant, block_steps=range(10, 50),
                                   clock=tenant.clock)
    assert not errors and out == stock
    assert kv.stats().peak_mapped_bytes <= 24 * 2 * L * VPAGE


def test_the_gates_map_what_the_step_allocates(monkeypatch):
    """Without refusals the gates map ahead of the allocations: the alloc calls themselves
    find their pages in the free list (ensure lends nothing)."""
    lent_in_alloc = []
    real = vs.ElasticKV.refill

    def refill(self, alloc, short, partial=False):
        if not partial:
            lent_in_alloc.append(short)
        return real(self, alloc, short, partial)

    monkeypatch.setattr(vs.ElasticKV, "refill", refill)
    for ps in (1, 16):
        stock, _, _, _ = serve(ps, whole(ps, 2048))
        out, errors, sched, kv = serve(ps, whole(ps, 2048), settings=SETTINGS)
        assert out == stock and not errors
        assert not lent_in_alloc, lent_in_alloc
        assert kv.stats().peak_mapped_bytes > 4 * chunk0(kv)


def _token_pool(size: int, settings: vs.KVSettings = SETTINGS):
    pool = MHATokenToKVPool(size, 1, settings)
    alloc = TokenToKVPoolAllocator(size, pool)
    vs.bind(pool, alloc)
    return pool, alloc, pool.vattn


def test_the_gate_keeps_what_the_device_gave_and_asks_again_later(tenant):
    """`realize` lends what the device gives (here 2 of 3 chunks), counts only that until
    `REFUSED_RETRY_S` later, then asks the device again (for a chunk, though nothing more
    is needed now) and counts by the limit again."""
    pool, alloc, kv = _token_pool(whole(1, 4096))
    assert len(alloc.free_pages) == 31  # chunk 0 but the padding page
    tenant.left = 2
    vs.realize(alloc, 31 + 96)  # 3 chunks more
    assert len(alloc.free_pages) == 31 + 64 and kv.refused and kv.num_refusals == 1
    assert alloc.available_size() == 95 and vs.unbacked_tokens(alloc) == kv.units - kv.lent_units
    check_books(kv, alloc, [])
    calls = tenant.calls
    tenant.left = None  # the other process let go, but nobody asks before the retry time
    vs.realize(alloc, 31 + 200)
    assert tenant.calls == calls and alloc.available_size() == 95
    tenant.clock[0] += vs.REFUSED_RETRY_S
    vs.realize(alloc, 10)  # nothing more needed: asks for one chunk all the same
    assert not kv.refused and len(alloc.free_pages) == 95 + 32
    assert alloc.available_size() == whole(1, 4096)
    check_books(kv, alloc, [])


def test_the_gate_maps_nothing_for_work_that_cannot_fit(tenant):
    """Under a limit the gate lends only when the work fits with what the radix cache
    would evict; beyond that SGLang's count says no, and nothing is mapped for it."""
    limit = 6 * 2 * L * VPAGE
    pool, alloc, kv = _token_pool(whole(1, 4096), vs.KVSettings(page_size=VPAGE, idle_trim_s=None,
                                                                 memory_limit=limit))
    mapped = kv.stats().mapped_bytes
    vs.realize(alloc, 31 + 6 * 32)  # one chunk more than the limit backs: no
    assert kv.stats().mapped_bytes == mapped and len(alloc.free_pages) == 31

    class Cache:
        def supports_prefix_sharing(self):
            return True

        def evictable_size(self):
            return 40

    vs.realize(alloc, 31 + 6 * 32, Cache())  # fits once 40 cached tokens are evicted: lend what the limit allows
    assert len(alloc.free_pages) == 31 + 5 * 32 and kv.stats().mapped_bytes == limit


def test_a_chunk_is_cut_to_what_memory_backs(tenant):
    """`fit_chunk`: a chunked prefill's next chunk, when memory is refused, is cut to the
    free list plus the evictable cache less this pass's work and a page; None when not a
    page fits (the request waits this pass)."""
    pool, alloc, kv = _token_pool(whole(1, 4096))
    tree = PageRadix(alloc, 1)
    budget = PrefillBudget(alloc, tree)
    tenant.blocked = True
    assert budget.available_chunk_tokens(64) == 31 - 1  # chunk 0's free pages, less the page
    budget.reserve(20, 0)  # 21 tokens of this pass's work
    assert budget.available_chunk_tokens(64) == 31 - 21 - 1
    budget.reserve(9, 0)
    assert budget.available_chunk_tokens(64) is None
    tenant.blocked = False
    tenant.clock[0] += vs.REFUSED_RETRY_S
    assert budget.available_chunk_tokens(64) == 64 and not kv.refused

