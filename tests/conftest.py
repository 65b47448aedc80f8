import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402
from workers import share_of_cores, xdist_workers  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    # Under pytest-xdist (README's test command) the workers share the cores: torch's intra-op threads
    # are split among them, not oversubscribed.
    if xdist_workers() > 1:
        torch.set_num_threads(share_of_cores())


def pytest_collection_modifyitems(config, items):
    # The slow tests first (a stable sort keeps the rest in order): under xdist (README's command, which
    # keeps collection order with --no-loadscope-reorder) the longest single test, the sm_90 compile
    # check, then overlaps the rest of the suite instead of running alone at its end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
