"""Issue 24 in the pipeline: prompt-normalised thresholds (``tau_mode`` anchor / baseline), random routing decided
before drafting, and a schedule with a router's veto.

Decisions are checked by hand from the run's own output frames (scored again independently), and every mode that
decides without a draft is checked bit for bit against a run in which the same decisions are forced after drafting."""

from __future__ import annotations

import math

import pytest
import torch

from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.router import RandomRouter, RewardRouter
from sdvg_fixtures import HEIGHT, WIDTH, CountingScorer, ForcedRouter as Forced, prompt_embeds, shared_parts, tiny_pipeline

PROMPT = "a red ball rolling on grass"
FRAMES = 57  # 5 blocks


def run(pipe, seed=5, workers=1, **opts):
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed,
                         options=SDVGOptions(**opts), workers=workers)


def same_video(a, b) -> bool:
    return (torch.equal(a.frames, b.frames) and torch.equal(a.latents, b.latents)
            and torch.equal(a.acceptance_mask, b.acceptance_mask))


def score_of(result, block) -> float:
    """min over the block's output frames of the tiny scorer's scores (not the report's numbers)."""
    frames = result.frames[slice(*block.video_frames)].permute(0, 3, 1, 2).contiguous()
    return float(shared_parts()["scorer"].score_frames(frames, PROMPT).scores.min())


def mixed(tau_mode):
    """A tau at which a ``tau_mode`` run keeps some drafts and regenerates others (from the margins of an
    all-accept and an all-reject run), and that run."""
    margins = []
    for tau in (-math.inf, math.inf):
        pipe = tiny_pipeline()
        pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode=tau_mode)
        margins += [b.decision.block_score - b.decision.reference_score for b in run(pipe).blocks if b.decision]
    for tau in sorted(margins):
        pipe = tiny_pipeline()
        pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode=tau_mode)
        result = run(pipe)
        if {"draft", "target"} <= {b.source for b in result.blocks[1:]}:
            return tau, result
    pytest.fail(f"no tau among the margins {margins} gives a mixed {tau_mode} run")


# ----------------------------------------------------------------------------------- router, by hand
def test_reference_of_by_hand():
    scorer = shared_parts()["scorer"]
    committed = [0.5, None, 2.0]
    assert RewardRouter(scorer, tau_mode="anchor").reference_of(committed) == 0.5
    assert RewardRouter(scorer, tau_mode="relative").reference_of([0.5, 1.0, 2.0]) == 2.0
    assert RewardRouter(scorer, tau_mode="baseline").reference_of([0.5, 1.0, 2.0]) == pytest.approx(3.5 / 3)
    assert RewardRouter(scorer, tau_mode="fixed").reference_of(committed) is None
    with pytest.raises(ValueError, match="needs the score of every committed block"):
        RewardRouter(scorer, tau_mode="baseline").reference_of(committed)
    with pytest.raises(ValueError, match="block 0 must be the target's"):
        RewardRouter(scorer, tau_mode="anchor").reference_of([])
    # which committed target blocks must be scored for later references
    needs = {m: [RewardRouter(scorer, tau_mode=m).needs_committed_score(b) for b in range(3)]
             for m in ("fixed", "accept_rate", "relative", "anchor", "baseline")}
    assert needs == {"fixed": [False] * 3, "accept_rate": [False] * 3, "relative": [True] * 3,
                     "anchor": [True, False, False], "baseline": [True] * 3}
    # anchor: draft 0.2 against block 0's 0.5 with tau -0.25: 0.2 - 0.5 = -0.3 < -0.25 -> reject; tau -0.3 keeps it
    anchor = RewardRouter(scorer, tau_mode="anchor", tau=-0.25)
    assert not anchor.decide([0.4, 0.2], reference=0.5).accept
    d = anchor.decide([0.4, 0.2], reference=0.5, tau=-0.3)
    assert d.accept and d.reference_score == 0.5 and d.block_score == pytest.approx(0.2)
    with pytest.raises(ValueError, match="tau_mode 'anchor' decides against block 0's score"):
        anchor.decide([0.2])


# ------------------------------------------------------------------------------ anchor and baseline runs
@pytest.mark.parametrize("tau_mode", ["anchor", "baseline"])
def test_reference_modes_follow_the_rule_on_the_output(tau_mode):
    tau, result = mixed(tau_mode)
    committed = [score_of(result, result.blocks[0])]  # block 0: the target's, scored from the output frames
    for block in result.blocks[1:]:
        d = block.decision
        expected = committed[0] if tau_mode == "anchor" else sum(committed) / len(committed)
        assert d.reference_score == pytest.approx(expected, abs=1e-5), block.index
        assert d.block_score == pytest.approx(min(d.frame_scores))
        assert block.source == ("draft" if d.block_score - d.reference_score >= tau else "target")
        committed.append(d.block_score if block.source == "draft" else score_of(result, block))


@pytest.mark.parametrize("tau_mode", ["anchor", "baseline"])
def test_reference_modes_score_only_the_target_blocks_they_read(tau_mode):
    tau, expected = mixed(tau_mode)
    counter = CountingScorer(shared_parts()["scorer"])
    pipe = tiny_pipeline()
    pipe.router = RewardRouter(counter, tau=tau, tau_mode=tau_mode)
    out = run(pipe)
    assert [b.source for b in out.blocks] == [b.source for b in expected.blocks]
    drafts = [12 for b in out.blocks if b.drafted]
    last = len(out.blocks) - 1
    if tau_mode == "anchor":  # block 0 (9 frames) and nothing else of the target's
        targets = [9]
    else:  # every target block a later draft's baseline reads
        targets = [b.video_frames[1] - b.video_frames[0] for b in out.blocks if b.source == "target" and b.index < last]
    seams = [1 for b in out.blocks if b.source == "target" and b.index < last]
    assert sorted(counter.calls) == sorted(drafts + targets + seams)


def test_anchor_replays_a_tau_change_bit_for_bit():
    tau, _ = mixed("anchor")
    pipe = tiny_pipeline()
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=-math.inf, tau_mode="anchor")
    pipe.memo = ReplayMemo()
    run(pipe)
    pipe.router.tau = tau
    replayed = run(pipe)
    assert replayed.report["replay"]["replayed_blocks"] >= 1
    fresh = tiny_pipeline()
    fresh.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode="anchor")
    reference = run(fresh)
    assert same_video(replayed, reference)
    assert [b.decision and b.decision.reference_score for b in replayed.blocks] == \
        [b.decision and b.decision.reference_score for b in reference.blocks]


# ------------------------------------------------------------------------------ random, decided before drafting
@pytest.mark.parametrize("workers", [1, 2])
def test_random_never_drafts_a_block_it_gives_the_target(workers):
    p, seed = 0.5, 11
    draws = RandomRouter(p, seed, key=PROMPT)
    keep = [False] + [draws.decide_block(b).accept for b in range(1, 5)]
    assert 0 < sum(keep) < 4, keep  # a mixed run (seed chosen for it)
    pipe = tiny_pipeline()
    pipe.router = None  # random mode needs no reward model
    result = run(pipe, seed=seed, workers=workers, mode="random", random_accept_prob=p)
    assert [b.source == "draft" for b in result.blocks] == keep
    assert [b.drafted for b in result.blocks] == keep  # the drafter never ran on a target block
    assert pipe.drafter.calls.get("denoise", 0) == pipe.drafter.schedule.num_steps * sum(keep)
    assert result.report["schedule"]["speculative_target_blocks"] == 0
    # every later block was given to the router: the report's acceptance is over those, as before
    acceptance = result.report["acceptance"]
    assert acceptance["drafted_blocks"] == 4 and acceptance["accepted_blocks"] == sum(keep)
    assert [b.decision is not None for b in result.blocks] == [False, True, True, True, True]
    forced = tiny_pipeline()
    forced.router = Forced(shared_parts()["scorer"], keep)
    assert same_video(result, run(forced, seed=seed))


# ------------------------------------------------------------------------------ schedule with a veto
@pytest.mark.parametrize("workers", [1, 2])
def test_schedule_veto_scores_only_the_drafted_blocks(workers):
    every = 2  # blocks 0, 2, 4 by the target, before drafting; 1 and 3 drafted and judged
    counter = CountingScorer(shared_parts()["scorer"])
    pipe = tiny_pipeline()
    pipe.router = RewardRouter(counter, tau=math.inf)  # the veto rejects every draft it sees
    result = run(pipe, workers=workers, mode="schedule", schedule_every=every, schedule_veto=True)
    assert [b.source for b in result.blocks] == ["target"] * 5
    assert [b.drafted for b in result.blocks] == [False, True, False, True, False]
    assert pipe.drafter.calls.get("denoise", 0) == pipe.drafter.schedule.num_steps * 2
    assert sorted(c for c in counter.calls if c > 1) == [12, 12]  # the two drafts, nothing else scored whole
    # a veto that keeps everything is the plain schedule, bit for bit
    keep_all = tiny_pipeline()
    keep_all.router = RewardRouter(shared_parts()["scorer"], tau=-math.inf)
    plain = tiny_pipeline()
    plain.router = None
    assert same_video(run(keep_all, mode="schedule", schedule_every=every, schedule_veto=True),
                      run(plain, mode="schedule", schedule_every=every))
    # and the vetoed run equals the same decisions forced after drafting every block
    forced = tiny_pipeline()
    forced.router = Forced(shared_parts()["scorer"], [False] * 5)
    assert same_video(result, run(forced))


def test_schedule_veto_with_a_relative_router_follows_the_rule():
    pipe = tiny_pipeline()
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=0.0, tau_mode="relative")
    result = run(pipe, mode="schedule", schedule_every=3, schedule_veto=True)
    assert [b.drafted for b in result.blocks] == [False, True, True, False, True]
    for block in result.blocks:
        if not block.drafted:
            assert block.source == "target" and block.decision is None
            continue
        previous = result.blocks[block.index - 1]
        expected = previous.decision.block_score if previous.source == "draft" else score_of(result, previous)
        assert block.decision.reference_score == pytest.approx(expected, abs=1e-5)
        assert block.source == ("draft" if block.decision.block_score - expected >= 0.0 else "target")


def test_schedule_veto_needs_a_router_and_a_bool():
    with pytest.raises(ValueError, match="schedule_veto scores each drafted block with the reward router"):
        SDVGOptions(mode="schedule", schedule_veto=True).validate(None)
    with pytest.raises(ValueError, match="schedule_veto must be True or False"):
        SDVGOptions(mode="schedule", schedule_veto="yes").validate(None)
    SDVGOptions(mode="schedule", schedule_veto=False).validate(None)  # the plain schedule needs no router


# ------------------------------------------------------------------------------ defaults follow the evidence
def test_default_router_is_relative_and_the_papers_is_one_setting_away():
    from sdvg_engine.router import DEFAULT_ROUTER_OPTIONS, PAPER_ROUTER_OPTIONS, default_router_options

    assert DEFAULT_ROUTER_OPTIONS == {"tau_mode": "relative", "tau": -0.25}
    assert PAPER_ROUTER_OPTIONS == {"tau_mode": "fixed", "tau": -0.7}
    assert default_router_options(None) == default_router_options({}) == DEFAULT_ROUTER_OPTIONS
    # a tau alone is on the paper's fixed scale (the only one before the default changed)
    assert default_router_options({"tau": -0.7}) == PAPER_ROUTER_OPTIONS
    assert default_router_options({"tau_mode": "fixed"}) == {"tau_mode": "fixed"}  # RewardRouter's own tau: -0.7
    assert RewardRouter(shared_parts()["scorer"], **default_router_options({"tau_mode": "fixed"})).tau == -0.7
    assert default_router_options({"tau_mode": "anchor", "aggregation": "mean"}) == {
        "tau_mode": "anchor", "tau": -0.25, "aggregation": "mean"}


@pytest.mark.parametrize("flags, expected", [
    ([], ("relative", -0.25)),
    (["--tau", "-0.7"], ("fixed", -0.7)),  # the paper's router, one setting away
    (["--tau-mode", "fixed"], ("fixed", -0.7)),
    (["--tau-mode", "baseline"], ("baseline", -0.25)),
    (["--tau-mode", "relative", "--tau", "0.1"], ("relative", 0.1)),
    (["--taus=-1,-0.5"], ("fixed", -0.7)),
])
def test_cli_router_defaults(flags, expected):
    from sdvg_engine.cli import build_parser

    args = build_parser().parse_args(["generate", "--drafter", "d", "--target", "t", "--vae", "v", *flags])
    assert (args.tau_mode, args.tau) == expected
    bench = build_parser().parse_args(["bench", "--drafter", "d", "--target", "t", "--vae", "v", "--reward", "r",
                                       "--prompts-file", "p"])
    assert (bench.tau_mode, bench.taus) == ("relative", "-0.1,-0.25,-0.5,-1.0")
