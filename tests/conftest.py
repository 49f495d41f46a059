import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# nor the user's cache (models unpacked from GGUF files, stored checkpoints)
os.environ.setdefault("SSE_PIPELINE_CACHE", tempfile.mkdtemp(prefix="sse-pipeline-tests-"))

import pytest
import torch

# under pytest-xdist (the README runs `-n 2`) the workers share the cores rather than each taking them all
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _workers))

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

if not torch.cuda.is_available():
    # the Triton kernels run on CPU through Triton's interpreter (set before kernels are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
