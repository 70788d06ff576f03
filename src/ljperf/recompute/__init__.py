"""The fastest recompute plan under a memory budget: the budget, per-layer cost, solver and closed loop."""
