"""The offload tiers on a multi-turn chat: a conversation's context computed once, not every turn.

Many users chat with one seeded model; each turn's prompt is the whole conversation so far
(their first message, every answer and message since) and a new message; answers are tens of
tokens. Users take turns round robin, `--concurrency` requests in flight at once (a closed
loop: a user's next turn comes after all the others'), so their contexts together need several
times the device memory allowed (`--device-tokens`: `physical_memory` of that many tokens).
Systems, one after another in one run, on the same requests:

- `no_prefix`: no prefix caching (every prompt computed whole);
- `device`: prefix caching in device memory only (a context evicted before its user's next
  turn is computed again);
- `host`: + the host tier (`offload_bytes`: every context fits);
- `host+disk`: + the disk tier (`offload_dir`), under a host tier of a quarter of that;
- `host_small`: that small host tier alone, no disk tier (`host+disk`'s step time p99 over
  its own is what the disk tier's writes cost the engine's thread);
- `unlimited`: prefix caching with device memory for everything (the bound).

Shapes (`--shape`, both by default, each a round of engines; the targets hold on each; the
restart round runs after `chat`'s):

- `chat`: 16 users, 4 requests in flight, 4,096 tokens of device memory (about 6 of the 16
  contexts at their end): the contexts are evicted between a user's turns, every running
  request fits;
- `pressure`: 8 users, all 8 in flight, 1,400 tokens of device memory (about 2 contexts at
  their end), 128-token prompt chunks: the requests in flight do not fit together, so some
  wait for memory and running ones are preempted as they grow. Before admission planned
  restores with the step, the host tier's restores took pages the running requests needed
  (more preemptions than device-only) and every iteration admitted requests the step then
  sent back (their prompts counted again each time).

Every engine has a slot per user (`max_batch_size`) and runs `--concurrency` of them
(`max_num_seqs`): memory, not slots, is what the systems differ in.

The systems' engines are open together and step in turn (`Chat`, `serve_together`): each
counts only its own steps' time, so a load on the shared machine falls on all of them. Per
system: prompt tokens computed and looked up (`queried`: once per admission, again after a
preemption), time to first token p50/p99 (engine time) and the wait from arrival to admission
p50 (memory, when requests in flight do not fit), each `llm.step()`'s time p99, preemptions,
output tokens/s, hits per tier, and whether every answer equals transformers' `generate` on the
same weights (computed first; the conversations are built from those answers). Then a restart: a new engine on the
`host+disk` system's directory serves every user's next turn (`restart`), beside a cold engine
without it (`cold`): the first turn's hits from disk and its TTFT.

Restore bandwidth (`bandwidth`): a prefix of `--bandwidth-blocks` blocks restored from the host
tier into a request's pages (`PrefixCache.map_prefix`: pages backed, copied page by page)
against one plain copy of the same bytes from (pinned, on CUDA) host memory to the device; the
GPU target is at least 80 % of the plain copy.

On a GPU (2 MiB pages: a block must be shorter than a conversation, so a model with big tokens,
fused): `--quick` (the GPU suite's stage) takes one of 16 layers of 16 KV heads of 128, 32
tokens a block; Llama-3-8B's shape with random fp16 weights is `vattn bench offload --device
cuda --layout fused --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336
--vocab 32000`. On a GPU (fp16) the answers' agreement with `generate` is reported, not failed.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from typing import Any

import torch

from vattn.bench._common import agreement, latency_stats, progress
from vattn.bench._common import sync as _sync
from vattn.bench._models import build_model, llama_config

NAME = "offload"
HELP = "the host and disk tiers under the prefix cache on a multi-turn chat (TTFT, prefill computed, hits)"
NEEDS_GPU = False

SYSTEMS = ("no_prefix", "device", "host", "host+disk", "host_small", "unlimited")
# --shape: the defaults each shape changes (see the module docstring)
SHAPES: dict[str, dict[str, Any]] = {
    "chat": dict(users=16, concurrency=4, device_tokens=4096, max_num_batched_tokens=512),
    "pressure": dict(users=8, concurrency=8, device_tokens=1400, max_num_batched_tokens=128)}
TARGETS = dict(prefill_vs_device=1 / 2, ttft_gain_vs_device=2.0, ttft_vs_unlimited=1.3, bandwidth_vs_copy=0.8,
               step_p99_disk_vs_host_small=1.1)

Turn = tuple[list[int], list[int]]  # (prompt, generate's answer)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--shape", nargs="+", default=None, choices=list(SHAPES),
                   help="the workloads, one round of engines each (see above; default: both, with --quick chat "
                        "only): users, in flight, device memory and chunk; the options below given explicitly apply "
                        "to every shape")
    p.add_argument("--users", type=int, default=None, help="users (default: the shape's)")
    p.add_argument("--turns", type=int, default=6, help="turns of every conversation (then one more after a restart)")
    p.add_argument("--first", type=int, default=300, help="tokens of a user's first message")
    p.add_argument("--message", type=int, default=40, help="tokens of every later message")
    p.add_argument("--answer", type=int, default=24, help="tokens of every answer")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (max_num_seqs; default: the shape's)")
    p.add_argument("--device-tokens", type=int, default=None,
                   help="physical_memory in tokens of K/V (the device tier's size; default: the shape's)")
    p.add_argument("--page-size", type=int, default=None,
                   help="page size in bytes (default: 32 KiB on the CPU, the GPU's granularity on CUDA)")
    p.add_argument("--layout", default="per-layer", choices=("per-layer", "fused"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="(default: the shape's)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--bandwidth-blocks", type=int, default=32, help="blocks restored in the bandwidth part (0: skip)")
    p.add_argument("--quick", action="store_true",
                   help="a short run (the GPU suite's stage): 8 users, 3 turns, 16-token answers, 2048 tokens of "
                        "device memory, 16 blocks restored; on CUDA a model of big tokens (16 layers, 16 KV heads of "
                        "128, fp16, fused 2 MiB pages: 32 tokens a block)")
    p.add_argument("--seed", type=int, default=0)


QUICK = dict(turns=3, answer=16, bandwidth_blocks=16)
QUICK_SHAPES = {"chat": dict(users=8, device_tokens=2048)}
QUICK_CUDA = dict(layers=16, hidden=2048, heads=16, kv_heads=16, intermediate=2048, vocab=32000, layout="fused")


# ------------------------------------------------------------------------ inputs ----
def model_config(args: argparse.Namespace) -> Any:
    max_len = args.first + (args.turns + 1) * (args.message + args.answer) + 64
    return llama_config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, max_position_embeddings=max_len, tie_word_embeddings=False)


def conversations(model: Any, args: argparse.Namespace, device: str) -> list[list[Turn]]:
    """Per user, `turns + 1` turns: (prompt, generate's greedy answer); a turn's prompt is the
    conversation so far and a new message (seeded token ids)."""
    rng = random.Random(args.seed)
    convs = []
    bar = progress(total=args.users * (args.turns + 1), desc="transformers' answers", unit="turn")
    for _ in range(args.users):
        history: list[int] = []
        turns = []
        for t in range(args.turns + 1):
            prompt = history + [rng.randrange(1, args.vocab) for _ in range(args.first if t == 0 else args.message)]
            ids = torch.tensor([prompt], device=device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.answer,
                                     min_new_tokens=args.answer, do_sample=False, pad_token_id=0)
            answer = out[0, len(prompt):].tolist()
            turns.append((prompt, answer))
            history = prompt + answer
            bar.update(1)
        convs.append(turns)
    bar.close()
    return convs


# ----------------------------------------------------------------------- serving ----
def engine_kwargs(system: str, args: argparse.Namespace, token_bytes: int, context_tokens: int,
                  directory: str) -> dict[str, Any]:
    """`LLM` settings of a system (see the module docstring); `context_tokens`: every
    conversation's tokens at its end (what a host tier holds them all in)."""
    # a slot for every user (a free slot keeps its pages: deferred reclamation), `concurrency` running
    kw: dict[str, Any] = dict(max_batch_size=args.users, max_num_seqs=args.concurrency, page_size=args.page_size,
                              layout=args.layout,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              physical_memory=args.device_tokens * token_bytes)
    every = 2 * context_tokens * token_bytes  # every context's blocks (and room for more)
    if system != "no_prefix":
        kw["enable_prefix_caching"] = True
    if system == "host":
        kw["offload_bytes"] = every
    if system == "host+disk":
        kw.update(offload_bytes=every // 8, offload_dir=directory, offload_dir_bytes=2 * every)  # a quarter of them
    if system == "host_small":
        kw["offload_bytes"] = every // 8
    if system == "unlimited":
        kw["physical_memory"] = None
    return kw


class Chat:
    """One engine serving the users' turns round robin, `concurrency` in flight (a request is
    added as one finishes), one `tick` (an engine step) at a time. Its clock runs only while
    it steps: engines that take turns on one machine each count their own time, and a load
    that comes and goes falls on all of them (TTFT: the engine time from a request's arrival
    to the step that gave its first token)."""

    def __init__(self, llm: Any, convs: list[list[Turn]], turns: range, concurrency: int, device: str) -> None:
        self.llm, self.convs, self.turns, self.concurrency, self.device = llm, convs, turns, concurrency, device
        self.order = [(u, t) for t in turns for u in range(len(convs))]
        self.answers: dict[tuple[int, int], list[int]] = {}
        self.pending: dict[int, tuple[int, int]] = {}  # request id -> (user, turn)
        self.arrived: dict[int, float] = {}  # request id -> the clock when it was added
        self.ttft: list[float] = []
        self.steps: list[float] = []  # each llm.step()'s seconds
        self.waits: list[float] = []  # engine time from a request's arrival to the step that first admitted it
        self.queued: dict[int, float] = {}  # request id -> arrival, until first admitted
        self.clock = 0.0
        self.next = 0

    @property
    def done(self) -> bool:
        return self.next >= len(self.order) and not self.pending

    def tick(self) -> None:
        from vattn import SamplingParams

        while self.next < len(self.order) and len(self.pending) < self.concurrency:
            u, t = self.order[self.next]
            prompt, answer = self.convs[u][t]
            params = SamplingParams(temperature=0, max_tokens=len(answer), ignore_eos=True)
            rid = self.llm.add_request(prompt, params)
            self.pending[rid], self.arrived[rid], self.queued[rid] = (u, t), self.clock, self.clock
            self.next += 1
        start = time.perf_counter()
        outs = self.llm.step()
        _sync(self.device)
        took = time.perf_counter() - start
        self.clock += took
        self.steps.append(took)
        requests = self.llm.scheduler.requests
        for rid in [r for r in self.queued if requests.get(r) is None or requests[r][0].slot is not None]:
            self.waits.append(self.clock - self.queued.pop(rid))
        for out in outs:
            rid = out.request_id
            if rid in self.arrived and out.outputs[0].token_ids:  # its first token
                self.ttft.append(self.clock - self.arrived.pop(rid))
            if out.finished and rid in self.pending:
                self.answers[self.pending.pop(rid)] = out.outputs[0].token_ids

    def served(self) -> dict[str, Any]:
        """Answers (user by user, turn by turn), TTFTs, engine seconds, output tokens."""
        return dict(answers=[self.answers[(u, t)] for u in range(len(self.convs)) for t in self.turns],
                    ttft=self.ttft, steps=self.steps, waits=self.waits, wall=self.clock,
                    output_tokens=sum(len(a) for a in self.answers.values()))


def serve_together(chats: list[Chat]) -> None:
    """Step every engine in turn until all are done."""
    while not all(c.done for c in chats):
        for c in chats:
            if not c.done:
                c.tick()


def counters(llm: Any) -> dict[str, int]:
    """The engine's running counts (taken after the warm-up, and again after the run)."""
    out = dict(computed=llm.scheduler.num_computed_tokens, preemptions=llm.num_preemptions)
    stats = llm.prefix_cache_stats()
    if stats is not None:
        out.update(queried=stats.num_query_tokens, hits_device=stats.num_device_hit_tokens,
                   hits_host=stats.num_host_hit_tokens,
                   hits_disk=stats.num_disk_hit_tokens)
    return out


def warm_up(llm: Any, args: argparse.Namespace) -> dict[str, int]:
    """One short request of tokens no conversation uses (the first forward's one-time costs
    out of the figures); returns the counts to subtract."""
    from vattn import SamplingParams

    llm.generate([[args.vocab - 1] * 16], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return counters(llm)


def figures(llm: Any, served: dict[str, Any], ref: list[list[int]], base: dict[str, int]) -> dict[str, Any]:
    """A system's row: prompt tokens computed, TTFT, tokens/s, hits per tier, agreement
    (counts since `base`). Hits count every lookup: a request admitted again (preempted, or
    admitted before memory allowed) is looked up again."""
    now = {k: v - base[k] for k, v in counters(llm).items()}
    decode = sum(len(a) - 1 for a in served["answers"])  # each answer token but the last is fed back once
    lat = latency_stats(served["ttft"])
    steps = latency_stats(served["steps"])
    waits = latency_stats(served["waits"])
    row = dict(prefill_computed=now.pop("computed") - decode, ttft_p50_ms=1e3 * lat["p50"],
               ttft_p99_ms=1e3 * lat["p99"], admit_wait_p50_ms=1e3 * waits["p50"], step_p50_ms=1e3 * steps["p50"],
               step_p99_ms=1e3 * steps["p99"],
               output_tok_s=served["output_tokens"] / served["wall"],
               wall_s=served["wall"], agreement=agreement(served["answers"], ref), **now)
    stats = llm.prefix_cache_stats()
    if stats is not None:
        row.update(host_bytes=stats.host_bytes, disk_bytes=stats.disk_bytes)
    return row


def shape_args(args: argparse.Namespace, shape: str) -> argparse.Namespace:
    """`args` with the shape's users, concurrency and device memory where none was given."""
    a = argparse.Namespace(**vars(args))
    for name, value in {**SHAPES[shape], **(QUICK_SHAPES.get(shape, {}) if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(a, name, value)
    return a


def run(args: argparse.Namespace) -> dict:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = args.device
    cuda = device.startswith("cuda")
    if args.quick:
        for name, value in {**QUICK, **(QUICK_CUDA if cuda else {})}.items():
            setattr(args, name, value)
    if args.page_size is None and not cuda:
        args.page_size = 32 << 10  # (CUDA: the backend's, its granularity)
    dtype = torch.float16 if cuda else torch.float32
    names = args.shape or (["chat"] if args.quick else list(SHAPES))  # (--quick: the GPU suite's short stage)
    shapes = {name: shape_args(args, name) for name in names}
    # one model for every engine (each uses it in place; the same weights): one copy of it in memory
    model = build_model(model_config(args), device, dtype, seed=args.seed)
    # one set of conversations (seeded user by user): a shape of fewer users takes the first ones
    convs = conversations(model, argparse.Namespace(**{**vars(args), "users": max(a.users for a in shapes.values())}),
                          device)
    token_bytes = (2 * args.layers * args.kv_heads * (args.hidden // args.heads)
                   * torch.empty((), dtype=dtype).element_size())
    result: dict[str, Any] = dict(device=device, turns=args.turns, token_bytes=token_bytes, shapes={}, failures=[])
    for name, a in shapes.items():
        shape = serve_shape(model, convs[:a.users], a, device, dtype, token_bytes, restart=name == "chat")
        result["shapes"][name] = shape
        for system, s in [*shape["systems"].items(), *((k, shape[k]) for k in ("cold", "restart") if k in shape)]:
            if not s["agreement"]["equal"] and not cuda:  # (fp16 on a GPU: a near-tie may flip; reported, not failed)
                result["failures"].append(f"{name} {system}: tokens differ from transformers' generate")
    if args.bandwidth_blocks:
        result["bandwidth"] = bandwidth(args, device, dtype)
        bw = result["bandwidth"]
        result["bandwidth_ratios"] = dict(restore_over_copy=bw["restore_GBps"] / bw["copy_GBps"],
                                          copies_over_copy=bw["copies_GBps"] / bw["copy_GBps"])
    result["targets"] = TARGETS
    return result


def serve_shape(model: Any, convs: list[list[Turn]], args: argparse.Namespace, device: str, dtype: torch.dtype,
                token_bytes: int, restart: bool) -> dict[str, Any]:
    """Every system of `args.systems` on one shape's conversations, their engines together;
    with `restart` (and `host+disk` among them), then the restart round."""
    from vattn import LLM

    served_turns, restart_turn = range(args.turns), range(args.turns, args.turns + 1)
    ref = [a for c in convs for _, a in c[:args.turns]]
    ref_restart = [c[args.turns][1] for c in convs]
    total = sum(len(c[-1][0]) + len(c[-1][1]) for c in convs)  # every conversation's tokens at its end
    result: dict[str, Any] = dict(users=args.users, concurrency=args.concurrency, device_tokens=args.device_tokens,
                                  context_tokens=sum(len(c[-1][0]) for c in convs), systems={})
    with tempfile.TemporaryDirectory(prefix="vattn-offload-") as directory:
        systems = [(name, name, served_turns, ref) for name in args.systems]
        rounds = [systems]
        if restart and "host+disk" in args.systems:  # then a restart on its directory, and a cold engine beside it
            rounds.append([("cold", "device", restart_turn, ref_restart), ("restart", "host+disk", restart_turn,
                                                                              ref_restart)])
        for engines in progress(rounds, desc="engines together", unit="round"):
            opened = []
            try:
                for name, system, turns, want in engines:
                    kw = engine_kwargs(system, args, token_bytes, total, directory)
                    llm = LLM(model, device=device, dtype=dtype, **kw)
                    opened.append((name, llm, warm_up(llm, args), Chat(llm, convs, turns, args.concurrency, device),
                                   want))
                serve_together([chat for _, _, _, chat, _ in opened])
                for name, llm, base, chat, want in opened:
                    row = figures(llm, chat.served(), want, base)
                    (result["systems"] if name in SYSTEMS else result)[name] = row
                    if name == "host+disk":
                        result["block_tokens"] = llm.prefix_cache_stats().block_tokens
            finally:
                for _, llm, _, _, _ in reversed(opened):
                    llm.close()  # (the host+disk engine's host blocks go to its directory here)
    result["ratios"] = ratios(result)
    return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """One shape's targets' ratios (one run): host against device-only and against unlimited;
    host+disk's step time p99 against the same small host tier without a disk tier."""
    s = result["systems"]
    out: dict[str, float] = {}
    if "host" in s and "device" in s:
        out["prefill_host_over_device"] = s["host"]["prefill_computed"] / max(1, s["device"]["prefill_computed"])
        out["ttft_p50_device_over_host"] = s["device"]["ttft_p50_ms"] / s["host"]["ttft_p50_ms"]
    if "host" in s and "unlimited" in s:
        out["ttft_p50_host_over_unlimited"] = s["host"]["ttft_p50_ms"] / s["unlimited"]["ttft_p50_ms"]
    if "host+disk" in s and "host_small" in s:
        out["step_p99_disk_over_host_small"] = s["host+disk"]["step_p99_ms"] / s["host_small"]["step_p99_ms"]
    if "host+disk" in s and "host" in s:  # (the same hits: host+disk's reads and writes of files on the thread)
        out["step_p99_disk_over_host"] = s["host+disk"]["step_p99_ms"] / s["host"]["step_p99_ms"]
    if "restart" in result and "cold" in result:
        out["ttft_p50_cold_over_restart"] = result["cold"]["ttft_p50_ms"] / result["restart"]["ttft_p50_ms"]
    return out


# ------------------------------------------------------------- restore bandwidth ----
def bandwidth(args: argparse.Namespace, device: str, dtype: torch.dtype, repeats: int = 5) -> dict[str, Any]:
    """Host-tier restores of `--bandwidth-blocks` blocks into a request's pages, against one plain
    copy of the same bytes (pinned host memory to the device on CUDA); best of `repeats`. Before
    each restore a request of as many tokens takes the blocks' pages (their pins evicted), so the
    restore maps pages that exist (no page creation, no first touch) and copies into them;
    `restore` is the whole lookup (`map_prefix` and the request's `step`, which waits for the
    copies on CUDA), `copies` the copies alone (`Tiers.restore`)."""
    import vattn
    from vattn.prefix_cache import PrefixCache

    blocks = args.bandwidth_blocks
    cache = vattn.KVCache(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                          max_batch_size=3, max_context_len=4096 * 8, dtype=dtype, device=device,
                          page_size=args.page_size, layout=args.layout, prefetch=False)
    try:
        g = cache.geometry
        t = g.share_tokens
        prompt = list(range(blocks * t + 1))
        nbytes = blocks * g.share_pages * g.group_bytes
        cache.allocator.set_max_pages((blocks + 2) * g.share_pages)  # the blocks, and a page more
        pc = PrefixCache(cache, salt="bandwidth", offload_bytes=2 * nbytes)
        r = cache.alloc_reqid()
        cache.step({r: len(prompt)})
        pc.insert(r, prompt)
        cache.free_reqid(r)
        copies: list[float] = []
        real = pc.tiers.restore

        def timed(*a: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            real(*a, **kw)
            _sync(device)
            copies.append(time.perf_counter() - t0)

        pc.tiers.restore = timed
        restore = []
        for _ in range(repeats):
            filler = cache.alloc_reqid()  # takes the pages: the blocks' pins are evicted
            assert cache.step({filler: len(prompt)})
            cache.free_reqid(filler)
            r = cache.alloc_reqid()
            _sync(device)
            t0 = time.perf_counter()
            n = pc.map_prefix(r, prompt)
            assert cache.step({r: len(prompt)})  # the request's step waits for its restore (CUDA: an event)
            _sync(device)
            restore.append(time.perf_counter() - t0)
            cache.free_reqid(r)
            assert n == blocks * t, (n, blocks * t)
        copy = _plain_copies(nbytes, device, repeats)
        return dict(blocks=blocks, block_bytes=g.share_pages * g.group_bytes, bytes=nbytes,
                    restore_GBps=nbytes / min(restore) / 1e9, copies_GBps=nbytes / min(copies) / 1e9,
                    copy_GBps=nbytes / min(copy) / 1e9, restore_ms=1e3 * min(restore),
                    copies_ms=1e3 * min(copies), copy_ms=1e3 * min(copy))
    finally:
        cache.close()


def _plain_copies(nbytes: int, device: str, repeats: int) -> list[float]:
    """Seconds of each of `repeats` plain copies of `nbytes` from host memory (pinned on
    CUDA) to `device`, after a first (untimed) one."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # (first touch)
    copy = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        copy.append(time.perf_counter() - t0)
    return copy


# ------------------------------------------------------------------------ output ----
HEADERS = ["shape / system", "prefill computed", "queried", "TTFT p50 ms", "TTFT p99 ms", "wait p50 ms", "step p99 ms",
           "output tok/s", "hits device", "hits host", "hits disk", "preempt", "= generate"]


def table(result: dict) -> tuple[list[str], list[list]]:
    rows = []
    blank = [""] * (len(HEADERS) - 2)
    for shape, r in result["shapes"].items():
        named = [*r["systems"].items(), *((k, r[k]) for k in ("cold", "restart") if k in r)]
        for name, s in named:
            rows.append([f"{shape} {name}", s["prefill_computed"], s.get("queried", "-"), round(s["ttft_p50_ms"], 1),
                         round(s["ttft_p99_ms"], 1), round(s["admit_wait_p50_ms"], 1), round(s["step_p99_ms"], 1),
                         round(s["output_tok_s"], 1),
                         s.get("hits_device", "-"), s.get("hits_host", "-"), s.get("hits_disk", "-"),
                         s["preemptions"], s["agreement"]["equal"]])
        for k, v in r["ratios"].items():
            rows.append([f"{shape} {k}", round(v, 3), *blank])
    bw = result.get("bandwidth")
    if bw:
        rows.append([f"restore {bw['blocks']} blocks", f"{bw['bytes']} B", f"{bw['restore_ms']:.2f} ms",
                     f"{bw['restore_GBps']:.2f} GB/s", f"copies {bw['copies_GBps']:.2f} GB/s",
                     f"plain copy {bw['copy_GBps']:.2f} GB/s", *[""] * (len(HEADERS) - 6)])
        for k, v in result["bandwidth_ratios"].items():
            rows.append([k, round(v, 3), *blank])
    return HEADERS, rows


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    fig, grid = plt.subplots(len(shapes), 4, figsize=(19, 4 * len(shapes)), squeeze=False)
    for axes, (shape, r) in zip(grid, shapes.items()):
        s = r["systems"]
        names = list(s)
        x = range(len(names))
        axes[0].bar(names, [s[n]["prefill_computed"] for n in names], color="tab:blue")
        axes[0].set_title(f"{shape}: prompt tokens computed")
        axes[1].bar([i - 0.2 for i in x], [s[n]["ttft_p50_ms"] for n in names], width=0.4, label="p50")
        axes[1].bar([i + 0.2 for i in x], [s[n]["ttft_p99_ms"] for n in names], width=0.4, label="p99")
        axes[1].set_xticks(list(x), names)
        axes[1].set_title(f"{shape}: time to first token (ms)")
        axes[1].legend()
        bottom = [0] * len(names)
        for tier, color in (("hits_device", "tab:green"), ("hits_host", "tab:orange"), ("hits_disk", "tab:red")):
            vals = [s[n].get(tier, 0) for n in names]
            axes[2].bar(names, vals, bottom=bottom, label=tier.split("_")[1], color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        axes[2].set_title(f"{shape}: prefix hits by tier (tokens)")
        axes[2].legend()
        axes[3].bar(names, [s[n]["step_p99_ms"] for n in names], color="tab:purple")
        for i, n in enumerate(names):
            axes[3].annotate(f"{s[n]['preemptions']} preempt", (i, s[n]["step_p99_ms"]), ha="center", fontsize=8)
        axes[3].set_title(f"{shape}: step time p99 (ms), preemptions")
        for ax in axes:
            ax.tick_params(axis="x", rotation=30)
    users = ", ".join(f"{k}: {r['users']} users, {r['concurrency']} in flight, {r['device_tokens']} device tokens"
                      for k, r in shapes.items())
    fig.suptitle(f"multi-turn chat, {result['turns']} turns on {result['device']} ({users})")
    fig.tight_layout()
    return fig
