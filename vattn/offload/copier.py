"""Copies between a cache's pages and host memory, for the offload tiers and swapping.

On the host backend a copy is done when the call returns. On CUDA every copy runs on one
copy stream, beside the model's kernels:

```
compute stream:  forward i ---------> forward i+1 ---------> [wait E_r] forward of r
                            \\ E_i                              ^
copy stream:                 +-> blocks to host (d2h)           |
                                 restore of request r (h2d) ---- E_r
```
- To host: the copy stream waits for the compute stream's work so far (the forward that
  wrote the pages), then copies; the host tensors are ready at the copy's event (`HostBlock.ready`).
- To the device: a restore into a request's fresh pages; the compute stream waits on its
  event only before that request's next step (`wait_slots`, called by `KVCache.step`).
- Before any page is unmapped the cache waits for every copy (`synchronize`, its page
  layer's `device_sync`): a copy may read or write through a slot's mapping.
Host tensors are pinned on CUDA (`empty`); PyTorch's pinned-memory allocator keeps a pinned
tensor from reuse until the copies that use it finished.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch


class Copier:
    """The copies of one cache (see the module docstring). `device`: the cache's device
    (a fake CUDA driver's caches are on the host: their copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: Any = None
        self.restores: dict[int, Any] = {}  # slot -> the event its restore's copies finish at
        self._busy = False  # copies enqueued since the last synchronize
        self.last_event: Any = None  # CUDA: the event of the latest copies (it covers every earlier one)

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def empty(self, nbytes: int) -> torch.Tensor:
        """`[nbytes]` uint8 host memory (pinned on CUDA)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, in_order: bool = False) -> Any:
        """Copy each (device source, host destination) pair, after the device work so far.
        Returns the event the copies finish at (None: done). `in_order`: the device work
        enqueued later waits for them too (sources that are written in place later, such as
        a snapshot row freed for reuse)."""
        if not self.cuda:
            copy_all(pairs)
            return None
        return self._on_stream(pairs, in_order)

    def to_device(self, slot: int | None, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (host source, device destination) pair into `slot`'s pages (or a snapshot
        row: `slot` None, ordered before any later device work), after the device work so far;
        the compute stream waits for them before `slot`'s next step."""
        if not self.cuda:
            copy_all(pairs)
            return
        event = self._on_stream(pairs, slot is None)
        if slot is not None:
            self.restores[slot] = event

    def _on_stream(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], in_order: bool) -> Any:
        current = torch.cuda.current_stream(self.device)
        stream = self.stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            copy_all(pairs, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if in_order:
            current.wait_event(event)
        self._busy, self.last_event = True, event
        return event

    def wait_slots(self, slots: Iterable[int]) -> None:
        """The compute stream waits for the restores into these slots (before their step)."""
        restores = self.restores
        for s in slots:
            event = restores.pop(s, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Block until every copy enqueued so far finished (before pages are unmapped)."""
        if self._busy:
            self.stream.synchronize()
            self._busy = False
            self.restores.clear()

    @staticmethod
    def wait(event: Any) -> None:
        """Block until the copies of `event` (from `to_host`) finished; None: done."""
        if event is not None:
            event.synchronize()


def copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool = False) -> None:
    """Copy each (source, destination) pair: one call for the lot (`torch._foreach_copy_`)
    where this torch has it, else one at a time."""
    if not pairs:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach([d for _, d in pairs], [s for s, _ in pairs], non_blocking=non_blocking)
            return
        except (RuntimeError, TypeError):  # (a torch whose foreach copy refuses these devices: copies are idempotent)
            pass
    for src, dst in pairs:
        dst.copy_(src, non_blocking=non_blocking)


__all__ = ["Copier", "copy_all"]
