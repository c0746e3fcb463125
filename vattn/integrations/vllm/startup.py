"""vLLM's start-up checks: what vattn cannot back, and whether every worker agrees with the
scheduler (settings, block layout) before the scheduler's books exist."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vattn.errors import InvalidConfigError


@dataclass(frozen=True)
class Workers:
    """What the workers said at start (`start`): their layout key (None: they keep vLLM's
    memory) and each one's number of regions (pipeline stages differ)."""

    key: tuple | None
    regions: tuple[int, ...]


def unsupported(vllm_config: Any) -> str | None:
    """Why vattn cannot back this engine's KV cache, or None."""
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer is not None:
        name = getattr(kv_transfer, "kv_connector", None) or "a KV connector"
        return (f"the KV connector {name} (--kv-transfer-config) registers or copies the whole KV buffer, "
                "and vattn maps it page by page")
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        return ("sleep mode (--enable-sleep-mode) frees and restores the KV buffer through vLLM's cumem "
                "allocator, which does not see vattn's pages; VATTN_VLLM_IDLE_TRIM_S gives memory back when idle")
    return None


def check_settings(answers: list[dict[str, Any]], mine: dict[str, Any]) -> None:
    """Raise InvalidConfigError, with both values, when a worker's `VATTN_VLLM*` settings
    (its `hello_rpc` answer) differ from the scheduler's (`mine`)."""
    for rank, a in enumerate(answers):
        for name, value in mine.items():
            if a["settings"].get(name) != value:
                raise InvalidConfigError(
                    f"vattn: {name} is {value!r} in the scheduler (EngineCore) and {a['settings'].get(name)!r} in "
                    f"worker {rank}: give every vLLM process the same VATTN_VLLM* environment")


def agreed_workers(vllm_config: Any, answers: list[dict[str, Any]]) -> Workers:
    """The workers' one block layout (vattn on): refuse what vattn cannot back (KV
    connectors, sleep mode) and workers that lay out blocks differently (InvalidConfigError)."""
    why = unsupported(vllm_config)
    if why is not None:
        raise InvalidConfigError(f"vattn cannot back this vLLM engine's KV cache: {why}. Run it without "
                                 "VATTN_VLLM=1 (stock memory), or without that feature")
    keys = {a["key"] for a in answers}
    if len(keys) > 1:
        detail = ", ".join(f"worker {r}: {a['key']}" for r, a in enumerate(answers))
        raise InvalidConfigError(
            "vattn: the workers lay out KV blocks differently (blocks, block bytes, page): " + detail + ". "
            "Pipeline stages with other layer counts need a layer-outer layout (VLLM_KV_CACHE_LAYOUT=NHD or HND), "
            "where a block has the same bytes in every stage; or run without VATTN_VLLM=1")
    return Workers(keys.pop() if keys else None, tuple(a["regions"] for a in answers))
