"""Presets: the paper's configuration ("reference": both models on the recompute window with the 5-call list) and
each model as distilled ("native"), on tiny real checkpoints."""

import math

import pytest
import torch

from sdvg_engine import load_generator
from sdvg_engine.loaders import load_pipeline
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.sampling import KREA_SCHEDULE, SELF_FORCING_SCHEDULE
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, write_checkpoint_files

PROMPT = "a red ball rolling on grass"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("preset_files"))


def pipeline(files, preset, tau=0.0, **kw):
    return load_pipeline(drafter=files / "drafter.safetensors", target=files / "target.safetensors", vae=files / "vae",
                         reward=files / "ImageReward.safetensors", preset=preset, dtype="float32",
                         router_options={"tau": tau}, **kw)


def generate(pipe, frames=45, mode="sdvg", seed=3):
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=frames, width=WIDTH, height=HEIGHT, seed=seed,
                         options=SDVGOptions(mode=mode))


def test_reference_and_native_settings_and_explicit_overrides(files):
    ref = pipeline(files, "reference")
    for gen in (ref.drafter, ref.target):
        assert gen.context.name == "recompute_window" and gen.context.context_frames == 3
        assert gen.schedule.timesteps == KREA_SCHEDULE.timesteps
        assert gen.settings_source == {"preset": "reference", "context_scheme": "preset", "schedule": "preset"}
    assert KREA_SCHEDULE.timesteps[:4] == pytest.approx((1000.0, 937.5, 833.3333, 625.0), abs=1e-3)
    assert KREA_SCHEDULE.timesteps[4] == 0.0
    native = pipeline(files, "native")
    for gen in (native.drafter, native.target):  # the tiny files say global_cache; a 1.3B-wide model gets 4 calls
        assert gen.context.name == "global_cache" and gen.schedule.timesteps == SELF_FORCING_SCHEDULE.timesteps
        assert gen.settings_source["context_scheme"] == "checkpoint"
    mixed = pipeline(files, "reference", drafter_context="global_cache", drafter_schedule="self_forcing")
    assert mixed.drafter.context.name == "global_cache" and mixed.drafter.schedule.name == "self_forcing"
    assert mixed.drafter.settings_source == {"preset": "reference", "context_scheme": "explicit", "schedule": "explicit"}
    assert mixed.target.context.name == "recompute_window"
    # Without a preset, load_generator keeps its checkpoint-native meaning of "auto" (compatible with earlier code).
    plain = load_generator(files / "drafter.safetensors", name="drafter", dtype="float32")
    assert plain.context.name == "global_cache" and plain.settings_source["preset"] is None
    with pytest.raises(ValueError, match="preset must be one of"):
        pipeline(files, "paper")
    with pytest.raises(ValueError, match="'drafter' or a 'target'"):
        load_generator(files / "drafter.safetensors", name="model", preset="reference")
    with pytest.raises(ValueError, match="attention_bias=0.3 only applies to the recompute-window"):
        load_generator(files / "drafter.safetensors", name="drafter", preset="native", attention_bias=0.3)


def _record_calls(pipe):
    calls = []
    for gen in (pipe.drafter, pipe.target):
        original = gen.run_model

        def run_model(kind, latents, timestep, start_frame, cache_bias=None, _gen=gen, _orig=original):
            calls.append((_gen.name, kind, latents.detach().clone(), float(timestep), start_frame))
            return _orig(kind, latents, timestep, start_frame, cache_bias)

        gen.run_model = run_model
    return calls


def test_reference_rebuilds_both_models_from_anchor_and_last_two_latents_before_every_block(files):
    pipe = pipeline(files, "reference", tau=math.inf)  # every draft rejected: both models work on every block
    calls = _record_calls(pipe)
    result = generate(pipe, frames=57)  # 5 blocks
    assert result.report["settings"]["preset"] == "reference"
    latents = result.latents
    for name in ("drafter", "target"):
        mine = [c for c in calls if c[0] == name]
        rebuilds = [c for c in mine if c[1] == "recompute"]
        denoise = [c for c in mine if c[1] == "denoise"]
        first_block = 0 if name == "target" else 1
        assert len(denoise) == 5 * (5 - first_block)  # the 5-call list, for the drafter too
        assert [c[3] for c in denoise[:5]] == list(KREA_SCHEDULE.timesteps)
        assert len(rebuilds) == 4  # before blocks 1..4, one t=0 pass over 3 context frames at position 0
        for b, call in zip(range(1, 5), rebuilds):
            _, _, context, timestep, start = call
            assert timestep == 0.0 and start == 0 and context.shape[2] == 3
            # The last two context frames are exactly the last two committed latent frames.
            assert torch.equal(context[:, :, 1:], latents[:, :, 3 * b - 2 : 3 * b].to(context.dtype))
            if b == 1:
                assert torch.equal(context[:, :, :1], latents[:, :, 0:1].to(context.dtype))
            else:
                # The anchor: the VAE re-encode of the first of the 9 pixel frames that cover the kept latents.
                first_pixel = 9 + 12 * (b - 1) - 9
                pixels = result.frames[first_pixel].permute(2, 0, 1)[None] * 2 - 1
                anchor = pipe.vae.encode_frame(pixels)
                assert torch.allclose(context[:, :, :1], anchor.to(context.dtype), atol=1e-4)
                assert not torch.equal(context[:, :, :1], latents[:, :, 3 * b - 3 : 3 * b - 2].to(context.dtype))


def test_reference_runs_105_frames_and_beyond(files):
    pipe = pipeline(files, "reference", tau=-math.inf)
    result = generate(pipe, frames=105)
    assert result.frames.shape[0] == 105 and len(result.blocks) == 9
    assert result.report["model_calls"]["drafter"]["denoise"] == 5 * 8
    with pytest.raises(ValueError, match="global KV cache holds 21 latent frames"):
        generate(pipeline(files, "native"), frames=105)


def test_tau_plus_inf_under_the_preset_is_target_only_under_the_preset(files):
    pipe = pipeline(files, "reference", tau=math.inf)
    sdvg, target_only = generate(pipe), generate(pipe, mode="target_only")
    assert torch.equal(sdvg.frames, target_only.frames) and torch.equal(sdvg.latents, target_only.latents)
    assert [b.source for b in sdvg.blocks] == ["target"] * 4


def test_presets_give_different_videos(files):
    assert not torch.equal(generate(pipeline(files, "reference")).latents, generate(pipeline(files, "native")).latents)
