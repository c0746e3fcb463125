"""The slot allocator: slots (reqids) over contiguous virtual memory, page groups mapped on
demand, deferred reclamation and background pre-mapping. Plain Python, no torch; see
`vattn.allocator.core` for how its parts fit."""
from __future__ import annotations

from vattn.allocator.books import MemoryStats, SlotBooks
from vattn.allocator.core import PageAllocator
from vattn.allocator.hybrid import HybridAllocator
from vattn.allocator.plan import StepPlan, StepResult

__all__ = ["HybridAllocator", "MemoryStats", "PageAllocator", "SlotBooks", "StepPlan", "StepResult"]
