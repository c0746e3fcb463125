"""The slot allocator: slots (reqids) over contiguous virtual memory, page groups mapped on
demand, deferred reclamation and background pre-mapping, for every layer kind of a cache
(full attention, sliding windows, recurrent states) under one coordinator. Plain Python, no
torch; see `vattn.allocator.coordinator` for how its parts fit."""
from __future__ import annotations

from vattn.allocator.books import MemoryStats, Slots, SlotBooks
from vattn.allocator.coordinator import Coordinator, KindSpec
from vattn.allocator.kinds import StateGeometry
from vattn.allocator.plan import KindPlan, StepPlan, StepResult

__all__ = ["Coordinator", "KindPlan", "KindSpec", "MemoryStats", "SlotBooks", "Slots", "StateGeometry", "StepPlan",
           "StepResult"]
