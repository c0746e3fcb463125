"""Other projects' clients against `vattn serve` (slow): `benchmarks/peer_clients.py --quick`
for each client whose environment is here, one process each: vLLM's `vllm bench serve`
(`--backend openai` and `openai-chat`, random dataset) and guidellm (two constant rates and a
sweep) with 0 failed requests, Debian's Prometheus answering at least 14 of vLLM's 16 Grafana
queries with data, and no ERROR in the server's log. A missing client skips, saying how to
make it (`python benchmarks/peer_clients.py --setup vllm|guidellm|prometheus`; the venvs at
/tmp/venv-vllm and /tmp/venv-guidellm, or VATTN_VLLM_CLIENT_VENV / VATTN_GUIDELLM_VENV).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
sys.path.insert(0, str(REPO / "benchmarks"))
peer_clients = pytest.importorskip("peer_clients")


@pytest.mark.parametrize("client", ["vllm", "guidellm", "prometheus"])
def test_peer_client_against_vattn_serve(client, tmp_path):
    why = peer_clients.missing(client)
    if why:
        pytest.skip(why)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peer_clients.py"), "--quick", "--clients", client,
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads((tmp_path / "peer_clients_cpu.json").read_text())
    assert result["server_log_errors"] == 0, result["server_log_first_error"]
    if client == "prometheus":
        assert result["prometheus"]["with_data"] >= 14, result["prometheus"]["queries"]
    else:
        assert result["runs"] and all(r["failed"] == 0 and r["ok"] > 0 for r in result["runs"]), result["runs"]
