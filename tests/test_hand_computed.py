"""Hand-computed expectations for two places where a one-line slip gives a plausible video (issue 23):

* hybrid regeneration (``refine_from_step=k``) with a drafter and a target on *different* schedules: which target
  step the handover starts at (picked by hand from the two timestep lists) and which latents it starts from;
* the seam-feature frame: the features the next draft's temporal term reads are the reward's image features of
  exactly the committed block's last frame (its index in the final video picked by hand).
"""

from __future__ import annotations

import math

import pytest
import torch

from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.sampling import Schedule, SeededNoise
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline

PROMPT = "a red ball rolling on grass"
DRAFTER = Schedule("drafter-4", (1000.0, 750.0, 500.0, 250.0))
TARGET = Schedule("target-6", (1000.0, 900.0, 750.0, 500.0, 250.0, 100.0))


def _capture(gen, log):
    """Record every denoising call of ``gen``: (timestep, input latents, returned flow)."""
    original = gen.run_model

    def run_model(kind, latents, timestep, start_frame, cache_bias=None):
        flow = original(kind, latents, timestep, start_frame, cache_bias)
        if kind == "denoise":
            log.append((float(timestep), latents.detach().clone(), flow.detach().clone()))
        return flow

    gen.run_model = run_model


# k -> (the drafter's timestep after k steps, its index in TARGET, the target's remaining timesteps), by hand
HANDOVER = {
    1: (750.0, 2, [750.0, 500.0, 250.0, 100.0]),
    2: (500.0, 3, [500.0, 250.0, 100.0]),
    3: (250.0, 4, [250.0, 100.0]),
}


@pytest.mark.parametrize("k", sorted(HANDOVER))
def test_hybrid_handover_step_and_start_latents_by_hand(k):
    """Seeded bugs caught: the target starting at ``step_index(timesteps[k - 1])`` / ``[k + 1]``, at the drafter's
    index k instead of the target's own index of that timestep, or from ``draft.states[k - 1]`` / ``[k + 1]``."""
    timestep, index, remaining = HANDOVER[k]
    assert DRAFTER.timesteps[k] == timestep and TARGET.timesteps[index] == timestep  # the hand table itself
    pipe = tiny_pipeline(tau=math.inf)  # every draft rejected
    pipe.drafter.schedule, pipe.target.schedule = DRAFTER, TARGET
    drafter_calls, target_calls = [], []
    _capture(pipe.drafter, drafter_calls)
    _capture(pipe.target, target_calls)
    seed = 5
    result = pipe.generate(prompt_embeds(1), prompt=PROMPT, num_frames=21, width=WIDTH, height=HEIGHT, seed=seed,
                           options=SDVGOptions(refine_from_step=k), workers=1)
    assert [b.source for b in result.blocks] == ["target", "target"] and result.blocks[1].drafted

    # Block 0: the target's whole 6-step schedule; block 1: the drafter's 4 steps, then the target from the handover.
    assert [t for t, _, _ in drafter_calls] == list(DRAFTER.timesteps)
    assert [t for t, _, _ in target_calls] == list(TARGET.timesteps) + remaining
    regen = target_calls[len(TARGET.timesteps):]
    # The start latents: exactly what the drafter was given at its step k (its state after k steps) ...
    assert torch.equal(regen[0][1], drafter_calls[k][1])
    # ... which by hand is the drafter's x0 after step k - 1 re-noised to sigma_k with the block's step-(k-1) noise.
    shape = tuple(drafter_calls[0][1].shape)
    noise = SeededNoise(seed)
    x, flow = drafter_calls[k - 1][1], drafter_calls[k - 1][2]
    x0 = x - DRAFTER.sigmas[k - 1] * flow
    sigma = DRAFTER.sigmas[k]
    assert torch.allclose(regen[0][1], (1 - sigma) * x0 + sigma * noise.step(1, k - 1, shape), atol=1e-6)
    # The target's next input: its own x0 re-noised to the sigma of its next step, with the noise of its step index.
    if len(regen) > 1:
        x, flow = regen[0][1], regen[0][2]
        x0 = x - TARGET.sigmas[index] * flow
        sigma = TARGET.sigmas[index + 1]
        assert torch.allclose(regen[1][1], (1 - sigma) * x0 + sigma * noise.step(1, index, shape), atol=1e-6)
    # The committed block is the target's last x0.
    x, flow = regen[-1][1], regen[-1][2]
    assert torch.allclose(result.latents[:, :, 3:], x - TARGET.sigmas[-1] * flow, atol=1e-6)


def test_a_handover_timestep_missing_from_the_target_schedule_is_refused_before_any_call():
    pipe = tiny_pipeline(tau=math.inf)
    pipe.drafter.schedule = Schedule("drafter-4b", (1000.0, 800.0, 500.0, 250.0))  # 800 is not a TARGET step
    pipe.target.schedule = TARGET
    calls = []
    _capture(pipe.drafter, calls)
    _capture(pipe.target, calls)
    with pytest.raises(ValueError, match="800"):
        pipe.generate(prompt_embeds(1), prompt=PROMPT, num_frames=21, width=WIDTH, height=HEIGHT, seed=5,
                      options=SDVGOptions(refine_from_step=1))
    assert calls == []
    # k = 2 hands over at 500, which the target has: fine.
    result = pipe.generate(prompt_embeds(1), prompt=PROMPT, num_frames=21, width=WIDTH, height=HEIGHT, seed=5,
                           options=SDVGOptions(refine_from_step=2))
    assert [t for t, _, _ in calls[-3:]] == [500.0, 250.0, 100.0] and result.blocks[1].source == "target"


# ---- the seam frame ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [math.inf, -math.inf], ids=["rejected-drafts", "accepted-drafts"])
def test_seam_features_are_those_of_the_committed_blocks_last_frame(tau):
    """Seeded bugs caught: ``decoded.pixels[:, :, :1]`` (the block's first frame) or ``[:, :, -2:-1]`` in
    ``_seam_features``; ``image_features[0]`` for an accepted draft's seam. 33 frames = 3 blocks of 9, 12 and 12
    video frames: the draft of block 1 reads frame 8, the draft of block 2 frame 20 (whoever made block 1)."""
    pipe = tiny_pipeline(tau=tau, temporal_weight=0.5)
    seen = []
    judge = pipe.router.judge

    def spy(*args, **kwargs):
        seen.append(kwargs.get("previous_features"))
        return judge(*args, **kwargs)

    pipe.router.judge = spy
    result = pipe.generate(prompt_embeds(2), prompt=PROMPT, num_frames=33, width=WIDTH, height=HEIGHT, seed=3, workers=1)
    expected_sources = ["target", "target", "target"] if tau > 0 else ["target", "draft", "draft"]
    assert [b.source for b in result.blocks] == expected_sources
    assert [b.video_frames for b in result.blocks] == [(0, 9), (9, 21), (21, 33)]
    assert len(seen) == 2

    scorer = shared_parts()["scorer"]
    frames = result.frames.permute(0, 3, 1, 2)  # [T, 3, H, W] in 0..1, what the reward was given

    def features_of(i):
        return scorer.score_frames(frames[i : i + 1], PROMPT).image_features[0]

    for previous, frame in zip(seen, (8, 20)):
        assert previous is not None
        expected = features_of(frame)
        if result.blocks[1 if frame == 20 else 0].source == "target":
            assert torch.equal(previous, expected), frame  # the seam pass scores exactly this one frame
        else:  # an accepted draft's own last-frame features (scored in the batch of its 12 frames)
            assert torch.allclose(previous, expected, atol=1e-5), frame
        for other in (frame - 1, frame + 1, frame - 8 if frame == 8 else frame - 11):
            assert not torch.allclose(previous, features_of(other), atol=1e-4), (frame, other)


# ---- reward preprocessing: the crop offset's rounding, the resize's truncation, the torch path's clamp ------------
from sdvg_engine.reward.preprocess import CLIP_MEAN, CLIP_STD, pil_resize_crop, preprocess_frames  # noqa: E402

# The reference is torchvision's CenterCrop (what ImageReward's transform uses, on PIL images too):
# top = int(round((h - S) / 2.0)) with Python's round, half to even. (dim - S) / 2 -> offset, by hand:
HALF_OFFSETS = {1: 0, 3: 2, 5: 2, 7: 4, 9: 4, 2: 1, 4: 2, 6: 3}  # dim - S: 0.5->0 1.5->2 2.5->2 3.5->4 4.5->4; whole


def _unnormalize(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return x * std + mean


@pytest.mark.parametrize("extra", sorted(HALF_OFFSETS))
@pytest.mark.parametrize("axis", ["width", "height"])
def test_center_crop_offset_rounds_half_to_even_in_both_paths(extra, axis):
    """Seeded bugs caught: ``math.floor`` / ``int()`` (1.5 -> 1, 3.5 -> 3) or half-up ``int(x + 0.5)`` (2.5 -> 3,
    0.5 -> 1) for the crop offset. The shorter side is already S, so nothing is resampled (PIL returns the image
    as is) and the crop's first column/row is the offset itself."""
    size = 4
    h, w = (size, size + extra) if axis == "width" else (size + extra, size)
    ramp = torch.arange(max(h, w), dtype=torch.uint8) * 10
    img = (ramp.view(1, -1) if axis == "width" else ramp.view(-1, 1)).expand(h, w)
    frame = img.view(1, 1, h, w).expand(1, 3, h, w).contiguous()  # uint8 [1, 3, H, W]
    offset = HALF_OFFSETS[extra]
    expected = torch.arange(offset, offset + size, dtype=torch.float32) * 10
    expected = expected.view(1, -1).expand(size, size) if axis == "width" else expected.view(-1, 1).expand(size, size)
    crop = pil_resize_crop(frame[0].permute(1, 2, 0).numpy(), size)
    assert torch.equal(torch.from_numpy(crop[..., 0].copy()).float(), expected)
    for mode in ("pil", "torch"):
        out = _unnormalize(preprocess_frames(frame, size, preprocess=mode))[0, 0] * 255
        assert torch.allclose(out, expected, atol=1e-3), mode


@pytest.mark.parametrize("h,w,size,expected", [
    (3, 5, 4, (4, 6)),  # 4 * 5 / 3 = 6.67 -> 6 (torchvision truncates the longer side; round would give 7)
    (5, 3, 4, (6, 4)),
    (6, 6, 4, (4, 4)),
    (7, 9, 4, (4, 5)),  # 5.14 -> 5
])
def test_resize_keeps_the_aspect_with_the_longer_side_truncated(h, w, size, expected):
    from sdvg_engine.reward.preprocess import _resized_size

    assert _resized_size(h, w, size) == expected
    # And the PIL path really resizes to it: an all-grey frame keeps its value, the crop is S x S.
    grey = torch.full((1, 3, h, w), 128, dtype=torch.uint8)
    assert pil_resize_crop(grey[0].permute(1, 2, 0).numpy(), size).shape == (size, size, 3)


def test_torch_path_clamps_inputs_outside_0_1_and_bicubic_overshoot():
    """Seeded bugs caught: the clamp dropped, clamped to [0, 255], or applied before the resize (a bicubic
    downscale of a hard edge overshoots past 0 and 1)."""
    size = 8
    # No resampling (shorter side = S, no crop): each value by hand.
    vals = torch.tensor([-0.5, 0.0, 0.25, 1.0, 1.5, 3.0, -2.0, 0.75])
    frame = vals.view(1, 1, 1, size).expand(1, 3, size, size).contiguous()
    out = _unnormalize(preprocess_frames(frame, size, preprocess="torch"))
    assert torch.allclose(out[0, 0, 0], torch.tensor([0.0, 0.0, 0.25, 1.0, 1.0, 1.0, 0.0, 0.75]), atol=1e-6)
    # The PIL path clamps too (8-bit truncation: 0.25 -> 63, 0.75 -> 191).
    pil = _unnormalize(preprocess_frames(frame, size, preprocess="pil"))[0, 0, 0] * 255
    assert torch.allclose(pil, torch.tensor([0.0, 0.0, 63.0, 255.0, 255.0, 255.0, 0.0, 191.0]), atol=1e-3)
    # A hard edge in range, downscaled 4x: bicubic overshoots; the result must still lie in [0, 1] and reach both ends.
    edge = torch.zeros(1, 3, 4 * size, 4 * size)
    edge[..., :, 2 * size - 3:] = 1.0
    edge[..., :, 3 * size:] = 0.0
    raw = torch.nn.functional.interpolate(edge, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    assert raw.max() > 1.0 + 1e-3 and raw.min() < -1e-3  # not vacuous: it does overshoot
    out = _unnormalize(preprocess_frames(edge, size, preprocess="torch"))
    assert torch.allclose(out, raw.clamp(0, 1), atol=1e-6)
    assert torch.allclose(out.amin(), torch.tensor(0.0), atol=1e-6) and torch.allclose(out.amax(), torch.tensor(1.0), atol=1e-6)
    # The caller's frames are not touched by the clamp.
    assert frame.min() == -2.0 and frame.max() == 3.0


# ---- model calls per mode, counted by hand, with one worker and with two ----------------------------------------
# 45 frames = 4 blocks; 4-step schedule; global cache: a committed block costs one commit pass, run only before the
# model next generates (so the last block's commit never runs, nor any commit of a model that never generates again).
CALLS = {
    # mode: (target calls, drafter calls)
    "target_only": ({"denoise": 4 * 4, "commit": 3}, {}),
    "draft_only": ({}, {"denoise": 4 * 4, "commit": 3}),
    "first_block_only": ({"denoise": 4}, {"denoise": 3 * 4, "commit": 3}),  # drafter: commits of blocks 0, 1, 2
    # schedule_every=2: the target makes blocks 0 and 2 (commits of 0 and 1 before block 2), the drafter 1 and 3
    # (commit of 0 before block 1; of 1 and 2 before block 3)
    "schedule": ({"denoise": 2 * 4, "commit": 2}, {"denoise": 2 * 4, "commit": 3}),
    # random decides before drafting: p=0 gives every block to the target, the drafter never runs
    "random-p0": ({"denoise": 4 * 4, "commit": 3}, {}),
    # p=1 keeps every draft after the forced block 0: like first_block_only
    "random-p1": ({"denoise": 4}, {"denoise": 3 * 4, "commit": 3}),
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", sorted(CALLS))
def test_model_calls_per_mode_by_hand(case, workers):
    """Seeded bug caught: two workers speculating (the target regenerating every drafted block beside its
    verification) in a mode that never rejects a draft after drafting it: the same video with up to 4x the
    target's calls. Only sdvg (and schedule with its veto) judge a draft after it is made."""
    mode, _, p = case.partition("-p")
    opts = SDVGOptions(mode=mode, schedule_every=2, random_accept_prob=float(p) if p else 0.73)
    pipe = tiny_pipeline(tau=0.0)
    result = pipe.generate(prompt_embeds(1), prompt=PROMPT, num_frames=45, width=WIDTH, height=HEIGHT, seed=5,
                           options=opts, workers=workers)
    target, drafter = CALLS[case]
    assert dict(pipe.target.calls) == target and dict(pipe.drafter.calls) == drafter
    assert result.report["model_calls"] == {"drafter": drafter, "target": target}
    assert result.report["schedule"]["speculative_target_blocks"] == 0
