"""Tensor parallelism on `torch.distributed`: each rank holds its attention heads' share of
the weights and of the KV cache, and all ranks follow one schedule.

Launch one process per GPU with `torchrun` (it sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); every process runs the same script:

```
torchrun --nproc-per-node 2 my_script.py       # my_script: LLM(model, tensor_parallel_size=2)
```

One schedule: every rank runs the same deterministic scheduler on the same inputs (SPMD:
every process makes the same add_request / generate / abort_request / step calls), and
what could differ between ranks is agreed before anyone acts on it (`agreed.AgreedSlots`): the
physical budget (the minimum over ranks), each `step`'s outcome (failed on one rank =
failed on all, the union of the failed requests, before the scheduler preempts), each new
slot, fork and swap-in (the same slot on every rank), each swap-out (on every rank or on
none), and with prefix caching each lookup's mapped tokens (the fewest any rank could map:
each rank evicts its own pinned pages; `agreed.AgreedPrefixCache`). Rank 0 samples and
broadcasts the tokens. Every control message also carries a digest of the rank's inputs and
schedule, so ranks that diverged stop at once; so do the others when a rank fails (`group`).

The package, by job:

- `group`: the process group (joined, owned, torn down), its counted control collectives,
  the control message every agreement is (`TensorParallel.agree`) and what an iteration
  sends; failure handling.
- `shard`: which slice of each weight a rank holds (Megatron-style, from the model's own
  plan), and building the rank's model from a checkpoint or a full model.
- `agreed`: the scheduler's cache (`AgreedSlots`), the prefix cache (`AgreedPrefixCache`)
  and the sampler (`RankZeroSampler`) with every result that could differ between ranks
  agreed, and the rank's model runner (`TPModelRunner`).
"""
from __future__ import annotations

from vattn.engine.parallel.agreed import (
    AgreedPrefixCache, AgreedSlots, AgreedStep, RankZeroSampler, TPModelRunner, raise_agreed)
from vattn.engine.parallel.group import (
    ALLOC_REQID, CHECK, FORK, PREFIX, STEP, SWAP_IN, SWAP_OUT, Agreement, TensorParallel)
from vattn.engine.parallel.shard import DEFAULT_PLAN, shard_config, shard_model, tp_plan
from vattn.errors import RankCacheError, TensorParallelError  # raised here; they live in vattn.errors

__all__ = [
    "ALLOC_REQID", "CHECK", "DEFAULT_PLAN", "FORK", "PREFIX", "STEP", "SWAP_IN", "SWAP_OUT", "AgreedPrefixCache",
    "AgreedSlots", "AgreedStep", "Agreement", "RankCacheError", "RankZeroSampler", "TPModelRunner",
    "TensorParallel", "TensorParallelError", "raise_agreed", "shard_config", "shard_model", "tp_plan"]
