"""The one pipeline builder (sdvg_engine.loaders.build_pipeline): each preset configures the same generators as the
hand-built pipelines it replaced, outputs are bit-identical to them, the demo and dry run use it; and the loaders
refuse bad paths and devices before anything loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdvg_engine import loaders
from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.loaders import LoadedDiT, build_pipeline, load_generator, load_pipeline
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline
from sdvg_engine.router import RewardRouter
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts

PROMPT = "a red ball rolling on grass"


def _hand_built(parts, preset, tau=0.0):
    """The pipelines as the toy demo and the dry run built them by hand before the builder (one per preset)."""
    if preset == "native":
        drafter = CausalGenerator(parts["drafter"], schedule="self_forcing", context=GlobalCache(21))
        target = CausalGenerator(parts["target"], schedule="krea", context=RecomputeWindow(3))
    else:
        drafter = CausalGenerator(parts["drafter"], schedule="krea", context=RecomputeWindow(3))
        target = CausalGenerator(parts["target"], schedule="krea", context=RecomputeWindow(3))
    return SpeculativePipeline(drafter, target, parts["vae"], RewardRouter(parts["scorer"], tau=tau))


def _built(parts, preset, tau=0.0, **kw):
    # the dry run's checkpoints: a Self-Forcing drafter (global cache, 4 calls) and a Krea target (window, 5 calls)
    return build_pipeline(LoadedDiT(parts["drafter"], "global_cache", "self_forcing"),
                          LoadedDiT(parts["target"], "recompute_window", "krea"), parts["vae"],
                          RewardRouter(parts["scorer"], tau=tau), preset=preset, **kw)


@pytest.mark.parametrize("preset", ["reference", "native"])
def test_builder_output_is_bit_identical_to_the_hand_built_pipeline(preset):
    parts = shared_parts()
    outputs = []
    for pipe in (_hand_built(parts, preset), _built(parts, preset)):
        result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=21, width=WIDTH, height=HEIGHT, seed=5,
                               options=SDVGOptions(mode="sdvg"), workers=1)
        outputs.append((result.frames, result.report["decisions"]))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert outputs[0][1] == outputs[1][1]


def test_builder_applies_the_preset_and_records_where_each_setting_came_from():
    parts = shared_parts()
    ref = _built(parts, "reference", workers=2)
    assert ref.preset == "reference" and ref.workers == 2 and ref.memo is None
    for gen in (ref.drafter, ref.target):
        assert (gen.context.name, gen.schedule.name) == ("recompute_window", "krea")
        assert gen.settings_source == {"preset": "reference", "context_scheme": "preset", "schedule": "preset"}
        assert gen.context.anchor_encoder is parts["vae"]  # the pipeline's VAE re-encodes the anchor
    native = _built(parts, "native", target_schedule="self_forcing")
    assert (native.drafter.context.name, native.drafter.schedule.name) == ("global_cache", "self_forcing")
    assert native.drafter.context.max_frames == 21
    assert native.drafter.settings_source == {"preset": "native", "context_scheme": "checkpoint",
                                              "schedule": "checkpoint"}
    assert (native.target.context.name, native.target.schedule.name) == ("recompute_window", "self_forcing")
    assert native.target.settings_source["schedule"] == "explicit"
    # fresh generators every time: two pipelines of the same loaded models share no run state
    again = _built(parts, "native")
    assert again.drafter is not native.drafter and again.drafter.model is native.drafter.model
    with pytest.raises(ValueError, match="preset must be one of"):
        _built(parts, "paper")
    with pytest.raises(ValueError, match="attention_bias=0.5 only applies to the recompute-window"):
        _built(parts, "native", drafter_attention_bias=0.5)


def test_the_toy_demo_and_the_dry_run_build_through_the_builder(monkeypatch):
    from sdvg_engine import dry_run
    from sdvg_engine.toy import clips, demo

    calls = []
    real = loaders.build_pipeline

    def spy(*args, **kwargs):
        calls.append(kwargs["preset"])
        return real(*args, **kwargs)

    monkeypatch.setattr(clips, "build", spy)
    monkeypatch.setattr(dry_run, "build_pipeline", spy)
    parts = shared_parts()

    class Toy:
        drafter, target, vae, scorer = parts["drafter"], parts["target"], parts["vae"], parts["scorer"]

    pipe = demo.build_pipeline(Toy, preset="reference", workers=2)
    assert calls == ["reference"] and pipe.workers == 2 and pipe.target.context.name == "recompute_window"
    stack = type("Stack", (), {"drafter": parts["drafter"], "target": parts["target"], "vae": parts["vae"]})
    pipe = dry_run.pipeline_for(stack, "native", None)
    assert calls == ["reference", "native"]
    assert (pipe.drafter.context.name, pipe.target.context.name) == ("global_cache", "recompute_window")
    assert (pipe.drafter.schedule.name, pipe.target.schedule.name) == ("self_forcing", "krea")


# ------------------------------------------------------------------------------------------------ bad input
def _no_load(monkeypatch):
    """Make any checkpoint read fail loudly: the checks must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loaders, "load_causal_wan", refuse)


@pytest.mark.parametrize("kwargs, message", [
    (dict(path="x.safetensors", device="bogus"), r"device='bogus' is not a device; use 'cpu', 'cuda' or 'cuda:N'"),
    (dict(path="x.safetensors", device="cuda"), r"device='cuda', but this PyTorch sees no CUDA GPU; use 'cpu'"),
    (dict(path=None), r"path must be the path of a checkpoint file \(a str or pathlib.Path\), got None; pass e\.g\. "
                      r"path='models/drafter.safetensors'"),
], ids=["device-bogus", "device-cuda-without-gpu", "path-none"])
def test_load_generator_refuses_bad_input_before_loading(monkeypatch, kwargs, message):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    _no_load(monkeypatch)
    path = kwargs.pop("path")
    with pytest.raises(ValueError, match=message):
        load_generator(path, name="drafter", **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(drafter=None), r"drafter must be the path of a checkpoint file .*got None"),
    (dict(vae=3), r"vae must be the path of a Wan2.1 VAE file or folder .*got 3"),
    (dict(device="bogus"), r"device='bogus' is not a device"),
    (dict(drafter_device="gpu0"), r"drafter_device='gpu0' is not a device"),
    (dict(offload="all"), r"offload must be one of \('none', 'target', 'both'\).*got 'all'"),
], ids=["drafter-none", "vae-int", "device-bogus", "drafter-device-bogus", "offload-all"])
def test_load_pipeline_refuses_bad_input_before_loading(monkeypatch, kwargs, message):
    _no_load(monkeypatch)
    monkeypatch.setattr("sdvg_engine.vae.load_wan_vae", lambda *a, **k: pytest.fail("the VAE loaded first"))
    args = {**dict(drafter="d.safetensors", target="t.safetensors", vae="vae.safetensors"), **kwargs}
    with pytest.raises(ValueError, match=message):
        load_pipeline(**args)


# ------------------------------------------------------------------------------------------------ one video writer
def test_the_toy_demo_writes_its_videos_through_video_io(tmp_path, monkeypatch):
    """The demo's clips go through sdvg_engine.video_io.write_video (the CLI's writer): a lossless WebP whose pixels
    are the frames enlarged 4x, exactly."""
    from PIL import Image, ImageSequence

    from sdvg_engine import video_io
    from sdvg_engine.toy import demo

    calls = []
    real = video_io.write_video
    monkeypatch.setattr(video_io, "write_video", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(video_io, "have_pyav", lambda: False)  # WebP only: no H.264 encoder needed here
    frames = torch.rand(5, 8, 6, 3, generator=torch.Generator().manual_seed(0))
    written = demo.write_video(frames, tmp_path / "clip", scale=4, fps=12)
    assert written == [str(tmp_path / "clip.webp")] and calls == [{"scale": 4, "lossless": True}]
    with Image.open(written[0]) as image:
        read = [torch.tensor(np.array(f.convert("RGB"))) for f in ImageSequence.Iterator(image)]
    expected = torch.from_numpy(video_io.to_uint8(frames)).repeat_interleave(4, 1).repeat_interleave(4, 2)
    assert torch.equal(torch.stack(read), expected)
    with pytest.raises(ValueError, match="scale must be a whole number >= 1, got 0"):
        video_io.write_video(frames, tmp_path / "bad.webp", scale=0)


def test_load_pipeline_finds_every_missing_or_wrong_file_before_the_dits_load(tmp_path, monkeypatch):
    """A missing target, VAE or reward, or a DiT given as the reward, is refused before any DiT loads (a 14B takes
    minutes): every path is checked first, and the reward (whose file kind is known only once read) loads first."""
    import sdvg_engine.loaders as loaders
    from sdvg_engine import load_pipeline, load_wan_vae

    opened = []
    real = loaders.load_dit
    monkeypatch.setattr(loaders, "load_dit", lambda path, **kw: (opened.append(path), real(path, **kw))[1])
    drafter = tmp_path / "drafter.safetensors"
    drafter.write_bytes(b"")  # never read: every case fails earlier
    for missing in ("target", "vae", "reward"):
        paths = {"drafter": drafter, "target": drafter, "vae": drafter, "reward": drafter}
        paths[missing] = tmp_path / f"no_{missing}.safetensors"
        with pytest.raises(FileNotFoundError, match=f"{missing}: no such file or folder: .*no_{missing}"):
            load_pipeline(**paths)
    assert opened == []
    with pytest.raises(ValueError, match="path must be the path of a Wan2.1 VAE file or folder"):
        load_wan_vae(None)
