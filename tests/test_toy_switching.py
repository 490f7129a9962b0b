"""The toy world's switching clips (issue 39): the split, a scheduled run, the metric, the cost model's counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.toy import switching as sw
from sdvg_engine.toy.clips import SPLITS, prompts_for
from sdvg_engine.toy.world import Scene, render


def test_switching_clips_of_the_two_splits_share_no_caption():
    clips = {split: sw.switch_clips(split) for split in SPLITS}
    captions = {split: {c for clip in cs for c in (clip.before, clip.after)} for split, cs in clips.items()}
    assert not captions["design"] & captions["report"]
    for split, (lo, hi) in SPLITS.items():
        assert captions[split] <= set(prompts_for(hi)[lo:hi])  # each split's clips use its own captions only
        assert len(clips[split]) >= 20
        for clip in clips[split]:  # one attribute changes, the one named
            a, b = Scene.parse(clip.before), Scene.parse(clip.after)
            changed = [f for f in ("colour", "shape", "motion", "background") if getattr(a, f) != getattr(b, f)]
            assert changed == [clip.attribute] and clip.attribute in sw.SWITCH_ATTRIBUTES
        assert {c.attribute for c in clips[split][:20]} == set(sw.SWITCH_ATTRIBUTES)
    assert sw.switch_clips("report", 5) == clips["report"][:5]  # deterministic
    assert sw.switch_block(81) == 3 and sw.segment_frames(clips["report"][0].segments(81), 81)[1][:2] == (33, 81)


def test_the_metric_scores_each_segment_against_its_own_caption():
    before, after = "a red ball moving left on black", "a red ball moving right on black"
    segments = [(0, before), (3, after)]
    old = render(Scene.parse(before), 81, 0)
    new = render(Scene.parse(after), 81, 0)
    follows_new = np.concatenate([old[:33], new[33:]])
    follows_old = old
    good, bad = sw.schedule_metrics(follows_new, segments), sw.schedule_metrics(follows_old, segments)
    assert good["quality"] > bad["quality"] + 0.1
    assert good["segments"][0]["quality"] == pytest.approx(bad["segments"][0]["quality"])
    assert bad["segments"][1]["quality"] < good["segments"][1]["quality"] - 0.2  # the motion term (a quarter)
    # frame-weighted: 33 frames of the first caption, 48 of the second
    q = [s["quality"] for s in good["segments"]]
    assert good["quality"] == pytest.approx((33 * q[0] + 48 * q[1]) / 81)
    assert [s["frames"] for s in good["segments"]] == [[0, 33], [33, 81]]


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    from sdvg_engine.toy.clips import build_pipeline
    from sdvg_engine.toy.models import load_toy_models

    return build_pipeline(load_toy_models(), tau=float("-inf"))


def test_a_scheduled_toy_clip_gives_the_block_after_the_switch_to_the_target(pipe):
    clip = sw.switch_clips("design", 1)[0]
    frames = 45  # 4 blocks: the switch at block 2, video frame 21
    assert clip.segments(frames) == [(0, clip.before), (2, clip.after)]
    runs = {}
    for on in (True, False):  # tau = -inf: every draft is kept, so only the switch rule gives the target a block
        options = SDVGOptions(mode="sdvg", target_after_switch=on)
        result, metrics = sw.run_switch_clip(pipe, clip, options, frames)
        runs[on] = (result, metrics, sw.run_counts(result, pipe.router, options, clip.segments(frames)))
        prompts = [s["prompt"] for s in result.report["settings"]["prompt_schedule"]]
        assert prompts == [clip.before, clip.after]
        assert [s["caption"] for s in metrics["segments"]] == [clip.before, clip.after]
    assert runs[True][0].report["decisions"] == ["target", "draft", "target", "draft"]
    assert runs[False][0].report["decisions"] == ["target", "draft", "draft", "draft"]
    on = runs[True][2]
    # the cost model's counts: 4 blocks decoded once (no draft rejected), 2 drafts scored; each model encodes the new
    # text once and re-caches its committed blocks under it
    assert on["decode"] == 4 and on["score"] == 2
    assert on["target"]["text"] == 1 and on["drafter"]["text"] == 1
    assert on["target"]["denoise"] == 8 and on["drafter"]["denoise"] == 8
    seconds = {"calls": {"drafter": {"per_call": 1.0}, "target": {"per_call": 10.0}}, "text": {"drafter": 0.5,
               "target": 5.0}, "decode": 2.0, "score": 3.0}
    calls = {m: sum(v for k, v in on[m].items() if k != "text") for m in ("drafter", "target")}
    assert sw.cost_seconds(on, seconds) == pytest.approx(calls["drafter"] + 10 * calls["target"] + 0.5 + 5 + 8 + 6)


def test_study_configs_cover_each_switch_rule_and_skip_the_refused_one():
    configs = sw.study_configs({m: 0.0 for m in sw.ROUTER_MODES})
    names = {c.name for c in configs}
    for mode in sw.ROUTER_MODES:
        assert {f"{mode} on/reset", f"{mode} off/{'reset' if mode == 'fixed' else 'carry'}"} <= names
    assert "relative off/reset" not in names and "accept_rate off/reset" in names  # refused by the engine / allowed
    assert {"target_only", "first_block_only on", "first_block_only off"} <= names
    assert {f"random p={p:g} {t}" for p in sw.RANDOM_P for t in ("on", "off")} <= names
