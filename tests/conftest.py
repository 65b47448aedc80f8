import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    # Under pytest-xdist (README's test command) the workers share the cores: torch's intra-op threads
    # are split among them, not oversubscribed.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    # The slow tests first (a stable sort keeps the rest in order): under xdist (README's command, which
    # keeps collection order with --no-loadscope-reorder) the longest single test, the sm_90 compile
    # check, then overlaps the rest of the suite instead of running alone at its end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
