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
        cuda = any("CUDA" in str(m.kwargs.get("reason", "")) and m.args and m.args[0] is not False
                   or "CUDA" in str(m.kwargs.get("reason", "")) and not m.args
                   for m in item.iter_markers("skipif"))
        (keep if cuda else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
