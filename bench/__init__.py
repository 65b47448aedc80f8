"""Benchmarks (pytest-benchmark): per-call copy vs resident constants. See docs/benchmarks.md.

``pytest bench/ --benchmark-json=bench/results/cpu.json`` runs them; ``python -m bench.report FILE.json``
prints the table and writes the plot.
"""
