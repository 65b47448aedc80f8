import os
import sys

# Kernels must know before any @triton.jit runs whether they are interpreted (no GPU here).
import tritondelegate.kernels  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
