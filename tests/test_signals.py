"""Issue 38: the verifier signals, their router walks and costs, the signal trees and the learned verifier."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from sdvg_engine.pipeline import unit_frames
from sdvg_engine.toy import signals as S
from sdvg_engine.toy import signal_trees as ST
from sdvg_engine.toy import tree as T
from sdvg_engine.toy import verifier as V
from sdvg_engine.toy.models import load_toy_models
from sdvg_engine.toy.tree_frames import ScoredFrames

FRAMES = 33  # 3 blocks: 2 decisions, 3 drafted nodes
CAPTION = "a red ball moving right on black"


def _seconds():
    calls = {m: {"steps": 4, "context": "global_cache", "per_call": c} for m, c in (("drafter", 0.004), ("target", 0.02))}
    return {"drafter": 0.02, "target": 0.1, "decode": 0.04, "score": 0.005, "calls": calls}


def _synthetic(n=3, seed=0):
    rng = np.random.default_rng(seed)
    frames = lambda: torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))  # noqa: E731,E501
    tree = T.ClipTree(
        caption=CAPTION, seed=seed, num_frames=12 * (n + 1) - 3, preset="native",
        block0=[float(x) for x in rng.normal(size=4)],
        draft=[[[float(x) for x in rng.normal(size=4)] for _ in range(2 ** b)] for b in range(n)],
        target=[[[float(x) for x in rng.normal(size=4)] for _ in range(2 ** b)] for b in range(n)],
        leaves=[{"quality": float(q), "adherence": 0.0, "temporal": 0.0} for q in rng.uniform(size=2 ** n)],
        draft_only={"quality": float(rng.uniform())})
    kept = ScoredFrames(frames(), [[frames() for _ in range(2 ** b)] for b in range(n)],
                        [[frames() for _ in range(2 ** b)] for b in range(n)])
    nodes = 2 ** n - 1
    sig = {"draft_x0": torch.randn(nodes, 4, 2, 3, 2, 2).half(), "target": torch.randn(nodes, 2, 3, 2, 2).half()}
    return tree, kept, sig


def test_auc_is_the_pairwise_probability_with_ties():
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=60), 1)  # ties
    pos = rng.uniform(size=60) < 0.4
    brute = np.mean([(a < b) + 0.5 * (a == b) for a in x[pos] for b in x[~pos]])
    assert S.auc(x, pos) == pytest.approx(brute)
    assert S.auc(-x, pos) == pytest.approx(1 - brute)
    assert S.auc(np.where(pos, 0.0, 1.0), pos) == 1.0


def test_reward_signals_walk_exactly_as_the_routers():
    """A signal router on r_min is the fixed-tau router, on m_relative_min / m_anchor_min / m_baseline_min the
    reference modes: same leaves as tree.walk at every tau; and their cost counts are tree.evaluate's."""
    for seed in range(3):
        tree, kept, sig = _synthetic(n=3, seed=seed)
        f = S.clip_features(tree, kept, sig)
        for name, mode in (("r_min", "fixed"), ("m_relative_min", "relative"), ("m_anchor_min", "anchor"),
                           ("m_baseline_min", "baseline")):
            values = np.sort(f[name])
            for tau in [-math.inf, *((values[1:] + values[:-1]) / 2), math.inf]:  # midpoints: no ties
                leaf = S.walk_leaf(f[name], 3, tau)
                router = T.tree_router(mode, tau)
                assert leaf == T.walk(tree, router).leaf, (name, tau)
                ev = T.evaluate([tree], router)
                counts = S.family_counts([leaf], 3, S.family_cost(S.signal_needs(name)))
                for k in ("drafter", "target", "decode", "score", "drafter_last", "target_last"):
                    assert float(np.sum(counts[k])) == pytest.approx(float(np.sum(ev["counts"][k]))), (name, k)
                assert S.family_speedup([leaf], 3, _seconds(), S.family_cost(S.signal_needs(name))) == pytest.approx(
                    T._speedup(ev["counts"], 4, 1, _seconds()))


def test_extra_seconds_and_free_signals_in_the_cost_model():
    seconds = _seconds()
    leaves = [0b101, 0b111]
    free = S.family_speedup(leaves, 3, seconds, S.family_cost({"reward": False}))
    scored = S.family_speedup(leaves, 3, seconds, S.family_cost({"reward": True}))
    slow = S.family_speedup(leaves, 3, seconds, S.family_cost({"reward": False}, extra_seconds=0.005))
    assert free > scored and slow == pytest.approx(scored)  # 0.005 s of arithmetic per block = one score
    assert S.marginal_cost({"reward": True}, seconds, 0.001) == pytest.approx(0.006)
    assert S.marginal_cost({"reward": False, "frames": True}, seconds, 0.001) == pytest.approx(0.001)


def test_score_family_against_the_exact_random_expectation():
    trees = [_synthetic(n=3, seed=s)[0] for s in range(6)]
    rng = np.random.default_rng(1)
    signals = [rng.normal(size=7) for _ in trees]
    fam = S.walk_family("noise", trees, signals)
    res = S.score_family(fam, trees, resamples=50)
    for row, leaves in zip(res["rows"], fam.leaves):
        p = row["acceptance"]
        assert p == pytest.approx(np.mean([bin(int(L)).count("1") for L in leaves]) / 3)
        assert row["random_quality"] == pytest.approx(np.mean([T.random_expectation(t, p) for t in trees]))
        assert row["quality"] == pytest.approx(np.mean([t.leaves[int(L)]["quality"] for t, L in zip(trees, leaves)]))
    # the label itself, walked as a router, beats random; the oracle's lift is positive
    oracle = S.score_family(S.walk_family("label", trees, [-T_gain(t) for t in trees]), trees, resamples=50)
    assert oracle["oracle_lift"] > 0 and oracle["lift"] > 0
    acc, best = S.oracle_curve(trees)
    assert best[:, 0] == pytest.approx([t.leaves[0]["quality"] for t in trees])
    assert best[:, -1] == pytest.approx([t.leaves[-1]["quality"] for t in trees])


def T_gain(tree):
    from sdvg_engine.toy.tree_frames import node_values

    return -node_values(tree)


def test_frame_and_latent_features_see_what_they_claim():
    still = torch.full((12, 3, 16, 16), 20, dtype=torch.uint8)
    still[:, :, 6:10, 6:10] = 200  # an object on a dark background
    moving = still.clone()
    jumped = torch.roll(still, shifts=5, dims=-1)
    a, b = S.frame_features(moving, still), S.frame_features(jumped, still)
    assert a["f_jump"] == 0.0 and b["f_jump"] < 0.0  # negated: a jump from the last kept frame is bad
    assert a["f_track_error"] > b["f_track_error"]
    x0 = torch.randn(4, 2, 3, 2, 2)
    same = torch.stack([x0[-1]] * 4)
    assert S.latent_features(same)["c_step2"] == 0.0 and S.latent_features(x0)["c_step2"] < 0.0


def test_learned_verifier_recovers_a_planted_signal_and_round_trips():
    rng = np.random.default_rng(0)
    feats = []
    for _ in range(12):
        f = {k: rng.normal(size=7) for k in V.CHEAP}
        f["block"] = np.array([1, 2, 2, 3, 3, 3, 3], dtype=float)
        f["gain"] = -f["f_jump"] + 0.3 * rng.normal(size=7)  # a jump (low f_jump) is what makes remaking help
        feats.append(f)
    for kind in V.KINDS:
        v = V.fit(feats, kind, V.CHEAP)
        test = {**{k: np.zeros(7) for k in V.CHEAP}, "block": np.full(7, 2.0), "f_jump": np.linspace(-2, 2, 7)}
        assert np.all(np.diff(v.signal(test)) > 0), kind  # high f_jump -> keep
        again = V.Verifier.from_json(json.loads(json.dumps(v.to_json())))
        assert again.signal(feats[1]) == pytest.approx(v.signal(feats[1]))
    oof = V.out_of_fold(feats, [], lambda tr: V.fit(tr, "ridge", V.CHEAP))
    pos = np.concatenate([f["gain"] for f in feats]) > 0
    assert S.auc(np.concatenate(oof), pos) > 0.8


def test_dfs_order_visits_accept_first():
    assert ST.dfs_nodes(3) == [(1, 0), (2, 1), (3, 3), (3, 1), (2, 0), (3, 2), (3, 0)]
    assert sorted(ST.node_index(b, h) for b, h in ST.dfs_nodes(3)) == list(range(7))


@pytest.fixture(scope="module")
def models():
    return load_toy_models()


def test_signal_trees_record_each_nodes_latents(models, tmp_path):
    """The drafter's and the target's blocks recorded per node decode (after the node's committed path) to the frames
    the tree scored at that node; the accept-first / reject-first order is checked by the swap being far off."""
    builder = T.TreeBuilder(models, num_frames=FRAMES, weights_id="test")
    assert ST.build_clip(builder, tmp_path, CAPTION, 0, log=lambda *a: None)
    assert not ST.build_clip(builder, tmp_path, CAPTION, 0, log=lambda *a: None)  # cached
    tree, kept, sig = ST.load_clip(tmp_path, builder.key(CAPTION, 0))
    assert sig["draft_x0"].shape[:2] == (3, 4)  # 3 nodes x 4 denoising steps
    vae = builder.pipe.vae

    def decoded(path):
        vae.reset()
        out = None
        for lat in path:
            out = ScoredFrames.keep(unit_frames(vae.decode_block(lat.float()[None])))
        return out.float()

    d, t = sig["draft_x0"][:, -1], sig["target"]
    cases = {  # node -> committed path before it
        (1, 0): [sig["block0"]], (2, 1): [sig["block0"], d[ST.node_index(1, 0)]],
        (2, 0): [sig["block0"], t[ST.node_index(1, 0)]]}
    errs = {}
    for (b, h), path in cases.items():
        i = ST.node_index(b, h)
        errs[(b, h)] = (decoded(path + [d[i]]) - kept.draft[b - 1][h].float()).abs().mean()
        assert errs[(b, h)] < 1.5, (b, h)
        assert (decoded(path + [t[i]]) - kept.target[b - 1][h].float()).abs().mean() < 1.5
    swapped = (decoded(cases[(2, 1)] + [d[ST.node_index(2, 0)]]) - kept.draft[1][1].float()).abs().mean()
    assert swapped > 3 * max(errs.values())
    f = S.clip_features(tree, kept, sig)
    assert len(f["gain"]) == 3 and np.allclose(f["gain"], T_gain(tree))


def test_verifier_command_collects_and_fits(models, tmp_path):
    out = tmp_path / "v.json"
    V.main(["--cache", str(tmp_path / "cache"), "--frames", str(FRAMES), "--clips", "2", "--extra", "1",
            "--out", str(out)])
    v = V.Verifier.from_json(json.loads(out.read_text()))
    assert v.trained_on["clips"] == 3 and v.trained_on["nodes"] == 9 and v.blocks == 2
    assert len(v.coef) == len(V.CHEAP) + 2 and all(math.isfinite(c) for c in v.coef)
    # resumes: a second call builds nothing (the cache holds every clip) and fits the same
    V.main(["--cache", str(tmp_path / "cache"), "--frames", str(FRAMES), "--clips", "2", "--extra", "1",
            "--no-build", "--out", str(tmp_path / "again.json")])
    assert json.loads((tmp_path / "again.json").read_text())["coef"] == v.coef
