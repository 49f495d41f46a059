"""GPU-only tests: run on a CUDA machine (``pytest -s tests/gpu``); skipped elsewhere."""

import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
