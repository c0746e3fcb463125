"""A minimal continuous-batching engine on the vattn cache.

`LLM(model, **config).generate(prompts, SamplingParams(...))` runs an unmodified Hugging
Face model: `Scheduler` (plain Python) picks each iteration's tokens and preempts when
the cache cannot back them, `ModelRunner` packs the batch and calls the model, whose
attention layers read and write the vattn cache through `vattn.integrations.hf`.
transformers is imported only when an `LLM` is created.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vattn._lazy import lazy_exports

if TYPE_CHECKING:
    from vattn.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, BeamSearchStats
    from vattn.engine.config import EngineConfig
    from vattn.engine.llm import LLM
    from vattn.engine.parallel import RankCacheError, TensorParallelError
    from vattn.engine.sampling_params import SamplingParams
    from vattn.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
    from vattn.engine.sequence import (CompletionOutput, Logprob, RequestMetrics, RequestOutput, Sequence,
                                       SequenceStatus)

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "EngineConfig",
    "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence", "SequenceStatus", "TensorParallelError",
    "RankCacheError", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "BeamSearchStats",
]

# Loaded on first use (PEP 562): the scheduler and the sequences are plain Python, and
# importing them (which runs this file) must not import torch through the model runner.
_EXPORTS = {
    "BeamSearchParams": "vattn.engine.beam_search", "BeamSearchOutput": "vattn.engine.beam_search",
    "BeamSearchSequence": "vattn.engine.beam_search", "BeamSearchStats": "vattn.engine.beam_search",
    "EngineConfig": "vattn.engine.config", "LLM": "vattn.engine.llm",
    "RankCacheError": "vattn.engine.parallel", "TensorParallelError": "vattn.engine.parallel",
    "SamplingParams": "vattn.engine.sampling_params", "Scheduler": "vattn.engine.scheduler",
    "SchedulerConfig": "vattn.engine.scheduler", "SchedulerOutput": "vattn.engine.scheduler",
    "CompletionOutput": "vattn.engine.sequence", "RequestMetrics": "vattn.engine.sequence",
    "RequestOutput": "vattn.engine.sequence", "Sequence": "vattn.engine.sequence",
    "SequenceStatus": "vattn.engine.sequence", "Logprob": "vattn.engine.sequence",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
