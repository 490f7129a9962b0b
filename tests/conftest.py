import sys
from pathlib import Path

import torch

# Test helpers (tiny real-architecture models) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
# Tiny models: one thread is fastest and immune to a busy machine (OpenMP spin-waits badly when oversubscribed).
torch.set_num_threads(1)
