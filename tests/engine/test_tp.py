"""Tensor parallelism (`vattn.engine.parallel`) with real processes: two ranks spawned with
torch.multiprocessing, gloo on 127.0.0.1, tiny seeded Llama / Qwen2 models. Each group of
checks spawns the two ranks once; every join has a deadline, so a hang fails the test."""
from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from tests.conftest import REPO  # noqa: E402
from tests.engine.test_prefix_caching_engine import (  # noqa: E402
    SYSTEM_ARRIVALS, system_params, system_prompts, system_reference)
from tests.helpers import (  # noqa: E402
    ARRIVALS, MAX_TOKENS, PAGE, build_model, greedy_params, hf_greedy, prompts, reference, tiny_config)
from vattn import LLM, SamplingParams  # noqa: E402
from vattn.engine.parallel import RankCacheError, TensorParallelError, shard_config  # noqa: E402
from vattn.errors import BackendError, FatalEngineError, InvalidConfigError, OutOfPhysicalMemoryError  # noqa: E402

WORLD = 2
MODELS = [("llama", 4), ("llama", 2), ("qwen2", 2), ("llama", 1)]  # MHA, GQA, GQA, 1 kv head on 2 ranks
SPAWN_TIMEOUT_S = 240  # whole group, both ranks; a hang fails instead of blocking the suite
TP = dict(tensor_parallel_size=WORLD, seed=0, page_size=PAGE, max_batch_size=8, distributed_timeout_s=60)


# ------------------------------------------------------------------- spawning ----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, ports: list[int], case: str, out_dir: str, args: tuple) -> None:
    """A spawned rank: torchrun's environment, then CASES[case](rank, ports, *args); its
    result (or traceback) is pickled to out_dir/rank{rank}.pkl."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        if case in OWN_GROUP:  # one group for several engines (vattn creates one per engine otherwise)
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        result: dict[str, Any] = {"ok": _case(case)(rank, ports, *args)}
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _case(case: str) -> Callable[..., Any]:
    """CASES[case], or the function "package.module:name" names (a case of another test file)."""
    if case in CASES:
        return CASES[case]
    module, name = case.split(":")
    return getattr(importlib.import_module(module), name)


def spawn(case: str, tmp_path: Path, *args: Any, num_ports: int = 1) -> tuple[list[Any], list[int | None]]:
    """Run CASES[case] (or "module:function") on two ranks; returns their results and exit codes. Fails when a rank
    is still running after SPAWN_TIMEOUT_S (a hang) or raised."""
    ctx = torch.multiprocessing.get_context("spawn")
    ports = [_free_port() for _ in range(num_ports)]
    procs = [ctx.Process(target=_rank_main, args=(r, ports, case, str(tmp_path), args), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not hung, f"ranks {hung} still ran after {SPAWN_TIMEOUT_S} s: a hang"
    results = []
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.pkl"
        results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    for r, res in enumerate(results):
        assert res is None or "error" not in res, f"rank {r} raised:\n{res['error']}"
    return [None if res is None else res["ok"] for res in results], [p.exitcode for p in procs]


def online(llm: LLM, check: Callable[[LLM], None] | None = None, prompt_list: list | None = None,
           params: list | None = None, arrivals: tuple[int, ...] = ARRIVALS) -> list:
    """helpers.run_online for every rank: each adds the same requests at the same iterations and
    steps until all finish; rank 0 returns the final outputs in prompt order, the others [].
    Default: helpers' prompts and greedy params."""
    prompt_list = prompts() if prompt_list is None else prompt_list
    params = greedy_params() if params is None else params
    index: dict[int, int] = {}
    done: dict[int, Any] = {}
    it = 0
    while len(index) < len(arrivals) or llm.has_unfinished():
        for i, a in enumerate(arrivals):
            if a == it:
                index[llm.add_request(prompt_list[i], params[i])] = i
        for out in llm.step():
            if out.finished:
                done[index[out.request_id]] = out
        if check is not None:
            check(llm)
        it += 1
        assert it < 5000, "the engine does not make progress"
    if not llm.is_output_rank:
        assert not done, "a rank other than 0 returned outputs"
        return []
    return [done[i].token_ids for i in range(len(arrivals))]


def books(llm: LLM) -> tuple:
    """The vattn books that must be equal on every rank: live slots and their lengths, and
    which sequence holds which slot."""
    alloc = llm.cache.allocator
    return (sorted((s, alloc.books.max_lens[s]) for s in alloc.books.active),
            sorted((s.seq_id, s.slot, s.num_computed_tokens) for s in llm.scheduler.running))


def check_books(llm: LLM) -> None:
    everyone = llm.tp.all_gather_object(books(llm))
    assert all(b == everyone[0] for b in everyone), f"the ranks' books diverged: {everyone}"


# ------------------------------------------------- what the ranks run (CASES) ----
def record_rank_cache_errors(llm: LLM) -> list[str]:
    """The texts of the RankCacheErrors the scheduler's cache steps raise from now on."""
    failures: list[str] = []
    kv_step = llm.scheduler.kv.step

    def spy(seq_lens):
        try:
            return kv_step(seq_lens)
        except RankCacheError as e:
            failures.append(str(e))
            raise

    llm.scheduler.kv.step = spy
    return failures


def _outputs(rank: int, ports: list[int], checkpoint: str) -> dict:
    """Greedy outputs of every model, a checkpoint read shard by shard, and online arrivals
    under a budget that forces preemption."""
    res: dict[str, Any] = {}
    for family, kv in MODELS:
        with LLM(tiny_config(family, kv), **TP) as llm:
            outs = llm.generate(prompts(), greedy_params())
            res[f"{family}/{kv}"] = [o.token_ids for o in outs] if rank == 0 else outs
            res[f"{family}/{kv} heads"] = (llm.cache.config.num_kv_heads,
                                           llm.runner.model.model.layers[0].self_attn.q_proj.weight.shape[0])
    for name, config, params in _extra_cases():
        with LLM(config, **TP) as llm:
            outs = llm.generate(prompts()[:3], params)
            res[name] = [[c.token_ids for c in o.outputs] for o in outs]
    with LLM(checkpoint, **TP) as llm:
        outs = llm.generate(prompts(), greedy_params())
        res["checkpoint"] = [o.token_ids for o in outs] if rank == 0 else outs
        res["checkpoint heads"] = llm.cache.config.num_kv_heads
    with LLM(tiny_config(), **{**TP, "max_batch_size": 4, "physical_memory": 48 << 10}) as llm:
        res["preempted"] = online(llm, check_books)
        res["num_preemptions"] = llm.num_preemptions
    # every engine destroyed its own gloo group at close; the user's default group is left
    res["groups_left"] = (dist.is_initialized(), len(dist.distributed_c10d._world.pg_map))
    return res


def _extra_cases() -> list[tuple[str, Any, Any]]:
    """Biases on the rowwise modules (added once, after the all-reduce), and parallel
    sampling (forks agreed on both ranks, rank 0's seeded draws), and a sliding-window layer
    beside a full one (each rank's window pages given back alike; n=2 forks agreed)."""
    sliding = tiny_config("qwen2", 2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    return [("bias", tiny_config("llama", 2, attention_bias=True, mlp_bias=True), greedy_params()[:3]),
            ("n=3", tiny_config(), SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=12)),
            ("sliding", sliding, [SamplingParams(temperature=0, max_tokens=40, n=2)] * 3),
            # rank 0's batched sampler with every field: its token counts, masks and logprobs
            ("fields", tiny_config(), [
                SamplingParams(temperature=0.8, seed=2, max_tokens=12, presence_penalty=0.5, repetition_penalty=1.2,
                               top_k=20, min_p=0.05),
                SamplingParams(temperature=0, max_tokens=10, frequency_penalty=1.0, logprobs=2),
                SamplingParams(temperature=1.0, seed=4, max_tokens=10, min_tokens=5, top_p=0.9, n=2)])]


def _agreement(rank: int, ports: list[int]) -> dict:
    """The budget is the ranks' minimum; one rank short of memory, or one whose backend fails
    a map, makes every rank fail that step: same preemptions, same books, same outputs."""
    res: dict[str, Any] = {}
    mine = (256 << 10) if rank == 0 else (96 << 10)
    with LLM(tiny_config(), **{**TP, "physical_memory": mine}) as llm:
        res["max_pages"] = llm.cache.allocator.max_pages
        res["group_bytes"] = llm.cache.geometry.group_bytes

    with LLM(tiny_config(), **{**TP, "max_batch_size": 4, "physical_memory": 256 << 10}) as llm:
        local_failures = 0
        step = llm.cache.step

        def counting_step(seq_lens):
            nonlocal local_failures
            out = step(seq_lens)
            local_failures += not out
            return out

        llm.cache.step = counting_step
        if rank == 1:  # this rank runs short: 3 page groups of the 16 agreed
            llm.cache.allocator.set_max_pages(3)
        res["short"] = online(llm, check_books)
        res["short_failures"] = local_failures
        res["short_preemptions"] = llm.num_preemptions
        res["resyncs"] = llm.scheduler.kv.num_resyncs

    with LLM(tiny_config(), **{**TP, "background": False}) as llm:
        backend = llm.cache.backend
        real_map, calls, injected = backend.map, [0], [0]

        def faulty_map(*args, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] == 4:
                injected[0] += 1
                raise BackendError("map", 1, "INJECTED", "rank 1's map failed")
            return real_map(*args, **kwargs)

        backend.map = faulty_map
        failures = record_rank_cache_errors(llm)
        res["faulty"] = online(llm, check_books)
        res["faulty_injected"], res["faulty_failures"] = injected[0], failures

    name, config, params = _extra_cases()[1]
    with LLM(config, **TP) as llm:  # rank 1 cannot fork the first time: every rank waits, then forks
        real_fork, forks = llm.cache.fork, []

        def short_fork(reqid, num_tokens):
            forks.append(reqid)
            if rank == 1 and len(forks) == 1:
                raise OutOfPhysicalMemoryError("injected: no page for the copy")
            return real_fork(reqid, num_tokens)

        llm.cache.fork = short_fork
        outs = llm.generate(prompts()[:3], params)
        res["fork"] = [[c.token_ids for c in o.outputs] for o in outs]
        res["fork_calls"] = len(forks)
        check_books(llm)
        llm.tp.fail("injected on every rank")  # tears down the engine's group, not the user's
    dist.barrier()  # the user's default group still works
    res["user_group_kept"] = (dist.is_initialized(), len(dist.distributed_c10d._world.pg_map))
    return res


def spy_calls(obj: Any, name: str) -> list:
    """Record the results of obj.name (an instance attribute wrapping the real method)."""
    calls: list = []
    real = getattr(obj, name)

    def spy(*args: Any) -> Any:
        out = real(*args)
        calls.append(out)
        return out

    setattr(obj, name, spy)
    return calls


def check_lookups(llm: LLM) -> list:
    """Record every prefix lookup as it returns: [(slot, tokens or error type, the tokens
    the slot holds then)], for `assert_lookups_agreed`."""
    pc, alloc, seen = llm.scheduler.prefix_cache, llm.cache.allocator, []
    real = pc.map_prefix

    def map_prefix(reqid: int, token_ids: list) -> int:
        try:
            out: Any = real(reqid, token_ids)
        except Exception as e:  # noqa: BLE001 - checked, then raised again
            out, error = type(e).__name__, e
        else:
            error = None
        seen.append((reqid, out, alloc.books.max_lens[reqid]))  # checked by the test: the scheduler catches errors
        if error is not None:
            raise error
        return out

    pc.map_prefix = map_prefix
    return seen


def assert_lookups_agreed(r0: list, r1: list) -> None:
    """Every rank returned the same tokens (or raised the same error) for the same slot, and
    its slot held exactly those tokens (the pages past them unmapped: `truncate_pinned`)."""
    assert r0 == r1, "the ranks' lookups diverged"
    for slot, out, held in r0:
        assert held == (out if isinstance(out, int) else 0), f"slot {slot} holds {held} tokens, {out} agreed"


def _sharing(rank: int, ports: list[int]) -> dict:
    """Prefix caching and swap preemption under budgets that evict pinned pages and preempt.
    Rank 1's cache also differs from rank 0's on purpose: every other lookup there finds its
    last cached page evicted, and now and then it drops its unmapped pinned pages or trims.
    So prefixes mapped on rank 0 only are unmapped again (the fewest tokens agreed), and
    swapped-out slots kept on rank 0 only are swapped in where both agree. Books checked
    every iteration."""
    res: dict[str, Any] = {}
    system = [list(p) for p in system_prompts()]
    for name, kw in (("prefix", {}), ("prefix+swap", {"preemption_mode": "swap"})):
        with LLM(tiny_config(), **{**TP, "max_batch_size": 4, "physical_memory": 64 << 10,
                                   "enable_prefix_caching": True, **kw}) as llm:
            alloc = llm.cache.allocator
            evicted = spy_calls(alloc.books, "evict")
            truncated = spy_calls(llm.cache, "truncate_pinned")
            real_map, lookups = llm.cache.map_pinned, [0]

            def map_pinned(reqid: int, handles: list) -> int:
                lookups[0] += 1
                if rank == 1 and lookups[0] % 2:  # as if its last page had been evicted
                    handles = handles[:-1]
                return real_map(reqid, handles)

            llm.cache.map_pinned = map_pinned
            lookups_seen = check_lookups(llm)
            it = [0]

            def evict_on_rank1(llm: LLM) -> None:
                check_books(llm)
                it[0] += 1
                if rank == 1 and it[0] % 4 == 0:
                    with alloc._quiet():
                        alloc.books.evict(len(alloc.pins))

            res[name] = online(llm, evict_on_rank1, system, system_params(), SYSTEM_ARRIVALS)
            res[f"{name} again"] = online(llm, evict_on_rank1)  # other prompts, same engine
            stats = llm.prefix_cache_stats()
            res[f"{name} stats"] = (stats.num_query_tokens, stats.num_hit_tokens, llm.num_preemptions,
                                    llm.scheduler.num_swapped_out, llm.scheduler.num_swapped_in)
            res[f"{name} evicted"] = sum(evicted)
            res[f"{name} truncated"] = len(truncated)
            res[f"{name} lookups"] = lookups_seen
            alloc.check_invariants()

    # 4 kv heads: 2 a rank, 32 tokens a page as at TP 1 with 2 (test_swap_engine's budget)
    with LLM(tiny_config("llama", 4), **{**TP, "max_batch_size": 4, "physical_memory": 80 << 10,
                                         "preemption_mode": "swap"}) as llm:
        real_swap_out, real_swap_in, outs, copied = llm.cache.swap_out, llm.cache.swap_in, [0], []

        def swap_out(reqid: int, num_tokens: int) -> Any:
            outs[0] += 1
            if rank == 1 and outs[0] == 2:
                raise RuntimeError("injected: rank 1 has no host memory")
            return real_swap_out(reqid, num_tokens)

        def swap_in(handle: Any) -> int:
            slot = real_swap_in(handle)
            copied.append(handle.copied_in)
            return slot

        llm.cache.swap_out, llm.cache.swap_in = swap_out, swap_in
        it = [0]

        def trim_on_rank1(llm: LLM) -> None:
            check_books(llm)
            it[0] += 1
            if it[0] % 3 == 0 and len(llm.scheduler.running) > 1:  # what a shortage does, on both ranks
                llm.scheduler.preempt(max(llm.scheduler.running, key=lambda s: s.seq_id))
            if rank == 1 and it[0] % 5 == 0:
                llm.cache.trim()

        res["swap"] = online(llm, trim_on_rank1)
        res["swap stats"] = (llm.num_preemptions, llm.scheduler.num_swapped_out, llm.scheduler.num_swapped_in)
        res["swap calls"] = (outs[0], copied)
        res["swap resyncs"] = llm.scheduler.kv.num_resyncs
        llm.cache.allocator.check_invariants()
    return res


def _sharing_failures(rank: int, ports: list[int]) -> dict:
    """Prefix caching and swap preemption when a cache call raises on one rank only: a
    lookup's map, a swap-out, a swap-in (short of memory, or failing), then the two that
    leave a rank's books unlike the others' (a trim in a slot resync, unmapping the pages
    past an agreed prefix): those raise TensorParallelError on every rank, soon."""
    res: dict[str, Any] = {}
    system = [list(p) for p in system_prompts()]
    with LLM(tiny_config(), **{**TP, "max_batch_size": 4, "physical_memory": 64 << 10,
                               "enable_prefix_caching": True}) as llm:
        real_map, maps = llm.cache.map_pinned, [0]

        def failing_map(reqid: int, handles: list) -> int:
            maps[0] += 1
            if rank == 1 and maps[0] % 2:
                raise RuntimeError("injected: rank 1's map of pinned pages failed")
            return real_map(reqid, handles)

        llm.cache.map_pinned = failing_map
        lookups = check_lookups(llm)
        res["map failed"] = online(llm, check_books, system, system_params(), SYSTEM_ARRIVALS)
        res["map failed lookups"], res["map calls"] = lookups, maps[0]
        llm.cache.allocator.check_invariants()

    with LLM(tiny_config("llama", 4), **{**TP, "max_batch_size": 4, "physical_memory": 80 << 10,
                                         "preemption_mode": "swap", "enable_prefix_caching": True}) as llm:
        real_out, real_in, calls = llm.cache.swap_out, llm.cache.swap_in, {"out": 0, "in": 0}

        def swap_out(reqid: int, num_tokens: int) -> Any:
            calls["out"] += 1
            if rank == 0 and calls["out"] == 3:
                raise RuntimeError("injected: rank 0 has no host memory")
            return real_out(reqid, num_tokens)

        def swap_in(handle: Any) -> int:
            calls["in"] += 1
            if rank == 1 and calls["in"] in (2, 5):
                raise OutOfPhysicalMemoryError("injected: rank 1 has no page for the swap-in")
            if rank == 0 and calls["in"] == 8:
                raise RuntimeError("injected: rank 0's swap-in failed")
            return real_in(handle)

        llm.cache.swap_out, llm.cache.swap_in = swap_out, swap_in
        agreed_in, seen = llm.scheduler.kv.swap_in, []

        def seen_swap_in(handle: Any) -> int:
            try:
                slot = agreed_in(handle)
            except Exception as e:  # noqa: BLE001 - recorded for the test
                seen.append(type(e).__name__)
                raise
            seen.append(slot)
            return slot

        llm.scheduler.kv.swap_in = seen_swap_in
        it = [0]

        def preempt_now_and_then(llm: LLM) -> None:
            check_books(llm)
            it[0] += 1
            if it[0] % 3 == 0 and len(llm.scheduler.running) > 1:  # what a shortage does, on both ranks
                llm.scheduler.preempt(max(llm.scheduler.running, key=lambda s: s.seq_id))

        res["swap failed"] = online(llm, preempt_now_and_then)
        res["swap failed stats"] = (llm.num_preemptions, llm.scheduler.num_swapped_out,
                                    llm.scheduler.num_swapped_in)
        res["swap-ins seen"], res["swap calls"] = seen, calls
        llm.cache.allocator.check_invariants()

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [3 + i % 120 for i in range(70)]  # a whole page of 64 tokens (one kv head a rank)
    with LLM(tiny_config(), **{**TP, "enable_prefix_caching": True}) as llm:
        real_map, real_truncate = llm.cache.map_pinned, llm.cache.truncate_pinned

        def map_fewer(reqid: int, handles: list) -> int:  # as if rank 1 had its page evicted
            return real_map(reqid, handles[:-1] if rank == 1 else handles)

        def failing_truncate(reqid: int, num_tokens: int) -> int:
            raise RuntimeError("injected: rank 0 could not unmap")

        llm.cache.map_pinned, llm.cache.truncate_pinned = map_fewer, failing_truncate
        llm.generate([prompt], params)
        t = time.monotonic()
        error = _raised(lambda: llm.generate([prompt + [5]], params))
        res["truncate failed"] = (type(error).__name__, str(error), time.monotonic() - t)

    with LLM(tiny_config(), **TP) as llm:
        cache, real_alloc = llm.cache, llm.cache.alloc_reqid

        def other_slot() -> int:  # slot 1 where rank 0 gets slot 0
            first, second = real_alloc(), real_alloc()
            cache.free_reqid(first)
            return second

        def failing_trim() -> int:
            raise RuntimeError("injected: rank 1's trim failed")

        if rank == 1:
            cache.alloc_reqid, cache.trim = other_slot, failing_trim
        t = time.monotonic()
        error = _raised(lambda: llm.generate([[5, 6, 7]], params))
        res["trim failed"] = (type(error).__name__, str(error), time.monotonic() - t)
    return res


def _failures(rank: int, ports: list[int]) -> dict:
    """Ranks given different requests, a rank whose forward raises, a rank that dies: the
    others raise TensorParallelError soon, never hang."""
    res: dict[str, Any] = {}

    def attempt(name: str, port: int, prompt_of: Callable[[int], list[int]], hook: Callable | None = None) -> None:
        os.environ["MASTER_PORT"] = str(port)
        llm = LLM(tiny_config(), **TP)
        if hook is not None:
            llm.runner.model.model.layers[0].register_forward_hook(hook)
        t = time.monotonic()
        try:
            llm.generate([prompt_of(rank)] * 3, greedy_params()[0])
            res[name] = ("no error", "", time.monotonic() - t)
        except Exception as e:  # noqa: BLE001 - what the test checks
            res[name] = (type(e).__name__, str(e), time.monotonic() - t)
        llm.close()

    # two engines on the default group vattn created: closing one leaves it to the other;
    # the last close destroys it
    os.environ["MASTER_PORT"] = str(ports[3])
    first, second = LLM(tiny_config(), **TP), LLM(tiny_config(), **TP)
    first.close()
    res["second engine"] = [o.token_ids for o in second.generate([[5, 6, 7]], greedy_params()[0])]
    second.close()
    res["group after close"] = dist.is_initialized()

    attempt("diverged", ports[0], lambda r: [5, 6, 7 + r])
    os.environ["MASTER_PORT"] = str(ports[4])  # rank 1 has a request, rank 0 none: they meet all the same
    with LLM(tiny_config(), **TP) as llm:
        if rank == 1:
            llm.add_request([5, 6, 7], greedy_params()[0])
        t = time.monotonic()
        error = _raised(llm.step)
        res["one idle"] = (type(error).__name__, str(error), time.monotonic() - t)
    forwards = [0]

    def raise_on_rank1(*_):
        forwards[0] += 1
        if rank == 1 and forwards[0] == 3:
            raise RuntimeError("injected: rank 1's forward failed")

    attempt("raised", ports[1], lambda r: [5, 6, 7], raise_on_rank1)
    forwards[0] = 0

    def die_on_rank1(*_):
        forwards[0] += 1
        if rank == 1 and forwards[0] == 3:
            os._exit(3)

    attempt("died", ports[2], lambda r: [5, 6, 7], die_on_rank1)
    return res


class ControlLog:
    """The round trips this rank's engine makes on its control group: every tensor
    collective on the engine's gloo group (all_gather_object and broadcast_object_list are
    two each), the model's all-reduces (on gloo, the same group) counted apart."""

    OPS = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter", "barrier")

    def __init__(self, tp: Any) -> None:
        self.tp, self.calls, self.model_all_reduces, self._in_model = tp, [], 0, False
        c10d = dist.distributed_c10d
        for op in self.OPS:  # vattn calls dist.X; the *_object collectives call c10d's X
            wrapped = self._wrap(op, getattr(c10d, op))
            setattr(c10d, op, wrapped)
            setattr(dist, op, wrapped)
        real = tp.all_reduce_

        def model_all_reduce(t: Any) -> None:
            self._in_model, self.model_all_reduces = True, self.model_all_reduces + 1
            try:
                real(t)
            finally:
                self._in_model = False

        tp.all_reduce_ = model_all_reduce

    def _wrap(self, op: str, real: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") is self.tp.cpu_group and not self._in_model:
                self.calls.append(op)
            return real(*args, **kwargs)
        return counted

    def step(self, llm: LLM) -> tuple[list[str], int]:
        """One `llm.step()`: its control round trips in order, and its model all-reduces."""
        self.calls, self.model_all_reduces = [], 0
        before = self.tp.num_control_round_trips
        llm.step()
        assert self.tp.num_control_round_trips - before == len(self.calls), "the engine's own count agrees"
        return self.calls, self.model_all_reduces


def _collectives(rank: int, ports: list[int]) -> dict:
    """The control round trips of each kind of iteration: idle, admitting two requests,
    decoding, a step that raised on rank 1, a sample that failed on rank 0."""
    res: dict[str, Any] = {}
    with LLM(tiny_config(), **TP) as llm:
        log = ControlLog(llm.tp)
        res["idle"] = log.step(llm)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.add_request([5, 6, 7], params)
        llm.add_request([8, 9, 10, 11], params)
        res["admit 2"] = log.step(llm)  # both prompts computed: one token each
        res["decode"] = [log.step(llm) for _ in range(4)]
        assert all(s.num_uncomputed_tokens == 1 for s in llm.scheduler.running), "decoding"

        real_step, armed = llm.cache.step, [True]

        def step_raises_on_rank1(seq_lens):
            if rank == 1 and armed[0]:
                armed[0] = False
                raise BackendError("map", 1, "INJECTED", "rank 1's map failed")
            return real_step(seq_lens)

        llm.cache.step = step_raises_on_rank1
        failures = record_rank_cache_errors(llm)
        res["step raised"] = log.step(llm)
        res["step raised errors"] = failures
        res["recompute"] = log.step(llm)  # the two requests computed again from their prompts

        sampler = llm.runner.sampler.sampler  # rank 0's: the one that samples
        real_sample = sampler.sample

        def sample_fails_once(logits, seq_ids, params, **history):
            out = real_sample(logits, seq_ids, params, **history)
            if rank == 0 and not res.get("sample failed on rank 0"):
                res["sample failed on rank 0"] = True
                out.errors[seq_ids[0]] = "injected: sampling failed"
            return out

        sampler.sample = sample_fails_once
        res["sample failed"] = log.step(llm)
        while llm.has_unfinished():
            log.step(llm)
        res["idle again"] = log.step(llm)

    os.environ["MASTER_PORT"] = str(ports[1])  # the first engine destroyed the default group vattn made
    with LLM(tiny_config(), **{**TP, "enable_prefix_caching": True, "preemption_mode": "swap"}) as llm:
        log = ControlLog(llm.tp)  # 64 tokens a page on each rank (one kv head of 2)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompt = [3 + i % 120 for i in range(70)]
        llm.add_request(prompt, params)
        res["prefix miss"] = log.step(llm)  # the new slot, its lookup (a miss), the step, the tokens
        res["prefix decode"] = [log.step(llm) for _ in range(2)]
        llm.add_request(prompt + [5], params)
        res["prefix hit"] = log.step(llm)  # the same, with 64 tokens mapped
        res["prefix hit tokens"] = llm.prefix_cache_stats().num_hit_tokens
        log.calls = []
        llm.scheduler.preempt(max(llm.scheduler.running, key=lambda s: s.seq_id))  # as a shortage does
        res["swap out"] = log.calls
        res["swap in"] = log.step(llm)  # the swap-in's slot, then as a decode
        res["swapped"] = (llm.scheduler.num_swapped_out, llm.scheduler.num_swapped_in)
        res["swap decode"] = log.step(llm)
    return res


CASES = {"outputs": _outputs, "agreement": _agreement, "failures": _failures, "collectives": _collectives,
         "sharing": _sharing, "sharing failures": _sharing_failures}
OWN_GROUP = ("outputs", "agreement", "sharing", "sharing failures")


# ------------------------------------------------------------------------ tests ----
def test_tp2_outputs_equal_tp1_and_transformers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "qwen2"
    build_model(tiny_config("qwen2", 2)).save_pretrained(checkpoint)
    (tp, other), codes = spawn("outputs", tmp_path, str(checkpoint))
    assert codes == [0, 0]
    for family, kv in MODELS:
        with LLM(tiny_config(family, kv), seed=0, page_size=PAGE, max_batch_size=8) as llm:
            tp1 = [o.token_ids for o in llm.generate(prompts(), greedy_params())]
        ref = [list(r) for r in reference(family, kv)]
        assert tp[f"{family}/{kv}"] == tp1 == ref, (family, kv)
        assert other[f"{family}/{kv}"] == [], "rank 1's generate returns nothing"
        # each rank holds half the query heads, and half the kv heads (one kv head replicated)
        assert tp[f"{family}/{kv} heads"] == other[f"{family}/{kv} heads"] == (max(1, kv // WORLD), 2 * 16)
    for name, config, params in _extra_cases():
        with LLM(config, seed=0, page_size=PAGE, max_batch_size=8) as llm:
            tp1 = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts()[:3], params)]
        assert tp[name] == tp1, name
        assert other[name] == [], name
    model = build_model(_extra_cases()[0][1])
    assert tp["bias"] == [[hf_greedy(model, p, m)] for p, m in zip(prompts(), MAX_TOKENS[:3])]
    assert len({tuple(c) for c in tp["n=3"][0]}) > 1, "the samples differ"
    assert tp["checkpoint"] == [list(r) for r in reference("qwen2", 2)]
    assert tp["checkpoint heads"] == 1
    assert tp["preempted"] == [list(r) for r in reference()]
    assert tp["num_preemptions"] == other["num_preemptions"] > 0
    assert tp["groups_left"] == other["groups_left"] == (True, 1), "engines' gloo groups leaked"


def test_ranks_agree_on_budget_and_failed_steps(tmp_path: Path) -> None:
    (r0, r1), codes = spawn("agreement", tmp_path)
    assert codes == [0, 0]
    assert r0["max_pages"] == r1["max_pages"] == (96 << 10) // r0["group_bytes"]  # the minimum, on both
    ref = [list(r) for r in reference()]
    # rank 1 alone ran out of memory; both preempted the same sequences (books checked every step)
    assert r1["short_failures"] > 0 and r0["short_failures"] == 0
    assert r0["short_preemptions"] == r1["short_preemptions"] > 0
    assert r0["short"] == ref
    # rank 1's backend failed one map: the step raised on both ranks with the same message
    assert r1["faulty_injected"] == 1
    assert len(r0["faulty_failures"]) == len(r1["faulty_failures"]) == 1
    assert r0["faulty_failures"] == r1["faulty_failures"]
    assert "rank 1: BackendError: map failed with INJECTED" in r0["faulty_failures"][0]
    assert r0["faulty"] == ref
    # rank 1 could not fork once: both undid it and forked again later, as TP 1 samples
    name, config, params = _extra_cases()[1]
    with LLM(config, seed=0, page_size=PAGE, max_batch_size=8) as llm:
        tp1 = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts()[:3], params)]
    assert r0["fork"] == tp1 and r1["fork"] == []
    assert r0["fork_calls"] == r1["fork_calls"] >= 3 * 2 + 1  # two forks per request, one retried (or more)
    assert r0["user_group_kept"] == r1["user_group_kept"] == (True, 1), "fail() destroyed the user's group"


def test_prefix_caching_and_swap_under_tp(tmp_path: Path) -> None:
    (r0, r1), codes = spawn("sharing", tmp_path)
    assert codes == [0, 0]
    system, ref = [list(r) for r in system_reference()], [list(r) for r in reference()]
    for name in ("prefix", "prefix+swap"):
        assert r0[name] == system and r0[f"{name} again"] == ref, name
        assert r1[name] == r1[f"{name} again"] == []
        queried, hits, preemptions, swapped_out, swapped_in = r0[f"{name} stats"]
        assert r0[f"{name} stats"] == r1[f"{name} stats"], "the ranks agreed on every hit and preemption"
        assert hits > 0 and preemptions > 0, name
        assert (swapped_out > 0) == (name == "prefix+swap"), name
        assert r0[f"{name} evicted"] > 0, "memory pressure evicted pinned pages"
        assert r0[f"{name} truncated"] > 0 and r1[f"{name} truncated"] == 0, "rank 0 unmapped what rank 1 lacked"
        assert_lookups_agreed(r0[f"{name} lookups"], r1[f"{name} lookups"])
        assert any(n for _, n, _ in r0[f"{name} lookups"]), name
    assert r0["swap"] == [list(r) for r in reference("llama", 4)] and r1["swap"] == []
    assert r0["swap stats"] == r1["swap stats"]
    preemptions, swapped_out, swapped_in = r0["swap stats"]
    assert preemptions > 0 and swapped_out > 0 and swapped_in > 0
    # rank 1's second swap-out failed: rank 0 took its slot back, both recomputed that one
    assert r0["swap calls"][0] == r1["swap calls"][0] == swapped_out + 1
    assert r0["swap calls"][1] != r1["swap calls"][1], "one rank copied a swap-in back where the other did not"
    assert r0["swap resyncs"] == r1["swap resyncs"] > 0, "the swap-ins' slots differed, and were agreed"


def test_prefix_caching_and_swap_when_one_rank_fails(tmp_path: Path) -> None:
    (r0, r1), codes = spawn("sharing failures", tmp_path)
    assert codes == [0, 0]
    # rank 1's map raised on every other lookup: a miss on both ranks (rank 0 unmapped its hit)
    assert r0["map failed"] == [list(r) for r in system_reference()] and r1["map failed"] == []
    assert_lookups_agreed(r0["map failed lookups"], r1["map failed lookups"])
    outcomes = [out for _, out, _ in r0["map failed lookups"]]
    assert "RankCacheError" in outcomes and any(isinstance(n, int) and n > 0 for n in outcomes), outcomes
    # a swap-out that failed on rank 0 (sampling rank), swap-ins short on rank 1, failing on rank 0
    assert r0["swap failed"] == [list(r) for r in reference("llama", 4)] and r1["swap failed"] == []
    assert r0["swap failed stats"] == r1["swap failed stats"]
    assert r0["swap-ins seen"] == r1["swap-ins seen"], "the ranks saw different swap-in outcomes"
    seen = r0["swap-ins seen"]
    assert "OutOfPhysicalMemoryError" in seen and seen.count("RankCacheError") == 1, seen
    assert r0["swap calls"]["out"] >= 3 and r0["swap calls"]["in"] >= 8 and r1["swap calls"]["in"] >= 5, \
        "every failure was injected"
    preemptions, swapped_out, swapped_in = r0["swap failed stats"]
    assert swapped_out > 0 and swapped_in > 0
    # books a rank could not restore: every rank raises TensorParallelError, soon
    for name, culprit, text in (("truncate failed", 0, "could not unmap the cached pages past the 0 tokens"),
                                ("trim failed", 1, "could not give back its cached pages to agree on a slot")):
        for r, res in enumerate((r0, r1)):
            kind, message, seconds = res[name]
            assert kind == "TensorParallelError", (name, r, kind, message)
            assert seconds < 30, f"{name}: rank {r} took {seconds:.1f} s"
            if r == culprit:
                assert text in message and "injected" in message, (name, message)


def test_a_failing_rank_stops_the_others_soon(tmp_path: Path) -> None:
    (r0, r1), codes = spawn("failures", tmp_path, num_ports=5)
    assert r1 is None and codes[1] == 3, "rank 1 died in the last phase"
    assert len(r0["second engine"]) == 1 and r0["second engine"][0], "the second engine kept its group"
    assert r0["group after close"] is False, "the last engine destroyed the group vattn created"
    for name in ("diverged", "one idle", "raised", "died"):
        kind, message, seconds = r0[name]
        assert kind == "TensorParallelError", (name, kind, message)
        assert seconds < 30, f"{name}: rank 0 took {seconds:.1f} s to notice (timeout 60 s)"
    assert "schedules differ" in r0["diverged"][1]
    assert "schedules differ" in r0["one idle"][1] and "agreeing on ['the schedule', 'a new slot']" in r0["one idle"][1]
    for name in ("raised", "died"):  # rank 0 learns it from its collective in the forward
        assert "another rank raised or exited" in r0[name][1]


def test_control_round_trips_per_iteration(tmp_path: Path) -> None:
    """The control messages each kind of iteration costs (tensor collectives on the engine's
    gloo group; the model's all-reduces apart), the same on both ranks: a regression in the
    number per decode step fails here."""
    (r0, r1), codes = spawn("collectives", tmp_path, num_ports=2)
    assert codes == [0, 0]
    assert {k: v for k, v in r0.items() if k != "sample failed on rank 0"} == \
        {k: v for k, v in r1.items()}, "the ranks made different collectives"
    gather, bcast = "all_gather", "broadcast"
    layers = tiny_config().num_hidden_layers
    # decode: the step's agreement (carrying the schedule's digest), the tokens: 2
    assert r0["decode"] == [([gather, bcast], 2 * layers)] * 4
    assert r0["idle"] == r0["idle again"] == ([gather], 0)  # the digest alone
    # two new slots agreed (the first carries the digest), then as a decode
    assert r0["admit 2"] == r0["recompute"] == ([gather, gather, gather, bcast], 2 * layers)
    # rare paths: rank 1's step raised (every rank fetches the errors: all_gather_object, two
    # round trips; nothing runs), rank 0's sampling failed for one request (its error broadcast)
    assert r0["step raised"] == ([gather, gather, gather], 0)
    assert r0["step raised errors"] == r1["step raised errors"] and len(r0["step raised errors"]) == 1
    assert "rank 1: BackendError" in r0["step raised errors"][0]
    assert r0["sample failed"] == ([gather, bcast, bcast, bcast], 2 * layers)
    # prefix caching: every new slot's lookup is agreed too (hit or miss); decode stays at 2
    assert r0["prefix miss"] == r0["prefix hit"] == ([gather, gather, gather, bcast], 2 * layers)
    assert r0["prefix hit tokens"] == 64
    assert r0["prefix decode"] == [([gather, bcast], 2 * layers)] * 2
    # swap preemption: one agreement to swap out, one to swap in (its slot), decode at 2 again
    assert r0["swap out"] == [gather]
    assert r0["swap in"] == ([gather, gather, bcast], 2 * layers)
    assert r0["swapped"] == (1, 1)
    assert r0["swap decode"] == ([gather, bcast], 2 * layers)


# ------------------------------------------------------------- no processes ----
def test_sharded_config_and_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    local = shard_config(tiny_config("llama", 2), 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.head_dim) \
        == (2, 1, 64, 16)
    assert shard_config(tiny_config("llama", 1), 4).num_key_value_heads == 1  # replicated kv head
    with pytest.raises(InvalidConfigError, match="num_attention_heads=4 is not divisible"):
        shard_config(tiny_config(), 3)
    six = tiny_config("llama", 2)
    six.num_attention_heads = 6
    with pytest.raises(InvalidConfigError, match="num_key_value_heads=2"):
        shard_config(six, 3)
    assert issubclass(TensorParallelError, FatalEngineError)  # the scheduler lets it propagate
    from vattn.engine.config import EngineConfig

    both = EngineConfig(tensor_parallel_size=2, enable_prefix_caching=True, preemption_mode="swap")
    assert both.enable_prefix_caching and both.preemption_mode == "swap"  # supported under TP
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidConfigError, match="torchrun --nproc-per-node 2"):
        LLM(tiny_config(), tensor_parallel_size=2)


def test_control_message_packs_slots_and_catches_divergence() -> None:
    """`TensorParallel.agree` without processes (a stand-in all-gather): slot sets over
    several int64 words, their union, each rank's error flag and value; ranks whose digests
    or kinds differ raise TensorParallelError."""
    from vattn.engine import parallel

    tp = parallel.TensorParallel.__new__(parallel.TensorParallel)
    tp.rank, tp.size, tp.num_slots, tp.broken, tp._released, tp.owns_group = 0, 2, 130, None, False, False
    tp._digest, tp._checked = 7, False
    peer: list[int] = []
    sent: list[list[int]] = []
    tp.all_gather_ints = lambda mine: sent.append(mine) or [mine, list(peer)]
    peer[:] = [parallel.STEP, 7, 1, 0, 0, 1 << 2, 1 << 3]  # rank 1: an error; slots 65 and 129
    agreed = tp.agree(parallel.STEP, value=1, slots=[0, 62, 63, 129])
    assert len(sent[-1]) == 4 + 3  # [kind, digest, error, value] + ceil(130 / 63) words
    assert agreed.errors == (1,) and agreed.values == (1, 0) and tp._checked
    assert agreed.slots == {0, 62, 63, 65, 129}
    tp.check_schedule()  # the step's message carried the digest: nothing more
    assert len(sent) == 1
    tp._checked = False
    peer[:] = [parallel.CHECK, 7, 0, 0, 0, 0, 0]
    tp.check_schedule()  # nothing agreed yet this iteration: the digest alone
    assert len(sent) == 2 and sent[-1][:2] == [parallel.CHECK, 7] and tp._checked
    peer[:] = [parallel.STEP, 7, 0, 0, 0, 0, 0]
    with pytest.raises(TensorParallelError, match=r"agreeing on \['a new slot', 'a step'\]"):
        tp.agree(parallel.ALLOC_REQID, value=3)
    tp.broken = None
    peer[:] = [parallel.CHECK, 8, 0, 0, 0, 0, 0]
    with pytest.raises(TensorParallelError, match=r"schedules differ \(digests \[7, 8\]"):
        tp.agree(parallel.CHECK)
    assert tp.broken is not None


def test_shard_runs_in_the_devices_dtype() -> None:
    """A config (or a checkpoint without safetensors) is sharded in the dtype of the rank's
    device, as at TP 1: float32 on the host, the half type on CUDA (made there: with a GPU only)."""
    from vattn.engine.config import EngineConfig
    from vattn.engine.parallel import TensorParallel

    tp = TensorParallel.__new__(TensorParallel)
    tp.rank, tp.size = 0, WORLD
    if torch.cuda.is_available():
        tp.device = torch.device("cuda", 0)
        loaded = tp.load_model(tiny_config(), EngineConfig.from_kwargs())
        assert loaded.dtype == torch.float16
        assert loaded.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    tp.device = torch.device("cpu")
    loaded = tp.load_model(tiny_config(), EngineConfig.from_kwargs())
    assert loaded.dtype == torch.float32
    assert loaded.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    with pytest.raises(InvalidConfigError, match="got int"):
        tp.load_model(3, EngineConfig.from_kwargs())


def test_cross_thread_abort_refused_under_tp() -> None:
    """Under TP an abort from another thread while generate runs would land at a different
    point of each rank's schedule: refused (InvalidRequestError), and generate goes on. A
    TP-1 engine with a stand-in for its rank's group (no processes)."""
    import threading
    import types

    from vattn.errors import InvalidRequestError

    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=8) as llm:
        llm.tp = types.SimpleNamespace(rank=0, begin_iteration=lambda _s: None, check_schedule=lambda: None,
                                       note_request=lambda *_: None, note_abort=lambda _ids: None, close=lambda: None)
        errors: list = []

        def abort_from_another_thread(*_):
            if not errors:
                t = threading.Thread(target=lambda: errors.append(_raised(lambda: llm.abort_request(0))))
                t.start()
                t.join(5)  # refused at once (the step holds the engine's lock meanwhile)

        llm.runner.model.model.layers[0].register_forward_hook(abort_from_another_thread)
        outs = llm.generate(prompts()[:2], greedy_params()[:2])
        assert all(o.outputs[0].finish_reason != "abort" for o in outs)
        assert isinstance(errors[0], InvalidRequestError) and "tensor parallelism" in str(errors[0])
        assert llm.abort_request(12345) == []  # from the thread that steps, between steps: fine


def _raised(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the test checks
        return e
    return None


def test_closing_releases_the_group_whatever_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's group is closed when building the scheduler raises (the runner too), and at
    close() even when the runner's close raises. A stand-in for the group (no processes)."""
    import types

    import vattn.engine.llm as llm_module
    from vattn.engine.loader import load_model

    closed: list[str] = []
    stub = types.SimpleNamespace(
        rank=0, device=torch.device("cpu"), agree_budget=lambda _cache: None,
        load_model=lambda model, config: load_model(model, config, torch.device("cpu")),
        close=lambda: closed.append("group"))
    monkeypatch.setattr(llm_module.TensorParallel, "start", classmethod(lambda cls, config: stub))
    real_close = llm_module.TPModelRunner.close

    def runner_close(self):
        closed.append("runner")
        real_close(self)

    monkeypatch.setattr(llm_module.TPModelRunner, "close", runner_close)

    def no_scheduler(*_args, **_kwargs):
        raise RuntimeError("injected: no scheduler")

    with monkeypatch.context() as m:
        m.setattr(llm_module, "Scheduler", no_scheduler)
        with pytest.raises(RuntimeError, match="injected"):
            LLM(tiny_config(), tensor_parallel_size=2)
    assert closed == ["runner", "group"]
    closed.clear()
    llm = LLM(tiny_config(), tensor_parallel_size=2)

    def failing_close(self):
        runner_close(self)
        raise RuntimeError("injected: the runner's close failed")

    monkeypatch.setattr(llm_module.TPModelRunner, "close", failing_close)
    with pytest.raises(RuntimeError, match="the runner's close failed"):
        llm.close()
    assert closed == ["runner", "group"]


def test_cli_tells_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-m", "vattn", "generate", "--model", "M", "--prompt-ids", "1,2",
                          "--tensor-parallel-size", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "torchrun --nproc-per-node 2 -m vattn generate --model M" in out.stderr
