"""Tests of the reward router and the random baseline router (CPU, tiny reward model)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import RandomRouter, RewardRouter, RouteDecision, temporal_consistency

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
        "accept", "block_score", "frame_scores", "reward_score", "temporal_score", "frames_scored"
    }
    assert data["frames_scored"] == 3 and isinstance(data["accept"], bool)
    r = RandomRouter(0.5, seed=0).decide_block(3).to_dict()
    json.dumps(r, allow_nan=False)
    assert r["reward_score"] is None and r["frames_scored"] == 0


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
    with pytest.raises(ValueError, match="temporal_weight must be finite"):
        RewardRouter(scorer, temporal_weight=math.inf)
    with pytest.raises(ValueError, match="at least one"):
        RewardRouter(scorer).decide([])
    for p in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
            RandomRouter(p, seed=0)
    with pytest.raises(ValueError, match="seed must be an int"):
        RandomRouter(0.5, seed="x")
    with pytest.raises(ValueError, match="block_index must be an int"):
        RandomRouter(0.5, seed=0).decide_block(1.5)
