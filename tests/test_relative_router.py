"""Relative routing (``tau_mode="relative"``): accept a draft when its score minus the last committed block's score
reaches tau. Decisions by hand, on a tiny real pipeline, with replay, and the validation errors."""

import json
import math

import pytest
import torch

from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.router import RewardRouter
from sdvg_fixtures import HEIGHT, WIDTH, CountingScorer, prompt_embeds, shared_parts, tiny_pipeline

PROMPT = "a red ball rolling on grass"
FRAMES = 45  # 4 blocks


def relative_pipeline(tau, **kw):
    pipe = tiny_pipeline(**kw)
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode="relative",
                               temporal_weight=kw.get("temporal_weight", 0.0))
    return pipe


def generate(pipe, tau=None, seed=5, **opts):
    if tau is not None:
        pipe.router.tau = tau
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed,
                         options=SDVGOptions(**opts))


# ------------------------------------------------------------------------------ decisions by hand
def test_relative_decisions_by_hand():
    router = RewardRouter(shared_parts()["scorer"], tau=0.2, tau_mode="relative")
    assert router.block_tau(None) == 0.2
    d = router.decide([0.5, 0.9, 0.7], reference=0.25)  # min 0.5, margin 0.25 >= 0.2
    assert d.accept and d.block_score == pytest.approx(0.5) and d.reference_score == 0.25 and d.tau == 0.2
    assert not router.decide([0.5, 0.9], reference=0.35).accept  # margin 0.15 < 0.2
    assert router.decide([0.5], reference=0.5, tau=0.0).accept  # margin 0 >= 0: equality accepts
    assert router.decide([-3.0], reference=-3.5, tau=0.5).accept  # only the difference counts, not the level
    assert not router.decide([3.0], reference=3.5, tau=-0.4).accept  # a drop of 0.5 is more than the 0.4 allowed
    mean = RewardRouter(shared_parts()["scorer"], tau=0.0, tau_mode="relative", aggregation="mean")
    assert mean.decide([0.2, 0.6], reference=0.35).accept and not mean.decide([0.2, 0.4], reference=0.35).accept
    # Explicit infinities and NaN, as in fixed mode.
    assert router.decide([math.nan], reference=0.0, tau=-math.inf).accept
    assert not router.decide([5.0], reference=-5.0, tau=math.inf).accept
    assert not router.decide([0.5], reference=math.nan).accept and not router.decide([math.nan], reference=0.0).accept
    with pytest.raises(ValueError, match="tau_mode 'relative' decides against the last committed block's score"):
        router.decide([0.5])
    with pytest.raises(ValueError, match="pass reference"):
        router.judge(torch.rand(2, 3, 32, 32), PROMPT)
    # Other modes ignore a reference and record none.
    fixed = RewardRouter(shared_parts()["scorer"], tau=0.2)
    assert fixed.decide([0.5], reference=10.0).accept and fixed.decide([0.5], reference=10.0).reference_score is None
    data = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert data["reference_score"] == 0.25 and data["tau"] == 0.2
    assert json.loads(json.dumps(router.decide([0.1], reference=math.nan).to_dict(), allow_nan=False))["reference_score"] is None


# ------------------------------------------------------------------------------ on the tiny pipeline
def _independent_score(scorer, frames_thwc, prompt):
    """min over frames of the scorer's frame scores, from the result's frames (the report's path not used)."""
    return float(scorer.score_frames(frames_thwc.permute(0, 3, 1, 2).contiguous(), prompt).scores.min())


@pytest.fixture(scope="module")
def mixed_run():
    """A relative-mode run whose later blocks include both accepted drafts and target regenerations."""
    margins = []
    for tau in (-math.inf, math.inf):  # all-accept and all-reject runs: margins seen along both paths
        r = generate(relative_pipeline(tau))
        margins += [b.decision.block_score - b.decision.reference_score for b in r.blocks if b.decision]
    for tau in sorted(margins):
        result = generate(relative_pipeline(tau))
        if {"draft", "target"} <= {b.source for b in result.blocks[1:]}:
            return tau, result
    pytest.fail(f"no tau among the margins {margins} gives a mixed run")


def test_relative_run_follows_the_rule_on_its_report(mixed_run):
    tau, result = mixed_run
    report = json.loads(json.dumps(result.report, allow_nan=False))
    scorer = shared_parts()["scorer"]
    assert report["settings"]["tau_mode"] == "relative" and report["tau_per_block"] == [None, tau, tau, tau]
    for b in range(1, 4):
        decision = report["blocks"][b]["decision"]
        previous = result.blocks[b - 1]
        if previous.source == "draft":
            expected_reference = previous.decision.block_score
        else:  # block 0 or a regenerated block: scored independently from the output frames
            expected_reference = _independent_score(scorer, result.frames[slice(*previous.video_frames)], PROMPT)
        assert decision["reference_score"] == pytest.approx(expected_reference, abs=1e-5)
        draft_score = min(decision["frame_scores"])
        assert decision["block_score"] == pytest.approx(draft_score)
        rule = draft_score - decision["reference_score"] >= tau
        assert report["decisions"][b] == ("draft" if rule else "target")
    assert report["blocks"][0]["decision"] is None


def test_target_blocks_are_scored_only_in_relative_mode(mixed_run):
    tau, result = mixed_run
    for tau_mode in ("fixed", "relative"):
        pipe = tiny_pipeline()
        counter = CountingScorer(shared_parts()["scorer"])
        pipe.router = RewardRouter(counter, tau=tau, tau_mode=tau_mode)
        out = generate(pipe)
        drafted = [12 for b in out.blocks if b.drafted]
        if tau_mode == "relative":
            assert [b.source for b in out.blocks] == [b.source for b in result.blocks]
            # the target's blocks a later draft is compared with: every target block but the last block's
            targets = [b.video_frames[1] - b.video_frames[0] for b in out.blocks if b.source == "target" and b.index < 3]
            assert 9 in targets and len(targets) >= 2  # block 0 (9 frames) and a regenerated block
        else:
            targets = []
        # and the seam frame of every target block a later draft follows (the reported temporal score spans it)
        seams = [1 for b in out.blocks if b.source == "target" and b.index < len(out.blocks) - 1]
        assert sorted(counter.calls) == sorted(drafted + targets + seams), tau_mode
    for mode in ("target_only", "draft_only", "first_block_only", "random"):
        pipe = tiny_pipeline()
        counter = CountingScorer(shared_parts()["scorer"])
        pipe.router = RewardRouter(counter, tau=tau, tau_mode="relative")
        generate(pipe, mode=mode)
        assert counter.calls == [], mode


def test_relative_and_two_workers_agree(mixed_run):
    tau, result = mixed_run
    pipe = relative_pipeline(tau)
    two = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                        options=SDVGOptions(), workers=2)
    assert torch.equal(two.frames, result.frames)
    assert [b.decision.reference_score if b.decision else None for b in two.blocks] == \
        [b.decision.reference_score if b.decision else None for b in result.blocks]


def test_relative_with_temporal_weight_scores_target_blocks_with_it():
    result = generate(relative_pipeline(math.inf, temporal_weight=0.5))
    # all rejected: every reference is a target block's reward minimum + 0.5 x its temporal term (seam included)
    scorer, feats = shared_parts()["scorer"], None
    for b in range(1, 4):
        frames = result.frames[slice(*result.blocks[b - 1].video_frames)].permute(0, 3, 1, 2).contiguous()
        out = scorer.score_frames(frames, PROMPT)
        from sdvg_engine.router import temporal_consistency

        expected = float(out.scores.min()) + 0.5 * temporal_consistency(out.image_features, feats)
        assert result.blocks[b].decision.reference_score == pytest.approx(expected, abs=1e-5)
        feats = out.image_features[-1]


# ------------------------------------------------------------------------------ replay
def test_relative_replay_equals_fresh_runs(mixed_run):
    tau, _ = mixed_run
    for tau_a, tau_b in ((-math.inf, tau), (math.inf, tau), (tau, -math.inf)):
        fresh = generate(relative_pipeline(tau_b))
        pipe = relative_pipeline(tau_a)
        pipe.memo = ReplayMemo()
        first = generate(pipe)
        replayed = generate(pipe, tau_b)
        assert torch.equal(replayed.frames, fresh.frames) and torch.equal(replayed.latents, fresh.latents)
        assert [b.source for b in replayed.blocks] == [b.source for b in fresh.blocks]
        assert [b.decision.reference_score if b.decision else None for b in replayed.blocks] == \
            [b.decision.reference_score if b.decision else None for b in fresh.blocks]
        sa, sb = [b.source for b in first.blocks], [b.source for b in fresh.blocks]
        expected = next((i for i in range(4) if sa[i] != sb[i]), 4)
        assert replayed.report["replay"]["replayed_blocks"] == expected


def test_fixed_recordings_do_not_replay_into_relative_runs(mixed_run):
    tau, result = mixed_run
    pipe = tiny_pipeline(tau=-math.inf)
    pipe.memo = ReplayMemo()
    generate(pipe)  # a fixed-mode recording: target blocks never scored
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode="relative")
    again = generate(pipe)
    assert again.report["replay"]["replayed_blocks"] == 0
    assert torch.equal(again.frames, result.frames)


def test_redecide_refuses_a_relative_decision_without_reference():
    from sdvg_engine.memo import redecide

    router = RewardRouter(shared_parts()["scorer"], tau=0.0, tau_mode="relative")
    fixed = RewardRouter(shared_parts()["scorer"], tau=0.0).decide([0.3])
    assert redecide(router, SDVGOptions(), fixed, 12, 0.0) is None
    with_ref = router.decide([0.3], reference=0.1)
    again = redecide(router, SDVGOptions(), with_ref, 12, 0.25)
    assert not again.accept and again.reference_score == 0.1 and again.tau == 0.25


# ------------------------------------------------------------------------------ validation
def test_relative_mode_validation():
    pipe = relative_pipeline(0.0)
    with pytest.raises(ValueError, match="block 0 has none: keep force_first_block on"):
        generate(pipe, force_first_block=False)
    with pytest.raises(ValueError, match="cascade scoring is not supported with tau_mode 'relative'"):
        generate(pipe, cascade=True)
    generate(pipe, mode="draft_only", force_first_block=False)  # other modes do not route: fine


def test_cli_tau_mode_relative_checks():
    from sdvg_engine.cli import UsageError, build_parser, validate_args

    base = ["generate", "--drafter", "d", "--target", "t", "--vae", "v", "--reward", "r", "--prompt", "x"]
    parse = build_parser().parse_args
    args = parse(base + ["--tau-mode", "relative", "--no-force-first-block"])
    with pytest.raises(UsageError, match="--tau-mode relative: compares each draft with the last committed block"):
        validate_args(args)
    args = parse(base + ["--tau-mode", "relative", "--cascade"])
    with pytest.raises(UsageError, match="not supported with --tau-mode relative"):
        validate_args(args)
    with pytest.raises(SystemExit):
        parse(base + ["--tau-mode", "relativ"])


# ------------------------------------------------------------------------------ what is compared with tau
def _mode_pipeline(tau_mode, tau, **router_kw):
    pipe = tiny_pipeline()
    pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode=tau_mode, **router_kw)
    return pipe


def _decisions(result):
    return [b.decision for b in result.blocks if b.decision is not None]


@pytest.mark.parametrize("tau_mode", ["fixed", "relative", "anchor", "baseline", "accept_rate"])
def test_comparison_is_what_decided_each_block(tau_mode):
    """On real runs, in every tau mode: each decision keeps its draft exactly when its comparison's value reaches
    the threshold, and the report carries the same comparison under "compared"."""
    # The values this mode compares, from an all-accept run; their median gives a run with both outcomes.
    kw = {}
    if tau_mode == "accept_rate":  # its threshold moves with the scores: a prior centred on them gives both outcomes
        scores = [d.block_score for d in _decisions(generate(_mode_pipeline("fixed", -math.inf)))]
        kw = {"prior_mean": sorted(scores)[len(scores) // 2], "prior_std": 1e-3, "prior_count": 1.0,
              "accept_rate": 0.5}
    values = [d.comparison().value for d in _decisions(generate(_mode_pipeline(tau_mode, -math.inf, **kw)))]
    outcomes = set()
    for tau in (-math.inf, sorted(values)[len(values) // 2], math.inf):
        result = generate(_mode_pipeline(tau_mode, tau, **kw))
        report = json.loads(json.dumps(result.report, allow_nan=False))
        for b, decision in enumerate(d.decision for d in result.blocks):
            if decision is None:
                continue
            c = decision.comparison()
            assert c.mode == tau_mode and c.keep_if == ">="
            assert decision.accept == c.keeps() == (c.value >= c.threshold or c.threshold == -math.inf)
            assert report["blocks"][b]["decision"]["compared"] == c.to_dict()
            if tau_mode in ("fixed", "accept_rate"):
                assert c.value == decision.block_score and c.threshold == decision.tau
            else:
                assert c.value == pytest.approx(decision.block_score - decision.reference_score)
                assert c.threshold == tau
            outcomes.add(decision.accept)
    assert outcomes == {True, False}


def test_comparison_of_random_mode_is_the_draw():
    pipe = tiny_pipeline()
    result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=2,
                           options=SDVGOptions(mode="random", random_accept_prob=0.5))  # seed 2: kept, kept, target
    report = json.loads(json.dumps(result.report, allow_nan=False))
    seen = set()
    for b, block in enumerate(result.blocks):
        if block.decision is None:
            continue
        c = block.decision.comparison()
        assert (c.mode, c.keep_if, c.threshold, c.quantity) == ("random", "<", 0.5, "random draw u (keep if u < p)")
        assert block.decision.accept == c.keeps() == (c.value < c.threshold) == (block.source == "draft")
        assert report["blocks"][b]["decision"]["compared"] == c.to_dict()
        seen.add(block.decision.accept)
    assert seen == {True, False}


def test_comparison_labels_and_json():
    from sdvg_engine.router import Comparison, RandomRouter

    scorer = shared_parts()["scorer"]
    labels = {m: RewardRouter(scorer, tau=0.1, tau_mode=m).decide([0.5], reference=0.2).comparison()
              for m in ("fixed", "accept_rate", "relative", "anchor", "baseline")}
    assert {m: c.quantity for m, c in labels.items()} == {
        "fixed": "draft score", "accept_rate": "score vs running quantile",
        "relative": "score - last committed block", "anchor": "score - block 0",
        "baseline": "score - mean of committed blocks"}
    assert labels["relative"][:2] == pytest.approx((0.3, 0.1))
    assert labels["fixed"][:2] == (0.5, 0.1)
    d = RewardRouter(scorer, tau=-math.inf).decide([math.nan])
    assert d.accept and d.comparison().keeps()
    assert d.to_dict()["compared"] == {"value": None, "threshold": "-inf", "quantity": "draft score",
                                       "keep_if": ">=", "mode": "fixed"}
    r = RandomRouter(1.0, seed=0).decide_block(2)
    assert r.comparison() == Comparison(r.block_score, 1.0, "random draw u (keep if u < p)", "<", "random")
    assert r.accept and r.comparison().keeps()
