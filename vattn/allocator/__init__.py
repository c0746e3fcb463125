"""The slot allocator: slots (reqids) over contiguous virtual memory, page groups mapped on
demand, deferred reclamation and background pre-mapping, for every layer kind of a cache
(full attention, sliding windows, chunked local attention, recurrent states: each a spec and
a manager, `registry.MANAGERS`) under one coordinator. Plain Python, no torch; see
`vattn.allocator.coordinator` for how its parts fit."""
from __future__ import annotations

from vattn.allocator.books import MemoryStats, Slots, SlotBooks
from vattn.allocator.coordinator import Coordinator
from vattn.allocator.kinds import Chunk, ChunkSpec, KindSpec, LayerKind, Window, WindowSpec
from vattn.allocator.plan import KindPlan, StepPlan, StepResult
from vattn.allocator.snapshots import Snapshots
from vattn.allocator.states import StateGeometry, StateSpec

__all__ = ["Chunk", "ChunkSpec", "Coordinator", "KindPlan", "KindSpec", "LayerKind", "MemoryStats", "SlotBooks",
           "Slots", "Snapshots", "StateGeometry", "StateSpec", "StepPlan", "StepResult", "Window", "WindowSpec"]
