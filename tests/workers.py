"""The cores a test process may use: under pytest-xdist (README's test command) the workers share them."""

import os


def xdist_workers() -> int:
    """How many worker processes share the cores (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def share_of_cores() -> int:
    """This process's share of the cores: all of them alone, cores / workers under xdist."""
    return max(1, (os.cpu_count() or 1) // xdist_workers())
