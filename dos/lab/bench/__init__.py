"""Benchmark harness: models, systems, one timing protocol, records (see DESIGN.md §5)."""
