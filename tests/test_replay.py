"""Replay (sdvg_engine.memo): a run that differs only in tau reuses the blocks before its first changed decision and
equals a fresh run at the new tau bit for bit."""

import math

import pytest
import torch

from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import CancelToken, GenerationCancelled, SDVGOptions
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline
from test_workers import assert_same

PROMPT = "a red ball rolling on grass"
FRAMES = 45  # 4 blocks


def generate(pipe, tau, *, seed=5, prompt=PROMPT, width=WIDTH, height=HEIGHT, embeds_seed=1, **opts):
    pipe.router.tau = tau
    return pipe.generate(prompt_embeds(embeds_seed), prompt=prompt, num_frames=FRAMES, width=width, height=height,
                         seed=seed, options=SDVGOptions(**opts))


def first_difference(a, b) -> int:
    sa, sb = [r.source for r in a.blocks], [r.source for r in b.blocks]
    return next((i for i in range(len(sa)) if sa[i] != sb[i]), len(sa))


def taus_for(scheme, **opts):
    """-inf, +inf and the midpoints between the drafts' scores of the all-accept and all-reject runs."""
    scores = set()
    for tau in (-math.inf, math.inf):
        result = generate(tiny_pipeline(target_scheme=scheme), tau, **opts)
        scores |= {r.decision.block_score for r in result.blocks if r.decision is not None}
    ordered = sorted(scores)
    return [-math.inf, math.inf] + [(x + y) / 2 for x, y in zip(ordered, ordered[1:])]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["global_cache", "recompute_window"])
def test_replay_equals_a_fresh_run_wherever_the_first_flip_is(scheme):
    taus = taus_for(scheme)
    fresh = {tau: generate(tiny_pipeline(target_scheme=scheme), tau) for tau in taus}
    flips = set()
    pairs = [(a, b) for a in taus[:2] for b in taus if a != b] + [(taus[-1], taus[2])]
    for tau_a, tau_b in pairs:
        pipe = tiny_pipeline(target_scheme=scheme)
        pipe.memo = ReplayMemo()
        generate(pipe, tau_a)
        replayed = generate(pipe, tau_b)
        assert_same(replayed, fresh[tau_b])
        expected = first_difference(fresh[tau_a], fresh[tau_b])
        assert replayed.report["replay"]["replayed_blocks"] == expected
        assert [r.replayed for r in replayed.blocks] == [i < expected for i in range(4)]
        assert [r.decision.tau if r.decision else None for r in replayed.blocks] == \
            [r.decision.tau if r.decision else None for r in fresh[tau_b].blocks]
        flips.add(expected)
    assert flips >= {1, 2, 3}  # the first drafted block, a middle one, the last one
    # No decision changes: the run returns at once, with every block replayed and no model call.
    pipe = tiny_pipeline(target_scheme=scheme)
    pipe.memo = ReplayMemo()
    generate(pipe, taus[2])
    again = generate(pipe, taus[2])
    assert_same(again, fresh[taus[2]])
    assert again.report["replay"]["replayed_blocks"] == 4
    assert again.report["model_calls"] == {"drafter": {}, "target": {}}
    assert again.report["replay"]["seconds_saved"] > 0


@pytest.mark.parametrize("opts", [{"refine_from_step": 2}, {"cascade": True, "cascade_frames": 2, "cascade_margin": 0.3}],
                         ids=["hybrid", "cascade"])
def test_replay_with_hybrid_and_cascade(opts):
    taus = taus_for("global_cache", **opts)
    fresh = {tau: generate(tiny_pipeline(), tau, **opts) for tau in taus}
    replays = 0
    for tau_a, tau_b in [(taus[0], taus[2]), (taus[1], taus[3]), (taus[2], taus[-1])]:
        pipe = tiny_pipeline()
        pipe.memo = ReplayMemo()
        generate(pipe, tau_a, **opts)
        replayed = generate(pipe, tau_b, **opts)
        assert_same(replayed, fresh[tau_b])
        reused = replayed.report["replay"]["replayed_blocks"]
        # Cascade may stop earlier: a draft scored on a few frames cannot always be re-decided.
        assert 1 <= reused <= first_difference(fresh[tau_a], fresh[tau_b])
        replays += reused > 1
    assert replays > 0


def test_two_workers_replay_too():
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    pipe.workers = 2
    generate(pipe, -math.inf)
    result = generate(pipe, 0.0)
    assert_same(result, generate(tiny_pipeline(), 0.0))


@pytest.mark.parametrize("change", ["seed", "prompt", "embeds", "size", "mode", "aggregation", "crop", "model", "frames"])
def test_any_other_change_never_replays(change):
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    generate(pipe, -math.inf)
    kwargs = {}
    if change == "seed":
        kwargs["seed"] = 6
    elif change == "prompt":
        kwargs["prompt"] = "a blue cube"
    elif change == "embeds":
        kwargs["embeds_seed"] = 2
    elif change == "size":
        kwargs["width"] = WIDTH + 16
    elif change == "mode":
        kwargs["mode"] = "first_block_only"
    elif change == "aggregation":
        pipe.router.aggregation = "mean"
    elif change == "crop":
        pipe.router.crop = "full"
    elif change == "model":
        from wan_fixtures import tiny_wan

        pipe.drafter.model = tiny_wan(seed=7)
    if change == "frames":
        pipe.router.tau = 0.0
        result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=33, width=WIDTH, height=HEIGHT, seed=5)
    else:
        result = generate(pipe, 0.0, **kwargs)
    assert result.report["replay"]["replayed_blocks"] == 0
    assert not any(r.replayed for r in result.blocks)


def test_memory_cap_is_honoured():
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    generate(pipe, -math.inf)
    one = pipe.memo.nbytes
    assert one > 0
    pipe.memo = ReplayMemo(max_bytes=int(one * 1.5))  # room for one recording, not two
    generate(pipe, -math.inf, seed=1)
    generate(pipe, -math.inf, seed=2)
    assert len(pipe.memo) == 1 and pipe.memo.nbytes <= pipe.memo.max_bytes
    assert generate(pipe, 0.0, seed=2).report["replay"]["replayed_blocks"] >= 1
    assert generate(pipe, 0.0, seed=1).report["replay"]["replayed_blocks"] == 0  # the oldest was dropped
    tiny = ReplayMemo(max_bytes=10)
    pipe.memo = tiny
    assert not generate(pipe, 0.0).report["replay"]["kept_for_replay"]
    assert len(tiny) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        ReplayMemo(max_bytes=-1)


def test_cancel_during_a_replayed_run_leaves_the_memo_usable():
    taus = taus_for("global_cache")
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    generate(pipe, -math.inf)
    token = CancelToken()
    calls = []

    def cancel_on_second_call(component, kind):
        calls.append(component)
        if len(calls) == 2:
            token.cancel()

    pipe.router.tau = math.inf
    with pytest.raises(GenerationCancelled):
        pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                      cancel=token, before_call=cancel_on_second_call)
    for tau in taus:
        assert_same(generate(pipe, tau), generate(tiny_pipeline(), tau))


def test_free_interval_is_where_no_decision_changes():
    taus = taus_for("global_cache")
    mixed = [t for t in taus if math.isfinite(t)]
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    result = generate(pipe, mixed[1])
    interval = result.report["free_tau_interval"]
    scores = [r.decision.block_score for r in result.blocks if r.decision is not None]
    assert interval["flip_tau_per_block"] == [None] + scores
    above, up_to = interval["above"], interval["up_to"]
    assert above == max(r.decision.block_score for r in result.blocks if r.decision and not r.decision.accept)
    assert up_to == min(r.decision.block_score for r in result.blocks if r.decision and r.decision.accept)
    assert above < mixed[1] <= up_to
    # Anywhere inside: every block replays, no model runs; just outside either end: the first flip regenerates.
    inside = generate(pipe, up_to)
    assert inside.report["replay"]["replayed_blocks"] == 4 and inside.report["model_calls"]["target"] == {}
    assert generate(pipe, above).report["replay"]["replayed_blocks"] < 4  # tau == the highest reject accepts it
    assert generate(tiny_pipeline(), 0.0, mode="target_only").report["free_tau_interval"] is None


@pytest.mark.parametrize("tau_mode", ["relative", "anchor", "baseline"])
def test_free_interval_in_the_reference_modes_is_in_the_compared_margin(tau_mode):
    """In the reference modes tau is compared with the margin block_score - reference_score: the free interval is
    given in that space, and it is exactly what a replay re-decides (inside: every block replays; just outside either
    end: one decision flips)."""
    from sdvg_engine.router import COMPARED_QUANTITY, RewardRouter

    def pipeline():
        pipe = tiny_pipeline()
        pipe.router = RewardRouter(shared_parts()["scorer"], tau_mode=tau_mode)
        return pipe

    probe = generate(pipeline(), -math.inf)
    margins = sorted(r.decision.block_score - r.decision.reference_score for r in probe.blocks if r.decision)
    tau = (margins[0] + margins[1]) / 2
    pipe = pipeline()
    pipe.memo = ReplayMemo()
    result = generate(pipe, tau)
    interval = result.report["free_tau_interval"]
    assert interval["compared"] == COMPARED_QUANTITY[tau_mode] and interval["tau_mode"] == tau_mode
    drafted = [r.decision for r in result.blocks if r.decision is not None]
    assert {d.accept for d in drafted} == {True, False}
    assert interval["flip_tau_per_block"] == [None] + [d.block_score - d.reference_score for d in drafted]
    above, up_to = interval["above"], interval["up_to"]
    assert above == max(d.block_score - d.reference_score for d in drafted if not d.accept)
    assert up_to == min(d.block_score - d.reference_score for d in drafted if d.accept)
    assert above < tau <= up_to
    for inside in (up_to, math.nextafter(above, math.inf), (above + up_to) / 2):
        replay = generate(pipe, inside).report
        assert replay["replay"]["replayed_blocks"] == 4 and replay["model_calls"]["target"] == {}, inside
    for outside in (above, math.nextafter(up_to, math.inf)):  # the highest reject kept / the lowest accept rejected
        assert generate(pipe, outside).report["replay"]["replayed_blocks"] < 4, outside


def test_a_carried_adaptive_state_sees_replayed_drafts():
    from sdvg_engine.router import RewardRouter

    def adaptive_pipe():
        pipe = tiny_pipeline()
        pipe.router = RewardRouter(shared_parts()["scorer"], tau_mode="accept_rate", accept_rate=0.5)
        return pipe

    pipe = adaptive_pipe()
    pipe.memo = ReplayMemo()
    first_state, second_state, fresh_state = pipe.router.new_tau_state(), pipe.router.new_tau_state(), pipe.router.new_tau_state()
    opts = dict(prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5)
    pipe.generate(prompt_embeds(), tau_state=first_state, **opts)
    replayed = pipe.generate(prompt_embeds(), tau_state=second_state, **opts)
    fresh = adaptive_pipe().generate(prompt_embeds(), tau_state=fresh_state, **opts)
    assert replayed.report["replay"]["replayed_blocks"] == 4
    assert_same(replayed, fresh)
    assert second_state.scores == fresh_state.scores == first_state.scores and len(fresh_state.scores) == 3


def test_a_recording_over_the_cap_keeps_its_longest_prefix_and_is_released():
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    full = generate(pipe, -math.inf)
    recording = pipe.memo.lookup(pipe.memo._recordings[0].key)[0]
    assert len(recording.blocks) == 4 and all(b.pixels is not None for b in recording.blocks)
    assert not hasattr(recording.blocks[0], "vae_after")  # no VAE decode cache is ever recorded
    prefix_bytes = type(recording)(recording.key, recording.blocks[:2]).nbytes
    pipe.memo = ReplayMemo(max_bytes=prefix_bytes)
    capped = generate(pipe, -math.inf, seed=7)
    assert capped.report["replay"]["kept_for_replay"] and capped.report["replay"]["recorded_blocks"] == 2
    assert pipe._run.recording is None  # the run keeps nothing once it has returned
    # The prefix still replays, and the rest equals a fresh run.
    again = generate(pipe, -math.inf, seed=7)
    assert again.report["replay"]["replayed_blocks"] == 2
    assert_same(again, generate(tiny_pipeline(), -math.inf, seed=7))
    assert full.report["replay"]["recorded_blocks"] == 4


def test_identical_replays_do_not_pile_up_recordings():
    pipe = tiny_pipeline()
    pipe.memo = ReplayMemo()
    for _ in range(5):
        generate(pipe, -math.inf)  # every run after the first is a whole replay with the same decisions
    assert len(pipe.memo) == 1
