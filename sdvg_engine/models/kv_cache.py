"""Preallocated self-attention key/value cache for a block-causal DiT.

One tensor pair holds every layer's keys and values, laid out ``[layers, B, heads, tokens, head_dim]``
so that ``cache[:end]`` is a view SDPA can consume without copying. Slots are addressed in latent
*frames*; a frame is ``tokens_per_frame`` tokens (1560 at 832x480). Writing the same frames again
overwrites them in place: that is how the noisy denoising steps and the clean commit pass of one
block share slots, and why a rejected draft needs no cache rollback. Which frames are valid is the
context scheme's knowledge (a block reads only up to its own end), so the cache keeps no such state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheGeometry:
    """Everything that fixes a cache's shape; a new geometry means a new allocation."""

    num_layers: int
    batch_size: int
    num_heads: int
    head_dim: int
    tokens_per_frame: int
    capacity_frames: int
    dtype: torch.dtype
    device: torch.device

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.batch_size, self.num_heads, self.capacity_frames * self.tokens_per_frame, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return 2 * n * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """Keys/values of ``capacity_frames`` latent frames for all layers of one model.

    Attributes:
        keys, values: ``[num_layers, B, heads, capacity_frames * tokens_per_frame, head_dim]``.
    """

    def __init__(self, geometry: CacheGeometry):
        self.geometry = geometry
        self.keys = torch.zeros(geometry.shape, dtype=geometry.dtype, device=geometry.device)
        self.values = torch.zeros(geometry.shape, dtype=geometry.dtype, device=geometry.device)

    @property
    def capacity_frames(self) -> int:
        return self.geometry.capacity_frames

    @property
    def tokens_per_frame(self) -> int:
        return self.geometry.tokens_per_frame

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def check_fits(self, start_frame: int, num_frames: int) -> None:
        if start_frame < 0 or start_frame + num_frames > self.capacity_frames:
            raise ValueError(
                f"KV cache holds {self.capacity_frames} latent frames, but frames "
                f"{start_frame}..{start_frame + num_frames - 1} were requested"
            )

    def write_and_read(self, layer: int, start_frame: int, k: torch.Tensor, v: torch.Tensor):
        """Store this block's ``k, v`` (``[B, heads, L, head_dim]``) at ``start_frame`` and return views
        of every cached key/value up to the block's end, which is what the block attends to."""
        begin = start_frame * self.tokens_per_frame
        end = begin + k.shape[2]
        self.keys[layer, :, :, begin:end] = k
        self.values[layer, :, :, begin:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
