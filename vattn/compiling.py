"""Dynamo settings vattn's compiled code runs under: shared by the compiled forward
(`vattn.engine.compile`) and the host's flex decode (`vattn.flex_decode`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def raise_past_recompile_limit() -> Iterator[None]:
    """For the block, dynamo past its recompile limit raises (`FailOnRecompileLimitHit`)
    instead of running the function uncompiled, so a caller counted as compiled never runs
    eagerly unseen; a torch without the setting runs as it does."""
    config = torch._dynamo.config
    if not hasattr(config, "fail_on_recompile_limit_hit"):
        yield
        return
    with config.patch(fail_on_recompile_limit_hit=True):
        yield
