"""CUDA VMM costs: per-call latency and the allocation bandwidth of `step`.

For each driver path (`cext`: vattn._C through dlopen, `cuda-python`: cuda.bindings) and
page size (the granularity, 2 MiB on stock drivers, and multiples):
1. per-call latency of cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease
   (cuda-python calls each separately; the cext path maps with access in one batched call);
2. `step` allocation bandwidth (GB/s of physical memory mapped per second of `step`) for a
   prefill of `--tokens` tokens in each of `--batch` requests, per-layer and fused layouts.

    python benchmarks/vmm_latency.py [--device cuda:0] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time
from array import array

import torch

import vattn
from _common import environment, print_table, save

MB = 1 << 20


def _t(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e6


def per_call(cache: vattn.KVCache, reps: int) -> dict:
    """Latency of each VMM call (us), through the cache's own driver."""
    be, g, a = cache.backend, cache.geometry, cache.allocator
    drv, page = be.drv, g.page_size
    out: dict[str, float] = {}
    if drv.name == "cuda-python":
        d = drv.d
        drv._ctx_current()
        create, mapt, acc, unmap, rel = [], [], [], [], []
        for i in range(reps):
            t0 = time.perf_counter(); h = drv._check("cuMemCreate", d.cuMemCreate(page, drv._prop, 0))[1]
            create.append(time.perf_counter() - t0)
            addr = a.bases[0] + g.page_offset(0, i)
            t0 = time.perf_counter(); drv._check("cuMemMap", d.cuMemMap(addr, page, 0, h, 0)); mapt.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); drv._check("cuMemSetAccess", d.cuMemSetAccess(addr, page, [drv._access], 1))
            acc.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); drv._check("cuMemUnmap", d.cuMemUnmap(addr, page)); unmap.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); drv._check("cuMemRelease", d.cuMemRelease(h)); rel.append(time.perf_counter() - t0)
        for k, v in dict(create=create, map=mapt, set_access=acc, unmap=unmap, release=rel).items():
            out[k] = statistics.median(v) * 1e6
    else:  # cext: cuMemMap and cuMemSetAccess happen in one batched call
        base = array("Q", a.bases[:1])
        hs: list[int] = []
        create = [_t(lambda: hs.extend(drv.create(1, page))) for _ in range(reps)]
        mapt = [_t(drv.map, base, array("Q", [g.page_offset(0, i)]), [hs[i]], page) for i in range(reps)]
        unmap = [_t(drv.unmap, base, array("Q", [g.page_offset(0, i)]), page) for i in range(reps)]
        rel = [_t(drv.release, [h]) for h in hs]
        out.update(create=statistics.median(create), map=statistics.median(mapt), set_access=float("nan"),
                   unmap=statistics.median(unmap), release=statistics.median(rel))
    return out


def step_bandwidth(cache: vattn.KVCache, batch: int, tokens: int) -> dict:
    g = cache.geometry
    slots = [cache.alloc_reqid() for _ in range(batch)]
    cache.reserve_physical(g.group_bytes * batch * g.pages_for(tokens))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = cache.step({s: tokens for s in slots})
    dt = time.perf_counter() - t0
    assert res
    nbytes = res.num_mapped * g.group_bytes
    for s in slots:
        cache.free_reqid(s)
    return dict(groups=res.num_mapped, bytes=nbytes, seconds=dt, GBps=nbytes / dt / 1e9,
                us_per_group=dt * 1e6 / max(1, res.num_mapped))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("vmm_latency.py needs a CUDA GPU (use alloc_latency.py for the host backend)")
    reps = 20 if args.quick else 100
    drivers = ["cext", "cuda-python"]
    rows_call, rows_bw = [], []
    for driver in drivers:
        for mult in (1, 2, 4):
            for layout in ("per-layer", "fused"):
                # Llama-3-8B shape: 32 layers, 8 KV heads x 128, fp16
                kw = dict(num_layers=32, num_kv_heads=8, head_dim=128, max_batch_size=args.batch,
                          max_context_len=max(args.tokens, 16384), dtype="float16", device=args.device,
                          layout=layout, cuda_driver=driver, prefetch=False)
                try:
                    with vattn.KVCache(**kw) as c0:
                        page = c0.backend.granularity * mult
                except vattn.InvalidConfigError as e:
                    print(f"skip {driver}: {e}")
                    break
                with vattn.KVCache(**kw, page_size=page) as c:
                    if layout == "per-layer":
                        pc = per_call(c, reps)
                        rows_call.append(dict(driver=driver, page_MiB=page / MB, **pc))
                    bw = step_bandwidth(c, args.batch, args.tokens)
                    rows_bw.append(dict(driver=driver, layout=layout, page_MiB=page / MB, **bw))
    print("\nper-call latency (us, median)")
    print_table(["driver", "page MiB", "create", "map", "set access", "unmap", "release"],
                [[r["driver"], r["page_MiB"], r["create"], r["map"], r["set_access"], r["unmap"], r["release"]] for r in rows_call])
    print(f"\nstep() allocation bandwidth: prefill of {args.tokens} tokens x {args.batch} requests")
    print_table(["driver", "layout", "page MiB", "groups", "GB/s", "us/group"],
                [[r["driver"], r["layout"], r["page_MiB"], r["groups"], r["GBps"], r["us_per_group"]] for r in rows_bw])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    calls = ["create", "map", "set_access", "unmap", "release"]
    for i, r in enumerate([r for r in rows_call if r["page_MiB"] == rows_call[0]["page_MiB"]]):
        ax1.bar([x + 0.4 * i for x in range(len(calls))], [r[k] for k in calls], width=0.4, label=r["driver"])
    ax1.set_xticks([x + 0.2 for x in range(len(calls))], calls)
    ax1.set(ylabel="us per call", title=f"VMM call latency, {rows_call[0]['page_MiB']:.0f} MiB pages")
    ax1.legend()
    for driver in drivers:
        for layout in ("per-layer", "fused"):
            rs = [r for r in rows_bw if r["driver"] == driver and r["layout"] == layout]
            if rs:
                ax2.plot([r["page_MiB"] for r in rs], [r["GBps"] for r in rs], "o-", label=f"{driver}, {layout}")
    ax2.set(xlabel="page size (MiB)", ylabel="GB/s", title="step() allocation bandwidth")
    ax2.legend()
    save("vmm_latency_cuda", {"env": environment(args.device), "args": vars(args), "per_call": rows_call,
                              "step_bandwidth": rows_bw}, fig)


if __name__ == "__main__":
    main()
