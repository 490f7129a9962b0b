"""One causal model, its KV cache, context scheme and schedule: generates and commits blocks.

The speculative loop owns two of these (drafter and target). Everything a block costs goes through
:meth:`CausalGenerator.run_model`, which counts calls by kind, times them, and gives the caller a
hook before each call (progress, cancel).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from .context import ContextScheme, GlobalCache
from .models.causal_wan import CausalWanTransformer3DModel, TextKV
from .models.kv_cache import KVCache
from .report import ComponentTimer
from .sampling import NoiseSource, Schedule, flow_to_x0, get_schedule, renoise


@dataclass
class BlockSample:
    """The result of denoising one block.

    Attributes:
        latents: final ``x0`` ``[B, C, F, h, w]`` float32 (normalized latent space).
        states: the noisy input of each step that ran, in order (``states[k]`` at ``timesteps[first_step + k]``);
            used by hybrid regeneration, which hands the drafter's state to the target.
        first_step: the index of the first schedule step that ran.
    """

    latents: torch.Tensor
    states: list[torch.Tensor] = field(default_factory=list)
    first_step: int = 0


class CausalGenerator:
    """Generates blocks with one :class:`CausalWanTransformer3DModel`.

    Args:
        model: the causal DiT.
        schedule: a :class:`Schedule` or its name (``self_forcing`` / ``krea``).
        context: the context scheme (default: Self-Forcing's global cache).
        frames_per_block: latent frames per block (3 for every released model).
        name: used in error messages and reports (``drafter`` / ``target``).
    """

    def __init__(self, model: CausalWanTransformer3DModel, *, schedule: "Schedule | str" = "self_forcing",
                 context: ContextScheme | None = None, frames_per_block: int = 3, name: str = "model"):
        if frames_per_block < 1:
            raise ValueError(f"frames_per_block must be positive, got {frames_per_block}")
        self.model = model
        self.schedule = get_schedule(schedule)
        self.context = context if context is not None else GlobalCache()
        self.frames_per_block = frames_per_block
        self.name = name
        #: where the context scheme and schedule came from ("explicit" / "preset" / "checkpoint"); see presets.py
        self.settings_source: dict = {"preset": None, "context_scheme": "explicit", "schedule": "explicit"}
        self.kv_cache: KVCache | None = None
        self.text_kv: TextKV | None = None
        self._text_source: torch.Tensor | None = None
        self._text_key: tuple | None = None
        self.calls: Counter = Counter()
        self.timer = ComponentTimer()  # seconds per call kind
        self.before_call: Callable[[str, str], None] | None = None
        self._latent_shape: tuple[int, int, int] | None = None
        #: the run's text per segment, ``[(first_block, prompt_embeds), ...]`` (one entry without a prompt schedule)
        self._text_segments: list[tuple[int, torch.Tensor]] = []
        self._segment = 0  # the segment whose text K/V ``text_kv`` holds (and the KV cache was built under)

    @property
    def seconds(self) -> Counter:
        """Seconds per call kind since :meth:`start` (``denoise``, ``commit``, ``recompute``, ...)."""
        return self.timer.seconds

    # ---- lifetime of a run --------------------------------------------------------------------------
    def start(self, prompt_embeds: torch.Tensor, *, latent_height: int, latent_width: int, num_blocks: int,
              switches: tuple = ()) -> None:
        """Prepare a new video: check its length, (re)use the KV cache, encode the prompt once.

        switches: ``((first_block, prompt_embeds), ...)`` for the later segments of a prompt schedule
        (:mod:`sdvg_engine.prompt_schedule`); their text is encoded when their first block is generated."""
        self.context.check_length(num_blocks, self.frames_per_block, self.name)
        batch = prompt_embeds.shape[0]
        capacity = self.context.capacity_frames(self.frames_per_block)
        geometry_ok = (
            self.kv_cache is not None
            and self.kv_cache.geometry.batch_size == batch
            and self.kv_cache.tokens_per_frame == self.model.tokens_per_frame(latent_height, latent_width)
            and self.kv_cache.capacity_frames == capacity
            and self.kv_cache.geometry.device == self.model.device
            # apply_memory_options(kv_dtype=...) on a loaded model takes effect at the next video
            and self.kv_cache.geometry.dtype == (self.model.kv_cache_dtype or self.model.compute_dtype)
        )
        if not geometry_ok:
            self.kv_cache = None  # free the old allocation before making the new one
            self.kv_cache = self.model.new_kv_cache(batch, latent_height, latent_width, capacity)
        text_key = (self.model.device, self.model.compute_dtype)
        if (self._text_source is None or self._text_key != text_key or self._text_source.shape != prompt_embeds.shape
                or not torch.equal(self._text_source, prompt_embeds.to(self._text_source.device))):
            self._encode_text(prompt_embeds)
        self._text_segments, self._segment = [(0, prompt_embeds), *switches], 0
        self.context.reset()
        self.calls.clear()
        self.timer.clear()
        self._latent_shape = (self.model.config.in_channels, latent_height, latent_width)

    def block_shape(self, batch: int | None = None) -> tuple[int, int, int, int, int]:
        if self._latent_shape is None:
            raise RuntimeError(f"{self.name}: call start() before generating")
        c, h, w = self._latent_shape
        return (batch or self.kv_cache.geometry.batch_size, c, self.frames_per_block, h, w)

    # ---- model calls --------------------------------------------------------------------------------
    def run_model(self, kind: str, latents: torch.Tensor, timestep: float, start_frame: int, cache_bias=None) -> torch.Tensor:
        """One DiT call over a block at ``start_frame`` (writes its K/V). ``kind`` labels the cost."""
        if self.before_call is not None:
            self.before_call(self.name, kind)
        device = self.model.device
        with self.timer.measure(kind, device):
            timesteps = torch.full((latents.shape[0], latents.shape[2]), float(timestep), device=device)
            flow = self.model.forward_block(latents.to(device), timesteps, self.text_kv, self.kv_cache, start_frame, cache_bias=cache_bias)
        self.calls[kind] += 1
        return flow

    def generate_block(self, block_index: int, noise: NoiseSource, *, first_step: int = 0,
                       start_latents: torch.Tensor | None = None) -> BlockSample:
        """Denoise block ``block_index`` from its noise (or from ``start_latents`` at ``first_step``)."""
        self.use_prompt_of(block_index)
        start_frame, cache_bias = self.context.prepare(self, block_index)
        shape = self.block_shape()
        timesteps, sigmas = self.schedule.timesteps, self.schedule.sigmas
        if not 0 <= first_step < len(timesteps):
            raise ValueError(f"{self.name}: first_step {first_step} outside the {len(timesteps)}-step schedule")
        if start_latents is None and first_step != 0:
            raise ValueError("start_latents are required when starting after step 0")
        draws = [noise.step(block_index, k, shape) for k in range(first_step, len(timesteps) - 1)]
        if start_latents is None:
            draws.insert(0, noise.initial(block_index, shape))
        for draw in draws:
            if tuple(draw.shape) != tuple(shape):
                raise ValueError(f"{self.name}: noise for block {block_index} has shape {tuple(draw.shape)}, "
                                 f"expected {tuple(shape)} (check the noise source's tensors)")
        draws = self._upload(draws)
        x = draws.pop(0) if start_latents is None else start_latents.to(self.model.device, torch.float32)
        states = []
        x0 = x
        for k in range(first_step, len(timesteps)):
            states.append(x)
            flow = self.run_model("denoise", x, timesteps[k], start_frame, cache_bias)
            x0 = flow_to_x0(x, flow, sigmas[k])
            if k + 1 < len(timesteps):
                x = renoise(x0, draws.pop(0), sigmas[k + 1])
        return BlockSample(latents=x0, states=states, first_step=first_step)

    def use_prompt_of(self, block_index: int) -> None:
        """Switch to the text of the segment holding ``block_index`` (a prompt schedule's switch): encode its text K/V
        (the old one is freed first: one prompt's K/V is resident at a time, 0.4 GB for the 14B in bf16) and have the
        context rebuilt under it before the block (:meth:`ContextScheme.invalidate`): the cache then holds what a
        model that had always seen this prompt would hold for the committed frames (see :mod:`sdvg_engine.prompt_schedule`)."""
        segment = max(i for i, (first, _) in enumerate(self._text_segments) if first <= block_index)
        if segment == self._segment:
            return
        if self.before_call is not None:
            self.before_call(self.name, "text")
        with self.timer.measure("text", self.model.device):
            self._encode_text(self._text_segments[segment][1])
        self.calls["text"] += 1
        self._segment = segment
        self.context.invalidate()

    def _encode_text(self, prompt_embeds: torch.Tensor) -> None:
        """``text_kv`` for ``prompt_embeds`` (the old one freed first), and what :meth:`start` compares to reuse it.
        Forgotten before the encode: one stopped halfway (a cancel, an error) leaves nothing a later start reuses."""
        self.text_kv, self._text_source = None, None
        self.text_kv = self.model.encode_text(prompt_embeds)
        self._text_source, self._text_key = prompt_embeds.detach().clone(), (self.model.device, self.model.compute_dtype)

    def _upload(self, draws: list[torch.Tensor]) -> list[torch.Tensor]:
        """Move a block's CPU noise draws to the model's device in one copy. On CUDA the copy is pinned and
        non-blocking: a plain copy per step would wait for every model call queued before it."""
        device = self.model.device
        if not draws or device.type == "cpu":
            return list(draws)
        host = torch.stack(draws)
        if device.type == "cuda":
            return list(host.pin_memory().to(device, non_blocking=True).unbind(0))
        return list(host.to(device).unbind(0))

    def commit_block(self, block_index: int, latents: torch.Tensor, pixels: torch.Tensor | None = None) -> None:
        """Make the final ``latents`` of ``block_index`` (and its decoded ``pixels`` ``[B,3,T,H,W]``) context."""
        self.context.commit(self, block_index, latents.to(self.model.device, torch.float32), pixels)

    def step_index(self, timestep: float) -> int:
        """Index of ``timestep`` in this model's schedule (for handing a state from another model)."""
        for k, t in enumerate(self.schedule.timesteps):
            if abs(t - timestep) < 1e-6:
                return k
        raise ValueError(f"{self.name}: timestep {timestep} is not in its schedule {self.schedule.timesteps}")

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.nbytes
