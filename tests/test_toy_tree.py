"""Whole-tree evaluation (sdvg_engine.toy.tree): the tree's paths are the pipeline's outputs, routers walked on it
decide as the pipeline does, random routing is scored by its exact expectation, and the bootstrap is seeded."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.router import RandomRouter, RewardRouter
from sdvg_engine.toy import clips, demo
from sdvg_engine.toy.text import embed_caption
from sdvg_engine.toy import tree as T
from sdvg_engine.toy.models import FILES, WEIGHTS, load_reward, load_toy_models
from sdvg_engine.toy.tree_frames import ScoredFrames, node_values, rescore
from sdvg_engine.toy.world import clip_metrics

FRAMES = 33  # 3 blocks: block 0 by the target, 2 decisions, 3 nodes, 4 leaves
CLIPS = (("a red ball moving right on black", 0), ("a green triangle moving left on gray", 3))


def _seconds(drafter=0.02, target=0.1, decode=0.04, score=0.005, drafter_call=0.004, target_call=0.02):
    """Per-block seconds and the DiTs' call costs (:func:`sdvg_engine.toy.clips.call_costs`): the toy's structure,
    4 denoising calls per block and a global cache (one commit pass per block before the last a model makes)."""
    calls = {m: {"steps": 4, "context": "global_cache", "per_call": c} for m, c in (("drafter", drafter_call),
                                                                                   ("target", target_call))}
    return {"drafter": drafter, "target": target, "decode": decode, "score": score, "calls": calls}


@pytest.fixture(scope="module")
def models():
    return load_toy_models()


@pytest.fixture(scope="module")
def built(models):
    builder = T.TreeBuilder(models, num_frames=FRAMES, weights_id="test")
    return {clip: builder.build(*clip, keep_frames=True) for clip in CLIPS}


@pytest.fixture(scope="module")
def other_reward(tmp_path_factory):
    """A second toy reward file: the shipped one with every weight perturbed (its scores differ)."""
    g = torch.Generator().manual_seed(0)
    state = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g) * v.float().std()).to(v.dtype)
             if v.is_floating_point() and v.numel() > 1 else v for k, v in load_file(str(WEIGHTS / FILES["reward"])).items()}
    path = tmp_path_factory.mktemp("reward") / "reward.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def structure(models):
    """Each preset's DiT call structure (:func:`clips.call_costs`), read off a real target-only and draft-only run."""
    out = {}
    for preset in ("native", "reference"):
        pipe = demo.build_pipeline(models, preset=preset)
        caption, seed = CLIPS[0]
        reports = {mode: pipe.generate(embed_caption(caption), prompt=caption, num_frames=FRAMES, width=32,
                                       height=32, seed=seed, options=SDVGOptions(mode=mode)).report
                   for mode in ("target_only", "draft_only")}
        model = {"target": "target_only", "drafter": "draft_only"}
        out[preset] = clips.call_costs({m: reports[r]["model_calls"][m] for m, r in model.items()},
                                   {m: reports[r]["model_call_seconds"][m] for m, r in model.items()}, 3)
    assert out["native"]["target"]["steps"] == 4 and out["native"]["target"]["context"] == "global_cache"
    assert out["reference"]["target"]["context"] == "recompute_window"
    return out


def _assert_calls(result, counts, calls):
    """The cost model's DiT calls of one clip (``counts``: a walk's, index 0) are the calls the pipeline made: its
    denoising calls and every context pass (lazy commits of kept drafts included)."""
    for m in ("drafter", "target"):
        expected = T.model_calls(m, float(counts[m][0]), float(counts[f"{m}_last"][0]), calls)
        assert expected == sum(result.report["model_calls"][m].values()), (m, result.report["model_calls"])


def _midpoints(values):
    v = sorted(set(values))
    return [(a + b) / 2 for a, b in zip(v, v[1:])]


def _routers(tree, first: bool):
    """A fixed tau between the tree's draft scores, an adaptive rate, a relative margin between its margins; the first
    clip also +-inf (target-only and all-accept)."""
    drafts = sorted(min(s) for level in tree.draft for s in level)
    margins = sorted([min(tree.draft[0][0]) - min(tree.block0)] + [
        min(tree.draft[1][h]) - min((tree.draft if h else tree.target)[0][0]) for h in (0, 1)])
    routers = [("fixed", _midpoints(drafts)[1]), ("accept_rate", 0.5 if first else 0.9),
               ("relative", _midpoints(margins)[0 if first else 1])]
    return routers + ([("fixed", math.inf), ("fixed", -math.inf)] if first else [])


def _pipeline_run(models, caption, seed, mode, value, preset="native"):
    pipe = demo.build_pipeline(models, preset=preset)
    kw = {"accept_rate": value} if mode == "accept_rate" else {"tau": value}
    pipe.router = RewardRouter(models.scorer, tau_mode=mode, **kw)
    return pipe.generate(embed_caption(caption), prompt=caption, num_frames=FRAMES, width=32, height=32,
                         seed=seed, options=SDVGOptions())


def test_tree_paths_are_the_pipelines_outputs(models, built, structure):
    seen = set()
    for i, ((caption, seed), (tree, frames)) in enumerate(built.items()):
        assert tree.num_decisions == 2 and len(tree.leaves) == 4 and sorted(frames) == [0, 1, 2, 3]
        for mode, value in _routers(tree, first=i == 0):
            w = T.walk(tree, T.tree_router(mode, value))
            result = _pipeline_run(models, caption, seed, mode, value)
            assert torch.equal(frames[w.leaf], result.frames), (caption, mode, value)
            assert result.report["decisions"][1:] == ["draft" if d.accept else "target" for d in w.decisions]
            for d, block in zip(w.decisions, result.blocks[1:]):
                assert d.block_score == block.decision.block_score and d.tau == block.decision.tau
                assert d.reference_score == block.decision.reference_score
            _assert_calls(result, T.evaluate([tree], T.tree_router(mode, value))["counts"], structure["native"])
            metrics = clip_metrics(result.frames.numpy(), caption)
            assert tree.leaves[w.leaf]["quality"] == metrics["quality"]
            seen.add((mode, w.leaf))
        draft_only = clips.run_clip(clips.build_pipeline(models), caption, seed, SDVGOptions(mode="draft_only"), FRAMES)[1]
        assert tree.draft_only["quality"] == draft_only["quality"]
    assert {leaf for mode, leaf in seen if mode == "fixed"} >= {0, 3}  # tau=+inf: the all-reject (target-only) leaf
    assert len({leaf for _, leaf in seen}) >= 3  # the routers reach different leaves


def test_schedule_leaves_are_the_pipelines_schedule_runs(models, built, structure):
    """Mode schedule walked on the tree (its leaf is fixed by k) is the pipeline's schedule run, bit for bit."""
    for (caption, seed), (tree, frames) in built.items():
        for every in (0, 1, 2):
            leaf = T.schedule_leaf(tree.num_decisions, every)
            pipe = demo.build_pipeline(models, preset="native")
            result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=FRAMES, width=32, height=32,
                                   seed=seed, options=SDVGOptions(mode="schedule", schedule_every=every))
            assert torch.equal(frames[leaf], result.frames), (caption, every)
            assert result.report["decisions"][1:] == ["draft" if leaf >> i & 1 else "target"
                                                      for i in range(tree.num_decisions)]
            assert tree.leaves[leaf]["quality"] == clip_metrics(result.frames.numpy(), caption)["quality"]
            _assert_calls(result, T.evaluate_schedule([tree], every)["counts"], structure["native"])


def test_tree_under_the_reference_preset_too(models, structure):
    caption, seed = CLIPS[0]
    tree, frames = T.TreeBuilder(models, preset="reference", num_frames=FRAMES).build(caption, seed, keep_frames=True)
    for mode, value in (("fixed", _midpoints([min(s) for lv in tree.draft for s in lv])[0]), ("relative", 0.0)):
        result = _pipeline_run(models, caption, seed, mode, value, preset="reference")
        assert torch.equal(frames[T.walk(tree, T.tree_router(mode, value)).leaf], result.frames)
        _assert_calls(result, T.evaluate([tree], T.tree_router(mode, value))["counts"], structure["reference"])


# ------------------------------------------------------------------------------ exact random expectation
def _synthetic(n=3, seed=0, caption="a red ball moving right on black"):
    rng = np.random.default_rng(seed)
    return T.ClipTree(
        caption=caption, seed=seed, num_frames=12 * (n + 1) - 3, preset="native", block0=[float(rng.normal())],
        draft=[[[float(x) for x in rng.normal(size=2)] for _ in range(2 ** b)] for b in range(n)],
        target=[[[float(x) for x in rng.normal(size=2)] for _ in range(2 ** b)] for b in range(n)],
        leaves=[{"quality": float(q), "adherence": 0.0, "temporal": 0.0} for q in rng.uniform(size=2 ** n)],
        draft_only={"quality": float(rng.uniform())})


def test_random_expectation_is_exact():
    tree = _synthetic(n=3)
    q = tree.leaf_quality()
    for p in (0.0, 0.3, 0.5, 0.85, 1.0):
        brute = 0.0
        for path in itertools.product((0, 1), repeat=3):  # path[i]: block i + 1 accepted
            prob = math.prod(p if a else 1 - p for a in path)
            brute += prob * q[sum(a << i for i, a in enumerate(path))]
        assert T.random_expectation(tree, p) == pytest.approx(brute, abs=1e-12)
    assert T.random_expectation(tree, 0.0) == q[0] and T.random_expectation(tree, 1.0) == q[-1]
    # Monte Carlo with the pipeline's own random router (its draws keyed per block), walking the tree
    p, draws = 0.37, []
    for key in range(4000):
        router = RandomRouter(p, seed=key, key="mc")
        leaf = sum(int(router.decide_block(b).accept) << (b - 1) for b in (1, 2, 3))
        draws.append(q[leaf])
    se = np.std(draws) / math.sqrt(len(draws))
    assert abs(np.mean(draws) - T.random_expectation(tree, p)) < 4 * se
    with pytest.raises(ValueError, match="p must be in"):
        T.random_expectation(tree, 1.5)


def test_walks_by_hand():
    t = _synthetic(n=2)
    t.block0 = [0.0]
    t.draft = [[[0.5, 0.2]], [[-1.0, 0.3], [0.6, 0.9]]]  # block 1 min 0.2; block 2 after reject -1.0, after accept 0.6
    t.target = [[[0.1, 0.4]], [[0.0], [0.0]]]  # target block 1 min 0.1
    assert T.walk(t, T.tree_router("fixed", 0.0)).leaf == 0b11  # 0.2 >= 0, 0.6 >= 0
    assert T.walk(t, T.tree_router("fixed", 0.3)).leaf == 0b00  # 0.2 < 0.3, then after reject -1.0 < 0.3
    assert T.walk(t, T.tree_router("fixed", 0.3, aggregation="mean")).leaf == 0b11  # means 0.35, 0.75
    w = T.walk(t, T.tree_router("relative", 0.3))  # 0.2 - 0.0 < 0.3: reject; -1.0 - 0.1 < 0.3: reject
    assert w.leaf == 0 and [d.reference_score for d in w.decisions] == [0.0, pytest.approx(0.1)]
    assert w.scored_target_blocks == 2  # block 0 and the regenerated block 1
    w = T.walk(t, T.tree_router("relative", 0.2))  # 0.2 >= 0.2: accept; 0.6 - 0.2 >= 0.2: accept
    assert w.leaf == 0b11 and w.decisions[1].reference_score == pytest.approx(0.2) and w.scored_target_blocks == 1
    with pytest.raises(ValueError, match="temporal_weight=0"):
        T.walk(t, T.tree_router("fixed", 0.0, temporal_weight=0.5))


# ------------------------------------------------------------------------------ analysis and bootstrap
def test_analysis_and_bootstrap():
    trees = [_synthetic(n=3, seed=s) for s in range(8)]
    seconds = _seconds()
    a = T.analyse(trees, resamples=500, seed=1, block_seconds=seconds)
    again = T.analyse(trees, resamples=500, seed=1, block_seconds=seconds)
    assert json.dumps(a) == json.dumps(again)  # seeded: identical
    other = T.analyse(trees, resamples=500, seed=2, block_seconds=seconds)
    assert other["modes"]["fixed"][5]["quality_ci"] != a["modes"]["fixed"][5]["quality_ci"]
    q0 = np.mean([t.leaves[0]["quality"] for t in trees])
    assert a["target_only"]["quality"] == pytest.approx(q0)
    for mode, rows in a["modes"].items():
        for r in rows:
            lo, hi = r["router_minus_random_ci"]
            assert lo <= r["router_minus_random"] <= hi, (mode, r)
            assert r["quality_ci"][0] <= r["quality"] <= r["quality_ci"][1]
            # the random term is the exact expectation at the router's realized acceptance
            expected = np.mean([T.random_expectation(t, r["acceptance"]) for t in trees])
            assert r["random_quality"] == pytest.approx(expected, abs=1e-12)
    fixed = a["modes"]["fixed"]
    assert fixed[0]["setting"] == "-inf" and fixed[0]["acceptance"] == 1.0
    assert fixed[-1]["setting"] == "inf" and fixed[-1]["acceptance"] == 0.0 and fixed[-1]["quality"] == pytest.approx(q0)
    assert fixed[-1]["router_minus_random"] == pytest.approx(0.0, abs=1e-12)
    # all-reject: the target makes every block: the speedup is below 1 (drafts and scores wasted)
    assert fixed[-1]["counts"] == {"drafter": 24.0, "target": 32.0, "decode": 56.0, "score": 24.0,
                                   "drafter_last": 24.0, "target_last": 24.0}
    # per clip: the drafter 3 blocks x 4 calls + 3 commits; the target 4 x 4 + 3, as many as target-only
    target_only = 8 * (19 * 0.02 + 4 * 0.04)
    cost = 8 * (15 * 0.004 + 19 * 0.02) + 56 * 0.04 + 24 * 0.005
    assert fixed[-1]["speedup"] == pytest.approx(target_only / cost)
    band = [r["router_minus_random"] for r in fixed if 0.1 <= r["acceptance"] <= 0.9]
    assert a["average_in_band"]["fixed"]["router_minus_random"] == pytest.approx(np.mean(band))
    lo, hi = a["average_in_band"]["fixed"]["ci"]
    assert lo <= np.mean(band) <= hi
    best = a["best_fixed_tau"]
    assert best is not None and best["quality"] >= 0.98 * q0
    # relative walks score the target's blocks too
    rel = a["modes"]["relative"][-1]  # tau=+inf: all rejected, 1 + 2 scored target blocks per clip
    assert rel["counts"]["score"] == 8 * (3 + 3)
    assert "no setting" in T.format_report(a) or "averaged over acceptance" in T.format_report(a)
    # schedule rows: k = 0..3 on 3 decisions; its leaf by hand, no draft/decode/score paid on a target block
    assert [T.schedule_leaf(3, k) for k in range(4)] == [0b111, 0b000, 0b101, 0b011]
    sched = {r["setting"]: r for r in a["modes"]["schedule"]}
    assert sorted(sched) == [0, 1, 2, 3]
    assert sched[2]["acceptance"] == pytest.approx(2 / 3)
    assert sched[2]["quality"] == pytest.approx(np.mean([t.leaves[0b101]["quality"] for t in trees]))
    assert sched[2]["counts"] == {"drafter": 16.0, "target": 16.0, "decode": 32.0, "score": 0.0,
                                  "drafter_last": 24.0, "target_last": 16.0}
    # per clip: the drafter makes blocks 1 and 3 (2 x 4 calls + 3 commits), the target 0 and 2 (2 x 4 + 2 commits:
    # blocks 0 and 1, the draft, before it makes block 2)
    cost = 8 * (11 * 0.004 + 10 * 0.02) + 32 * 0.04
    assert sched[2]["speedup"] == pytest.approx(target_only / cost)
    assert sched[1]["speedup"] == pytest.approx(1.0)  # every block by the target: exactly target-only


def test_main_caches_shards_and_merges(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "report.json"
    common = ["--clips", "2", "--frames", str(FRAMES), "--cache", str(cache), "--out", str(out), "--resamples", "200",
              "--no-timing"]
    assert T.main(common + ["--shard", "0/2"]) is None
    files = sorted(cache.rglob("*.json"))
    assert len(files) == 1 and not out.exists()
    T.main(common + ["--shard", "1/2"])
    files = sorted(cache.rglob("*.json"))
    assert len(files) == 2
    stamps = {f: f.stat().st_mtime_ns for f in files}
    report = T.main(common)
    assert {f: f.stat().st_mtime_ns for f in files} == stamps  # the merged run rebuilt nothing
    assert json.loads(out.read_text())["clips"] == 2 == report["clips"]
    assert [c["caption"] for c in report["settings"]["clips"]] == demo.prompts_for(2)
    assert report["settings"]["weights_hash"] in str(files[0])
    # a tree whose key does not match its file is refused, naming the file
    data = json.loads(files[0].read_text())
    data["key"]["seed"] = 99
    files[0].write_text(json.dumps(data))
    with pytest.raises(ValueError, match="delete it to rebuild"):
        T.main(common)
    with pytest.raises(SystemExit, match="--shard 2/2"):
        T.main(common + ["--shard", "2/2"])


# ------------------------------------------------------------------------------ kept frames, rescoring
def test_kept_frames_rescore_to_the_scores_of_a_build_with_that_reward(models, other_reward):
    """The frames kept as uint8 give back the tree's scores bit for bit, and scored by another reward they give
    what a whole new build with that reward scores (the reference path: nothing regenerated but nothing reused)."""
    caption, seed = CLIPS[0]
    builder = T.TreeBuilder(models, num_frames=FRAMES)
    scored = ScoredFrames.empty(2)
    tree = builder.build(caption, seed, scored=scored)
    assert scored.block0.dtype == torch.uint8 and tuple(scored.block0.shape) == (9, 3, 32, 32)
    assert [tuple(x.shape) for lv in scored.draft + scored.target for x in lv] == [(12, 3, 32, 32)] * 6
    same = rescore(tree, scored, builder.pipe.router)
    assert (same.block0, same.draft, same.target) == (tree.block0, tree.draft, tree.target)
    router = RewardRouter(load_reward(other_reward))
    other = rescore(tree, scored, router, reward_id="other")
    builder.pipe.router = router
    rebuilt = builder.build(caption, seed)
    assert (other.block0, other.draft, other.target) == (rebuilt.block0, rebuilt.draft, rebuilt.target)
    assert other.draft != tree.draft and other.leaves == tree.leaves and other.key["reward"] == "other"


def test_node_values_by_hand():
    tree = _synthetic(n=2)
    q = tree.leaf_quality()  # leaf bits: bit 0 = block 1 accepted, bit 1 = block 2 accepted
    expected = [(q[1] + q[3]) / 2 - (q[0] + q[2]) / 2,  # block 1
                q[2] - q[0],  # block 2 after block 1 rejected
                q[3] - q[1]]  # block 2 after block 1 accepted
    np.testing.assert_allclose(node_values(tree), expected)


def test_main_keeps_frames_and_rescores(tmp_path, other_reward):
    cache, out = tmp_path / "cache", tmp_path / "report.json"
    common = ["--clips", "2", "--skip", "1", "--frames", str(FRAMES), "--cache", str(cache), "--out", str(out),
              "--resamples", "200", "--no-timing"]
    plain = T.main(common + ["--keep-frames"])
    assert [c["caption"] for c in plain["settings"]["clips"]] == demo.prompts_for(2)[1:]
    assert len(list(cache.rglob("*.frames.pt"))) == 1
    d = plain["reward_diagnostics"]
    assert (d["nodes"], d["frames"]) == (3, 72) and -1 <= d["frame_corr"] <= 1 and plain["settings"]["reward"] is None
    same = T.main(common + ["--reward", str(WEIGHTS / FILES["reward"])])  # the builder's own reward: same report
    assert same["modes"] == plain["modes"] and same["reward_diagnostics"] == d
    other = T.main(common + ["--reward", str(other_reward)])
    assert other["settings"]["reward"]["file"] == str(other_reward) and other["modes"] != plain["modes"]
    assert other["target_only"] == plain["target_only"]  # same trees: only the routing changes
    # a tree cached without its frames is refused with the fix, never silently rebuilt
    for f in cache.rglob("*.frames.pt"):
        f.unlink()
    with pytest.raises(ValueError, match="cached without the frames it scored.*delete it to rebuild it with --keep-frames"):
        T.main(common + ["--reward", str(other_reward)])
    with pytest.raises(SystemExit, match="no such file"):
        T.main(common + ["--reward", str(tmp_path / "missing.safetensors")])
    with pytest.raises(SystemExit, match="--skip 2: must be >= 0 and below --clips 2"):
        T.main(["--clips", "2", "--skip", "2"])


def test_main_judges_a_tau_chosen_on_other_clips(tmp_path, models):
    """--tau-from: the best fixed tau of a run on other clips, walked on this run's trees."""
    cache = tmp_path / "cache"
    common = ["--frames", str(FRAMES), "--cache", str(cache), "--resamples", "200", "--no-timing"]
    chosen = T.main(common + ["--clips", "2", "--skip", "1", "--out", str(tmp_path / "a.json")])
    tau = chosen["best_fixed_tau"]["tau"]
    here = T.main(common + ["--clips", "1", "--out", str(tmp_path / "b.json"), "--tau-from", str(tmp_path / "a.json")])
    carried = here["tau_from"]
    assert carried["setting"] == tau and carried["chosen_there"] == {**chosen["best_fixed_tau"], "tau": float(tau)}
    builder = T.TreeBuilder(models, num_frames=FRAMES, weights_id=T.weights_hash(WEIGHTS))
    trees = [T.load_or_build(builder, cache, c, s, build=False) for c, s in T.clip_list(1)]
    walks = [T.walk(t, T.tree_router("fixed", float(tau))) for t in trees]
    assert carried["quality"] == np.mean([t.leaves[w.leaf]["quality"] for t, w in zip(trees, walks)])
    assert carried["acceptance"] == sum(w.accepted for w in walks) / (2 * len(trees))
    with pytest.raises(SystemExit, match="no such file"):
        T.main(common + ["--clips", "1", "--tau-from", str(tmp_path / "missing.json")])
    (tmp_path / "none.json").write_text(json.dumps({"best_fixed_tau": None}))
    with pytest.raises(SystemExit, match="no tau to carry over"):
        T.main(common + ["--clips", "1", "--tau-from", str(tmp_path / "none.json")])


# ------------------------------------------------------------------------------ issue 24: routers that earn their cost
def _hand_tree():
    """3 decisions, scores chosen by hand (min aggregation): block 0 0.3; block 1 draft 0.4, target 0.2; block 2 after
    reject draft 0.1 / target 0.35, after accept draft 0.5 / target 0.45; block 3 drafts 0.0, 0.3, 0.6, 0.2 after
    histories 0..3 (bit 0: block 1 kept, bit 1: block 2 kept), targets 0.9 (the last block: never a reference)."""
    t = _synthetic(n=3)
    t.block0 = [0.5, 0.3]
    t.draft = [[[0.6, 0.4]], [[0.1], [0.5]], [[0.0], [0.3], [0.6], [0.2]]]
    t.target = [[[0.2]], [[0.35], [0.45]], [[0.9]] * 4]
    return t


def _refs(w):
    return [None if d is None else d.reference_score for d in w.decisions]


def test_reference_mode_walks_by_hand():
    t = _hand_tree()
    approx = pytest.approx
    # anchor: every draft against block 0's 0.3; only block 0 is ever scored as a reference
    w = T.walk(t, T.tree_router("anchor", 0.0))  # 0.4-0.3 >= 0 keep; 0.5-0.3 keep; 0.2-0.3 < 0 reject
    assert w.leaf == 0b011 and _refs(w) == [approx(0.3)] * 3 and w.scored_target_blocks == 1
    w = T.walk(t, T.tree_router("anchor", 0.15))  # 0.1 < 0.15 reject; 0.1-0.3 reject; 0.0-0.3 reject
    assert w.leaf == 0 and _refs(w) == [approx(0.3)] * 3 and w.scored_target_blocks == 1  # no target block after 0
    # baseline: against the mean of the committed blocks
    w = T.walk(t, T.tree_router("baseline", 0.0))  # 0.4-0.3 keep; 0.5-mean(0.3,0.4) keep; 0.2-mean(.3,.4,.5) reject
    assert w.leaf == 0b011 and _refs(w) == [approx(0.3), approx(0.35), approx(0.4)] and w.scored_target_blocks == 1
    w = T.walk(t, T.tree_router("baseline", 0.12))  # 0.1 < 0.12 reject (target 0.2 scored); 0.1 - 0.25 reject
    assert w.leaf == 0 and _refs(w) == [approx(0.3), approx(0.25), approx((0.3 + 0.2 + 0.35) / 3)]
    assert w.scored_target_blocks == 3  # blocks 0, 1, 2 (the last block's target never)
    # relative on the same tree: the last committed block
    w = T.walk(t, T.tree_router("relative", 0.0))  # 0.4-0.3 keep; 0.5-0.4 keep; 0.2-0.5 reject
    assert w.leaf == 0b011 and _refs(w) == [approx(0.3), approx(0.4), approx(0.5)] and w.scored_target_blocks == 1
    for mode in ("fixed", "accept_rate"):
        assert T.walk(t, T.tree_router(mode, 0.5)).scored_target_blocks == 0


def test_schedule_veto_walks_and_counts_by_hand():
    t = _hand_tree()
    approx = pytest.approx
    # k = 2: block 2 is the target's before drafting (no decision, history bit 0); blocks 1 and 3 drafted and vetoed
    w = T.walk(t, T.tree_router("anchor", -0.05), schedule_every=2)  # 0.4-0.3 keep; block 3 after h=1: 0.3-0.3 keep
    assert w.leaf == 0b101 and w.decisions[1] is None and w.drafted == 2 and _refs(w) == [approx(0.3), None, approx(0.3)]
    assert w.scored_target_blocks == 1
    w = T.walk(t, T.tree_router("relative", 0.0), schedule_every=2)  # keep; target block 2 (0.45) scored; 0.3-0.45 reject
    assert w.leaf == 0b001 and _refs(w) == [approx(0.3), None, approx(0.45)] and w.scored_target_blocks == 2
    w = T.walk(t, T.tree_router("baseline", 0.0), schedule_every=2)  # keep; 0.3 - mean(0.3, 0.4, 0.45) reject
    assert w.leaf == 0b001 and _refs(w)[2] == approx((0.3 + 0.4 + 0.45) / 3) and w.scored_target_blocks == 2
    w = T.walk(t, T.tree_router("fixed", -math.inf), schedule_every=2)  # no veto: the plain schedule's leaf
    assert w.leaf == T.schedule_leaf(3, 2) and w.scored_target_blocks == 0
    w = T.walk(t, T.tree_router("relative", 0.0), schedule_every=3)  # block 3 forced: 2 decisions, as plain relative
    assert w.leaf == 0b011 and w.decisions[2] is None and w.scored_target_blocks == 1  # block 3 = last: not scored
    # the cost model's counts: drafted blocks pay drafter + decode + score, a vetoed one target + decode again,
    # a scheduled block the target and one decode, a reference mode also scores the target blocks it reads
    r = T.evaluate([t], T.tree_router("relative", 0.0), schedule_every=2)
    assert {k: float(v[0]) for k, v in r["counts"].items()} == {"drafter": 2, "target": 3, "decode": 5, "score": 4,
                                                                 "drafter_last": 3, "target_last": 3}
    r = T.evaluate([t], T.tree_router("anchor", -0.05), schedule_every=2)
    assert {k: float(v[0]) for k, v in r["counts"].items()} == {"drafter": 2, "target": 2, "decode": 4, "score": 3,
                                                                 "drafter_last": 3, "target_last": 2}
    r = T.evaluate([t], T.tree_router("baseline", 0.12))  # plain routing: 3 drafted, 3 rejected, 3 references
    assert {k: float(v[0]) for k, v in r["counts"].items()} == {"drafter": 3, "target": 4, "decode": 7, "score": 6,
                                                                 "drafter_last": 3, "target_last": 3}
    assert r["quality"][0] == t.leaves[0]["quality"] and r["accepted"][0] == 0


def test_random_is_decided_before_drafting_in_the_cost_model():
    trees = [_synthetic(n=6, seed=s) for s in range(5)]
    # the expected last kept block at p = 0.5: sum of b 0.5^(7 - b) over b = 1..6 = 5.015625 (and the same for the
    # last block given to the target)
    assert T.random_counts(6, 0.5) == {"drafter": 3.0, "target": 4.0, "decode": 7.0, "score": 0.0,
                                       "drafter_last": 5.015625, "target_last": 5.015625}
    assert T.random_counts(6, 0.0) == {"drafter": 0.0, "target": 7.0, "decode": 7.0, "score": 0.0,
                                       "drafter_last": 0.0, "target_last": 6.0}  # = target-only
    r = T.evaluate_random(trees, 0.25)
    np.testing.assert_allclose(r["quality"], [T.random_expectation(t, 0.25) for t in trees])
    # the pipeline's own draws: RandomRouter keyed by (seed, caption, block)
    t = trees[0]
    draws = RandomRouter(0.25, t.seed, key=t.caption)
    assert r["leaves"][0] == sum(int(draws.decide_block(b).accept) << (b - 1) for b in range(1, 7))
    a = T.analyse(trees, grids={"random": [0.0, 0.5], "fixed": [math.inf]}, resamples=200, block_seconds=_seconds())
    zero, half = a["modes"]["random"]
    assert zero["speedup"] == pytest.approx(1.0) and zero["router_minus_random"] == 0.0
    assert {k: half["counts"][k] for k in ("drafter", "target", "decode", "score")} == {
        "drafter": 15.0, "target": 20.0, "decode": 35.0, "score": 0.0}
    drafter_calls, target_calls = 4 * 3 + 5.015625, 4 * 4 + 5.015625  # per clip, commit passes included
    assert half["speedup"] == pytest.approx(5 * (34 * 0.02 + 7 * 0.04) / (
        5 * (drafter_calls * 0.004 + target_calls * 0.02) + 35 * 0.04))
    assert half["router_minus_random"] == pytest.approx(0.0, abs=1e-12) and half["acceptance"] == 0.5
    # verify-then-decide at acceptance 0 pays every draft, decode and score on top: slower than target-only
    assert a["modes"]["fixed"][0]["speedup"] < 1.0
    assert set(a["modes"]) == {"random", "fixed"}  # explicit grids: nothing else


def test_analysis_of_every_router_and_the_pareto_front():
    trees = [_synthetic(n=6, seed=s) for s in range(6)]
    seconds = _seconds(target=0.18, score=0.006, target_call=0.036)
    grids = T.default_grids(trees)
    assert set(grids) == {*T.MODES, "schedule", "random", *(f"schedule_veto_{m}" for m in T.VETO_MODES)}
    assert grids["schedule_veto_relative"][0] == (2, "relative", -math.inf)
    assert {k for k, _, _ in grids["schedule_veto_anchor"]} == {2, 3, 4, 6}
    a = T.analyse(trees, grids={m: v if m == "schedule" else v[::6] for m, v in grids.items()}, resamples=200,
                  block_seconds=seconds)
    for mode, rows in a["modes"].items():
        for r in rows:  # every row: its walk again, by hand
            result = T.run_setting(trees, mode, T.setting_value(mode, r["setting"]))
            assert r["quality"] == pytest.approx(float(np.mean(result["quality"])))
    veto = a["modes"]["schedule_veto_relative"][0]  # k=2, tau=-inf: the plain schedule k=2, whose cost it has
    plain = next(r for r in a["modes"]["schedule"] if r["setting"] == 2)
    assert veto["setting"] == {"every": 2, "tau_mode": "relative", "tau": "-inf"}
    assert veto["quality"] == plain["quality"] and veto["acceptance"] == plain["acceptance"]
    assert veto["counts"]["drafter"] == plain["counts"]["drafter"] and veto["counts"]["score"] == 6 * (3 + 3)  # drafts 1, 3, 5; targets 0, 2, 4
    front = a["pareto"]
    assert front and all(x["speedup"] < y["speedup"] and x["quality"] > y["quality"] for x, y in zip(front, front[1:]))
    everything = [r for rows in a["modes"].values() for r in rows]
    for p in front:  # nothing beats a front point on both axes
        assert not any(r["quality"] > p["quality"] and r["speedup"] > p["speedup"] for r in everything)
    q0 = a["target_only"]["quality"]
    for mode, best in a["best"].items():
        ok = [r for r in a["modes"][mode] if r["quality"] >= 0.98 * q0]
        assert (best is None) == (not ok)
        if best is not None:
            assert best["speedup"] == max(r["speedup"] for r in ok)
    assert "k=2 relative>=-inf" in T.format_setting(veto["setting"])


def test_the_split_is_fixed():
    design, report = T.split_clips("design"), T.split_clips("report")
    assert (len(design), len(report)) == (48, 40) and not {c for c, _ in design} & {c for c, _ in report}
    assert [c for c, _ in design] == demo.prompts_for(48)  # every earlier figure: prompts 0-47
    assert [c for c, _ in report] == demo.prompts_for(88)[48:]
    assert report[:2] == [("a blue ball moving down on white", 0), ("a red square moving right on white", 0)]
    with pytest.raises(ValueError, match="split must be one of"):
        T.split_clips("all")


# ---- tree walks of the new routers against real pipeline runs (need the engine's anchor/baseline modes, random
# decided before drafting and SDVGOptions.schedule_veto)
def _spy(pipe):
    """Count what the pipeline really runs: drafter and target blocks, decodes, and whole-block scores (a 1-frame
    seam-feature pass is not a block score)."""
    counts = {"drafter": 0, "target": 0, "decode": 0, "score": 0}

    def wrap(obj, name, key, counted=lambda *a, **k: True):
        inner = getattr(obj, name)

        def spied(*a, **k):
            counts[key] += bool(counted(*a, **k))
            return inner(*a, **k)
        setattr(obj, name, spied)

    wrap(pipe.drafter, "generate_block", "drafter")
    wrap(pipe.target, "generate_block", "target")
    wrap(pipe.vae, "decode_block", "decode")
    wrap(pipe.router, "score_frames", "score", lambda frames, *a, **k: frames.shape[0] > 1)
    return counts


def _margin_midpoints(tree, mode):
    return _midpoints(T._margins([tree], mode))


def _run_counted(models, caption, seed, options, router_kw=None):
    pipe = demo.build_pipeline(models, preset="native")
    pipe.router = RewardRouter(models.scorer, **(router_kw or {}))
    counts = _spy(pipe)
    result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=FRAMES, width=32, height=32,
                           seed=seed, options=options)
    return result, counts


def test_anchor_baseline_and_veto_walks_are_the_pipelines_runs(models, built, structure):
    leaves = set()
    for i, ((caption, seed), (tree, frames)) in enumerate(built.items()):
        for mode in ("anchor", "baseline", "relative"):
            for every, tau in [(None, t) for t in _margin_midpoints(tree, mode)[i::2]] + [(2, _margin_midpoints(tree, mode)[0]), (0, 0.0)]:
                router = T.tree_router(mode, tau)
                w = T.walk(tree, router, schedule_every=every or 0)
                expected = T.evaluate([tree], router, schedule_every=every or 0)
                options = SDVGOptions() if every is None else SDVGOptions(mode="schedule", schedule_every=every,
                                                                          schedule_veto=True)
                result, counts = _run_counted(models, caption, seed, options, {"tau_mode": mode, "tau": tau})
                assert torch.equal(frames[w.leaf], result.frames), (caption, mode, every, tau)
                assert result.report["decisions"][1:] == ["draft" if w.leaf >> b & 1 else "target"
                                                          for b in range(tree.num_decisions)]
                for d, block in zip(w.decisions, result.blocks[1:]):
                    if d is None:
                        assert block.decision is None  # scheduled: the target's, never drafted
                        continue
                    assert d.block_score == block.decision.block_score and d.tau == block.decision.tau
                    assert d.reference_score == pytest.approx(block.decision.reference_score, abs=0)
                assert counts == {k: int(expected["counts"][k][0]) for k in counts}, (caption, mode, every, tau)
                _assert_calls(result, expected["counts"], structure["native"])
                leaves.add((mode, w.leaf))
    assert len({leaf for _, leaf in leaves}) >= 3


def test_random_mode_is_the_tree_walk_and_drafts_only_what_it_keeps(models, built, structure):
    for (caption, seed), (tree, frames) in built.items():
        for p in (0.3, 0.7):
            leaf = T.random_walk(tree, p)
            result, counts = _run_counted(models, caption, seed, SDVGOptions(mode="random", random_accept_prob=p))
            assert torch.equal(frames[leaf], result.frames), (caption, p)
            n, kept = tree.num_decisions, bin(leaf).count("1")
            assert counts == {"drafter": kept, "target": 1 + n - kept, "decode": 1 + n, "score": 0}
            _assert_calls(result, T.before_drafting_counts([leaf], n), structure["native"])  # this draw's path


def test_baseline_rows_of_a_tree_are_the_pipelines_runs(models, built):
    """The tree report's baseline table (issue 29) reads target-only, block 0 + every draft, and the drafts' scores off
    the tree: they are what three pipeline runs give (python -m sdvg_engine.toy.baselines)."""
    from sdvg_engine.toy import baselines

    pipe = demo.build_pipeline(models)
    for clip, (tree, _) in built.items():
        from_tree = baselines.rows_from_trees([tree])[0]
        runs = baselines.clip_row(pipe, *clip, num_frames=FRAMES)
        assert (from_tree["caption"], from_tree["seed"]) == clip == (runs["caption"], runs["seed"])
        for key in ("target_only", "draft_only", "first_block_only"):
            assert from_tree[key] == pytest.approx(runs[key], abs=1e-12), (clip, key)
        assert len(from_tree["draft_scores"]) == tree.num_decisions
        assert from_tree["draft_scores"] == pytest.approx(runs["draft_scores"], abs=1e-6)


def test_routing_table_is_the_bench_runs_rows(tmp_path):
    """The shipped routing table (sdvg_engine.toy.routing_report, what `make demo` charts) holds, for every router, the
    settings bench_routing chose on the design trees and their rows on the report trees, unchanged; the demo's
    ROUTING_CHOICE reads the design picks back as the tree tool's settings; the held-out best is the fastest report row
    within 98%."""
    import sys

    sys.path.insert(0, str(WEIGHTS.parents[2] / "bench"))
    import bench_routing as BR
    from sdvg_engine.toy import routing_report as R

    design = [_synthetic(n=6, seed=s) for s in range(8)]
    report = [_synthetic(n=6, seed=s) for s in range(8, 16)]
    seconds = _seconds(target=0.18, score=0.006, target_call=0.036)
    grids = {m: v if m in ("schedule", "random") else v[::4] for m, v in T.default_grids(design).items()}
    d = T.analyse(design, grids=grids, block_seconds=seconds, resamples=100)
    r = T.analyse(report, grids=grids, block_seconds=seconds, resamples=100, extra_bands={"fast": BR.FAST_BAND})
    judged = BR.judge(BR.choose(d), r)
    bench = {"design": d, "report": r, "judged": judged, "speed_target": T.SPEED_TARGET, "quality_share": T.QUALITY_SHARE,
             "winner": BR.winner(judged, r), "oracle": BR.oracle_rows(report, seconds)}
    table = json.loads(json.dumps(R.summarize(bench, "abc")))  # as written to the file
    assert table["weights"] == "abc" and table["clips"] == {"design": 8, "report": 8}
    assert table["baselines"]["draft_only"]["speedup"] == pytest.approx((0.18 + 0.04) / (0.02 + 0.04))
    assert table["baselines"]["first_block_only"]["quality"] == pytest.approx(
        float(np.mean([t.leaves[-1]["quality"] for t in report])))  # every draft after block 0 kept
    assert set(table["band_average"]) == {"band", "fast"} and table["bands"]["fast"] == list(BR.FAST_BAND)
    fast_rows = []
    for mode, picks in judged.items():
        for pick in R.PICKS:
            if picks[pick] is None:
                assert table["points"][mode][pick] is None
                continue
            shipped = table["points"][mode][pick]["report"]
            row = BR._row_for(r, mode, picks[pick]["design"]["setting"])
            for key in ("acceptance", "quality", "quality_ratio_to_target", "speedup", "router_minus_random"):
                assert shipped[key] == pytest.approx(row[key]), (mode, pick, key)
            if row["quality_ratio_to_target"] >= T.QUALITY_SHARE:
                fast_rows.append(row["speedup"])
    best = table["held_out_best"]
    assert (best is None) == (not fast_rows)
    if best is not None:
        assert best["speedup"] == pytest.approx(max(fast_rows)) and best["quality_ratio_to_target"] >= T.QUALITY_SHARE
    # the one setting the design trees alone point to: the fastest pick keeping 98% on design, with its report row
    on_design = [(p["design"]["speedup"], m, pick) for m, picks in judged.items() for pick, p in picks.items()
                 if p is not None and p["design"]["quality_ratio_to_target"] >= T.QUALITY_SHARE]
    first = table["design_best"]
    assert first is not None and on_design  # schedule k=1 (target-only) always qualifies
    speed, m, pick = max(on_design)
    assert first["design"]["speedup"] == pytest.approx(speed)
    assert first["report"]["quality"] == pytest.approx(judged[first["mode"]][first["pick"]]["report"]["quality"])
    path = tmp_path / "routing_report.json"
    path.write_text(json.dumps(table))
    choice = R.design_choices("at_speed", path)
    expected = {m: T.setting_value(m, p["at_speed"]["design"]["setting"]) for m, p in judged.items() if p["at_speed"]}
    assert choice == expected and choice  # veto settings come back as (k, tau_mode, tau) tuples
    with pytest.raises(ValueError, match="pick 'fastest'"):
        R.design_choices("fastest", path)
    with pytest.raises(FileNotFoundError, match="bench_routing.py --ship"):
        R.load(tmp_path / "missing.json")
