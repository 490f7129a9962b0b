"""The replay key (sdvg_engine.replay_key) covers every input that can change an output, and nothing else.

For each input: a run that differs from a recorded one only in that input must never replay (compared on the key
itself, which is what the memo looks up, and end to end for the inputs that used to be missing). Conversely the router's
tau settings, the workers and a model moved off its device and back must keep the key (they replay).
"""

import dataclasses
import math

import pytest
import torch

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline, pad_text
from sdvg_engine.replay_key import replay_key, weights_fingerprint
from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.workers import COMPONENTS
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline, tiny_vae
from wan_fixtures import tiny_wan

PROMPT = "a red ball rolling on grass"
FRAMES = 21  # 2 blocks: block 0 by the target, block 1 drafted
TAU_SETTINGS = ("tau", "tau_mode", "accept_rate", "prior_mean", "prior_std", "prior_count")


def private_pipeline(tau: float = -math.inf) -> SpeculativePipeline:
    """Models of its own (the shared fixture's must never be changed in place)."""
    drafter = CausalGenerator(tiny_wan(seed=1), schedule="self_forcing", context=GlobalCache(21))
    target = CausalGenerator(tiny_wan(seed=2), schedule="self_forcing", context=GlobalCache(21))
    router = RewardRouter(build_tiny_image_reward(seed=0), tau=tau)
    return SpeculativePipeline(drafter, target, tiny_vae(), router)


def key_of(pipe, *, embeds=None, prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5, opts=None,
           devices=None):
    embeds = pad_text(prompt_embeds(1) if embeds is None else embeds)
    devices = devices if devices is not None else {c: pipe._device(c) for c in COMPONENTS}
    return replay_key(pipe, embeds, prompt, num_frames, width, height, seed, opts or SDVGOptions(), devices)


def nudge_(param: torch.Tensor) -> None:
    """An in-place change of every value (a merged LoRA), under inference mode like ComfyUI's tensors."""
    with torch.inference_mode():
        param.data.mul_(1.01).add_(1e-3)


def middle_parameter(module: torch.nn.Module) -> torch.Tensor:
    """Neither the first, the middle nor the last parameter (the three the old fingerprint sampled)."""
    params = list(module.parameters())
    assert len(params) > 8
    return params[len(params) // 2 - 2]


# ---- SDVGOptions: every field ------------------------------------------------------------------------
OPTION_CHANGES = {
    "mode": [dict(mode=m) for m in ("target_only", "draft_only", "first_block_only", "random", "schedule")],
    "force_first_block": [dict(force_first_block=False)],
    "random_accept_prob": [dict(random_accept_prob=0.0), dict(random_accept_prob=1.0)],
    "refine_from_step": [dict(refine_from_step=1), dict(refine_from_step=2)],
    "cascade": [dict(cascade=True)],
    "cascade_frames": [dict(cascade_frames=1), dict(cascade_frames=5)],
    "cascade_margin": [dict(cascade_margin=0.0), dict(cascade_margin=0.25)],
    "schedule_every": [dict(schedule_every=0), dict(schedule_every=2)],
    "schedule_veto": [dict(schedule_veto=True)],
    "target_after_switch": [dict(target_after_switch=True)],
    "switch_routing": [dict(switch_routing="reset")],
}


def test_every_option_field_is_covered_below():
    assert set(OPTION_CHANGES) == {f.name for f in dataclasses.fields(SDVGOptions)}


@pytest.mark.parametrize("change", [c for cs in OPTION_CHANGES.values() for c in cs],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_each_option_is_in_the_key(change):
    pipe = tiny_pipeline()
    base = key_of(pipe)
    assert key_of(pipe, opts=SDVGOptions()) == base  # deterministic
    # From each mode's defaults (also those that use the field), so no field counts in one mode only.
    for mode in ("sdvg", "random", "schedule", "target_only"):
        if change.get("mode") != mode:
            assert key_of(pipe, opts=SDVGOptions(**{"mode": mode, **change})) != key_of(pipe, opts=SDVGOptions(mode=mode))


# ---- run inputs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change", [
    dict(prompt="a blue cube"), dict(prompt=PROMPT + " "), dict(seed=6), dict(seed=-5), dict(width=WIDTH + 16),
    dict(height=HEIGHT + 16), dict(width=HEIGHT, height=WIDTH), dict(num_frames=33), dict(embeds=prompt_embeds(2)),
], ids=lambda c: next(iter(c)))
def test_each_run_input_is_in_the_key(change):
    pipe = tiny_pipeline()
    assert key_of(pipe, **change) != key_of(pipe)


def test_one_changed_embedding_value_is_in_the_key():
    pipe = tiny_pipeline()
    embeds = prompt_embeds(1)
    embeds[0, 3, 100] += 1e-6
    assert key_of(pipe, embeds=embeds) != key_of(pipe)
    longer = torch.zeros(1, 513, 4096)  # padded to the same 512 rows it would not be the same context
    longer[:, :512] = prompt_embeds(1)
    assert key_of(pipe, embeds=longer) != key_of(pipe)


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_device_placement_is_in_the_key(component):
    pipe = tiny_pipeline()
    devices = {c: torch.device("cpu") for c in COMPONENTS}
    moved = {**devices, component: torch.device("meta")}
    assert key_of(pipe, devices=moved) != key_of(pipe, devices=devices)


# ---- router ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attr,value", [("aggregation", "mean"), ("temporal_weight", 0.5), ("temporal_weight", 1e-9),
                                        ("crop", "full"), ("preprocess", "torch")])
def test_each_router_setting_is_in_the_key(attr, value):
    pipe = tiny_pipeline()
    base = key_of(pipe)
    setattr(pipe.router, attr, value)
    assert key_of(pipe) != base


def test_any_router_setting_but_the_tau_settings_is_in_the_key():
    """Generic, so a setting added later is covered too: each value of settings() outside the tau settings."""
    pipe = tiny_pipeline()
    base = key_of(pipe)
    original = pipe.router.settings
    names = [k for k in original() if k not in TAU_SETTINGS]
    assert {"aggregation", "crop", "temporal_weight", "preprocess"} <= set(names)
    for name in names:
        pipe.router.settings = lambda name=name: {**original(), name: "<another value>"}
        assert key_of(pipe) != base, name
    for name in TAU_SETTINGS:
        pipe.router.settings = lambda name=name: {**original(), name: "<another value>"}
        assert key_of(pipe) == base, name


def test_the_reward_model_is_in_the_key():
    pipe = private_pipeline()
    base = key_of(pipe)
    scorer = pipe.router.scorer
    nudge_(middle_parameter(scorer.model))  # in place: same object, other scores
    in_place = key_of(pipe)
    assert in_place != base
    other = build_tiny_image_reward(seed=1)
    scorer.model.load_state_dict(other.model.state_dict())  # other weights loaded into the same module
    assert key_of(pipe) not in (base, in_place)
    pipe.router.scorer = build_tiny_image_reward(seed=0)  # another scorer object
    assert key_of(pipe) != base
    fresh = tiny_pipeline()
    before = key_of(fresh)
    fresh.router.scorer.batch_size = 1  # another batching, other float sums (the same scorer object)
    try:
        assert key_of(fresh) != before
    finally:
        fresh.router.scorer.batch_size = None


def test_without_a_router_the_key_still_works():
    pipe = tiny_pipeline()
    pipe.router = None
    opts = SDVGOptions(mode="target_only")
    assert key_of(pipe, opts=opts) == key_of(pipe, opts=opts) != key_of(pipe, opts=SDVGOptions(mode="draft_only"))


# ---- models: weights, schedule, KV dtype, context, frames per block ------------------------------------
def _inplace_middle(gen):
    nudge_(middle_parameter(gen.model))


def _inplace_last_value(gen):
    nudge_(list(gen.model.parameters())[-1])


def _reload(gen):
    gen.model.load_state_dict(tiny_wan(seed=9).state_dict())


def _replace(gen):
    gen.model = tiny_wan(seed=9)


def _timesteps(gen):
    gen.schedule = dataclasses.replace(gen.schedule, timesteps=(1000.0, 800.0, 500.0, 250.0))


def _shift(gen):
    gen.schedule = dataclasses.replace(gen.schedule, shift=gen.schedule.shift + 0.5)


def _kv_dtype(gen):
    gen.model.use_runtime(kv_cache_dtype=torch.float8_e4m3fn)


def _compute_dtype(gen):
    gen.model.to(torch.bfloat16)


def _scheme(gen):
    gen.context = RecomputeWindow(3)


def _max_frames(gen):
    gen.context = GlobalCache(24)


def _frames_per_block(gen):
    gen.frames_per_block = 1


MODEL_CHANGES = [_inplace_middle, _inplace_last_value, _reload, _replace, _timesteps, _shift, _kv_dtype, _compute_dtype,
                 _scheme, _max_frames, _frames_per_block]


@pytest.mark.parametrize("which", ["drafter", "target"])
@pytest.mark.parametrize("change", MODEL_CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_each_model_input_is_in_the_key(which, change):
    pipe = private_pipeline()
    base = key_of(pipe)
    change(getattr(pipe, which))
    assert key_of(pipe) != base


def test_the_compute_dtype_is_in_the_key_under_an_fp8_kv_cache():
    pipe = private_pipeline()
    pipe.target.model.use_runtime(kv_cache_dtype=torch.float8_e4m3fn)
    base = key_of(pipe)
    pipe.target.model.to(torch.bfloat16)  # the KV cache stays fp8; the model now computes in bf16
    assert key_of(pipe) != base


@pytest.mark.parametrize("settings", [dict(context_frames=6), dict(attention_bias=0.5), dict(attention_bias=1.0)])
def test_each_recompute_window_setting_is_in_the_key(settings):
    pipe = private_pipeline()
    pipe.target.context = RecomputeWindow(3, anchor_encoder=pipe.vae)
    base = key_of(pipe)
    pipe.target.context = RecomputeWindow(**{"context_frames": 3, **settings}, anchor_encoder=pipe.vae)
    assert key_of(pipe) != base


@pytest.mark.parametrize("change", ["in_place", "reload", "dtype", "object"])
def test_the_vae_is_in_the_key(change):
    pipe = private_pipeline()
    base = key_of(pipe)
    if change == "in_place":
        nudge_(middle_parameter(pipe.vae.vae.decoder))
    elif change == "reload":
        pipe.vae.vae.load_state_dict(tiny_vae(seed=3).vae.state_dict())
    elif change == "dtype":
        pipe.vae.vae.to(torch.bfloat16)
    else:
        pipe.vae = tiny_vae()
    assert key_of(pipe) != base


# ---- the converse: what must keep the key -----------------------------------------------------------------
def test_tau_settings_and_moved_weights_keep_the_key():
    pipe = private_pipeline()
    base = key_of(pipe)
    for attr, value in [("tau", 1.5), ("tau", math.inf), ("accept_rate", 0.5), ("prior_mean", 0.0), ("prior_std", 2.0),
                        ("prior_count", 0.0), ("tau_mode", "accept_rate"), ("tau_mode", "fixed")]:
        setattr(pipe.router, attr, value)
        assert key_of(pipe) == base, attr
    # Relative recordings hold the committed blocks' scores, which a fixed tau never computes.
    pipe.router.tau_mode = "relative"
    assert key_of(pipe) != base
    pipe.router.tau_mode = "fixed"
    # The same weights in new storage (ComfyUI moves a model off the GPU and back), also under inference mode.
    with torch.inference_mode():
        for module in (pipe.drafter.model, pipe.target.model, pipe.vae.vae, pipe.router.scorer.model):
            module._apply(lambda t: t.clone())
    assert key_of(pipe) == base
    # A round trip through another dtype that keeps every value.
    pipe.target.model.to(torch.float64).to(torch.float32)
    assert key_of(pipe) == base


def test_the_fingerprint_reads_every_parameter_and_no_storage():
    model = tiny_wan(seed=1)
    base = weights_fingerprint(model)
    params = list(model.parameters())
    for i in range(len(params)):
        saved = params[i].data.clone()
        nudge_(params[i])
        assert weights_fingerprint(model) != base, i
        params[i].data.copy_(saved)
    assert weights_fingerprint(model) == base == weights_fingerprint(tiny_wan(seed=1))
    # A change of the middle half of one tensor only (its first and last values stay): still seen.
    flat = params[len(params) // 2 - 2].data.reshape(-1)
    n = flat.numel()
    flat[n // 4: 3 * n // 4] += 0.01
    assert weights_fingerprint(model) != base
    assert weights_fingerprint(tiny_wan(seed=2)) != base


# ---- end to end: the inputs that used to be missing never replay; tau, workers and moves still do ---------
def _generate(pipe, tau=-math.inf, workers=None, **opts):
    pipe.router.tau = tau
    return pipe.generate(prompt_embeds(1), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                         options=SDVGOptions(**opts), workers=workers)


@pytest.mark.parametrize("change", ["drafter_middle_weights", "reward_weights", "vae_weights"])
def test_in_place_changes_never_replay(change):
    pipe = private_pipeline()
    pipe.memo = ReplayMemo()
    _generate(pipe)
    if change == "drafter_middle_weights":
        nudge_(middle_parameter(pipe.drafter.model))
    elif change == "reward_weights":
        nudge_(middle_parameter(pipe.router.scorer.model))
    else:
        nudge_(middle_parameter(pipe.vae.vae.decoder))
    result = _generate(pipe)
    assert result.report["replay"]["replayed_blocks"] == 0
    assert not any(r.replayed for r in result.blocks)


def test_option_changes_never_replay_end_to_end():
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    _generate(pipe)
    for opts in (dict(refine_from_step=2), dict(cascade=True, cascade_frames=2), dict(force_first_block=False)):
        assert _generate(pipe, **opts).report["replay"]["replayed_blocks"] == 0, opts
    _generate(pipe, mode="schedule", schedule_every=1)
    assert _generate(pipe, mode="schedule", schedule_every=0).report["replay"]["replayed_blocks"] == 0
    assert _generate(pipe, mode="schedule", schedule_every=1).report["replay"]["replayed_blocks"] == 2


def test_tau_workers_and_a_moved_model_still_replay():
    pipe = private_pipeline()
    pipe.memo = ReplayMemo()
    first = _generate(pipe, tau=-math.inf)
    assert [r.source for r in first.blocks] == ["target", "draft"]
    score = first.blocks[1].decision.block_score
    assert _generate(pipe, tau=score - 1.0).report["replay"]["replayed_blocks"] == 2  # same decisions
    assert _generate(pipe, tau=score - 1.0, workers=2).report["replay"]["replayed_blocks"] == 2
    with torch.inference_mode():
        pipe.target.model._apply(lambda t: t.clone())
    assert _generate(pipe, tau=score - 1.0).report["replay"]["replayed_blocks"] == 2
    # The first flip: the draft is rejected now; block 0 is still the recorded one.
    assert _generate(pipe, tau=score + 1.0).report["replay"]["replayed_blocks"] == 1
    pipe.router.tau_mode, pipe.router.accept_rate = "accept_rate", 0.5  # an adaptive tau: a recording decides alike
    assert _generate(pipe).report["replay"]["replayed_blocks"] == 2
