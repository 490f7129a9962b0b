"""Prompt schedules (issue 39): each block under its own prompt through both models, the router and replay.

The reference path for a switch: a model that had seen only the new prompt, given the same committed blocks, makes
the same next block (its KV cache holds the committed frames' K/V under the prompt of the block it generates)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from sdvg_engine import PromptSchedule, SDVGOptions, SeededNoise, parse_schedule  # noqa: E402
from sdvg_engine.context import GlobalCache, RecomputeWindow  # noqa: E402
from sdvg_engine.generator import CausalGenerator  # noqa: E402
from sdvg_engine.memo import ReplayMemo  # noqa: E402
from sdvg_engine.pipeline import SpeculativePipeline, pad_text, unit_frames  # noqa: E402
from sdvg_engine.router import RewardRouter, TauState, temporal_consistency  # noqa: E402
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts  # noqa: E402

FRAMES, SEED = 45, 5  # 4 blocks
RED, BLUE, GREEN = "a red ball rolling on grass", "a blue cube on a table", "a green cone in snow"


def pipeline(scheme: str = "global_cache", *, tau: float = 0.0, tau_mode: str = "fixed") -> SpeculativePipeline:
    parts = shared_parts()

    def context():
        return GlobalCache(21) if scheme == "global_cache" else RecomputeWindow(3, anchor_encoder=parts["vae"])

    drafter = CausalGenerator(parts["drafter"], schedule="self_forcing", context=context())
    target = CausalGenerator(parts["target"], schedule="krea", context=context())
    return SpeculativePipeline(drafter, target, parts["vae"], RewardRouter(parts["scorer"], tau=tau, tau_mode=tau_mode))


def two_prompts(switch: int = 2, second=(2, BLUE)):
    return [(0, prompt_embeds(1), RED), (switch, prompt_embeds(second[0]), second[1])]


def run(pipe, schedule, workers=1, **options):
    return pipe.generate(prompt_schedule=schedule, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=SEED,
                         options=SDVGOptions(**options), workers=workers)


def block_latents(result, b: int) -> torch.Tensor:
    return result.latents[:, :, 3 * b: 3 * b + 3]


# ---- the switch itself ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["global_cache", "recompute_window"])
def test_after_a_switch_each_model_equals_one_that_only_saw_the_new_prompt(scheme):
    """Blocks after the switch equal what a fresh model started on the new prompt makes from the same committed
    blocks (global cache: re-cached; recompute window: rebuilt under the new text); the blocks before it equal the
    one-prompt run's."""
    pipe = pipeline(scheme)
    mode, gen = ("draft_only", pipe.drafter) if scheme == "global_cache" else ("target_only", pipe.target)
    scheduled = run(pipe, two_prompts(), mode=mode)
    one_prompt = run(pipe, [(0, prompt_embeds(1), RED)], mode=mode)
    assert torch.equal(scheduled.latents[:, :, :6], one_prompt.latents[:, :, :6])
    assert not torch.equal(block_latents(scheduled, 2), block_latents(one_prompt, 2))
    assert gen.calls["text"] == 0  # the last run had one prompt: no switch

    fresh = CausalGenerator(gen.model, schedule=gen.schedule, context=type(gen.context)(
        *((21,) if scheme == "global_cache" else (3, None, pipe.vae))))
    fresh.start(pad_text(prompt_embeds(2)), latent_height=HEIGHT // 8, latent_width=WIDTH // 8, num_blocks=4)
    pipe.vae.reset()
    for b in range(4):
        if b >= 2:
            made = fresh.generate_block(b, SeededNoise(SEED)).latents
            assert torch.equal(made, block_latents(scheduled, b)), f"block {b}"
        latents = block_latents(scheduled, b)
        fresh.commit_block(b, latents, pipe.vae.decode_block(latents))


def test_a_global_cache_switch_re_caches_the_committed_blocks_and_encodes_the_text_once():
    pipe = pipeline("global_cache")
    run(pipe, two_prompts(switch=3), mode="draft_only")
    # Commits of blocks 0, 1, 2 under the first prompt (one before each block), then at the switch all three again.
    assert pipe.drafter.calls == {"denoise": 16, "commit": 3 + 2, "text": 1}
    run(pipe, [(0, prompt_embeds(1), RED)], mode="draft_only")
    assert pipe.drafter.calls == {"denoise": 16, "commit": 3}


def test_one_entry_schedule_runs_the_one_prompt_run():
    pipe = pipeline()
    a = pipe.generate(prompt_embeds(1), prompt=RED, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=SEED)
    b = run(pipe, [(0, prompt_embeds(1), RED)])
    assert torch.equal(a.frames, b.frames) and torch.equal(a.latents, b.latents)
    assert a.report["settings"]["prompt_schedule"] == [{"first_block": 0, "first_frame": 0, "prompt": RED}]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_block_after_a_switch_is_the_targets_and_drafts_are_scored_against_their_own_prompt(workers):
    pipe = pipeline(tau=-1e9)
    result = run(pipe, two_prompts(), workers=workers, target_after_switch=True)
    assert [r.source for r in result.blocks] == ["target", "draft", "target", "draft"]
    assert result.blocks[2].decision is None and not result.blocks[2].drafted
    assert result.report["settings"]["prompt_schedule"] == [
        {"first_block": 0, "first_frame": 0, "prompt": RED}, {"first_block": 2, "first_frame": 21, "prompt": BLUE}]
    scorer = pipe.router.scorer
    for b, prompt in ((1, RED), (3, BLUE)):
        frames = result.frames[result.blocks[b].video_frames[0]: result.blocks[b].video_frames[1]]
        expected = scorer.score_frames(frames.permute(0, 3, 1, 2), scorer.encode_prompt(prompt)).scores
        assert torch.allclose(torch.tensor(result.blocks[b].decision.frame_scores), expected, atol=1e-5), b
    off = run(pipe, two_prompts(), workers=workers)  # the default: the router decides the switch block too
    assert [r.source for r in off.blocks] == ["target", "draft", "draft", "draft"]


def test_random_mode_gives_the_switch_block_to_the_target_without_a_draw():
    pipe = pipeline()
    result = run(pipe, two_prompts(), mode="random", random_accept_prob=1.0, target_after_switch=True)
    assert [(r.source, r.drafted, r.decision) for r in result.blocks] == [
        ("target", False, None), ("draft", True, result.blocks[1].decision), ("target", False, None),
        ("draft", True, result.blocks[3].decision)]


# ---- routing across a switch ------------------------------------------------------------------------------------
def _block_score(pipe, result, b, prompt, previous_block=None):
    scorer = pipe.router.scorer
    frames = unit_frames(result.frames[slice(*result.blocks[b].video_frames)].permute(3, 0, 1, 2)[None] * 2 - 1)
    scores = scorer.score_frames(frames, scorer.encode_prompt(prompt))
    return pipe.router.block_score(scores.scores, temporal_consistency(scores.image_features, None))


def test_reset_compares_the_first_draft_after_a_switch_with_the_switch_block_under_the_new_prompt():
    pipe = pipeline(tau=-1e9, tau_mode="relative")
    result = run(pipe, two_prompts(), target_after_switch=True, switch_routing="reset")
    reference = result.blocks[3].decision.reference_score
    assert reference == pytest.approx(_block_score(pipe, result, 2, BLUE), abs=1e-5)
    assert reference != pytest.approx(_block_score(pipe, result, 2, RED), abs=1e-3)
    carry = run(pipe, two_prompts())  # the defaults: the router decides block 2, its state carried
    # carry: block 2's draft is compared with block 1 as it was scored (an accepted draft: its own score, old prompt)
    assert carry.blocks[2].decision.reference_score == pytest.approx(carry.blocks[1].decision.block_score, abs=0)


def test_reset_restarts_accept_rates_pool_and_carry_keeps_it():
    pipe = pipeline(tau_mode="accept_rate")
    pipe.router.accept_rate = 0.5
    prior = pipe.router.block_tau(TauState())
    reset = run(pipe, two_prompts(), switch_routing="reset")
    assert reset.blocks[2].decision.tau == pytest.approx(prior)
    carry = run(pipe, two_prompts())
    state = TauState()
    state.observe(carry.blocks[1].decision.block_score)
    assert carry.blocks[2].decision.tau == pytest.approx(pipe.router.block_tau(state))
    assert carry.blocks[2].decision.tau != pytest.approx(prior)


# ---- replay -----------------------------------------------------------------------------------------------------
def test_changing_only_the_last_prompt_replays_every_block_before_it():
    pipe = pipeline(tau=-1e9)
    pipe.memo = ReplayMemo()
    run(pipe, two_prompts(switch=3))
    steered = run(pipe, two_prompts(switch=3, second=(3, GREEN)))
    assert steered.report["replay"]["replayed_blocks"] == 3
    pipe.memo = None
    fresh = run(pipe, two_prompts(switch=3, second=(3, GREEN)))
    assert torch.equal(steered.frames, fresh.frames) and torch.equal(steered.latents, fresh.latents)
    moved = run(pipe, two_prompts(switch=2, second=(3, GREEN)))  # another switch block: blocks from 2 on differ
    assert not torch.equal(moved.latents[:, :, 6:], fresh.latents[:, :, 6:])


@pytest.mark.parametrize("tau_mode", ["fixed", "accept_rate"])
def test_a_tau_change_on_a_scheduled_run_replays_and_equals_a_fresh_run(tau_mode):
    pipe = pipeline(tau_mode=tau_mode)
    first = run(pipe, two_prompts(switch=2), target_after_switch=False)
    scores = sorted(r.decision.block_score for r in first.blocks if r.decision is not None)
    pipe.memo = ReplayMemo()
    if tau_mode == "fixed":
        pipe.router.tau = scores[-1] + 1.0  # accept nothing: the first draft's decision changes
        run(pipe, two_prompts(switch=2), target_after_switch=False)
        pipe.router.tau = -1e9  # accept everything
    else:
        pipe.router.accept_rate = 0.05
        run(pipe, two_prompts(switch=2), target_after_switch=False)
        pipe.router.accept_rate = 0.95
    replayed = run(pipe, two_prompts(switch=2), target_after_switch=False)
    assert replayed.report["replay"]["replayed_blocks"] >= 1
    pipe.memo = None
    fresh = run(pipe, two_prompts(switch=2), target_after_switch=False)
    assert torch.equal(replayed.frames, fresh.frames)
    assert [r.source for r in replayed.blocks] == [r.source for r in fresh.blocks]


# ---- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, options, message", [
    ([(1, prompt_embeds(1), RED)], {}, "entry 0 starts at block 1; the first entry must start at block 0"),
    ([(0, prompt_embeds(1), RED), (4, prompt_embeds(2), BLUE)], {}, "beyond the video's 4 blocks"),
    ([(0, prompt_embeds(1), RED), (2, prompt_embeds(2), BLUE), (1, prompt_embeds(3), GREEN)], {},
     "entry 2 starts at block 1, not after entry 1"),
    ([(0, prompt_embeds(1), RED), (2, prompt_embeds(2), " ")], {}, "entry 1 (block 2): the reward prompt is empty"),
    ([(0, prompt_embeds(1), RED), (2, torch.zeros(1, 8, 7), BLUE)], {}, "entry 1 (block 2): text context must be"),
    ([(0, prompt_embeds(1), RED), (2, prompt_embeds(2)[0], BLUE)], {}, "entry 1 (block 2): text context must be"),
    ("0: a red ball", {}, "prompt_schedule must be a list of (first_block, prompt_embeds, reward_prompt)"),
    ([], {}, "prompt_schedule is empty"),
])
def test_bad_schedules_are_refused_before_any_model_runs(schedule, options, message):
    pipe = pipeline()
    with pytest.raises(ValueError, match=re.escape(message)):
        run(pipe, schedule, **options)
    assert pipe.target.calls == {} or sum(pipe.target.calls.values()) == 0


def test_reference_mode_reset_without_a_target_block_after_the_switch_is_refused():
    pipe = pipeline(tau_mode="relative")
    with pytest.raises(ValueError, match="the first block after a switch has none: keep target_after_switch on"):
        run(pipe, two_prompts(), switch_routing="reset")
    run(pipe, two_prompts())  # carry (the default): allowed
    run(pipe, two_prompts(), switch_routing="reset", target_after_switch=True)  # allowed


def test_prompt_embeds_and_a_schedule_together_are_refused():
    with pytest.raises(ValueError, match="pass either prompt_embeds and prompt"):
        pipeline().generate(prompt_embeds(1), prompt=RED, prompt_schedule=two_prompts(), num_frames=FRAMES,
                            width=WIDTH, height=HEIGHT)


def test_options_refuse_an_unknown_switch_routing():
    with pytest.raises(ValueError, match=r"switch_routing must be one of \('reset', 'carry'\), got 'rescale'"):
        SDVGOptions(switch_routing="rescale")
    with pytest.raises(ValueError, match="target_after_switch"):
        SDVGOptions(target_after_switch="no")


# ---- what users write -------------------------------------------------------------------------------------------
def test_the_line_and_json_forms_give_the_same_schedule():
    lines = parse_schedule("# steer the ball\n0: a red ball\n\n33: a blue ball\n", 81)
    as_json = parse_schedule('[{"frame": 0, "prompt": "a red ball"}, [33, "a blue ball"]]', 81)
    assert lines == as_json == [(0, "a red ball", "a red ball"), (3, "a blue ball", "a blue ball")]
    assert parse_schedule('[{"frame": 0, "prompt": "x", "reward_prompt": "y"}]', 81) == [(0, "x", "y")]


@pytest.mark.parametrize("text, message", [
    ("0: a\n30: b", "line 2: frame 30 is not the start of a block; prompts change between blocks: use 21 or 33"),
    ("0: a\n81: b", "line 2: starts at frame 81, beyond the 81-frame video"),
    ("0: a\n33: b\n21: c", "line 3: frame 21 comes before the previous entry's frame 33"),
    ("0: a\n21: b\n21: c", "line 3: frame 21 repeats the previous entry's frame 21"),
    ("0: a\n21:   ", "line 2: the prompt is empty"),
    ("9: a", "line 1: the first entry starts at frame 9; it must start at frame 0"),
    ("a red ball", "line 1: expected `frame: prompt`"),
    ("# only a comment\n", "holds no entries"),
    ('[{"frame": 0}]', 'entry 1: needs "frame" and "prompt"'),
    ('[{"frame": 0, "text": "a"}]', "entry 1: unknown keys"),
    ("[0: a]", "not valid JSON"),
])
def test_what_users_write_is_checked_with_the_line_and_the_fix(text, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        parse_schedule(text, 81, source="my.txt")
    assert str(err.value).startswith("my.txt")


def test_a_switches_only_text_refuses_frame_zero():
    assert parse_schedule("33: b", 81, opening=False) == [(3, "b", "b")]
    with pytest.raises(ValueError, match="starts at frame 0, which the opening prompt"):
        parse_schedule("0: a\n33: b", 81, opening=False)


def test_schedule_reading():
    schedule = PromptSchedule.of(two_prompts(switch=2))
    assert [schedule.segment_index(b) for b in range(4)] == [0, 0, 1, 1]
    assert [schedule.starts_segment(b) for b in range(4)] == [False, False, True, False]
    digests = schedule.block_digests(4)
    assert digests[0] == digests[1] != digests[2] == digests[3]


# ---- real size --------------------------------------------------------------------------------------------------
def test_a_switch_at_real_size_holds_one_prompts_text_kv_per_model_and_re_caches_the_drafter():
    """832x480x81 with the 14B on the meta device: a switch keeps one prompt's cross-attention K/V per model (the
    14B's: 40 layers x K and V x 512 rows x 5120 x bf16 = 0.39 GiB), holds the schedule's two text contexts on the
    host (8 MiB each) and costs the Self-Forcing drafter's global cache one t=0 pass per block before the switch."""
    from sdvg_engine.dry_run import DryRunConfig, dry_run

    plain = dry_run(DryRunConfig(preset="native", mode="draft_only", workers=1))
    switched = dry_run(DryRunConfig(preset="native", mode="draft_only", workers=1, switch_at=3))
    assert switched.device == plain.device
    assert switched.host["prompt schedule (text contexts)"] == 2 * 512 * 4096 * 4
    assert switched.report["model_calls"]["drafter"] == {"denoise": 28, "commit": 6 + 2, "text": 1}
    from sdvg_engine.dry_run import meta_stack

    target = meta_stack().target
    assert sum(t.nbytes for t in target.encode_text(torch.zeros(1, 512, 4096)).keys) * 2 == 40 * 2 * 512 * 5120 * 2


def test_reset_makes_baseline_and_anchor_read_only_the_segments_blocks():
    """baseline: the mean of the segment's committed blocks (here the switch block alone, under the new prompt);
    anchor: the segment's first block; carry reads the whole video as it was scored."""
    for tau_mode in ("baseline", "anchor"):
        pipe = pipeline(tau=-1e9, tau_mode=tau_mode)
        result = run(pipe, two_prompts(), target_after_switch=True, switch_routing="reset")
        assert result.blocks[3].decision.reference_score == pytest.approx(_block_score(pipe, result, 2, BLUE), abs=1e-5)
        carry = run(pipe, two_prompts(), target_after_switch=True)
        block0 = _block_score(pipe, carry, 0, RED)
        expected = block0 if tau_mode == "anchor" else (block0 + carry.blocks[1].decision.block_score
                                                         + _block_score(pipe, carry, 2, BLUE)) / 3
        assert carry.blocks[3].decision.reference_score == pytest.approx(expected, abs=1e-5), tau_mode


def test_a_replay_across_a_switch_re_decides_with_the_pool_the_run_had():
    """accept_rate under reset: a rerun with the same settings replays every block with the decisions (and
    thresholds) of the run that made them, the pool restarted at the switch as there."""
    pipe = pipeline(tau_mode="accept_rate")
    pipe.router.accept_rate = 0.5
    pipe.memo = ReplayMemo()
    first = run(pipe, two_prompts(), switch_routing="reset")
    again = run(pipe, two_prompts(), switch_routing="reset")
    assert again.report["replay"]["replayed_blocks"] == 4
    assert [r.decision.tau for r in again.blocks[1:]] == [r.decision.tau for r in first.blocks[1:]]


def test_a_switch_stopped_in_its_text_encode_leaves_the_models_usable():
    """A cancel or an error inside the new prompt's text encode: the next run (on the prompt the model held before)
    encodes its text again instead of reusing a half-switched state, and equals a run that never failed."""
    pipe = pipeline(tau=-1e9)
    before = run(pipe, [(0, prompt_embeds(1), RED)])
    encode = pipe.drafter.model.encode_text

    def stopped(embeds):
        raise RuntimeError("stopped inside the text encode")

    pipe.drafter.model.encode_text = stopped
    try:
        with pytest.raises(RuntimeError, match="stopped inside the text encode"):
            run(pipe, two_prompts())
    finally:
        pipe.drafter.model.encode_text = encode
    after = run(pipe, [(0, prompt_embeds(1), RED)])
    assert torch.equal(after.frames, before.frames) and torch.equal(after.latents, before.latents)
