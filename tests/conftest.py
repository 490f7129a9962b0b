import sys
from pathlib import Path

import torch

# Test helpers (tiny real-architecture models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
# Tiny models: one thread is fastest and immune to a busy machine (OpenMP spin-waits badly when oversubscribed).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``SDVG_ONLY_CUDA_TESTS=1`` (``make gpu-check``): keep only the tests that are skipped without CUDA."""
    import os

    if os.environ.get("SDVG_ONLY_CUDA_TESTS") != "1":
        return
    keep, drop = [], []
    for item in items:
        # the CUDA-only tests are marked skipif(not torch.cuda.is_available(), reason="needs CUDA")
        cuda = any(m.kwargs.get("reason") == "needs CUDA" for m in item.iter_markers("skipif"))
        (keep if cuda else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
