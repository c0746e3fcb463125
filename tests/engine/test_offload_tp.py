"""The offload tiers under tensor parallelism: each rank keeps its own host and disk tiers
(its heads' K/V; its disk files under its own identity: the rank is part of the salt), and
how many tokens a lookup maps, device pages and restores alike, is agreed between the ranks.
Greedy tokens equal transformers' generate; a restart gets disk hits on every rank."""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

from tests.engine.test_offload import TURNS, chat, expected  # noqa: E402
from tests.engine.test_tp import TP, check_books, online, spawn  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402
from vattn import LLM, SamplingParams  # noqa: E402


def _offload_case(rank: int, ports: list[int], convs: Any, directory: str) -> dict:
    """Every conversation's turns under TP 2 with a host and a disk tier; rank 1 gives its
    device memory's cached pages back every third iteration, so its hits come from its host
    tier where rank 0's are in device memory. Then a new engine on the same directory."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    kw = dict(max_batch_size=2, physical_memory=64 << 10, enable_prefix_caching=True, offload_bytes=6 * 8 << 10,
              offload_dir=directory, offload_dir_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=len(convs[0][0][1]), ignore_eos=True)
    res: dict[str, Any] = {"answers": []}
    with LLM(tiny_config(), **{**TP, **kw}) as llm:
        it = [0]

        def trim_on_rank1(llm: LLM) -> None:
            check_books(llm)
            it[0] += 1
            if rank == 1 and it[0] % 3 == 0:
                llm.cache.trim()

        for t in range(TURNS - 1):
            prompts = [list(c[t][0]) for c in convs]
            res["answers"] += online(llm, trim_on_rank1, prompts, [params] * len(prompts), (0,) * len(prompts))
        stats = llm.prefix_cache_stats()
        res["stats"] = (stats.num_hit_tokens, stats.num_host_hit_tokens, stats.num_disk_hit_tokens)
    with LLM(tiny_config(), **{**TP, **kw}) as again:
        prompts = [list(c[TURNS - 1][0]) for c in convs]
        res["answers again"] = online(again, check_books, prompts, [params] * len(prompts), (0,) * len(prompts))
        stats = again.prefix_cache_stats()
        res["stats again"] = (stats.num_hit_tokens, stats.num_host_hit_tokens, stats.num_disk_hit_tokens)
    return res


def test_offload_tiers_under_tp(tmp_path: Path) -> None:
    convs = chat()
    (r0, r1), codes = spawn("tests.engine.test_offload_tp:_offload_case", tmp_path, convs, str(tmp_path / "kv"))
    assert codes == [0, 0]
    by_turn = expected(convs, range(TURNS - 1))
    users = len(convs)
    # online() returns the answers of one turn, user by user; expected() is user by user, turn by turn
    assert r0["answers"] == [by_turn[u * (TURNS - 1) + t] for t in range(TURNS - 1) for u in range(users)]
    assert r0["answers again"] == expected(convs, range(TURNS - 1, TURNS))
    assert r1["answers"] == r1["answers again"] == []
    assert r0["stats"][0] == r1["stats"][0] > 0, "the ranks agreed on every hit"
    assert r1["stats"][1] > 0, "rank 1's hits came from its host tier"
    assert r0["stats again"][0] == r1["stats again"][0] and min(r0["stats again"][2], r1["stats again"][2]) > 0
    assert len(list((tmp_path / "kv").glob("vattn-kv-*"))) == 2, "one directory per rank"
