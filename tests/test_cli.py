"""The `vattn` command: the README's main job and `generate`."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from vattn.cli import build_parser, main


def test_demo_synthetic(capsys):
    assert main(["demo", "--synthetic", "--requests", "12", "--max-batch-size", "4", "--max-context-len", "1024",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "vattn synthetic allocator demo" in out and "requests / iterations" in out
    assert "12 /" in out


def test_demo_synthetic_refuses_tensor_parallelism(capsys, monkeypatch):
    """--synthetic has no model to split: a TP size > 1 is a usage error, not silently ignored
    (also under torchrun, WORLD_SIZE set)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["demo", "--synthetic", "--tensor-parallel-size", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err
    assert "--synthetic drives the allocator alone" in err and "--tensor-parallel-size 2" in err


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


def test_version(capsys):
    import vattn

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vattn {vattn.__version__}"


@pytest.mark.parametrize("argv", [
    ["demo", "--synthetic", "--requests", "0"], ["demo", "--requests", "-1"], ["demo", "--requests", "x"],
    ["demo", "--page-size", "0"], ["demo", "--physical-memory", "-5"], ["demo", "--synthetic", "--max-batch-size", "0"],
    ["demo", "--synthetic", "--max-context-len", "1.5"], ["generate", "--model", "m", "--max-tokens", "0"],
    ["generate", "--model", "m", "--dtype", "int8"],
], ids=" ".join)
def test_bad_numbers_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err
    assert "expected a positive integer" in err or "invalid choice" in err


def test_every_option_has_help():
    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from ((f"{name} {opt}", a) for opt, a in walk(sub))
            elif action.option_strings:
                yield "/".join(action.option_strings), action

    missing = [name for name, action in walk(build_parser()) if not action.help]
    assert not missing, f"options without help: {missing}"


def test_engine_demo_with_failed_requests_exits_non_zero_and_says_why(capsys):
    # 600 kB of KV pages: requests longer than about 150 tokens cannot fit even alone
    code = main(["demo", "--requests", "6", "--device", "cpu", "--physical-memory", "600000"])
    captured = capsys.readouterr()
    assert code == 1
    assert "requests failed" in captured.err and "raise physical_memory" in captured.err
    assert "requests (errors)" in captured.out


def test_serve_has_its_own_options(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--memory-limit" in capsys.readouterr().out
    assert main(["serve", "--model", "/nonexistent-dir"]) == 2  # a message, not a traceback
    assert "vattn: error:" in capsys.readouterr().err
