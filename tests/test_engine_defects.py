"""Defects of the engine loop found in review (issue 30), and the seeded bugs its suite missed; each test here fails
on the code before its fix (checked by reverting the fix or planting the bug)."""

from __future__ import annotations

import math
import threading

import pytest

import sdvg_engine.memo as memo_module
from sdvg_engine.context import RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.memo import ReplayMemo, _tensors, recording_bytes
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline
from sdvg_engine.router import RewardRouter
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline
from test_host_copies import _spy as spy_host_copies
from test_workers import assert_same

PROMPT = "a red ball rolling on grass"
FRAMES = 45  # 4 blocks


def run(pipe, workers=1, seed=5, **opts):
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed,
                         options=SDVGOptions(**opts), workers=workers)


@pytest.fixture(scope="module")
def scores():
    """The three drafts' scores when every draft is kept (global-cache target), to place tau between them."""
    return sorted(b.decision.block_score for b in run(tiny_pipeline(tau=-math.inf)).blocks[1:])


def reference_pipeline(tau: float, tau_mode: str = "fixed") -> SpeculativePipeline:
    """Both models on the recompute window (the reference preset): context snapshots hold per-frame pixel views."""
    parts = shared_parts()
    drafter = CausalGenerator(parts["drafter"], schedule="krea", context=RecomputeWindow(3))
    target = CausalGenerator(parts["target"], schedule="krea", context=RecomputeWindow(3))
    return SpeculativePipeline(drafter, target, parts["vae"], RewardRouter(parts["scorer"], tau=tau, tau_mode=tau_mode))


# ---- defect 1: kept drafts crossed to the host on the main thread with 2 workers ---------------------------------
def test_kept_drafts_cross_to_the_host_only_on_the_vae_worker(monkeypatch, scores):
    """With 2 workers every block's decoded frames are copied for the recording on the VAE's lane; the main thread
    (which finishes blocks) never copies or even looks up frames, kept drafts included."""
    calls = spy_host_copies(monkeypatch)
    pipe = tiny_pipeline(tau=(scores[0] + scores[1]) / 2)
    pipe.memo = ReplayMemo()
    result = run(pipe, workers=2)
    kept = [b for b in result.blocks if b.source == "draft"]
    assert kept and any(b.drafted and b.source == "target" for b in result.blocks)  # keeps and rejects
    assert result.report["replay"]["recorded_blocks"] == 4
    assert {thread for _, thread in calls} == {"sdvg-side"}, calls
    assert len(calls) == len({ptr for ptr, _ in calls}) == 4  # each kept block's frames once; no rejected draft's


# ---- defect 2: a recompute-window recording copied view by view (~1.8x its size on a GPU) -------------------------
def _distinct_storages(recording) -> int:
    return len({t.untyped_storage().data_ptr() for b in recording.blocks
                for t in _tensors([b.latents, b.pixels, b.contexts_after, b.previous_features_after])})


def test_a_recording_copied_from_a_device_shares_storage_as_on_the_device(monkeypatch):
    """The recording's host copies keep the sharing of the device tensors: a recompute window's per-frame pixel views
    and latent views are views of the recorded frames and latents, not copies of their own. On the CPU nothing is
    copied; here every CPU tensor takes the device path (memo._on_host says no), as every tensor does on a GPU."""
    on_cpu = reference_pipeline(-math.inf)
    on_cpu.memo = ReplayMemo()
    plain = run(on_cpu)
    (plain_recording,) = on_cpu.memo._recordings.values()

    monkeypatch.setattr(memo_module, "_on_host", lambda t: False)
    copied = reference_pipeline(-math.inf)
    copied.memo = ReplayMemo()
    result = run(copied)
    (recording,) = copied.memo._recordings.values()
    assert_same(plain, result)
    assert recording.nbytes == plain_recording.nbytes == result.report["replay"]["recording_bytes"]
    assert _distinct_storages(recording) == _distinct_storages(plain_recording)
    features = recording.blocks[0].previous_features_after.numel()  # the tiny reward's image features
    # every block's latents, frames and seam features once (all drafts kept: the last block's seam is its own)
    assert recording.nbytes == recording_bytes(WIDTH, HEIGHT, FRAMES, feature_dim=features)
    # the recording's frames are copies (not the run's own tensors), each crossing once
    assert all(b.pixels.untyped_storage().data_ptr() != 0 for b in recording.blocks)


# ---- defect 4: replay's re-decode time was charged to the first freshly generated block ---------------------------
def test_replay_redecode_time_is_the_replayed_blocks_own():
    """A replayed block that is decoded again carries that decode's time; the first fresh block carries only its own
    work, so a later replay of this run's recording saves what the blocks really cost."""
    pipe = tiny_pipeline(tau=math.inf)  # every draft rejected
    pipe.memo = ReplayMemo()
    first = run(pipe)
    pipe.router.tau = -math.inf  # block 1 now accepted: block 0 is replayed (decoded again), blocks 1..3 are fresh
    second = run(pipe)
    assert second.report["replay"]["replayed_blocks"] == 1
    replayed, fresh = second.blocks[0], second.blocks[1:]
    assert replayed.replayed and replayed.seconds == {"vae": pytest.approx(replayed.decode_seconds, rel=1e-6)}
    for block in fresh:  # kept drafts: one decode each, the block's own
        assert block.source == "draft" and block.seconds["vae"] == pytest.approx(block.decode_seconds, rel=1e-6)
    third = run(pipe)  # replays the second run whole: saves what its blocks took when they were made
    assert third.report["replay"]["replayed_blocks"] == 4
    made = sum(first.blocks[0].seconds.values()) + sum(sum(b.seconds.values()) for b in fresh)
    assert third.report["replay"]["seconds_saved"] == pytest.approx(made, abs=1e-5)


# ---- seeded bugs the suite missed -------------------------------------------------------------------------------
def _sdvg_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sdvg-")]


def _fail_target_denoising(monkeypatch, model, state):
    """Make the target's denoising calls fail once ``state['armed']``, where the generator really calls the model
    (``forward_block``; a forward pre-hook never fires). Context passes (t = 0) still run."""
    real = model.forward_block

    def forward_block(latents, timesteps, *args, **kwargs):
        if state["armed"] and bool((timesteps > 0).any()):
            state["fired"] += 1
            raise RuntimeError("target out of memory (simulated)")
        return real(latents, timesteps, *args, **kwargs)

    monkeypatch.setattr(model, "forward_block", forward_block)


def test_a_failed_speculative_regeneration_that_is_used_fails_the_run(monkeypatch):
    """Every draft rejected, 2 workers: each regeneration is the target's speculative task, and its result is used.
    Its failure must fail the run with its own error (and leave the pipeline usable)."""
    pipe = tiny_pipeline(tau=math.inf)
    fresh = run(tiny_pipeline(tau=math.inf), workers=2)
    state = {"armed": False, "fired": 0}
    _fail_target_denoising(monkeypatch, pipe.target.model, state)
    with pytest.raises(RuntimeError, match="target out of memory"):
        pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                      workers=2, on_block=lambda r: state.update(armed=True))  # block 0 is made before arming
    assert state["fired"] >= 1 and pipe._run.workers.speculations >= 1 and not _sdvg_threads()
    state["armed"] = False
    assert_same(run(pipe, workers=2), fresh)


def test_a_run_with_an_explicit_noise_source_is_never_replayed(scores):
    from sdvg_engine.sampling import SeededNoise

    tau = (scores[0] + scores[1]) / 2
    pipe = tiny_pipeline(tau=tau)
    pipe.memo = ReplayMemo()
    run(pipe, seed=5)  # recorded under seed 5
    kwargs = dict(prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5)
    explicit = pipe.generate(prompt_embeds(), noise=SeededNoise(6), **kwargs)  # the seed says 5, the noise is 6's
    assert explicit.report["replay"]["replayed_blocks"] == 0 and not explicit.report["replay"]["enabled"]
    assert_same(explicit, tiny_pipeline(tau=tau).generate(prompt_embeds(), noise=SeededNoise(6), **kwargs))


def test_a_cascade_run_is_replayed_whole_at_the_same_tau(scores):
    """Early rejects, early accepts and fully scored drafts: at the same tau, a cascade run re-decides every recorded
    draft as it was decided, so the whole run replays."""
    opts = {"cascade": True, "cascade_frames": 2, "cascade_margin": 0.5}
    seen = set()
    for tau in [(x + y) / 2 for x, y in zip(scores, scores[1:])] + [scores[0] - 0.3, scores[-1] + 0.3]:
        pipe = tiny_pipeline(tau=tau)
        pipe.memo = ReplayMemo()
        first = run(pipe, **opts)
        seen |= {(r.decision.accept, r.decision.frames_scored) for r in first.blocks if r.decision is not None}
        again = run(pipe, **opts)
        assert again.report["replay"]["replayed_blocks"] == 4, tau
        assert_same(first, again)
    assert {accept for accept, _ in seen} == {True, False}
    assert {n for _, n in seen} == {2, 12}  # decided on the first 2 frames, and on all 12


def test_the_weights_fingerprint_sees_every_parameters_last_value():
    from sdvg_engine.replay_key import weights_fingerprint
    from wan_fixtures import tiny_wan

    model = tiny_wan(seed=9)
    before = weights_fingerprint(model)
    samples = 64
    for p in model.parameters():
        flat = p.data.reshape(-1)
        step = max(1, flat.numel() // samples)
        if (samples - 1) * step < flat.numel() - 1:  # the strided samples stop short of the last value
            break
    else:
        pytest.fail("no parameter whose last value the strided samples miss")
    flat[-1] += 1.0
    assert weights_fingerprint(model) != before


def test_the_reference_modes_never_share_a_replay_key(scores):
    """relative, anchor and baseline record different committed-block scores and compare with different references:
    a recording of one is never replayed by another (fixed and accept_rate share one: only the tau settings differ)."""
    from sdvg_engine.replay_key import replay_key
    from sdvg_engine.run import pad_text
    from sdvg_engine.workers import COMPONENTS

    def key(tau_mode):
        pipe = tiny_pipeline()
        pipe.router = RewardRouter(shared_parts()["scorer"], tau=0.0, tau_mode=tau_mode)
        return replay_key(pipe, pad_text(prompt_embeds()), PROMPT, FRAMES, WIDTH, HEIGHT, 5, SDVGOptions(),
                          {c: pipe._device(c) for c in COMPONENTS})

    keys = {mode: key(mode) for mode in ("fixed", "accept_rate", "relative", "anchor", "baseline")}
    assert keys["fixed"] == keys["accept_rate"]
    assert len({keys[m] for m in ("fixed", "relative", "anchor", "baseline")}) == 4
    # end to end: an anchor run after a relative one on the same pipeline and memo is a fresh run
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=-0.25, tau_mode="relative")
    run(pipe)
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=-0.25, tau_mode="anchor")
    anchor = run(pipe)
    assert anchor.report["replay"]["replayed_blocks"] == 0
    fresh = tiny_pipeline()
    fresh.router = RewardRouter(shared_parts()["scorer"], tau=-0.25, tau_mode="anchor")
    assert_same(anchor, run(fresh))


def test_a_schedule_veto_replay_re_decides_the_drafts_at_the_new_tau():
    """schedule + veto scores its drafts: a replay at another tau re-decides them, it does not keep stale accepts."""
    opts = {"mode": "schedule", "schedule_every": 2, "schedule_veto": True}
    pipe = tiny_pipeline(tau=-math.inf)  # every draft kept
    pipe.memo = ReplayMemo()
    run(pipe, **opts)
    pipe.router.tau = math.inf  # every draft vetoed
    replayed = run(pipe, **opts)
    fresh = run(tiny_pipeline(tau=math.inf), **opts)
    assert [r.source for r in fresh.blocks] == ["target"] * 4 and fresh.blocks[1].drafted
    assert replayed.report["replay"]["replayed_blocks"] == 1  # block 0; block 1's decision changed
    assert_same(replayed, fresh)
