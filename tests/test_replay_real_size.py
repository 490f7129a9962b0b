"""What a replay recording holds at the size users run: 832x480, 81 frames (7 blocks), the real latent and pixel
shapes, built through the real context schemes and recording code on the meta device (no compute, no RAM).

Before this round every recorded block also kept the VAE's decode cache: 0.605 MB per latent pixel, 3.52 GiB a block
in fp32 (25 GiB for 81 frames), so the 4 GiB default cap refused every recording above about 300 px square. Now a
replay decodes the reused latents again instead (tests/test_replay.py checks it is bit-identical)."""

from __future__ import annotations

import pytest
import torch

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.memo import DEFAULT_MAX_BYTES, RecordedBlock, Recording, ReplayMemo, _cpu, recording_bytes
from sdvg_engine.pipeline import video_frames_to_latent_frames

WIDTH, HEIGHT, FRAMES = 832, 480, 81
LATENT = (16, 3, HEIGHT // 8, WIDTH // 8)  # one block of Wan2.1 latents
FEATURES = 1024  # BLIP ViT-L image features (the seam term)


class _Gen:
    frames_per_block = 3


def recording_at_real_size(scheme: str) -> Recording:
    blocks = video_frames_to_latent_frames(FRAMES) // 3
    contexts = {"drafter": GlobalCache(21), "target": GlobalCache(21) if scheme == "global_cache" else RecomputeWindow(3)}
    recording = Recording(key=("real size", scheme))
    for b in range(blocks):
        latents = torch.empty(1, *LATENT, device="meta")
        pixels = torch.empty(1, 3, 9 if b == 0 else 12, HEIGHT, WIDTH, device="meta")
        for ctx in contexts.values():  # what SpeculativePipeline._commit_to does with a committed block
            ctx.commit(_Gen(), b, latents, pixels if isinstance(ctx, RecomputeWindow) else None)
        recording.blocks.append(RecordedBlock(
            index=b, source="target" if b == 0 else "draft", drafted=b > 0, decision=None, latents=latents,
            num_frames=pixels.shape[2], contexts_after={n: _cpu(c.snapshot(), recording.host_copies) for n, c in contexts.items()},
            previous_features_after=torch.empty(FEATURES, device="meta"), seconds=1.0, pixels=pixels))
    return recording


# 7 blocks of latents, 81 decoded frames of 3x480x832 fp32 and 7 seam feature vectors, whatever the scheme: the
# recompute window's snapshots reference the same frames, and each tensor is counted once.
REAL_SIZE_BYTES = 7 * 16 * 3 * 60 * 104 * 4 + 81 * 3 * 480 * 832 * 4 + 7 * FEATURES * 4


@pytest.mark.parametrize("scheme, expected", [("global_cache", REAL_SIZE_BYTES), ("recompute_window", REAL_SIZE_BYTES)])
def test_a_real_size_recording_fits_the_default_cap(scheme, expected):
    recording = recording_at_real_size(scheme)
    assert recording.nbytes == expected == recording_bytes(WIDTH, HEIGHT, FRAMES)  # each tensor once, however many
    # snapshots reference it; recording_bytes is the closed form bench/memory_plan.py prints
    assert recording.nbytes < DEFAULT_MAX_BYTES / 10  # 397 MB
    memo = ReplayMemo()
    assert memo.store(recording) and memo.nbytes == expected
    old_vae_cache_per_block = 0.605e6 * (HEIGHT // 8) * (WIDTH // 8)  # measured on the real VAE (issue 23)
    assert old_vae_cache_per_block * 7 > DEFAULT_MAX_BYTES  # what the old recordings could not fit
