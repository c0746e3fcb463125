"""The `vattn` command: the README's main job and `generate`."""
from __future__ import annotations

import subprocess
import sys

import torch

from vattn.cli import main


def test_demo_synthetic(capsys):
    assert main(["demo", "--synthetic", "--requests", "12", "--max-batch-size", "4", "--max-context-len", "1024",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "vattn synthetic allocator demo" in out and "requests / iterations" in out
    assert "12 /" in out


def test_demo_engine_as_module():
    p = subprocess.run([sys.executable, "-m", "vattn", "demo", "--requests", "6", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "output throughput" in p.stdout and "KV mapped" in p.stdout and "requests (errors)" in p.stdout


def test_generate_from_checkpoint_dir(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--max-tokens", "5"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    ref = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    assert got == ref


def test_generate_errors_are_messages_not_tracebacks(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 2
    assert "not a local checkpoint directory" in capsys.readouterr().err
