"""How a causal model sees the frames before the block it generates: the two reference schemes.

* :class:`GlobalCache` (Self-Forcing): every committed block's clean K/V stays in a cache that grows
  to ``max_frames`` (21 latent frames = 81 video frames for the released model). Committing a block
  costs one t=0 pass over it at its own frame position. Commits are queued and run just before the
  model next generates, so a model that never generates again (the target after an accepted draft
  at the end of a video) never pays for them.
* :class:`RecomputeWindow` (Krea Realtime 14B): before a block, the cache is rebuilt from scratch
  by one t=0 pass over a short clean context, an *anchor* frame plus the last ``context_frames - 1``
  latent frames, at positions ``0..context_frames-1``; the new block sits right after. Positions stay
  bounded, so video length is unbounded. Once the video outgrows the window the anchor is the VAE
  re-encode of the oldest kept pixel frame, hence the :class:`AnchorEncoder` interface. A rebuild
  happens only when the model must generate and something was committed since the last rebuild.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .generator import CausalGenerator


class AnchorEncoder(Protocol):
    """Encodes one decoded pixel frame ``[B, 3, H, W]`` in [-1, 1] into a normalized image latent ``[B, C, 1, h, w]``.

    :class:`sdvg_engine.vae.StreamingWanVAE` implements it with the Wan VAE encoder.
    """

    def encode_frame(self, pixels: torch.Tensor) -> torch.Tensor: ...


class ContextScheme:
    """Interface shared by the two schemes; one instance belongs to one :class:`CausalGenerator`."""

    name: str
    #: whether :meth:`commit` needs the block's decoded pixels (to re-encode an anchor frame later)
    needs_pixels: bool = False

    def capacity_frames(self, frames_per_block: int) -> int:
        raise NotImplementedError

    def check_length(self, num_blocks: int, frames_per_block: int, model_name: str) -> None:
        """Raise before any work if a video of ``num_blocks`` blocks cannot be generated."""

    def reset(self) -> None:
        raise NotImplementedError

    def prepare(self, gen: "CausalGenerator", block_index: int) -> tuple[int, tuple | None]:
        """Bring the cache up to date for ``block_index``; return its frame position and cache bias."""
        raise NotImplementedError

    def commit(self, gen: "CausalGenerator", block_index: int, latents: torch.Tensor, pixels: torch.Tensor | None) -> None:
        """Record the final latents (and decoded pixels) of ``block_index`` as context for what follows."""
        raise NotImplementedError

    def invalidate(self) -> None:
        """The text the cache was built under changed (a prompt switch): rebuild it from the committed frames before
        the model next generates, by the same passes that built it (so under the new text)."""
        self.restore(self.snapshot())

    def snapshot(self) -> tuple:
        """What :meth:`restore` needs to bring this context back to now (tensor references, no copies)."""
        raise NotImplementedError

    def restore(self, state: tuple) -> None:
        """Return to a :meth:`snapshot`. The KV cache is rebuilt lazily, before the model next generates, by the
        same passes that built it, so what follows is bit-identical to a run that never left that point."""
        raise NotImplementedError


class GlobalCache(ContextScheme):
    """Self-Forcing's growing cache of every committed frame (bounded by ``max_frames``)."""

    name = "global_cache"

    def __init__(self, max_frames: int = 21):
        if max_frames < 1:
            raise ValueError(f"max_frames must be positive, got {max_frames}")
        self.max_frames = max_frames
        self.reset()

    def capacity_frames(self, frames_per_block: int) -> int:
        return self.max_frames

    def check_length(self, num_blocks: int, frames_per_block: int, model_name: str) -> None:
        needed = num_blocks * frames_per_block
        if needed > self.max_frames:
            max_video = 1 + 4 * (self.max_frames - 1)
            raise ValueError(
                f"{model_name}: the global KV cache holds {self.max_frames} latent frames ({max_video} video frames), "
                f"but {needed} latent frames were requested. Use the recompute-window context scheme for longer videos."
            )

    def reset(self) -> None:
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.history: list[tuple[int, torch.Tensor]] = []  # every committed block, for snapshot()
        self.committed_frames = 0

    def snapshot(self) -> tuple:
        return tuple(self.history)

    def restore(self, state: tuple) -> None:
        # Every committed block's K/V comes from its t=0 commit pass over the blocks before it: queuing them all
        # again rebuilds the cache exactly (one call per block, not the block's whole schedule).
        self.reset()
        self.history = list(state)
        self.pending = list(state)

    def prepare(self, gen, block_index):
        fpb = gen.frames_per_block
        while self.pending:  # one at a time, so a call stopped halfway leaves only the unfinished commits queued
            pending_index, latents = self.pending[0]
            gen.run_model("commit", latents, 0.0, pending_index * fpb)
            self.committed_frames = (pending_index + 1) * fpb
            self.pending.pop(0)
        if self.committed_frames != block_index * fpb:
            raise RuntimeError(
                f"{gen.name}: block {block_index} needs {block_index * fpb} committed frames, cache has {self.committed_frames}"
            )
        return block_index * fpb, None

    def commit(self, gen, block_index, latents, pixels):
        self.pending.append((block_index, latents))
        self.history.append((block_index, latents))


class RecomputeWindow(ContextScheme):
    """Krea's KV recompute: rebuild the cache from an anchor frame + the last frames before each block.

    Args:
        context_frames: latent frames in the rebuilt context (Krea: 3 = anchor + last 2).
        attention_bias: if set (Scope uses 0.3), multiply attention to the non-anchor context frames
            by this factor (``log(bias)`` added to their logits) while denoising. Off by default, as in
            Krea's own repository.
        anchor_encoder: re-encodes a pixel frame into the anchor latent once the video is longer
            than the window (a VAE; see :class:`AnchorEncoder`).
    """

    name = "recompute_window"
    needs_pixels = True

    def __init__(self, context_frames: int = 3, attention_bias: float | None = None, anchor_encoder: AnchorEncoder | None = None):
        if context_frames < 2:
            raise ValueError(f"context_frames must be at least 2 (anchor + 1), got {context_frames}")
        if attention_bias is not None and not (0.0 < attention_bias <= 1.0):
            raise ValueError(f"attention_bias must be in (0, 1], got {attention_bias}")
        self.context_frames = context_frames
        self.attention_bias = attention_bias
        self.anchor_encoder = anchor_encoder
        self.reset()

    def capacity_frames(self, frames_per_block: int) -> int:
        return self.context_frames + frames_per_block

    def reset(self) -> None:
        self.latent_frames: deque[torch.Tensor] = deque(maxlen=self.context_frames)
        # The pixel frames covering the kept latents: 1 + 4 * (context_frames - 1) of them (9 for Krea).
        self.pixel_frames: deque[torch.Tensor] = deque(maxlen=1 + 4 * (self.context_frames - 1))
        self.committed_frames = 0
        self.context_len = 0
        self.dirty = False

    def context_latents(self) -> torch.Tensor:
        """The clean context ``[B, C, n, h, w]`` the cache is rebuilt from."""
        frames = list(self.latent_frames)
        if self.committed_frames > self.context_frames:
            if self.anchor_encoder is None:
                raise RuntimeError("the recompute-window context needs an anchor encoder (the VAE) once the video outgrows the window")
            if len(self.pixel_frames) < self.pixel_frames.maxlen:
                raise RuntimeError("the recompute-window context needs the decoded pixel frames of committed blocks (pass pixels to commit)")
            anchor = self.anchor_encoder.encode_frame(self.pixel_frames[0])
            frames = [anchor.to(frames[-1].device, frames[-1].dtype)] + frames[1:]
        return torch.cat(frames, dim=2)

    def prepare(self, gen, block_index):
        if self.committed_frames == 0:
            return 0, None
        if self.dirty:
            context = self.context_latents()
            # Block-causal over the context, in chunks of a block, from position 0.
            fpb = gen.frames_per_block
            for first in range(0, context.shape[2], fpb):
                gen.run_model("recompute", context[:, :, first : first + fpb], 0.0, first)
            self.context_len = context.shape[2]
            self.dirty = False
        bias = None
        if self.attention_bias is not None and self.attention_bias < 1.0 and self.context_len > 1:
            bias = ((1, self.context_len), math.log(self.attention_bias))
        return self.context_len, bias

    def snapshot(self) -> tuple:
        return tuple(self.latent_frames), tuple(self.pixel_frames), self.committed_frames

    def restore(self, state: tuple) -> None:
        latent_frames, pixel_frames, committed = state
        self.reset()
        self.latent_frames.extend(latent_frames)
        self.pixel_frames.extend(pixel_frames)
        self.committed_frames = committed
        self.dirty = committed > 0  # rebuilt before the next block, as it was after this commit

    def commit(self, gen, block_index, latents, pixels):
        for f in range(latents.shape[2]):
            self.latent_frames.append(latents[:, :, f : f + 1])
        if pixels is not None:
            for f in range(pixels.shape[2]):
                self.pixel_frames.append(pixels[:, :, f])
        self.committed_frames += latents.shape[2]
        self.dirty = True


def make_context_scheme(name: str, *, max_frames: int = 21, context_frames: int = 3,
                        attention_bias: float | None = None, anchor_encoder: AnchorEncoder | None = None) -> ContextScheme:
    if name == "global_cache":
        return GlobalCache(max_frames=max_frames)
    if name == "recompute_window":
        return RecomputeWindow(context_frames=context_frames, attention_bias=attention_bias, anchor_encoder=anchor_encoder)
    raise ValueError(f"unknown context scheme {name!r}; choose 'global_cache' or 'recompute_window'")
