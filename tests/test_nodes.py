"""The ComfyUI nodes' logic on tiny real models, through the same functions the V3 nodes call (no ComfyUI).

``nodes/comfy_nodes.py`` only forwards widget values to ``nodes.logic`` with a ComfyUI ``Services``; here
the default ``Services`` (plain PyTorch on the CPU) stands in for it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`

from nodes import logic, schema  # noqa: E402
from node_fixtures import (  # noqa: E402
    DRAFTER_FILE, EMBEDDINGS_FILE, PROMPTS, REWARD_FILE, TARGET_FILE, FakeComfyVAE, write_reward_with_heads_metadata,
    write_tiny_models,
)
from sdvg_engine.context import make_context_scheme  # noqa: E402
from sdvg_engine.generator import CausalGenerator  # noqa: E402
from sdvg_engine.models.loading import Fp8Linear  # noqa: E402
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline  # noqa: E402
from sdvg_engine.router import RewardRouter  # noqa: E402
from sdvg_engine.vae import StreamingWanVAE  # noqa: E402

W, H = 48, 32
FRAMES = 45  # 4 blocks
# ComfyUI's latent_formats.Wan21 (comfy/latent_formats.py): LATENT holds raw VAE latents z = x * std + mean.
WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


class RecordingServices(logic.Services):
    def __init__(self, folders):
        super().__init__(folders)
        self.progress_calls, self.interrupt_checks, self.loaded = [], 0, []
        self.interrupt_after = None

    def check_interrupt(self):
        self.interrupt_checks += 1
        if self.interrupt_after is not None and self.interrupt_checks > self.interrupt_after:
            raise KeyboardInterrupt("interrupted by the test")

    def progress(self, value, total, preview=None):
        self.progress_calls.append((value, total, None if preview is None else preview.size))

    def load(self, patchers):
        self.loaded.append(list(patchers))
        super().load(patchers)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_tiny_models(root)
    return root


@pytest.fixture(scope="module")
def folders(models_dir):
    return {name: [str(models_dir / name)] for name in ("diffusion_models", "sdvg_reward", "sdvg_embeddings")}


@pytest.fixture
def services(folders):
    return RecordingServices(folders)


@pytest.fixture(scope="module")
def stack(folders):
    svc = logic.Services(folders)
    drafter = logic.load_model_node(DRAFTER_FILE, "fp32", "auto", "auto", role="drafter", services=svc)
    target = logic.load_model_node(TARGET_FILE, "fp32", "cpu", "auto", role="target", services=svc)
    positive, prompt = logic.load_embeddings_node(EMBEDDINGS_FILE, 0, services=svc)
    return dict(drafter=drafter, target=target, positive=positive, prompt=prompt, vae=FakeComfyVAE())


def sample(stack, router, services, **kw):
    args = dict(drafter=stack["drafter"], target=stack["target"], router=router, positive=stack["positive"],
                vae=stack["vae"], reward_prompt=stack["prompt"], width=W, height=H, length=FRAMES, seed=7,
                services=services)
    args.update(kw)
    return logic.run_sampler(**args)


@pytest.fixture(scope="module")
def draft_scores(stack, folders):
    svc = logic.Services(folders)
    out = sample(stack, logic.build_router(REWARD_FILE, -math.inf, "min", "center", 0.0, services=svc), svc)
    scores = json.loads(out.report)["draft_scores"][1:]
    assert len(set(scores)) == 3
    return scores


# ------------------------------------------------------------------------------------------------------ sampler
def test_sampler_end_to_end(stack, services, draft_scores):
    tau = sorted(draft_scores)[1]  # rejects the worst draft, keeps the best
    router = logic.build_router(REWARD_FILE, tau, "min", "center", 0.0, services=services)
    out = sample(stack, router, services)

    assert out.frames.shape == (FRAMES, H, W, 3) and out.frames.dtype == torch.float32
    assert 0.0 <= out.frames.min() and out.frames.max() <= 1.0
    report = json.loads(out.report)
    assert report["decisions"][0] == "target" and {"draft", "target"} <= set(report["decisions"][1:])
    # MASK [T, H, W]: constant per block, 1 for kept drafts and 0 for target blocks.
    assert out.mask.shape == (FRAMES, H, W)
    for block in report["blocks"]:
        first, end = block["video_frames"]
        assert out.mask[first:end].eq(1.0 if block["source"] == "draft" else 0.0).all()
    # LATENT in ComfyUI's Wan21 space (raw VAE latents) with Wan's 1 + 4k frame rule.
    samples = out.latent["samples"]
    assert samples.shape == (1, 16, (FRAMES - 1) // 4 + 1, H // 8, W // 8)
    mean, std = torch.tensor(WAN21_MEAN).view(1, -1, 1, 1, 1), torch.tensor(WAN21_STD).view(1, -1, 1, 1, 1)
    torch.testing.assert_close((samples - mean) / std, out.result.latents, rtol=1e-4, atol=1e-4)
    assert out.fps == 16.0
    # Report: the engine's plus the pack's additions; strict JSON.
    assert report["settings"]["tau"] == pytest.approx(tau) and report["settings"]["prompt"] == PROMPTS[0]
    assert report["models"]["drafter"]["file"] == DRAFTER_FILE and report["models"]["reward"] == REWARD_FILE
    assert report["output"] == {"frames": FRAMES, "height": H, "width": W, "fps": 16.0, "latent_shape": list(samples.shape)}
    json.loads(out.report, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    # Score plot: one RGB image with kept (green) and rejected (red) markers.
    assert out.plot.shape == (1, 360, 640, 3) and 0 <= out.plot.min() and out.plot.max() <= 1
    pixels = (out.plot[0] * 255).round().to(torch.int16).view(-1, 3)
    assert ((pixels - torch.tensor([30, 160, 60])).abs().sum(1) == 0).any()
    assert ((pixels - torch.tensor([210, 40, 40])).abs().sum(1) == 0).any()
    # Progress: one update per block (after a 0), each with a preview of the newest frame.
    assert services.progress_calls == [(0, 4, None)] + [(i, 4, (W, H)) for i in range(1, 5)]
    assert services.interrupt_checks > 20  # before every model, VAE and reward call
    assert len(services.loaded) == 1 and len(services.loaded[0]) == 4  # drafter, target, VAE, reward
    # The summary counts what the report's blocks say (one outcome, read from the run, not either of two).
    drafted = [blk for blk in report["blocks"] if blk["drafted"]]
    kept = sum(blk["source"] == "draft" for blk in drafted)
    assert len(drafted) == 3 and f"kept {kept}/3 drafts" in logic.sampler_summary(out.report)


def test_nothing_cached_is_mutated(stack, services):
    router = logic.build_router(REWARD_FILE, 0.3, "mean", "full", 0.0, services=services)
    before = {k: v.clone() for k, v in stack["drafter"].model.state_dict().items()}
    positive = stack["positive"][0][0].clone()
    conversions = stack["vae"].first_stage_model.calls
    a = sample(stack, router, services, length=21)
    b = sample(stack, router, services, length=21)
    assert torch.equal(a.frames, b.frames) and torch.equal(a.latent["samples"], b.latent["samples"])
    assert (router.tau, router.aggregation, router.crop) == (0.3, "mean", "full")
    assert torch.equal(stack["positive"][0][0], positive)
    assert all(torch.equal(v, before[k]) for k, v in stack["drafter"].model.state_dict().items())
    # The VAE is converted at most once per VAE object, whatever the number of runs.
    assert stack["vae"].first_stage_model.calls - conversions <= 1


def test_changing_tau_reuses_the_loaded_reward_model(services):
    a = logic.build_router(REWARD_FILE, -0.7, "min", "center", 0.0, services=services)
    b = logic.build_router(REWARD_FILE, 1.5, "min", "center", 0.0, services=services)
    assert a.scorer is b.scorer and a.patcher is b.patcher
    assert (a.tau, b.tau) == (-0.7, 1.5)
    assert (a.scorer.config.vision_heads, a.scorer.config.text_heads) == (16, 12)  # ImageReward-v1.0 defaults
    with pytest.raises(ValueError, match="aggregation"):
        logic.build_router(REWARD_FILE, 0.0, "max", "center", 0.0, services=services)


@pytest.mark.parametrize("mode, expected", [
    ("draft_only", ["draft", "draft"]),
    ("target_only", ["target", "target"]),
    ("first_block_only", ["target", "draft"]),
])
def test_modes(stack, services, mode, expected):
    # ComfyUI evaluates the lazy model inputs a mode needs only: the unused model arrives as None.
    unused = {"draft_only": "target", "target_only": "drafter"}.get(mode)
    assert logic.needed_inputs(mode) == [r for r in ("drafter", "target") if r != unused]
    out = sample(stack, None, services, length=21, mode=mode, **({unused: None} if unused else {}))
    report = json.loads(out.report)
    assert report["decisions"] == expected
    spans = [b["video_frames"] for b in report["blocks"]]
    for (first, end), source in zip(spans, expected):
        assert out.mask[first:end].eq(1.0 if source == "draft" else 0.0).all()
    if mode == "target_only":
        assert report["model_calls"]["drafter"] == {} and report["models"]["drafter"] is None
    if mode == "draft_only":
        assert report["model_calls"]["target"] == {} and report["models"]["target"] is None


def test_random_mode_and_loop_options(stack, services):
    out = sample(stack, None, services, mode="random", random_accept_prob=1.0, length=21)
    assert json.loads(out.report)["decisions"] == ["target", "draft"]
    # A connected router with a temporal weight is not handed to the engine outside mode sdvg (the engine would
    # score committed frames without a prompt there).
    weighted = logic.build_router(REWARD_FILE, 0.0, "min", "center", 0.5, services=services)
    assert json.loads(sample(stack, weighted, services, mode="target_only", length=21).report)["decisions"] == ["target"] * 2
    router = logic.build_router(REWARD_FILE, math.inf, "min", "center", 0.0, services=services)
    # preset "native": each model as its checkpoint says (global cache, the 4-step schedule), built by hand below.
    out = sample(stack, router, services, length=21, refine_from_step=2, cascade=True, preset="native")
    report = json.loads(out.report)
    assert report["settings"]["refine_from_step"] == 2 and report["settings"]["cascade"] is True
    assert report["decisions"] == ["target", "target"]
    # The options reach the engine: the same run through the engine directly gives the same latents; the
    # target ran 4 steps for block 0 and only the last 2 for the rejected draft; cascade scored 4 of 12 frames.
    reference = _engine_run(stack, services, router, num_frames=21,
                            options=SDVGOptions(refine_from_step=2, cascade=True))
    assert torch.equal(out.result.latents, reference.latents)
    assert report["model_calls"]["target"]["denoise"] == 4 + 2
    assert report["blocks"][1]["decision"]["frames_scored"] == 4
    full = sample(stack, router, services, length=21, preset="native")
    assert json.loads(full.report)["model_calls"]["target"]["denoise"] == 4 + 4
    assert not torch.equal(full.result.latents[:, :, 3:], out.result.latents[:, :, 3:])


def _engine_run(stack, services, router, *, num_frames, options, drafter=None, target=None):
    """The same generation through the engine directly (no node logic): the reference for the node tests."""
    drafter, target = drafter or stack["drafter"], target or stack["target"]
    stream, _ = logic.streaming_vae(stack["vae"], services)

    def generator(m):  # as loaded: the loader's explicit scheme, else the checkpoint's (global cache), 4 steps
        return CausalGenerator(m.model, schedule="self_forcing", name=m.role,
                               context=make_context_scheme(m.context_scheme, max_frames=21))

    pipe = SpeculativePipeline(generator(drafter), generator(target), stream,
                               None if router is None else RewardRouter(router.scorer, tau=router.tau))
    return pipe.generate(stack["positive"][0][0], prompt=stack["prompt"], num_frames=num_frames, width=W, height=H,
                         seed=7, options=options)


def test_interrupt_propagates_and_the_next_run_works(stack, services):
    router = logic.build_router(REWARD_FILE, 0.0, "min", "center", 0.0, services=services)
    services.interrupt_after = 5
    with pytest.raises(KeyboardInterrupt):
        sample(stack, router, services, length=21)
    services.interrupt_after = None
    assert sample(stack, router, services, length=21).frames.shape[0] == 21


# ------------------------------------------------------------------------------------------------------ errors
def test_bad_conditioning_width_is_rejected(stack, services):
    clip_l = [[torch.zeros(1, 77, 768), {"pooled_output": torch.zeros(1, 768)}]]
    with pytest.raises(ValueError, match=r"768 wide.*CLIPLoader with type 'wan' and umt5_xxl"):
        sample(stack, None, services, positive=clip_l, mode="target_only", length=9)
    two = stack["positive"] + stack["positive"]
    with pytest.raises(ValueError, match="one prompt"):
        sample(stack, None, services, positive=two, mode="target_only", length=9)
    with pytest.raises(ValueError, match="CONDITIONING"):
        sample(stack, None, services, positive=torch.zeros(1, 512, 4096), mode="target_only", length=9)


def test_invalid_length_is_rejected(stack, services):
    with pytest.raises(ValueError, match=r"length: num_frames=40 .*use 33 or 45"):
        sample(stack, None, services, length=40, mode="target_only")
    # A valid 12n - 3 length beyond the global cache's 81 frames needs recompute-window models (the native preset).
    with pytest.raises(ValueError, match="recompute-window"):
        sample(stack, None, services, length=93, mode="target_only", preset="native")
    assert services.interrupt_checks == 0  # rejected before any model call
    assert logic.geometry_problem(832, 480, 81) is None
    assert "multiple of 16" in logic.geometry_problem(840, 480, 81)
    assert "length" in logic.geometry_problem(832, 480, 80)
    assert logic.geometry_problem(None, None, None) is None  # linked inputs are checked at run time


def test_a_drafter_larger_than_the_target_is_refused(stack, services):
    """The two models swapped (the 14B on the drafter input) would make every block slower than the target alone:
    refused by name before anything loads, in every mode that runs both; target_only / draft_only run one model."""
    from dataclasses import replace

    bigger = replace(stack["drafter"], info=replace(stack["drafter"].info, architecture="Wan2.1-T2V-14B",
                                                    num_parameters=14_288_901_184))
    smaller = replace(stack["target"], info=replace(stack["target"].info, architecture="Wan2.1-T2V-1.3B",
                                                    num_parameters=1_418_996_800))
    for mode in ("first_block_only", "random"):
        with pytest.raises(ValueError, match=r"the drafter \(Wan2.1-T2V-14B, 14.29B parameters\) is larger than the "
                                             r"target \(Wan2.1-T2V-1.3B, 1.42B parameters\).* Swap them"):
            sample(stack, None, services, drafter=bigger, target=smaller, mode=mode, length=9)
    assert services.loaded == []  # refused before anything loads
    out = sample(stack, None, services, drafter=bigger, target=smaller, mode="draft_only", length=9)
    assert out.frames.shape[0] == 9


def test_sdvg_mode_needs_the_prompt_text(stack, services):
    router = logic.build_router(REWARD_FILE, 0.0, "min", "center", 0.0, services=services)
    with pytest.raises(ValueError, match="reward_prompt is empty"):
        sample(stack, router, services, reward_prompt="  ", length=9)
    with pytest.raises(ValueError, match="needs a router"):
        sample(stack, None, services, length=9)
    with pytest.raises(ValueError, match="needs the target"):
        sample(stack, router, services, target=None, length=9)
    assert logic.needed_inputs("sdvg") == ["drafter", "target", "router"]
    assert logic.needed_inputs("sdvg", drafter=1, target=2, router=3) == []
    assert logic.needed_inputs("random", drafter=1) == ["target"]


# ------------------------------------------------------------------------------------------------ other nodes
def test_prompt_embeddings_node(services):
    conditioning, prompt = logic.load_embeddings_node(EMBEDDINGS_FILE, 1, services=services)
    assert prompt == PROMPTS[1]
    assert len(conditioning) == 1 and conditioning[0][1] == {"pooled_output": None}
    assert conditioning[0][0].shape == (1, 512, 4096) and conditioning[0][0].dtype == torch.float32
    assert logic.context_from_conditioning(conditioning) is conditioning[0][0]
    with pytest.raises(ValueError, match=r"holds 2 prompt\(s\)"):
        logic.load_embeddings_node(EMBEDDINGS_FILE, 2, services=services)
    with pytest.raises(FileNotFoundError):
        logic.load_embeddings_node("missing.safetensors", 0, services=services)


def test_loader_options(services):
    target = logic.load_model_node(TARGET_FILE, "fp8", "cpu", "recompute_window", role="target", services=services)
    assert any(isinstance(m, Fp8Linear) for m in target.model.modules())
    # The schedule follows the weights (only the 14B is Krea), not the context scheme.
    assert (target.context_scheme, target.schedule, target.dtype) == ("recompute_window", "self_forcing", "fp8")
    assert target.new_generator() is not target.new_generator()  # per-run generators
    with pytest.raises(ValueError, match="does not exist"):
        logic.resolve_devices("cuda:7", services)
    with pytest.raises(ValueError, match="context_scheme"):
        logic.load_model_node(TARGET_FILE, "bf16", "cpu", "sliding", role="target", services=services)


def test_long_video_with_recompute_window_models(services, stack):
    drafter = logic.load_model_node(DRAFTER_FILE, "fp32", "cpu", "recompute_window", role="drafter", services=services)
    out = sample(stack, None, services, drafter=drafter, mode="draft_only", length=93, preset="native")
    assert out.frames.shape[0] == 93 and out.mask.eq(1.0).all()
    # Values: the engine run with a recompute-window drafter gives the same video ...
    reference = _engine_run(stack, services, None, num_frames=93, options=SDVGOptions(mode="draft_only"),
                            drafter=drafter, target=drafter)
    assert torch.equal(out.result.latents, reference.latents)
    # ... whose first two blocks equal the global-cache drafter's (the window still holds all of block 0),
    # and whose later blocks do not (the window forgets; the anchor is re-encoded).
    short = sample(stack, None, services, mode="draft_only", length=21, preset="native")
    assert (out.result.latents[:, :, :6] - short.result.latents).abs().max().item() <= 1e-5
    longer = sample(stack, None, services, mode="draft_only", length=45, preset="native")
    assert (out.result.latents[:, :, 6:12] - longer.result.latents[:, :, 6:12]).abs().max().item() > 1e-4


def test_vae_conversion_matches_comfy_weights(services):
    fake = FakeComfyVAE(seed=3)
    stream, patcher = logic.streaming_vae(fake, services)
    again, patcher2 = logic.streaming_vae(fake, services)
    assert again.vae is stream.vae and patcher2 is patcher and again is not stream  # cached model, fresh stream
    assert fake.first_stage_model.calls == 1
    latents = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    reference = StreamingWanVAE(fake.source)
    torch.testing.assert_close(stream.decode_block(latents), reference.decode_block(latents))
    with pytest.raises(ValueError, match="Wan2.1 VAE"):
        logic.streaming_vae(type("NotWan", (), {"first_stage_model": torch.nn.Conv2d(3, 4, 1)})(), services)


def test_reward_head_counts_from_safetensors_metadata(tmp_path, folders):
    write_reward_with_heads_metadata(tmp_path / "tiny_reward.safetensors")
    svc = logic.Services({**folders, "image_reward": [str(tmp_path)]})
    router = logic.build_router("tiny_reward.safetensors", 0.0, "min", "center", 0.0, services=svc)
    assert (router.scorer.config.vision_heads, router.scorer.config.text_heads) == (2, 2)
    assert logic.combo_options(schema.REWARD_ROUTER.input("reward_model"), svc) == [REWARD_FILE, "tiny_reward.safetensors"]


def test_combo_options(services):
    assert logic.combo_options(schema.LOAD_DRAFTER.input("ckpt_name"), services) == [TARGET_FILE, DRAFTER_FILE]
    assert logic.combo_options(schema.REWARD_ROUTER.input("reward_model"), services) == [REWARD_FILE]
    assert logic.combo_options(schema.LOAD_DRAFTER.input("device"), services)[:2] == ["auto", "cpu"]
    assert logic.combo_options(schema.SAMPLER.input("mode"), services) == list(schema.MODES)


def test_score_plot_places_markers_at_the_scores():
    """Marker colours at the positions recomputed from the documented layout (plot box ``score_view.BOX``, one
    column per block, scores and thresholds spanning the y range with 10% padding); tests/test_score_plot.py reads
    the sides of the threshold in every tau mode."""
    from sdvg_engine.score_view import BOX

    scores = {1: (-0.8, True), 2: (-1.6, False), 3: (-0.2, True)}
    blocks = [{"index": 0, "source": "target", "decision": None}]
    blocks += [{"index": i, "source": "draft" if kept else "target", "decision": {"block_score": v, "accept": kept}}
               for i, (v, kept) in scores.items()]
    tau = -1.0
    plot = logic.score_plot({"settings": {"mode": "sdvg", "tau": tau}, "blocks": blocks})
    assert plot.shape == (1, 360, 640, 3) and plot.dtype == torch.float32
    pixels = (plot[0] * 255).round().to(torch.int16)
    left, right, top, bottom = BOX
    lo, hi = -1.6, -0.2
    lo, hi = lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo)

    def at(x, y):
        return pixels[int(round(y)), int(round(x))].tolist()

    for i, (v, kept) in scores.items():
        x = left + (i + 0.5) * (right - left) / 4
        y = bottom - (v - lo) / (hi - lo) * (bottom - top)
        assert at(x, y) == ([30, 160, 60] if kept else [210, 40, 40]), (i, v)
    assert at(left + 0.5 * (right - left) / 4, bottom - 4) == [150, 150, 150]  # block 0: not scored
    y_tau = bottom - (tau - lo) / (hi - lo) * (bottom - top)
    assert at(left + 1.25 * (right - left) / 4, y_tau) == [40, 90, 220]  # block 1's threshold


def test_score_plot_edge_cases():
    empty = logic.score_plot({"settings": {"mode": "target_only", "tau": None}, "blocks": []})
    assert empty.shape == (1, 360, 640, 3)
    block = {"index": 0, "source": "target", "decision": {"block_score": None, "accept": False}}
    assert logic.score_plot({"settings": {"mode": "sdvg", "tau": "inf"}, "blocks": [block]}).shape == (1, 360, 640, 3)


# ------------------------------------------------------------------------------------- ComfyUI versions (compat)
class _LiveFolderNames:
    """``folder_paths.folder_names_and_paths`` of the LTS fork (hiddenswitch 0.12.1, ``FolderNames``): an entry is
    a pair of live views of the mapping's storage, and assigning an entry first drops the old one, then stores what
    it was given, so views of the dropped entry read empty by then."""

    def __init__(self):
        self.paths, self.exts = {}, {}

    def __contains__(self, name):
        return name in self.paths

    def __getitem__(self, name):
        self.paths.setdefault(name, [])
        self.exts.setdefault(name, set())
        return _PathsView(self, name), _ExtensionsView(self, name)

    def __setitem__(self, name, value):
        paths, extensions = value
        self.paths.pop(name, None)
        self.exts.pop(name, None)
        self.paths[name], self.exts[name] = list(paths), set(extensions)


class _PathsView:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __iter__(self):
        return iter(list(self.owner.paths.get(self.name, [])))

    def __contains__(self, path):
        return path in self.owner.paths.get(self.name, [])

    def append(self, path):
        self.owner.paths.setdefault(self.name, []).append(path)


class _ExtensionsView(_PathsView):
    def __len__(self):
        return len(self.owner.exts.get(self.name, ()))

    def __iter__(self):
        return iter(set(self.owner.exts.get(self.name, ())))

    def update(self, extensions):
        self.owner.exts.setdefault(self.name, set()).update(extensions)

    add = update


def _folder_paths_module(mapping, models_dir):
    """A ``folder_paths`` module around ``mapping`` (a plain dict: ComfyUI 0.3.64; live views: the LTS fork), with
    0.3.64's ``add_model_folder_path`` (an existing entry's list is appended to; a new key gets no extensions)."""
    import types

    def add_model_folder_path(name, path, is_default=False):
        if name in mapping:
            paths, _ = mapping[name]
            if path not in paths:
                paths.append(path)
        else:
            mapping[name] = ([path], set())

    return types.SimpleNamespace(models_dir=str(models_dir), folder_names_and_paths=mapping,
                                 add_model_folder_path=add_model_folder_path)


@pytest.mark.parametrize("live", [False, True], ids=["comfyui-0.3.64-dict", "lts-0.12.1-live-views"])
def test_model_folders_register_on_both_comfyuis(tmp_path, live):
    from nodes import compat

    mapping = _LiveFolderNames() if live else {}
    if live:  # an extra_model_paths.yaml entry for one of the folders, as each version stores it
        mapping["sdvg_reward"][0].append("/extra/reward")
    else:
        mapping["sdvg_reward"] = (["/extra/reward"], set())
    module = _folder_paths_module(mapping, tmp_path)
    compat.register_folders_in(module)
    for name, extensions in compat.MODEL_FOLDERS.items():
        paths, known = mapping[name]
        expected = (["/extra/reward"] if name == "sdvg_reward" else []) + [str(tmp_path / name)]
        assert list(paths) == expected, name
        assert set(known) == set(extensions), name
    compat.register_folders_in(module)  # twice (a reload): nothing doubles
    assert list(mapping["sdvg"][0]) == [str(tmp_path / "sdvg")]


def _upstream_loader(module) -> tuple[list, list]:
    """ComfyUI 0.3.64 nodes.load_custom_node: a non-None NODE_CLASS_MAPPINGS is registered and loading stops."""
    mappings = getattr(module, "NODE_CLASS_MAPPINGS", None)
    if mappings is not None:
        return list(mappings), []
    if hasattr(module, "comfy_entrypoint"):
        return module.comfy_entrypoint(), []
    return [], ["Skip ... lack of NODE_CLASS_MAPPINGS or NODES_LIST"]


def _fork_loader(module) -> tuple[list, list]:
    """The LTS fork's vanilla_node_importing: mappings if present, else an error logged; the V3 entry point always."""
    mappings = getattr(module, "NODE_CLASS_MAPPINGS", None)
    nodes, errors = (list(mappings), []) if mappings is not None else ([], ["Skip ... lack of NODE_CLASS_MAPPINGS."])
    if hasattr(module, "comfy_entrypoint"):
        nodes += module.comfy_entrypoint()
    return nodes, errors


@pytest.mark.parametrize("fork", [False, True], ids=["comfyui-0.3.64", "lts-0.12.1"])
def test_the_pack_exports_what_each_loader_needs(fork):
    """The root __init__ adds an empty NODE_CLASS_MAPPINGS exactly when the loader also calls comfy_entrypoint: the
    nodes load on both and the fork logs no error; on upstream that mapping would hide every node."""
    import types

    from nodes import compat

    def find_spec(name):
        if name == "comfy.nodes.vanilla_node_importing" and not fork:
            raise ModuleNotFoundError("No module named 'comfy.nodes'")
        return object()

    chosen = compat.loader_calls_entrypoint_beside_mappings(find_spec)
    assert chosen == fork
    module = types.SimpleNamespace(comfy_entrypoint=lambda: [s.node_id for s in schema.NODES])
    if chosen:
        module.NODE_CLASS_MAPPINGS = {}
    loader = _fork_loader if fork else _upstream_loader
    assert loader(module) == ([s.node_id for s in schema.NODES], [])
    # the other choice fails on that loader
    other = types.SimpleNamespace(comfy_entrypoint=module.comfy_entrypoint)
    if not chosen:
        other.NODE_CLASS_MAPPINGS = {}
    assert loader(other) != ([s.node_id for s in schema.NODES], [])


# ----------------------------------------------------------------------------------- bad input (issue 30, nodes)
@pytest.mark.parametrize("row", ["geometry_string_width", "drafter_fp8", "device_cuda_without_gpu", "device_mps",
                                 "embedding_index_bool"])
def test_node_bad_input_is_refused_clearly(row, services):
    """Each row of issue 30's node matrix: a ValueError (or message) naming the input, the value and the fix,
    before any model loads."""
    if row == "geometry_string_width":
        problem = logic.geometry_problem("48", 32, 21)
        assert problem == "width must be a whole number, got '48' (str); e.g. width=832"
        with pytest.raises(ValueError, match=r"width must be a whole number, got '48'"):
            logic.run_sampler(drafter=None, target=None, router=None, positive=None, vae=None, width="48",
                              services=services)
        return
    if row == "embedding_index_bool":
        with pytest.raises(ValueError, match=r"index must be a whole number, got True \(bool\); pass the prompt's "
                                             r"position in the file, 0 for the first"):
            logic.load_embeddings_node(EMBEDDINGS_FILE, True, services=services)
        return
    from nodes import loaders

    loads = []
    real = loaders.load_generator
    loaders.load_generator = lambda *a, **k: loads.append(a) or real(*a, **k)
    try:
        if row == "drafter_fp8":
            with pytest.raises(ValueError, match=r"dtype of the drafter must be one of \('bf16', 'fp16', 'fp32'\), "
                                                 r"got 'fp8'; fp8 is for the target"):
                logic.load_model_node(DRAFTER_FILE, "fp8", "cpu", "auto", role="drafter", services=services)
        else:
            device = "cuda" if row == "device_cuda_without_gpu" else "mps"
            with pytest.raises(ValueError, match=rf"device must be one of \['auto', 'cpu'\] on this machine, got "
                                                 rf"'{device}'; pick 'auto'"):
                logic.load_model_node(TARGET_FILE, "bf16", device, "auto", role="target", services=services)
    finally:
        loaders.load_generator = real
    assert loads == []  # refused before any model loads


# ---------------------------------------------------------------------------------------- card size, advanced options
def test_card_choice_follows_the_memory_plan():
    from sdvg_engine.offload import plan_memory

    assert logic.card_settings("manual", "target") == {}
    for card in schema.CARDS[1:]:
        plan = plan_memory(float(card.split()[0]))
        target, drafter = logic.card_settings(card, "target"), logic.card_settings(card, "drafter")
        assert target["dtype"] == ("fp8" if plan.fp8_target else "bf16") and drafter["dtype"] == "bf16"
        assert target["kv_dtype"] == drafter["kv_dtype"] == plan.kv_dtype
        assert target["offload"] == ("blocks" if plan.offload in ("target", "both") else "none")
        assert drafter["offload"] == ("blocks" if plan.offload == "both" else "none")
        assert drafter.get("context_scheme", "auto") == plan.drafter_context and "context_scheme" not in target
    # the plan's rows, as docs/dev/memory.md states them
    assert logic.card_settings("24 GB", "target") == {"dtype": "fp8", "offload": "blocks", "kv_dtype": "fp8"}
    assert logic.card_settings("24 GB", "drafter") == {"dtype": "bf16", "offload": "none", "kv_dtype": "fp8"}
    assert logic.card_settings("16 GB", "drafter") == {"dtype": "bf16", "offload": "blocks", "kv_dtype": "fp8",
                                                       "context_scheme": "recompute_window"}
    assert logic.card_settings("48 GB", "target") == {"dtype": "fp8", "offload": "none", "kv_dtype": "auto"}
    assert logic.card_settings("80 GB", "target") == {"dtype": "bf16", "offload": "none", "kv_dtype": "auto"}
    assert logic.card_settings("24 GB", "target", on_cuda=False)["offload"] == "none"  # nothing to stream from RAM
    with pytest.raises(ValueError, match="card must be one of"):
        logic.card_settings("12 GB", "target")


def test_card_overrides_the_loader_widgets(services):
    target = logic.load_model_node(TARGET_FILE, "fp32", "cpu", "auto", role="target", services=services, card="24 GB")
    assert target.dtype == "fp8" and any(isinstance(m, Fp8Linear) for m in target.model.modules())
    assert target.describe()["kv_dtype"] == "fp8" and "offload" not in target.describe()  # CPU: not streamed
    drafter = logic.load_model_node(DRAFTER_FILE, "fp32", "cpu", "auto", role="drafter", services=services, card="16 GB")
    assert (drafter.dtype, drafter.context_scheme) == ("bf16", "recompute_window")
    manual = logic.load_model_node(DRAFTER_FILE, "fp32", "cpu", "auto", role="drafter", services=services)
    assert (manual.dtype, manual.context_scheme) == ("fp32", "global_cache")


def test_advanced_options_node_wins_over_the_sampler_widgets(stack, services):
    names = schema.ADVANCED_NAMES
    values = {i.name: i.default for i in schema.ADVANCED_OPTIONS.inputs}
    options = logic.run_node("SDVGAdvancedOptions", services, **{**values, "random_accept_prob": 0.0,
                                                                  "replay": False}).outputs[0]
    assert set(options) == set(names) and options["random_accept_prob"] == 0.0
    out = sample(stack, None, services, mode="random", random_accept_prob=1.0, advanced_options=options, length=33)
    report = json.loads(out.report)
    assert report["settings"]["random_accept_prob"] == 0.0 and report["decisions"] == ["target"] * 3
    without = sample(stack, None, services, mode="random", random_accept_prob=1.0, length=33, replay=False)
    assert json.loads(without.report)["decisions"] == ["target", "draft", "draft"]
    # the lazy router check sees the node's schedule_veto
    veto = {**values, "schedule_veto": True}
    assert logic.needed_inputs("schedule", 1, 1, None, logic.effective_schedule_veto(False, veto)) == ["router"]
    assert logic.needed_inputs("schedule", 1, 1, None, logic.effective_schedule_veto(False, None)) == []
    with pytest.raises(ValueError, match="advanced_options: expected the output of SDVG Advanced Options"):
        sample(stack, None, services, mode="draft_only", advanced_options={"replay": True})


# ------------------------------------------------------------------------------- SDVG Drafter / Target from MODEL
def test_the_from_model_nodes_are_registered_after_the_others():
    """Two new node ids appended (saved workflows keep every earlier id and widget order); their inputs in order: the
    MODEL socket, then context_scheme and kv_dtype; their output the sampler's SDVG_MODEL. The V3 classes (read from
    comfy_nodes.py, which needs ComfyUI to import) are listed in the same order."""
    import ast

    ids = [s.node_id for s in schema.NODES]
    assert ids[:6] == ["SDVGLoadDrafter", "SDVGLoadTarget", "SDVGRewardRouter", "SDVGSpeculativeSampler",
                       "SDVGLoadPromptEmbeddings", "SDVGAdvancedOptions"]
    assert ids[6:8] == ["SDVGDrafterFromModel", "SDVGTargetFromModel"]
    assert ids[8:] == ["SDVGPromptSchedule", "SDVGPromptSwitch"]  # issue 39, appended after these
    for spec, role in ((schema.DRAFTER_FROM_MODEL, "Drafter"), (schema.TARGET_FROM_MODEL, "Target")):
        assert spec.display_name == f"SDVG {role} from MODEL"
        assert [(i.name, i.type) for i in spec.inputs] == [("model", "MODEL"), ("context_scheme", "COMBO"),
                                                           ("kv_dtype", "COMBO")]
        assert spec.input("context_scheme").options == ("auto", "global_cache", "recompute_window")
        assert spec.input("kv_dtype").options == ("auto", "fp8")
        assert [(o.name, o.type) for o in spec.outputs] == [("sdvg_model", schema.SDVG_MODEL)]
        tooltip = spec.input("model").tooltip
        assert all(word in tooltip for word in ("LoRA", "fp8", "GGUF", "attention", "one worker lane"))
    assert schema.SAMPLER.input("drafter").type == schema.SAMPLER.input("target").type == schema.SDVG_MODEL
    tree = ast.parse((Path(__file__).resolve().parents[1] / "nodes" / "comfy_nodes.py").read_text())
    listed = next(n.value for n in tree.body
                  if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "NODE_CLASSES")
    assert [e.id for e in listed.elts] == ids


class _Model:
    """What SDVG asks of a ComfyUI MODEL before anything else: ``get_model_object("diffusion_model")`` (counted)."""

    def __init__(self, diffusion_model):
        self.diffusion_model, self.asked = diffusion_model, 0

    def get_model_object(self, name):
        self.asked += 1
        return {"diffusion_model": self.diffusion_model}[name]


def _original_layout_wan(class_name: str, **attributes):
    from test_original_layout import StandInWanModel
    from wan_fixtures import tiny_wan, to_original_keys

    model = type(class_name, (StandInWanModel,), {})(to_original_keys(tiny_wan(seed=1).state_dict()))
    for name, value in attributes.items():
        setattr(model, name, value)
    return model


@pytest.mark.parametrize("row", ["not_a_model", "packs_own_model", "wan_variant", "wan_i2v", "bad_context_scheme",
                                 "bad_kv_dtype"])
def test_from_model_bad_input_is_refused_clearly(row, services):
    """A MODEL that SDVG cannot run is refused by the node with what was found and what to connect; bad widget values
    before the MODEL is even asked for its diffusion model. None of it needs ComfyUI."""
    from wan_fixtures import tiny_wan

    inputs = dict(context_scheme="auto", kv_dtype="auto")
    if row == "not_a_model":
        inputs["model"], match = "wan.safetensors", (r"model: expected a ComfyUI MODEL \(the output of Load Diffusion "
                                                     r"Model / UNETLoader, a LoRA loader or Unet Loader \(GGUF\)\), got a "
                                                     r"builtins\.str")
    elif row == "packs_own_model":
        inputs["model"] = _Model(tiny_wan(seed=1))
        match = (r"model: this MODEL is a sdvg_engine\.models\.causal_wan\.CausalWanTransformer3DModel \(no "
                 r"text_embedding, time_embedding, time_projection, head\), not a Wan2\.1 DiT in ComfyUI's layout\. "
                 r"SDVG runs Wan2\.1 text-to-video DiTs .* SDVG Load Drafter / SDVG Load Target for the checkpoint file")
    elif row == "wan_variant":
        inputs["model"] = _Model(_original_layout_wan("VaceWanModel"))
        match = r"model: this MODEL is a .*\.VaceWanModel, a Wan variant with inputs of its own \(VACE"
    elif row == "wan_i2v":
        inputs["model"] = _Model(_original_layout_wan("WanModel", model_type="i2v"))
        match = r"model: this MODEL is a Wan i2v model \(image conditioning\); SDVG runs Wan2\.1 text-to-video models"
    else:
        inputs["model"] = _Model(tiny_wan(seed=1))
        name, value = ("context_scheme", "sliding") if row == "bad_context_scheme" else ("kv_dtype", "int8")
        inputs[name] = value
        match = rf"{name} must be one of \(.*\), got '{value}'"
    with pytest.raises(ValueError, match=match):
        logic.run_node("SDVGDrafterFromModel", services, **inputs)
    if row.startswith("bad_"):
        assert inputs["model"].asked == 0  # refused before the MODEL was touched


def test_the_run_reserves_what_its_caches_take(stack, services):
    """The bytes the sampler asks the memory manager to reserve (ComfyUI: load_models_gpu's memory_required, in the
    same call that loads every model of the run) hold the KV caches and text K/V the run's models really allocate,
    plus the VAE state and the largest transient of the memory plan."""
    reserved = []

    class Reserving(RecordingServices):
        def load_run(self, patchers, memory_required=0):
            reserved.append(memory_required)
            super().load_run(patchers, memory_required)

    svc = Reserving(services.folders)
    out = sample(stack, None, svc, mode="first_block_only")
    report = json.loads(out.report)
    components = report["memory_required"]["components"]
    assert reserved == [report["memory_required"]["bytes"]] == [sum(components.values())] and len(svc.loaded) == 1
    for role in ("drafter", "target"):
        model = stack[role].model
        frames = 6  # the reference preset: the recompute window (3 context + 3 block frames) for both
        allocated = (model.new_kv_cache(1, H // 8, W // 8, frames).geometry.nbytes
                     + model.encode_text(stack["positive"][0][0]).nbytes)
        assert components[f"{role} KV ({frames} frames, 4-byte compute dtype)"] == allocated
    assert {k.split(" (")[0] for k in components} == {"drafter KV", "target KV", "VAE decode cache",
                                                      "VAE rollback snapshot", "largest transient: DiT block "
                                                      "activations or VAE decode temporaries, whichever is larger"}


def test_run_memory_matches_the_memory_plan_at_832x480x81():
    """The closed form the nodes reserve with is the memory plan's, term for term, for the 1.3B drafter and the 14B
    target at 832x480, 81 frames (native preset: drafter on its 21-frame global cache; the bf16 / fp8 KV steps)."""
    from sdvg_engine.models.causal_wan import wan_config
    from sdvg_engine.offload import LADDER, memory_components, run_memory_components

    drafter, target = wan_config("Wan2.1-T2V-1.3B"), wan_config("Wan2.1-T2V-14B")
    for step in (LADDER[0], LADDER[4]):
        kv = step["kv_dtype"]
        ours = run_memory_components([("drafter", drafter, 21, kv, 2), ("target", target, 6, kv, 2)], width=832,
                                     height=480, vae_dtype=step["vae_dtype"])
        plan = {k: v for k, v in memory_components(**step).items() if "weights" not in k and "reserve" not in k
                and "ImageReward" not in k}
        assert len(ours) == len(plan) == 5
        assert sorted(v / 2**30 for v in ours.values()) == pytest.approx(sorted(plan.values()), rel=1e-12)
