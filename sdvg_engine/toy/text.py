"""Fixed text embeddings for the toy vocabulary, shaped like UMT5-XXL output: ``[1, 512, 4096]``, zero padded.

Row ``i`` of a caption's context is ``word_vector(word_i) + 0.5 * position_vector(i)``; every vector is
N(0, 1) drawn from a generator keyed by the word (or position) itself, so the table never changes
when the vocabulary grows and nothing needs to be shipped.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .world import VOCAB

TEXT_DIM = 4096
TEXT_LEN = 512


def _vector(key: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(TEXT_DIM).astype(np.float32)


def word_vector(word: str) -> np.ndarray:
    if word not in VOCAB:
        raise ValueError(f"{word!r} is not in the toy vocabulary: {' '.join(VOCAB)}")
    return _vector("word:" + word)


def embed_caption(caption: str) -> torch.Tensor:
    """Caption -> context ``[1, 512, 4096]`` float32 (rows after the last word are zero)."""
    words = caption.strip().lower().split()
    ctx = np.zeros((1, TEXT_LEN, TEXT_DIM), dtype=np.float32)
    for i, w in enumerate(words):
        ctx[0, i] = word_vector(w) + 0.5 * _vector(f"pos:{i}")
    return torch.from_numpy(ctx)
