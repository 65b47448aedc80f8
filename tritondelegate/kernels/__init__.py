"""Triton kernels, one op family per file: each file holds its ``@triton.jit`` kernels and their
lowerings. ``table.py`` is the runtime's table of kernels by name; ``registry.py`` the lowering side's
table of ATen ops; ``refs.py`` the leaf every lowering shares; ``fusion.py`` the pass over recorded
launches. Importing this package changes nothing in Triton: the simulated device interprets its own
kernels (``runtime/interpreter.py``)."""
