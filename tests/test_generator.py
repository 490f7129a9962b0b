"""Sampling, noise determinism and both context schemes through CausalGenerator."""

import math

import pytest
import torch

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.models.causal_wan import block_causal_mask
from sdvg_engine.sampling import KREA_SCHEDULE, SELF_FORCING_SCHEDULE, SeededNoise, TensorNoise, shifted_sigma_table
from wan_fixtures import PoolingAnchorEncoder, text_context, tiny_wan

H, W = 4, 6


@pytest.fixture(scope="module")
def model():
    return tiny_wan(seed=1)


def _run(gen, noise, num_blocks):
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=num_blocks)
    blocks = []
    for b in range(num_blocks):
        latents = gen.generate_block(b, noise).latents
        pixels = torch.rand(1, 3, 9 if b == 0 else 12, 8 * H, 8 * W) * 2 - 1
        gen.commit_block(b, latents, pixels)
        blocks.append(latents)
    return torch.cat(blocks, dim=2)


def test_schedules_match_the_references():
    assert SELF_FORCING_SCHEDULE.timesteps == pytest.approx((1000.0, 937.5, 833.3333333, 625.0))
    assert SELF_FORCING_SCHEDULE.sigmas == pytest.approx((1.0, 0.9375, 0.8333333, 0.625))
    assert KREA_SCHEDULE.num_steps == 5 and KREA_SCHEDULE.timesteps[-1] == 0.0
    assert KREA_SCHEDULE.sigmas[-1] == pytest.approx(0.00498, abs=1e-5)  # nearest table entry, not 0
    table = shifted_sigma_table()
    assert table.shape == (1000,) and table[0] == 1.0


def test_seeded_noise_is_keyed_not_sequential():
    a, b = SeededNoise(42), SeededNoise(42)
    shape = (1, 16, 3, H, W)
    first = a.initial(3, shape)
    a.step(0, 0, shape), a.step(5, 2, shape)  # other draws in between change nothing
    assert torch.equal(first, b.initial(3, shape))
    assert not torch.equal(a.initial(3, shape), a.initial(4, shape))
    assert not torch.equal(a.step(3, 0, shape), a.step(3, 1, shape))
    assert not torch.equal(a.initial(3, shape), SeededNoise(43).initial(3, shape))


def test_same_seed_bit_identical_and_call_counts(model):
    gen = CausalGenerator(model, schedule="self_forcing", context=GlobalCache(max_frames=21), name="drafter")
    first = _run(gen, SeededNoise(7), 3)
    # 4 denoising calls per block; commits run lazily before the next block (none after the last).
    assert gen.calls == {"denoise": 12, "commit": 2}
    second = _run(gen, SeededNoise(7), 3)
    assert torch.equal(first, second)
    assert not torch.equal(first, _run(gen, SeededNoise(8), 3))


def test_regenerated_block_reproduces_first_attempt(model):
    gen = CausalGenerator(model, context=GlobalCache())
    noise = SeededNoise(3)
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=3)
    b0 = gen.generate_block(0, noise).latents
    gen.commit_block(0, b0)
    attempt1 = gen.generate_block(1, noise).latents
    attempt2 = gen.generate_block(1, noise).latents  # e.g. after a rejection: same slots, same noise
    assert torch.equal(attempt1, attempt2)


def test_global_cache_generation_equals_full_sequence_semantics(model):
    """Every step of block b sees exactly the clean committed frames of blocks < b (checked by a
    reference that recomputes the whole prefix with a block-causal mask at every call)."""
    noise = SeededNoise(5)
    gen = CausalGenerator(model, context=GlobalCache())
    cached = _run(gen, noise, 3)

    text_kv = model.encode_text(text_context())
    tpf = model.tokens_per_frame(H, W)
    sched = SELF_FORCING_SCHEDULE
    clean = []
    for b in range(3):
        shape = (1, 16, 3, H, W)
        x = noise.initial(b, shape)
        for k, (t, s) in enumerate(zip(sched.timesteps, sched.sigmas)):
            seq = torch.cat(clean + [x], dim=2)
            times = torch.cat([torch.zeros(1, 3 * b), torch.full((1, 3), t)], dim=1)
            flow = model.forward_block(seq, times, text_kv, attn_mask=block_causal_mask(3 * b + 3, 3, tpf))[:, :, -3:]
            x0 = x - s * flow
            if k + 1 < sched.num_steps:
                x = (1 - sched.sigmas[k + 1]) * x0 + sched.sigmas[k + 1] * noise.step(b, k, shape)
        clean.append(x0)
    assert (cached - torch.cat(clean, dim=2)).abs().max().item() <= 1e-4


def test_global_cache_length_limit_is_explicit(model):
    gen = CausalGenerator(model, context=GlobalCache(max_frames=21), name="drafter")
    with pytest.raises(ValueError, match=r"drafter: .*21 latent frames \(81 video frames\).*recompute"):
        gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=8)


def test_recompute_window_rebuilds_from_anchor_and_last_frames(model):
    encoder = PoolingAnchorEncoder()
    gen = CausalGenerator(model, schedule="krea", context=RecomputeWindow(3, anchor_encoder=encoder), name="target")
    latents = _run(gen, SeededNoise(9), 10)  # 30 latent frames: beyond the 21-frame global limit
    assert latents.shape == (1, 16, 30, H, W)
    assert gen.kv_cache.capacity_frames == 6  # positions stay bounded
    assert gen.calls == {"denoise": 50, "recompute": 9}
    assert encoder.calls == 8  # blocks 2..9 re-encode the anchor


def test_recompute_window_matches_manual_context(model):
    """Block 2 under Krea's scheme == a fresh forward over [anchor, f4, f5] + block at positions 0..5."""
    encoder = PoolingAnchorEncoder()
    gen = CausalGenerator(model, schedule="krea", context=RecomputeWindow(3, attention_bias=0.3, anchor_encoder=encoder))
    noise = SeededNoise(2)
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=3)
    pixels = []
    committed = []
    for b in range(2):
        lat = gen.generate_block(b, noise).latents
        px = torch.rand(1, 3, 9 if b == 0 else 12, 8 * H, 8 * W, generator=torch.Generator().manual_seed(b)) * 2 - 1
        gen.commit_block(b, lat, px)
        pixels.append(px)
        committed.append(lat)
    out = gen.generate_block(2, noise).latents

    all_px = torch.cat(pixels, dim=2)
    anchor = encoder.encode_frame(all_px[:, :, -9])
    context = torch.cat([anchor, committed[1][:, :, 1:]], dim=2)
    text_kv = model.encode_text(text_context())
    cache = model.new_kv_cache(1, H, W, 6)
    model.forward_block(context, torch.zeros(1, 3), text_kv, cache, 0)
    sched = KREA_SCHEDULE
    x = noise.initial(2, (1, 16, 3, H, W))
    for k, (t, s) in enumerate(zip(sched.timesteps, sched.sigmas)):
        flow = model.forward_block(x, torch.full((1, 3), t), text_kv, cache, 3, cache_bias=((1, 3), math.log(0.3)))
        x0 = x - s * flow
        if k + 1 < sched.num_steps:
            x = (1 - sched.sigmas[k + 1]) * x0 + sched.sigmas[k + 1] * noise.step(2, k, (1, 16, 3, H, W))
    assert (out - x0).abs().max().item() <= 1e-5


def test_kv_cache_is_reused_across_runs(model):
    gen = CausalGenerator(model, context=GlobalCache())
    _run(gen, SeededNoise(1), 2)
    ptr, nbytes = gen.kv_cache.keys.data_ptr(), gen.kv_cache_bytes
    assert nbytes == 2 * 2 * 1 * 2 * 21 * model.tokens_per_frame(H, W) * 128 * 4
    _run(gen, SeededNoise(2), 2)
    assert gen.kv_cache.keys.data_ptr() == ptr and gen.kv_cache_bytes == nbytes


def test_explicit_noise_tensors(model):
    video_noise = SeededNoise(11)
    full = torch.cat([video_noise.initial(b, (1, 16, 3, H, W)) for b in range(2)], dim=2)
    gen = CausalGenerator(model, context=GlobalCache())
    a = _run(gen, video_noise, 2)
    b = _run(gen, TensorNoise(full, 3, fallback=SeededNoise(11)), 2)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no block 2"):
        TensorNoise(full, 3).initial(2, (1, 16, 3, H, W))
    # Every draw given explicitly: the same video as the seeded source; a missing draw is an error, not seed 0.
    steps = {(blk, k): video_noise.step(blk, k, (1, 16, 3, H, W)) for blk in range(2) for k in range(3)}
    assert torch.equal(_run(gen, TensorNoise(full, 3, steps=steps), 2), a)
    del steps[(1, 2)]
    with pytest.raises(ValueError, match=r"no re-noising draw for block 1, step 2 .*fallback=SeededNoise"):
        _run(gen, TensorNoise(full, 3, steps=steps), 2)


def test_auto_schedule_follows_the_weights_not_the_scheme(tmp_path):
    from sdvg_engine.loaders import load_generator
    from sdvg_engine.models.loading import save_checkpoint

    path = tmp_path / "tiny.safetensors"
    save_checkpoint(tiny_wan(seed=1), path)
    gen = load_generator(path, dtype="fp32", context_scheme="recompute_window")
    assert gen.context.name == "recompute_window" and gen.schedule.name == "self_forcing"
    assert load_generator(path, dtype="fp32", schedule="krea").schedule.name == "krea"


def test_noise_of_the_wrong_shape_is_named(model):
    gen = CausalGenerator(model, schedule="self_forcing", context=GlobalCache(max_frames=21))
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=1)
    good = torch.randn(1, 16, 3, H, W)
    noise = TensorNoise(good, 3, steps={(0, 0): good, (0, 1): torch.randn(1, 16, 3, H, 1), (0, 2): good})
    with pytest.raises(ValueError, match=r"noise for block 0 has shape \(1, 16, 3, 4, 1\), expected \(1, 16, 3, 4, 6\)"):
        gen.generate_block(0, noise)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generation_matches_cpu_including_hybrid_start(model):
    """The pinned, non-blocking noise upload must hand every step the same draw as on the CPU."""
    import copy

    results = []
    for device in ("cpu", "cuda"):
        gen = CausalGenerator(copy.deepcopy(model).to(device), schedule="self_forcing", context=GlobalCache(max_frames=21))
        gen.start(text_context().to(device), latent_height=H, latent_width=W, num_blocks=2)
        first = gen.generate_block(0, SeededNoise(3))
        gen.commit_block(0, first.latents)
        hybrid = gen.generate_block(1, SeededNoise(3), first_step=2, start_latents=first.states[2])
        results.append((first.latents.cpu(), hybrid.latents.cpu()))
    for cpu, gpu in zip(*results):
        assert (cpu - gpu).abs().max().item() < 1e-3
