import os
import sys
from pathlib import Path

# Subprocesses the tests start (CLI, torchrun ranks, bench scripts) inherit this: with two pytest workers on two
# cores, a child that also spun up one OpenMP thread per core would oversubscribe the machine (see below).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it loads)

# Test helpers (tiny real-architecture models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
# Tiny models: one thread is fastest and immune to a busy machine (OpenMP spin-waits badly when oversubscribed).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Two things, in this order:

    ``SDVG_ONLY_CUDA_TESTS=1`` (``make gpu-check``): keep only the tests that are skipped without CUDA.

    Files holding a test marked ``slow`` run first. ``make test`` hands whole files to two workers in collection order
    (``--dist loadfile --no-loadscope-reorder``); a long file started last would leave one core idle while it ends."""
    if os.environ.get("SDVG_ONLY_CUDA_TESTS") == "1":
        keep, drop = [], []
        for item in items:
            # the CUDA-only tests are marked skipif(not torch.cuda.is_available(), reason="needs CUDA")
            cuda = any(m.kwargs.get("reason") == "needs CUDA" for m in item.iter_markers("skipif"))
            (keep if cuda else drop).append(item)
        items[:] = keep
        config.hook.pytest_deselected(items=drop)

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group is kept
