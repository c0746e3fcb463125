"""Allocation cost: `step` latency against the pages it maps, synchronous vs background.

A Llama-3-8B shape (`--layers` layers, 8 KV heads x 128, fp16; per-layer layout: a page
group is one page in each of 2 x layers buffers) on `--device` (cpu: the host backend;
cuda: the CUDA VMM API). The physical pages exist before timing (`reserve_physical`):
creating them is not what this measures. Three experiments:

1. `step` that backs a new request of n page groups (n = 1, 2, 4, ...), per page size:
   - `sync`: `prefetch=False`, `step` maps all n groups (the paper's synchronous path);
     allocation bandwidth = n x group bytes / step time;
   - `background`: the default cache; a previous request of the same length taught the
     pre-mapping worker the prompt size, it mapped the next slot while "the model ran"
     (we wait for it), and `step` maps what is still missing (usually nothing).
2. One page-group map through the batched C call against one call per buffer.
3. `step` in a decode loop of `--batch` requests with `--compute-ms` of real work between
   steps: on-demand, synchronous pre-mapping and background pre-mapping.
4. The scratch backing of an `ElasticPool` (what a server's tensors get: no byte faults),
   against reserved-only free pages: the start-up of a large reservation (`--scratch-gib`,
   one block a page) and a page turn (`alloc` of a block on a fresh page, `free`, `trim`),
   timed, with the backend calls each makes and (host) the mappings (VMAs) the process holds.
On CUDA also the latency of each driver call (cuMemCreate, cuMemMap, ...) per driver.

    vattn bench alloc [--device cpu|cuda] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from array import array
from typing import Any

import torch

import vattn

from ._common import latency_stats, progress
from ._common import sync as _sync

NAME = "alloc"
HELP = "step latency vs pages mapped, sync vs background mapping, allocation bandwidth (host; CUDA with --device)"
NEEDS_GPU = False

KB, MB = 1 << 10, 1 << 20


def _cfg(args: argparse.Namespace, layout: str, page: int, **kw: Any) -> dict[str, Any]:
    # Llama-3-8B per-GPU shape: 8 KV heads x 128, fp16 -> 2 KiB per token per buffer
    return dict(num_layers=args.layers, num_kv_heads=8, head_dim=128, dtype="float16", device=args.device,
                page_size=page, layout=layout, **kw)


# ------------------------------------------------------------- 1. step vs pages ----
def bench_new_pages(args: argparse.Namespace, page: int, counts: list[int], bar: Any) -> list[dict]:
    """step latency of one new request of n page groups, sync and background. Every repetition
    takes a fresh slot and pages (they all exist at once): at least 2, at most --reps of them
    within --max-mib."""
    rows = []
    for mode, kw in (("sync", dict(prefetch=False, background=False)), ("background", dict(background=True))):
        for n in counts:
            reps = _reps(args, n * 2 * args.layers * page)
            with _cache_for(args, page, n, reps, kw) as c:
                reps = min(reps, c.stats().max_pages // n - 2)  # the cache's memory budget (free host memory)
                if reps < 1:
                    bar.update(1)
                    continue
                g = c.geometry
                tokens = n * page // g.token_bytes
                c.reserve_physical(g.group_bytes * n * (reps + 2))
                times, mapped = [], []
                for i in range(reps + 1):  # rep 0 teaches the worker the prompt length
                    r = c.alloc_reqid()
                    c.synchronize()  # the worker's pre-mapping happened while the "model" ran
                    _sync(args.device)
                    t0 = time.perf_counter()
                    res = c.step({r: tokens})
                    dt = time.perf_counter() - t0
                    assert res, f"step of {n} page groups failed"
                    if i:
                        times.append(dt * 1e6)
                        mapped.append(res.num_mapped)
                st = latency_stats(times)
                rows.append(dict(mode=mode, page_KiB=page // KB, new_groups=n, group_MiB=g.group_bytes / MB,
                                 step_us=st["p50"], step_us_mean=st["mean"], step_us_max=st["max"],
                                 groups_mapped_in_step=statistics.mean(mapped),
                                 GBps=n * g.group_bytes / (st["p50"] * 1e-6) / 1e9))
            bar.update(1)
    return rows


def _reps(args: argparse.Namespace, nbytes: int) -> int:
    """Repetitions of a step mapping `nbytes` that fit --max-mib with the two extra slots."""
    return min(args.reps, args.max_mib * MB // nbytes - 2)


def _cache_for(args: argparse.Namespace, page: int, n: int, reps: int, kw: dict) -> vattn.KVCache:
    tokens = n * page // (8 * 128 * 2)  # a request of n pages: 2 KiB a token in each buffer
    return vattn.KVCache(**_cfg(args, "per-layer", page, max_batch_size=reps + 2, max_context_len=tokens), **kw)


# -------------------------------------------------------------- 2. one group map ----
def bench_map(args: argparse.Namespace, pages: list[int], reps: int) -> list[dict]:
    """map + unmap of one page group: the batched C call vs one call per buffer."""
    rows = []
    for layout in ("per-layer", "fused"):
        for page in pages:
            with vattn.KVCache(**_cfg(args, layout, page, max_batch_size=2,
                                      max_context_len=max(4096, reps * page // 1024)), prefetch=False) as c:
                g, be, a = c.geometry, c.backend, c.allocator
                n = min(reps, g.pages_per_slot)
                groups = be.create(n, g.num_buffers, page)
                offs = [g.page_offset(0, p) for p in range(n)]
                t0 = time.perf_counter()
                for i in range(n):
                    be.map(a.books.physical.bases, offs[i:i + 1], groups[i:i + 1], page)
                _sync(args.device)
                t_map = (time.perf_counter() - t0) / n
                t0 = time.perf_counter()
                for i in range(n):
                    be.unmap(a.books.physical.bases, offs[i:i + 1], page)
                _sync(args.device)
                t_unmap = (time.perf_counter() - t0) / n
                t0 = time.perf_counter()  # the same group mapped one buffer at a time
                for i in range(n):
                    for b in range(g.num_buffers):
                        be.map(a.books.physical.bases[b:b + 1], offs[i:i + 1], [_one(groups[i], b)], page)
                _sync(args.device)
                t_per_buf = (time.perf_counter() - t0) / n
                be.unmap(a.books.physical.bases, offs, page)
                be.release(groups)
                rows.append(dict(layout=layout, page_KiB=page // KB, buffers=g.num_buffers, map_us=t_map * 1e6,
                                 unmap_us=t_unmap * 1e6, map_per_buffer_calls_us=t_per_buf * 1e6,
                                 us_per_page=t_map * 1e6 / g.num_buffers, map_GBps=g.group_bytes / t_map / 1e9))
    return rows


def _one(group: Any, b: int) -> Any:
    """The page of buffer b of a group, as a one-buffer group (host or CUDA)."""
    if hasattr(group, "fd"):
        return group._replace(offset=group.offset + b * group.stride, stride=0, num_buffers=1)
    return (group[b],)


# ------------------------------------------------------------- 3. decode loop ----
def _compute(ms: float, device: str) -> None:
    """A stand-in for the model's forward: real work that releases the GIL."""
    x = torch.ones(256, 256, device=device)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = x @ x * 0.001
    _sync(device)


def bench_decode(args: argparse.Namespace, page: int) -> list[dict]:
    modes = [("on-demand", dict(prefetch=False, background=False)),
             ("sync pre-map", dict(prefetch=True, background=False)),
             ("background", dict(prefetch=True, background=True))]
    rows = []
    tpp = page // (8 * 128 * 2)  # tokens per page: 2 KiB a token in each buffer
    for name, kw in modes:
        with vattn.KVCache(**_cfg(args, "per-layer", page, max_batch_size=args.batch,
                                  max_context_len=max(8192, 2 * tpp + args.iters)), **kw) as c:
            slots = [c.alloc_reqid() for _ in range(args.batch)]
            if tpp < args.iters:  # small pages: staggered lengths, every request crosses pages in the loop
                lens = {s: 64 + 33 * i for i, s in enumerate(slots)}
            else:  # 2 MiB pages hold 1024 tokens: request i crosses into its 2nd page at iteration ~ (i + 1) x iters / (batch + 1)
                lens = {s: tpp - (i + 1) * args.iters // (args.batch + 1) for i, s in enumerate(slots)}
            c.reserve_physical(c.geometry.group_bytes
                               * (sum(c.geometry.pages_for(n + args.iters) for n in lens.values()) + 2))
            assert c.step(lens)
            times, mapped = [], 0
            for _ in range(args.iters):
                lens = {s: n + 1 for s, n in lens.items()}
                t0 = time.perf_counter()
                res = c.step(lens)
                times.append((time.perf_counter() - t0) * 1e6)
                assert res
                mapped += res.num_mapped
                _compute(args.compute_ms, args.device)
            st = latency_stats(times)
            rows.append(dict(mode=name, page_KiB=page // KB, batch=args.batch, step_us_mean=st["mean"],
                             step_us_p50=st["p50"], step_us_p99=st["p99"], step_us_max=st["max"],
                             groups_mapped_in_step=mapped))
    for r in rows:
        r["mean_vs_on_demand"] = r["step_us_mean"] / rows[0]["step_us_mean"]
    return rows


# ---------------------------------------------------------- 4. scratch backing ----
def _scratch_pool(args: argparse.Namespace, num_pages: int, page: int, scratch: bool) -> vattn.ElasticPool:
    """One block a page, one buffer (a seam: the tests build it on the fake CUDA driver)."""
    return vattn.ElasticPool(num_pages, (page,), torch.uint8, 1, device=args.device, page_size=page, grow=1,
                             scratch=scratch)


def _vmas() -> int:
    """The mappings (VMAs) of this process (vm.max_map_count bounds them): /proc/self/maps lines."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return -1


_COUNTERS = ("num_map_calls", "num_unmap_calls", "num_scratch_calls")


def bench_scratch(args: argparse.Namespace, pages: list[int], sizes_gib: list[float], turns: int) -> list[dict]:
    """Start-up of a `gib` GiB pool and `turns` page turns (alloc a block on a fresh page, free
    it, trim), with and without the scratch backing; backend calls per turn and VMAs."""
    rows = []
    for page in pages:
        for gib in sizes_gib:
            n = max(1, int(gib * 2**30) // page)
            starts: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(2):  # start-up, alternated (the first pool of a size also warms the host's caches)
                for scratch in (False, True):
                    t0 = time.perf_counter()
                    _scratch_pool(args, n, page, scratch).close()
                    starts[scratch].append(time.perf_counter() - t0)
            for scratch in (False, True):
                before = _vmas()
                t0 = time.perf_counter()
                pool = _scratch_pool(args, n, page, scratch)
                starts[scratch].append(time.perf_counter() - t0)
                start = statistics.median(starts[scratch])
                with pool:
                    vmas_start = _vmas() - before
                    be = pool.backend
                    counts = [getattr(be, c) for c in _COUNTERS]
                    t_alloc, t_trim = [], []
                    for i in range(turns):
                        t0 = time.perf_counter()
                        ids = pool.take([(i * 7919) % n])  # a fresh page, away from the last one
                        _sync(args.device)
                        t_alloc.append((time.perf_counter() - t0) * 1e6)
                        assert ids is not None
                        pool.free(ids)
                        t0 = time.perf_counter()
                        pool.trim()
                        t_trim.append((time.perf_counter() - t0) * 1e6)
                    per_turn = {c[4:]: (getattr(be, c) - k) / turns for c, k in zip(_COUNTERS, counts)}
                    rows.append(dict(page_KiB=page // KB, reservation_GiB=gib, pages=n, scratch=scratch,
                                     startup_ms=start * 1e3, vmas_at_start=vmas_start,
                                     scratch_KiB=be.scratch_bytes // KB, alloc_us=latency_stats(t_alloc)["p50"],
                                     trim_us=latency_stats(t_trim)["p50"], **{f"{k}_per_turn": v
                                                                              for k, v in per_turn.items()}))
            strict, with_scratch = rows[-2], rows[-1]
            for r in (strict, with_scratch):
                r["startup_vs_strict"] = r["startup_ms"] / strict["startup_ms"]
                r["turn_vs_strict"] = (r["alloc_us"] + r["trim_us"]) / (strict["alloc_us"] + strict["trim_us"])
    return rows


# ---------------------------------------------------------- CUDA driver calls ----
def _t(fn: Any, *a: Any) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return (time.perf_counter() - t0) * 1e6


def _vmm_cache(args: argparse.Namespace, driver: str, reps: int) -> vattn.KVCache:
    """A one-layer cache on `driver` ("cext" or "cuda-python"); the tests build it on fake drivers."""
    return vattn.KVCache(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", device=args.device,
                         max_batch_size=1, max_context_len=reps * 1024, cuda_driver=driver, prefetch=False)


def vmm_calls(args: argparse.Namespace, reps: int) -> list[dict]:
    """Latency (us, median) of each VMM call through each CUDA driver path. A driver path that
    cannot start (cuda-python not installed) is a row with its error; anything else raises."""
    rows = []
    for driver in ("cext", "cuda-python"):
        try:
            cache = _vmm_cache(args, driver, reps)
        except vattn.VattnError as e:
            rows.append(dict(driver=driver, error=str(e)))
            continue
        with cache:
            rows.append(dict(driver=driver, page_MiB=cache.page_size / MB, **_per_call(cache, reps)))
    return rows


def _per_call(cache: vattn.KVCache, reps: int) -> dict[str, float]:
    be, g, a = cache.backend, cache.geometry, cache.allocator
    drv, page = be.drv, g.page_size
    reps = min(reps, g.pages_per_slot)
    if drv.name == "cuda-python":  # one driver call at a time, the device's context current around them
        d = drv.d
        ts: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
        with drv._in_ctx():
            for i in range(reps):
                t0 = time.perf_counter(); h = drv._check("cuMemCreate", d.cuMemCreate(page, drv._prop, 0))[1]
                ts["create"].append(time.perf_counter() - t0)
                addr = a.books.physical.bases[0] + g.page_offset(0, i)
                t0 = time.perf_counter(); drv._check("cuMemMap", d.cuMemMap(addr, page, 0, h, 0))
                ts["map"].append(time.perf_counter() - t0)
                t0 = time.perf_counter(); drv._check("cuMemSetAccess", d.cuMemSetAccess(addr, page, [drv._access], 1))
                ts["set_access"].append(time.perf_counter() - t0)
                t0 = time.perf_counter(); drv._check("cuMemUnmap", d.cuMemUnmap(addr, page))
                ts["unmap"].append(time.perf_counter() - t0)
                t0 = time.perf_counter(); drv._check("cuMemRelease", d.cuMemRelease(h))
                ts["release"].append(time.perf_counter() - t0)
        return {k: statistics.median(v) * 1e6 for k, v in ts.items()}
    base = array("Q", a.books.physical.bases[:1])  # cext: cuMemMap and cuMemSetAccess in one batched call
    hs: list[int] = []
    create = [_t(lambda: hs.extend(drv.create(1, page))) for _ in range(reps)]
    mapt = [_t(drv.map, base, array("Q", [g.page_offset(0, i)]), [hs[i]], page) for i in range(reps)]
    unmap = [_t(drv.unmap, base, array("Q", [g.page_offset(0, i)]), page) for i in range(reps)]
    rel = [_t(drv.release, [h]) for h in hs]
    return dict(create=statistics.median(create), map=statistics.median(mapt), set_access=float("nan"),
                unmap=statistics.median(unmap), release=statistics.median(rel))


# ------------------------------------------------------------------------ bench ----
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (host backend, default) or cuda[:N]")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    p.add_argument("--layers", type=int, default=32, help="layers of the Llama-3-8B shape (default: 32)")
    p.add_argument("--pages", type=int, nargs="+", default=None,
                   help="page sizes in bytes (default: 64K 256K 2M on the host, 2M 4M 8M on CUDA)")
    p.add_argument("--max-groups", type=int, default=64, help="largest new-request size in page groups (default: 64)")
    p.add_argument("--max-mib", type=int, default=None,
                   help="memory for the pages of one new-request size, all repetitions (default: 1024 on the host, "
                   "16384 on CUDA)")
    p.add_argument("--reps", type=int, default=None, help="repetitions per size (default: 10; 4 with --quick)")
    p.add_argument("--batch", type=int, default=16, help="decode loop: requests (default: 16)")
    p.add_argument("--iters", type=int, default=None, help="decode loop: steps (default: 400; 150 with --quick)")
    p.add_argument("--compute-ms", type=float, default=2.0, help="decode loop: work between steps (default: 2)")
    p.add_argument("--scratch-gib", type=float, nargs="+", default=None,
                   help="scratch backing: reservation sizes in GiB (default: 1 8; 1 with --quick)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise vattn.InvalidConfigError("--device cuda needs a CUDA GPU and none is available; use --device cpu")
    pages = args.pages or ([2 * MB, 4 * MB, 8 * MB] if cuda else [64 * KB, 256 * KB, 2 * MB])
    args.reps = args.reps or (4 if args.quick else 10)
    args.max_mib = args.max_mib or (16384 if cuda else 1024)
    args.iters = args.iters or (150 if args.quick else 400)
    group = {p: 2 * args.layers * p for p in pages}
    counts = {p: [n for n in (1 << i for i in range(12)) if n <= args.max_groups and _reps(args, n * group[p]) >= 2]
              for p in pages}
    scratch_gib = args.scratch_gib or ([1] if args.quick else [1, 8])
    bar = progress(total=2 * sum(len(c) for c in counts.values()) + 3, desc="alloc", unit="case")
    with bar:
        new_rows = [r for p in pages for r in bench_new_pages(args, p, counts[p], bar)]
        map_rows = bench_map(args, pages, 8 if args.quick else 32)
        bar.update(1)
        decode_rows = bench_decode(args, pages[0])
        bar.update(1)
        scratch_rows = bench_scratch(args, [pages[0], pages[-1]] if len(pages) > 1 else pages, scratch_gib,
                                     8 if args.quick else 32)
        bar.update(1)
    out = dict(device=args.device, layers=args.layers, pages_KiB=[p // KB for p in pages], new_request=new_rows,
               map=map_rows, decode=decode_rows, scratch=scratch_rows)
    if cuda:
        out["vmm_calls"] = vmm_calls(args, 20 if args.quick else 100)
    sync = [r for r in new_rows if r["mode"] == "sync"]
    out["peak_GBps"] = max((r["GBps"] for r in sync), default=float("nan"))
    return out


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """The new-request steps (sync vs background), then the decode loop and the one-group maps as notes."""
    by = {(r["page_KiB"], r["new_groups"], r["mode"]): r for r in result["new_request"]}
    rows = []
    for (page, n, mode), r in by.items():
        if mode != "sync":
            continue
        b = by.get((page, n, "background"), {})
        rows.append([page, n, r["group_MiB"] * n, r["step_us"], r["GBps"], b.get("step_us"),
                     b.get("groups_mapped_in_step"), b.get("step_us", float("nan")) / r["step_us"]])
    print(f"\none page-group map, {result['device']} ({result['layers']} layers):")
    for r in result["map"]:
        print(f"  {r['layout']:9} {r['page_KiB']:5} KiB: {r['map_us']:.1f} us batched ({r['buffers']} buffers), "
              f"{r['map_per_buffer_calls_us']:.1f} us one call per buffer, unmap {r['unmap_us']:.1f} us")
    d = result["decode"]
    print(f"decode loop, batch {d[0]['batch']}, {d[0]['page_KiB']} KiB pages: " + "; ".join(
        f"{r['mode']} mean {r['step_us_mean']:.0f} us p99 {r['step_us_p99']:.0f} us ({r['mean_vs_on_demand']:.2f}x)"
        for r in d))
    print("scratch backing (ElasticPool, one block a page) vs reserved-only free pages:")
    for r in result.get("scratch", []):
        print(f"  {r['page_KiB']:5} KiB pages, {r['reservation_GiB']} GiB ({r['pages']} pages), "
              f"{'scratch' if r['scratch'] else 'strict '}: start-up {r['startup_ms']:.1f} ms "
              f"({r['startup_vs_strict']:.2f}x), {r['vmas_at_start']} VMAs, page turn alloc {r['alloc_us']:.0f} us + "
              f"trim {r['trim_us']:.0f} us ({r['turn_vs_strict']:.2f}x); per turn {r['map_calls_per_turn']:.0f} map, "
              f"{r['unmap_calls_per_turn']:.0f} unmap, {r['scratch_calls_per_turn']:.0f} scratch call(s)")
    for r in result.get("vmm_calls", []):
        print(f"  {r['driver']}: " + (r["error"] if "error" in r else ", ".join(
            f"{k} {r[k]:.1f} us" for k in ("create", "map", "set_access", "unmap", "release"))))
    print(f"peak allocation bandwidth (sync step): {result['peak_GBps']:.2f} GB/s\n")
    return (["page KiB", "new groups", "MiB", "sync step us", "sync GB/s", "background step us",
             "groups mapped in background step", "background / sync"], rows)


def plot(result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for page in result["pages_KiB"]:
        for mode, ls in (("sync", "-"), ("background", "--")):
            rs = [r for r in result["new_request"] if r["page_KiB"] == page and r["mode"] == mode]
            if rs:
                line = ax1.plot([r["new_groups"] for r in rs], [r["step_us"] for r in rs], ls, marker="o",
                                label=f"{page} KiB {mode}")
                if mode == "sync":
                    ax2.plot([r["new_groups"] * r["group_MiB"] for r in rs], [r["GBps"] for r in rs], marker="o",
                             color=line[0].get_color(), label=f"{page} KiB")
    ax1.set(xscale="log", yscale="log", xlabel="page groups of the new request", ylabel="step latency (us, p50)",
            title=f"step() of a new request ({result['device']}, {result['layers']} layers)")
    ax2.set(xscale="log", xlabel="MiB mapped in one step", ylabel="GB/s mapped",
            title="allocation bandwidth (sync step)" + (" (host: mmap, no copy)" if result["device"] == "cpu" else ""))
    d = result["decode"]
    ax3.bar([r["mode"] for r in d], [r["step_us_p99"] for r in d], color="tab:orange", alpha=0.5, label="p99")
    ax3.bar([r["mode"] for r in d], [r["step_us_mean"] for r in d], color="tab:blue", label="mean")
    ax3.set(ylabel="step latency (us)", title=f"decode loop, batch {d[0]['batch']}, {d[0]['page_KiB']} KiB pages")
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=7)
    return fig
