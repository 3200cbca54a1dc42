"""Example records tasks for `data.source=records` (put `examples/` on PYTHONPATH to import their rewards)."""
