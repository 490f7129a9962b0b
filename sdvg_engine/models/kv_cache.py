"""Preallocated self-attention key/value cache for a block-causal DiT.

One tensor pair holds every layer's keys and values, laid out ``[layers, B, heads, tokens, head_dim]``
so that ``cache[:end]`` is a view SDPA can consume without copying. Slots are addressed in latent
*frames*; a frame is ``tokens_per_frame`` tokens (1560 at 832x480). Writing the same frames again
overwrites them in place: that is how the noisy denoising steps and the clean commit pass of one
block share slots, and why a rejected draft needs no cache rollback. Which frames are valid is the
context scheme's knowledge (a block reads only up to its own end), so the cache keeps no such state.

A cache whose ``dtype`` is ``torch.float8_e4m3fn`` (``kv_dtype="fp8"``) stores each key/value row (one
token of one head) as float8 with its own float32 scale (``amax / 448``; 4 bytes per 128 values, so the
cache is 0.52x a bf16 one). Reads dequantize the cached prefix into ``compute_dtype`` and use the
block's own keys/values unrounded, so attention itself runs in the compute dtype. Error against a
bf16 cache: see ``docs/memory.md`` (measured by ``tests/test_memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: float8 formats a cache may store (e4m3: 3 mantissa bits, max 448; the scale takes the range).
FP8_DTYPES = (torch.float8_e4m3fn,)


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
    #: dtype keys/values are read back in (attention's dtype); ``None`` = ``dtype`` (needed for float8 storage)
    compute_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.dtype in FP8_DTYPES and (self.compute_dtype is None or self.compute_dtype in FP8_DTYPES):
            raise ValueError(f"a {self.dtype} KV cache needs compute_dtype (the attention dtype, e.g. torch.bfloat16), "
                             f"got {self.compute_dtype}")

    @property
    def quantized(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.batch_size, self.num_heads, self.capacity_frames * self.tokens_per_frame, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        total = 2 * n * torch.empty((), dtype=self.dtype).element_size()
        if self.quantized:  # one float32 scale per cached row
            total += 2 * (n // self.head_dim) * 4
        return total


class KVCache:
    """Keys/values of ``capacity_frames`` latent frames for all layers of one model.

    Attributes:
        keys, values: ``[num_layers, B, heads, capacity_frames * tokens_per_frame, head_dim]``.
    """

    def __init__(self, geometry: CacheGeometry):
        self.geometry = geometry
        self.keys = torch.zeros(geometry.shape, dtype=geometry.dtype, device=geometry.device)
        self.values = torch.zeros(geometry.shape, dtype=geometry.dtype, device=geometry.device)
        if geometry.quantized:
            self.key_scales = torch.zeros(geometry.shape[:-1] + (1,), dtype=torch.float32, device=geometry.device)
            self.value_scales = torch.zeros_like(self.key_scales)

    @property
    def capacity_frames(self) -> int:
        return self.geometry.capacity_frames

    @property
    def tokens_per_frame(self) -> int:
        return self.geometry.tokens_per_frame

    @property
    def nbytes(self) -> int:
        scales = self.key_scales.nbytes + self.value_scales.nbytes if self.geometry.quantized else 0
        return self.keys.nbytes + self.values.nbytes + scales

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
        if self.geometry.quantized:
            return self._write_and_read_fp8(layer, begin, end, k, v)
        self.keys[layer, :, :, begin:end] = k
        self.values[layer, :, :, begin:end] = v
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        read = self.geometry.compute_dtype
        if read is not None and read != self.geometry.dtype:  # e.g. an fp32 or fp16 cache beside bf16 attention
            keys, values = keys.to(read), values.to(read)
        return keys, values

    def _write_and_read_fp8(self, layer: int, begin: int, end: int, k: torch.Tensor, v: torch.Tensor):
        out = []
        for store, scales, new in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            q, s = quantize_rows(new, self.geometry.dtype)
            store[layer, :, :, begin:end] = q
            scales[layer, :, :, begin:end] = s
            # Earlier frames come back dequantized; the block's own rows are used as computed.
            full = torch.empty(new.shape[:2] + (end, new.shape[3]), dtype=self.geometry.compute_dtype, device=new.device)
            if begin:
                # fp8 -> compute dtype is exact; the in-place multiply computes in float32 and rounds once, so
                # this equals dequantize_rows() without a float32 copy of the prefix.
                prefix = full[:, :, :begin]
                prefix.copy_(store[layer, :, :, :begin])
                prefix.mul_(scales[layer, :, :, :begin])
            full[:, :, begin:end] = new
            out.append(full)
        return out[0], out[1]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> (``x / scale`` in float8, float32 ``scale [..., 1]``) with ``scale = amax(|row|) / fp8 max``."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max
    return (x / scale).to(dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)
