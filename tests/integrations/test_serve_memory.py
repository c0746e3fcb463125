"""What bounds `vattn serve`'s own host memory on a CPU box (issue 36): the README's command
shape (a local checkpoint, `--memory-limit`, no `--num-blocks` / `--max-batch-tokens`) runs
as a process of its own, answers a request, and its peak RSS (VmHWM) stays under the
checkpoint's weights + the KV limit + `MARGIN`, whichever engine. Before, transformers sized
its continuous-batching buffers from the host's free memory (12 GiB here for a 64 MiB limit).
See docs/servers.md, "What bounds the server's memory"."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("transformers")

from vattn.bench._models import char_checkpoint  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 64 << 20
# docs/servers.md: the interpreter, torch, transformers and the HTTP stack (~450 MiB measured on
# CPU) plus the batch buffers (hf_cb.caches.BATCH_BUFFER_BYTES, 256 MiB, for the transformers engine)
MARGIN = 1 << 30
READY_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss(pid: int) -> int:
    """VmHWM of `pid`, bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return char_checkpoint(tmp_path_factory.mktemp("ckpt"))


def weights_bytes(ckpt: str) -> int:
    return sum(p.stat().st_size for p in pathlib.Path(ckpt).iterdir() if p.suffix in (".safetensors", ".bin"))


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("engine", ["vattn", "transformers"])
def test_readme_serve_command_is_bounded_by_model_limit_and_margin(ckpt, engine):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "vattn", "serve", "--engine", engine, "--model", ckpt, "--port", str(port),
           "--memory-limit", str(LIMIT)]
    if engine == "vattn":  # this checkpoint's 128-byte tokens share prefixes in blocks of 512 tokens on 64 KiB pages
        cmd += ["--page-size", "4096"]
    with open(os.devnull, "rb") as stdin, open(os.devnull, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_S
        while True:
            assert proc.poll() is None, f"vattn serve --engine {engine} ended with {proc.returncode}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.2)
        body = json.dumps({"model": ckpt, "prompt": "hello world", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] >= 1
        peak, bound = peak_rss(proc.pid), weights_bytes(ckpt) + LIMIT + MARGIN
        print(f"{engine}: peak RSS {peak >> 20} MiB, bound {bound >> 20} MiB")
        assert peak <= bound, f"vattn serve --engine {engine}: peak RSS {peak >> 20} MiB > {bound >> 20} MiB"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
