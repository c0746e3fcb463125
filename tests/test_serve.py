"""`vattn serve` (transformers serve, continuous batching on vattn memory) over real HTTP."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import vattn  # noqa: E402
from vattn.integrations import hf_cb  # noqa: E402

try:
    hf_cb.check_transformers()
    CB_SKIP = ""
except vattn.InvalidConfigError as e:  # pragma: no cover - another transformers
    CB_SKIP = str(e)
needs_cb = pytest.mark.skipif(bool(CB_SKIP), reason=CB_SKIP)
PAGE = 4096


def tiny(seed: int = 0):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def char_checkpoint(path) -> str:
    """A tiny seeded Llama with a character-level tokenizer and a chat template, saved locally."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    model = tiny()
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@needs_cb
def test_serve_answers_over_http_from_vattn_memory(tmp_path):
    import importlib.util
    import socket
    import time
    import urllib.request

    missing = [m for m in hf_cb.SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"transformers serve needs {missing} (pip install 'transformers[serving]')")
    path = char_checkpoint(tmp_path / "ckpt")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = hf_cb.serve(path, port=port, device="cpu", num_blocks=64, page_size=PAGE, memory_limit=2 << 20,
                         non_blocking=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        out = _post(base + "/v1/completions", {"model": path, "prompt": "hello world", "max_tokens": 12,
                                               "temperature": 0})
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ids = tok("hello world", return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert out["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
        assert server.vattn.num_caches >= 1 and server.vattn.stats().peak_mapped_bytes > 0
        chat = _post(base + "/v1/chat/completions", {"model": path, "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert chat["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.kill_server()
        hf_cb.disable_all()
