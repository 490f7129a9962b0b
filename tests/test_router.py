"""Tests of the reward router and the random baseline router (CPU, tiny reward model)."""

from __future__ import annotations

import json
import math

import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import TAU_MODES, RandomRouter, RewardRouter, RouteDecision, TauState, temporal_consistency

PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def scorer():
    return build_tiny_image_reward(seed=0)


def _frames(n, seed=1, h=48, w=80):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------- decide() on precomputed scores --------------------


def test_min_vs_mean_on_one_bad_frame(scorer):
    scores = torch.tensor([0.8, 1.1, -2.5, 0.9])  # one bad frame
    by_min = RewardRouter(scorer, tau=-0.7, aggregation="min").decide(scores)
    by_mean = RewardRouter(scorer, tau=-0.7, aggregation="mean").decide(scores)
    assert not by_min.accept and by_min.block_score == pytest.approx(-2.5)
    assert by_mean.accept and by_mean.block_score == pytest.approx(0.075)
    assert by_min.frame_scores == pytest.approx([0.8, 1.1, -2.5, 0.9])
    assert by_min.frames_scored == 4 and by_min.temporal_score is None
    # Lists work too; equality with tau accepts.
    assert RewardRouter(scorer, tau=0.5).decide([0.5, 0.7]).accept


def test_min_vs_mean_through_judge(scorer):
    frames = _frames(6, seed=11)
    s = scorer.score_frames(frames, PROMPT).scores
    lo, mean = float(s.min()), float(s.mean())
    assert mean - lo > 0.1  # the block has a clearly worse frame
    tau = (lo + mean) / 2
    d_min, fs = RewardRouter(scorer, tau=tau, aggregation="min").judge(frames, PROMPT)
    d_mean, _ = RewardRouter(scorer, tau=tau, aggregation="mean").judge(frames, PROMPT)
    assert not d_min.accept and d_mean.accept
    assert d_min.reward_score == pytest.approx(lo, abs=1e-6)
    assert d_mean.reward_score == pytest.approx(mean, abs=1e-6)
    assert d_min.frames_scored == 6 and len(fs) == 6
    torch.testing.assert_close(torch.tensor(d_min.frame_scores), s, atol=1e-6, rtol=0)
    # Weight 0: temporal is reported but not added.
    assert d_min.temporal_score is not None and d_min.block_score == d_min.reward_score


def test_tau_infinities(scorer):
    frames = _frames(2)
    never = RewardRouter(scorer, tau=math.inf)
    always = RewardRouter(scorer, tau=-math.inf)
    assert not never.judge(frames, PROMPT)[0].accept
    assert always.judge(frames, PROMPT)[0].accept
    assert not never.decide([math.inf]).accept
    assert always.decide([-math.inf]).accept and always.decide([math.nan]).accept
    # A NaN frame (diverged decode) is rejected under a finite tau, with min and mean.
    assert not RewardRouter(scorer, tau=-100.0).decide([1.0, math.nan]).accept
    assert not RewardRouter(scorer, tau=-100.0, aggregation="mean").decide([1.0, math.nan]).accept


# ------------------------------------------- temporal term -------------------------------------


def test_temporal_term_includes_seam(scorer):
    frames = _frames(4, seed=5)
    out = scorer.score_frames(frames, PROMPT)
    prev = torch.randn(out.image_features.shape[1], generator=torch.Generator().manual_seed(2))
    f = torch.cat([prev[None], out.image_features])
    manual = float(F.cosine_similarity(f[:-1], f[1:], dim=-1).mean())
    w = 0.5
    router = RewardRouter(scorer, tau=-0.7, temporal_weight=w)
    d, _ = router.judge(frames, PROMPT, previous_features=prev)
    assert d.temporal_score == pytest.approx(manual, abs=1e-6)
    assert d.block_score == pytest.approx(d.reward_score + w * manual, abs=1e-6)
    # Without the seam: only the 3 in-block pairs.
    d2, _ = router.judge(frames, PROMPT)
    g = out.image_features
    assert d2.temporal_score == pytest.approx(
        float(F.cosine_similarity(g[:-1], g[1:], dim=-1).mean()), abs=1e-6
    )
    # Identical frames are perfectly consistent; a single frame has no pair.
    same = frames[:1].expand(3, -1, -1, -1)
    assert router.judge(same, PROMPT)[0].temporal_score == pytest.approx(1.0, abs=1e-5)
    single, _ = router.judge(frames[:1], PROMPT)
    assert single.temporal_score is None and single.block_score == single.reward_score
    # [K, D] previous features: the last row is used.
    multi = torch.stack([torch.zeros_like(prev) + 1, prev])
    assert temporal_consistency(g, multi) == pytest.approx(temporal_consistency(g, prev), abs=1e-6)
    with pytest.raises(ValueError, match="width"):
        temporal_consistency(g, torch.ones(7))


def test_temporal_weight_can_flip_decision(scorer):
    scores = torch.tensor([0.0, 0.1])
    assert not RewardRouter(scorer, tau=0.3).decide(scores, temporal=0.9).accept
    assert RewardRouter(scorer, tau=0.3, temporal_weight=0.5).decide(scores, temporal=0.9).accept


# ------------------------------------------- serialisation -------------------------------------


def test_to_dict_is_strict_json(scorer):
    d, _ = RewardRouter(scorer).judge(_frames(3), PROMPT)
    data = json.loads(json.dumps(d.to_dict(), allow_nan=False))
    assert set(data) == {
        "accept", "block_score", "frame_scores", "reward_score", "temporal_score", "frames_scored", "tau", "compared"
    }
    assert data["frames_scored"] == 3 and isinstance(data["accept"], bool)
    assert data["tau"] == pytest.approx(-0.7)
    r = RandomRouter(0.5, seed=0).decide_block(3).to_dict()
    json.dumps(r, allow_nan=False)
    assert r["reward_score"] is None and r["frames_scored"] == 0 and r["tau"] is None
    for tau, shown in ((math.inf, "inf"), (-math.inf, "-inf"), (0.25, 0.25)):
        d = RewardRouter(scorer, tau=tau).decide([0.1]).to_dict()
        assert json.loads(json.dumps(d, allow_nan=False))["tau"] == shown


# ------------------------------------------- random router -------------------------------------


def test_random_router_deterministic_and_order_independent():
    a = RandomRouter(0.4, seed=123)
    forward = [a.decide_block(i).accept for i in range(200)]
    b = RandomRouter(0.4, seed=123)
    backward = [b.decide_block(i).accept for i in reversed(range(200))][::-1]
    assert forward == backward
    assert forward == [RandomRouter(0.4, seed=123).decide_block(i).accept for i in range(200)]
    other = [RandomRouter(0.4, seed=124).decide_block(i).accept for i in range(200)]
    assert other != forward
    # The key (the pipeline passes the prompt) gives each prompt its own stream under one seed.
    keyed = [RandomRouter(0.4, seed=123, key="a red ball").decide_block(i).accept for i in range(200)]
    assert keyed != forward and keyed != [RandomRouter(0.4, seed=123, key="a blue ball").decide_block(i).accept for i in range(200)]
    assert keyed == [RandomRouter(0.4, seed=123, key="a red ball").decide_block(i).accept for i in range(200)]
    d = a.decide_block(7)
    assert isinstance(d, RouteDecision) and 0.0 <= d.block_score < 1.0
    assert d.accept == (d.block_score < 0.4)


@pytest.mark.parametrize("p", [0.0, 0.25, 0.7, 1.0])
def test_random_router_rate(p):
    r = RandomRouter(p, seed=9)
    rate = sum(r.decide_block(i).accept for i in range(4000)) / 4000
    if p in (0.0, 1.0):
        assert rate == p
    else:
        assert abs(rate - p) < 0.03  # binomial sd ~0.007


# ------------------------------------------- argument validation -------------------------------


def test_bad_arguments(scorer):
    with pytest.raises(ValueError, match="aggregation must be one of"):
        RewardRouter(scorer, aggregation="max")
    with pytest.raises(ValueError, match="crop must be one of"):
        RewardRouter(scorer, crop="left")
    with pytest.raises(ValueError, match="tau must not be NaN"):
        RewardRouter(scorer, tau=math.nan)
    with pytest.raises(ValueError, match="tau must be a number"):
        RewardRouter(scorer, tau="high")
    with pytest.raises(ValueError, match="temporal_weight must be a finite number, got inf"):
        RewardRouter(scorer, temporal_weight=math.inf)
    with pytest.raises(ValueError, match="at least one"):
        RewardRouter(scorer).decide([])
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"p must be in \[0, 1\], got "):
            RandomRouter(p, seed=0)
    with pytest.raises(ValueError, match="p must be a finite number, got nan"):
        RandomRouter(math.nan, seed=0)
    with pytest.raises(ValueError, match=r"seed must be a whole number, got 'x' \(str\)"):
        RandomRouter(0.5, seed="x")
    with pytest.raises(ValueError, match="block_index must be an int"):
        RandomRouter(0.5, seed=0).decide_block(1.5)


# ------------------------------------------- adaptive tau (tau_mode="accept_rate") ---------------


def _expected_tau(seen, r, mean=0.566, std=1.071, count=5.0):
    """Written from the stated definition, independently of the router: the smallest t with
    count * Phi((t - mean) / std) + #{seen <= t} >= (1 - r) * (count + n), found by bisection
    (the left-hand side is non-decreasing and right-continuous in t)."""
    q, n = 1.0 - r, len(seen)
    if n == 0:
        return mean + std * NormalDist().inv_cdf(q)
    a = np.array([-np.inf if math.isnan(x) else x for x in seen])
    prior = NormalDist(mean, std)

    def reached(t):
        return count * prior.cdf(t) + np.count_nonzero(a <= t) >= q * (count + n)

    lo, hi = -60.0, 60.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reached(mid) else (mid, hi)
    return hi


SEQUENCE = [0.9, -0.4, 1.3, 0.2, -1.1, 0.6, 0.05, 2.0, -0.4, 0.7, 0.31, -2.2]


@pytest.mark.parametrize("count", [5.0, 2.5, 0.0])
@pytest.mark.parametrize("r", [0.73, 0.5])
def test_accept_rate_thresholds_and_decisions_hand_computed(scorer, r, count):
    router = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=r, prior_count=count)
    state, seen, accepted = router.new_tau_state(), [], []
    for i, s in enumerate(SEQUENCE):
        tau = router.block_tau(state)
        expected = _expected_tau(seen, r, count=count)
        assert tau == pytest.approx(expected, abs=1e-9), (i, tau, expected)
        d = router.decide([s + 0.5, s], tau=tau)  # min aggregation: block score = s (as float32)
        assert d.block_score == pytest.approx(s, abs=1e-6) and d.tau == tau
        assert d.accept == (d.block_score >= expected)
        accepted.append(d.accept)
        state.observe(d.block_score)
        seen.append(d.block_score)
    assert state.scores == seen
    assert 0 < sum(accepted) < len(accepted)  # the sequence exercises both outcomes


def test_accept_rate_threshold_literal_values(scorer):
    # Block 0: the prior's own 27 % quantile, the reference server's warm-up threshold for r = 0.73:
    # 0.566 + 1.071 * Phi^-1(0.27) = 0.566 - 1.071 * 0.612813 = -0.090323.
    router = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=0.73)
    assert router.block_tau(None) == pytest.approx(-0.0903227, abs=1e-6)
    assert router.block_tau(router.new_tau_state()) == router.block_tau(None)
    # No prior weight: the inverse-ECDF quantile of the scores (numpy "inverted_cdf").
    bare = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=0.73, prior_count=0)
    assert bare.block_tau(TauState([3.0, 1.0, 2.0])) == 1.0  # 0.27 * 3 = 0.81 -> 1st smallest
    assert bare.block_tau(TauState([3.0, 1.0, 2.0, 4.0])) == 2.0  # 1.08 -> 2nd smallest
    seen = [0.4, -1.0, 2.2, 0.1, 0.9, -0.3, 1.7]
    assert bare.block_tau(TauState(seen)) == np.quantile(seen, 0.27, method="inverted_cdf")
    # A jump: with prior weight 1 and scores {0, 0, 0}, H(t) jumps from Phi(t) to Phi(t) + 3 at 0 and the
    # target 0.27 * 4 = 1.08 is first reached exactly there.
    one = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=0.73, prior_count=1.0)
    assert one.block_tau(TauState([0.0, 0.0, 0.0])) == 0.0
    # Below it, the jump at -9 (mass 1 >= 0.27 * 2) decides; for r = 0.2 (target 0.8 * 2 = 1.6) it does not, and
    # the remaining mass 0.6 is solved in the prior: 0.566 + 1.071 * Phi^-1(0.6).
    assert one.block_tau(TauState([-9.0])) == -9.0
    strict = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=0.2, prior_count=1.0)
    assert strict.block_tau(TauState([-9.0])) == pytest.approx(0.566 + 1.071 * 0.2533471, abs=1e-6)


@pytest.mark.parametrize("r", [0.5, 0.73, 0.9])
def test_accept_rate_converges_on_long_run(scorer, r):
    router = RewardRouter(scorer, tau_mode="accept_rate", accept_rate=r)
    scores = np.random.default_rng(int(r * 100)).standard_normal(5000)
    state, accepted = router.new_tau_state(), 0
    for s in scores:
        tau = router.block_tau(state)
        accepted += float(s) >= tau
        state.observe(float(s))
    assert abs(accepted / len(scores) - r) < 0.02
    # The final threshold is the score distribution's (1 - r) quantile.
    assert router.block_tau(state) == pytest.approx(NormalDist().inv_cdf(1 - r), abs=0.06)


def test_fixed_mode_ignores_state(scorer):
    router = RewardRouter(scorer, tau=0.4)
    assert router.tau_mode == "fixed" and TAU_MODES == ("fixed", "accept_rate", "relative", "anchor", "baseline")
    assert router.block_tau(None) == 0.4 and router.block_tau(TauState([5.0, 6.0])) == 0.4
    d = router.decide([0.3])
    assert not d.accept and d.tau == 0.4
    assert router.decide([0.3], tau=0.2).accept and router.decide([0.3], tau=0.2).tau == 0.2
    with pytest.raises(ValueError, match="tau must not be NaN"):
        router.decide([0.3], tau=math.nan)
    with pytest.raises(ValueError, match="tau must not be NaN"):
        router.judge(_frames(1), PROMPT, tau=math.nan)


def test_tau_state_copy_and_nan(scorer):
    router = RewardRouter(scorer, tau_mode="accept_rate", prior_count=1.0)
    a = TauState()
    for s in (0.3, -0.2, 1.0):
        a.observe(s)
    b = a.copy()
    b.observe(-0.1)
    assert a.scores == [0.3, -0.2, 1.0] and b.scores == [0.3, -0.2, 1.0, -0.1] and len(b) == 4
    assert router.block_tau(a) != router.block_tau(b)
    # A NaN score (diverged draft) is recorded but leaves the threshold alone, and such a block is rejected.
    c = a.copy()
    c.observe(math.nan)
    assert router.block_tau(c) == router.block_tau(a) and len(c) == 4
    assert not router.decide([math.nan], tau=router.block_tau(c)).accept
    # Two NaNs used to rank as -inf and drag the (1 - 0.73) quantile to -inf: every later draft was then kept.
    d = TauState()
    for s in (0.3, math.nan, math.nan):
        d.observe(s)
    assert math.isfinite(router.block_tau(d)) and router.block_tau(d) == router.block_tau(TauState([0.3]))
    assert not router.decide([-4.0], tau=router.block_tau(d)).accept
    # Edited in place: the sorted view follows.
    a.scores.append(9.0)
    assert router.block_tau(a) == router.block_tau(TauState([0.3, -0.2, 1.0, 9.0]))


def test_judge_and_score_frames_use_router_crop_and_preprocess(scorer):
    frames = _frames(3, seed=4, h=40, w=90)
    feats = scorer.encode_prompt(PROMPT)
    for crop, mode in (("center", "pil"), ("full", "torch"), ("full", "pil")):
        router = RewardRouter(scorer, crop=crop, preprocess=mode)
        direct = scorer.score_frames(frames, feats, crop=crop, preprocess=mode)
        assert torch.equal(router.score_frames(frames, feats).scores, direct.scores)
        d, out = router.judge(frames, PROMPT, tau=0.0)
        assert torch.equal(out.scores, direct.scores) and d.tau == 0.0
    pil = RewardRouter(scorer).score_frames(frames, feats).scores
    fast = RewardRouter(scorer, preprocess="torch").score_frames(frames, feats).scores
    assert not torch.equal(pil, fast)


def test_settings_json(scorer):
    router = RewardRouter(scorer, tau=math.inf, tau_mode="accept_rate", accept_rate=0.6, prior_count=3,
                          preprocess="torch", crop="full")
    data = json.loads(json.dumps(router.settings(), allow_nan=False))
    assert data == {
        "tau": "inf", "tau_mode": "accept_rate", "accept_rate": 0.6, "prior_mean": 0.566, "prior_std": 1.071,
        "prior_count": 3.0, "aggregation": "min", "crop": "full", "temporal_weight": 0.0, "preprocess": "torch",
    }
    assert RewardRouter(scorer).settings()["tau"] == -0.7


def test_adaptive_tau_bad_arguments(scorer):
    for r in (0.0, 1.0, -0.5, 1.2, math.nan):
        with pytest.raises(ValueError, match=r"accept_rate must be in \(0, 1\)"):
            RewardRouter(scorer, tau_mode="accept_rate", accept_rate=r)
    with pytest.raises(ValueError, match="accept_rate must be a number"):
        RewardRouter(scorer, accept_rate="most")
    for sd in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="prior_std must be > 0"):
            RewardRouter(scorer, prior_std=sd)
    with pytest.raises(ValueError, match="prior_count must be >= 0"):
        RewardRouter(scorer, prior_count=-1)
    with pytest.raises(ValueError, match="prior_mean must be finite"):
        RewardRouter(scorer, prior_mean=math.nan)
    with pytest.raises(ValueError, match=r"tau_mode must be one of \('fixed', 'accept_rate', 'relative', 'anchor', 'baseline'\), got 'adaptive'"):
        RewardRouter(scorer, tau_mode="adaptive")
    with pytest.raises(ValueError, match="preprocess must be one of"):
        RewardRouter(scorer, preprocess="cv2")
    with pytest.raises(TypeError, match="TauState"):
        RewardRouter(scorer, tau_mode="accept_rate").block_tau([0.1, 0.2])


# ------------------------------------------- ComfyUI router node --------------------------------


def test_router_node_builds_adaptive_router(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`
    from node_fixtures import REWARD_FILE, write_tiny_models
    from nodes import logic, schema

    names = [i.name for i in schema.REWARD_ROUTER.inputs]
    assert names == ["reward_model", "tau", "aggregation", "crop", "temporal_weight", "tau_mode", "accept_rate",
                     "preprocess"]
    tail = {i.name: i for i in schema.REWARD_ROUTER.inputs[5:]}
    assert all(i.optional and i.tooltip for i in tail.values())
    # A node added from the menu starts on the shipped router (relative, -0.25); a workflow saved before tau_mode
    # existed does not store it, and the node's logic then keeps the paper's fixed router (asserted below).
    assert (tail["tau_mode"].options, tail["tau_mode"].default) == (
        ("fixed", "accept_rate", "relative", "anchor", "baseline"), "relative")
    assert schema.REWARD_ROUTER.inputs[1].default == -0.25
    assert (tail["preprocess"].options, tail["preprocess"].default) == (("pil", "torch"), "pil")
    assert tail["accept_rate"].default == 0.73

    write_tiny_models(tmp_path)
    svc = logic.Services({name: [str(tmp_path / name)] for name in ("diffusion_models", "sdvg_reward", "sdvg_embeddings")})
    node = logic.build_router(REWARD_FILE, -0.7, "min", "center", 0.0, services=svc, tau_mode="accept_rate",
                              accept_rate=0.6, preprocess="torch")
    router = node.new_router()
    assert (router.tau_mode, router.accept_rate, router.preprocess) == ("accept_rate", 0.6, "torch")
    assert router.block_tau(None) == pytest.approx(0.566 + 1.071 * NormalDist().inv_cdf(0.4))
    default = logic.build_router(REWARD_FILE, -0.7, "min", "center", 0.0, services=svc).new_router()
    assert (default.tau_mode, default.preprocess, default.block_tau(None)) == ("fixed", "pil", -0.7)
    with pytest.raises(ValueError, match="accept_rate must be in"):
        logic.build_router(REWARD_FILE, 0.0, "min", "center", 0.0, services=svc, tau_mode="accept_rate", accept_rate=1.0)


def test_router_node_workflows_old_and_new_widget_counts():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workflow_checks import ROOT, check_ui_workflow, ui_to_api

    wf = json.loads((ROOT / "workflows" / "sdvg_text_to_video.json").read_text())
    node = next(n for n in wf["nodes"] if n["type"] == "SDVGRewardRouter")
    assert node["widgets_values"][1:] == [-0.25, "min", "center", 0.0, "relative"]  # shipped: the held-out choice
    node["widgets_values"] = node["widgets_values"][:5]  # as saved before the optional inputs existed: still valid
    assert check_ui_workflow(wf) == []
    assert "tau_mode" not in ui_to_api(wf)[str(node["id"])]["inputs"]  # left to the node's default
    node["widgets_values"] += ["accept_rate", 0.6, "torch"]  # as saved now
    assert check_ui_workflow(wf) == []
    assert ui_to_api(wf)[str(node["id"])]["inputs"]["preprocess"] == "torch"
    node["widgets_values"][5] = "adaptive"
    assert any("adaptive" in e for e in check_ui_workflow(wf))
    node["widgets_values"] = node["widgets_values"][:6]  # part of the optional tail is fine too
    node["widgets_values"][5] = "fixed"
    assert check_ui_workflow(wf) == []
    node["widgets_values"] = node["widgets_values"][:4]  # a required widget missing is not
    assert any("widgets_values" in e for e in check_ui_workflow(wf))


def test_reported_temporal_score_spans_the_seam_with_the_weight_off():
    """temporal_weight=0: each drafted block's reported temporal score is the consistency of its frames with the last
    frame before it (block 0's, a regenerated block's or a kept draft's), computed here by hand from the video."""
    from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline
    from sdvg_engine.router import temporal_consistency

    taus = []
    for tau in (-math.inf, math.inf):
        pipe = tiny_pipeline(tau=tau)
        scores = [r.decision.block_score for r in pipe.generate(
            prompt_embeds(), prompt=PROMPT, num_frames=45, width=WIDTH, height=HEIGHT, seed=5).blocks if r.decision]
        taus.append(scores)
    tau = sorted(taus[0])[1]  # a mix: the lowest draft rejected
    pipe = tiny_pipeline(tau=tau)
    result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=45, width=WIDTH, height=HEIGHT, seed=5)
    assert {r.source for r in result.blocks[1:]} == {"draft", "target"}
    router = pipe.router
    features = router.scorer.encode_prompt(PROMPT)
    for record in result.blocks[1:]:
        first, end = record.video_frames
        previous = result.frames[first - 1 : first].permute(0, 3, 1, 2)
        seam = router.score_frames(previous, features).image_features[-1]
        if record.source == "draft":
            drafted = result.frames[first:end].permute(0, 3, 1, 2)
            expected = temporal_consistency(router.score_frames(drafted, features).image_features, seam)
            assert record.decision.temporal_score == pytest.approx(expected, abs=1e-5)
