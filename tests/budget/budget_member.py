"""A member of a shared budget in its own process, driven by tests/budget/test_budget_shared.py:
one JSON command a line on stdin, one JSON answer a line on stdout.

    python -m tests.budget.budget_member NAME [--limit B] [--member-limit B] [--label L] [--llm FAMILY]

It joins `vattn.Budget.shared(NAME)` and builds a host `KVCache` on it (or, with --llm,
an `LLM` of a tiny seeded model). Between commands it does nothing at all: memory it
gives back meanwhile is its budget responder's doing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import torch

import vattn

# 2 layers x K/V x 4 KiB pages: one 16 KiB page group = 32 tokens of a slot, 32 groups a slot;
# the cache grows by 16 groups at least (fewer when the budget has less room)
CACHE = dict(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=4, max_context_len=1024, dtype="float32",
             device="cpu", page_size=4096, prefetch=False)
GROUP = 4 * 4096


def pattern(slot: int, tag: float, layer: int, n: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)
    return (tag * 1000 + layer * 100 + slot * 10 + pos % 97)[:, None, None]


def fill(cache: vattn.KVCache, r: int, n: int, tag: float) -> None:
    for layer in range(CACHE["num_layers"]):
        cache.k_cache(layer)[r, :n] = pattern(r, tag, layer, n).to(CACHE["device"])
        cache.v_cache(layer)[r, :n] = -pattern(r, tag, layer, n).to(CACHE["device"])


def intact(cache: vattn.KVCache, r: int, n: int, tag: float) -> bool:
    for layer in range(CACHE["num_layers"]):
        want = pattern(r, tag, layer, n).to(CACHE["device"])
        if not (torch.equal(cache.k_cache(layer)[r, :n], want.expand(n, 2, 16))
                and torch.equal(cache.v_cache(layer)[r, :n], -want.expand(n, 2, 16))):
            return False
    return True


def churn(cache: vattn.KVCache, seconds: float, seed: int) -> dict[str, Any]:
    """Random requests for `seconds`: alloc, grow, write, check, free; every written token
    must read back until its request is freed."""
    rng = random.Random(seed)
    live: dict[int, int] = {}  # reqid -> tokens written
    steps = ok = oom = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if live and (rng.random() < 0.3 or len(live) == CACHE["max_batch_size"]):
            r = rng.choice(list(live))
            assert intact(cache, r, live.pop(r), 1), f"request {r} lost its data"
            cache.free_reqid(r)
            continue
        r = cache.alloc_reqid()
        n = rng.randrange(32, 1024)
        res = cache.step({**live, r: n})
        steps += 1
        if res.failed:
            oom += res.out_of_memory
            cache.free_reqid(r)
            for x in res.failed:  # preempted: give up that request too
                if x in live:
                    live.pop(x)
                    cache.free_reqid(x)
            continue
        ok += 1
        fill(cache, r, n, 1)
        live[r] = n
    for r, n in live.items():
        assert intact(cache, r, n, 1), f"request {r} lost its data"
        cache.free_reqid(r)
    return {"steps": steps, "ok": ok, "oom": oom}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--member-limit", type=int, default=None)
    ap.add_argument("--label", default=None)
    ap.add_argument("--llm", default=None, help="a tests.helpers model family: an engine instead of a cache")
    ap.add_argument("--device", default="cpu", help="cuda: the cache on the GPU, 2 MiB pages (a slot is one group)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.device != "cpu":
        CACHE.update(device=a.device, page_size=2 << 20)
    budget = vattn.Budget.shared(a.name, a.limit, member_limit=a.member_limit, label=a.label, device=a.device)
    if a.llm:
        from tests.helpers import greedy_params, prompts, tiny_config
        from vattn.engine import LLM

        llm = LLM(tiny_config(a.llm), seed=0, max_batch_size=4, page_size=4096, budget=budget)
        cache = llm.cache
    else:
        cache = vattn.KVCache(**CACHE, budget=budget)
    say({"ready": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        t0 = time.monotonic()
        if op == "alloc":
            out: Any = cache.alloc_reqid()
        elif op == "step":
            res = cache.step({int(k): v for k, v in cmd["lens"].items()})
            out = {"ok": bool(res), "oom": res.out_of_memory, "failed": list(res.failed)}
        elif op == "fill":
            fill(cache, cmd["r"], cmd["n"], cmd["tag"])
            out = True
        elif op == "intact":
            out = intact(cache, cmd["r"], cmd["n"], cmd["tag"])
        elif op == "free":
            cache.free_reqid(cmd["r"])
            out = True
        elif op == "reclaim":  # what the cache asks the budget when it is `n` bytes short
            out = budget.reclaim(cmd["n"])
        elif op == "churn":
            out = churn(cache, cmd["seconds"], cmd["seed"])
        elif op == "generate":
            outs = llm.generate(prompts(), greedy_params())
            out = {"tokens": [o.token_ids for o in outs], "preemptions": llm.num_preemptions}
        else:
            raise SystemExit(f"unknown op {op!r}")
        s, b = cache.stats(), budget.stats()
        say({"out": out, "s": time.monotonic() - t0, "created": s.num_created_pages * s.group_bytes,
             "budget_used": b.used, "member_used": b.member_used})
    cache.close()


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
