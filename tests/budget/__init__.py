"""The memory budget (vattn.budget, vattn.budget.shared): slots of several caches on one
budget, and one budget shared by processes."""
