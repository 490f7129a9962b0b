"""Whole-tree evaluation of routers on the toy world.

    python -m sdvg_engine.toy.tree --clips 32 --cache outputs/tree_cache --out outputs/toy_tree.json

For a clip (caption, seed) every decision prefix is generated exactly once: block 0 by the target, then for each
block ``b = 1 .. B-1`` and each history of accept/reject decisions on blocks ``1 .. b-1`` (``2**(b-1)`` of them; 63
nodes for an 81-frame clip of 7 blocks) the drafter's block AND the target's block, from the block's noise keyed by
``(seed, block, step)`` exactly as :meth:`SpeculativePipeline.generate` draws it. Both are decoded (the causal VAE
decode cache and both models' contexts are rolled back between siblings with the snapshot/restore of
:mod:`sdvg_engine.vae` and :mod:`sdvg_engine.context`) and scored per frame with the reward model. Each of the
``2**(B-1)`` leaves (64) is a whole clip, scored with the world's ground truth (:func:`world.clip_metrics`).
A root-to-leaf path is what ``pipeline.generate`` outputs for the same decisions, bit for bit (tests check it).

On the saved trees any router is scored exactly by walking the tree (:func:`walk`): fixed tau, adaptive
(``accept_rate``, a fresh :class:`TauState` per video, as the pipeline), the reference modes relative, anchor and
baseline (draft score minus the last committed block's, block 0's, or the committed blocks' mean score), mode
``schedule`` (k) and the schedule with a veto (``schedule_veto_<mode>``). Random routing at acceptance ``p`` is scored
as its exact expectation, not by sampling:

    E_p[Q] = sum over leaves L of  p**k(L) * (1 - p)**(n - k(L)) * Q(L)

with ``k(L)`` the accepted drafts on the path to ``L`` and ``n = B - 1`` the drafted blocks, per clip, then averaged
over clips, with ``p`` the router's realized acceptance over all clips (accepted / drafted blocks). Confidence
intervals resample clips (bootstrap, seeded). See docs/dev/toy_tree.md for every number of the report.

The cost model counts what each router runs: verify-then-decide routers draft, decode and score every routed block;
random routing and schedules decide before drafting, so a block they give the target costs the target alone.
``--split design|report`` takes the fixed held-out split (:data:`DESIGN_PROMPTS`, :data:`REPORT_PROMPTS`);
``bench/bench_routing.py`` chooses on one and reports on the other (docs/dev/routing.md).

``--keep-frames`` also saves the frames every node scored (:mod:`.tree_frames`), so that ``--reward FILE`` can score
the same trees with another reward model without generating anything, and the report compares the scores with the
world's ground truth (``reward_diagnostics``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..context import GlobalCache
from ..pipeline import SDVGOptions, pad_text, unit_frames, video_frames_to_latent_frames
from ..router import RandomRouter, RewardRouter, TauState
from ..sampling import SeededNoise
from .baselines import rows_from_trees
from .baselines import table as baseline_table
from .clips import DESIGN_PROMPTS, NUM_FRAMES, REPORT_PROMPTS, SPLITS, build_pipeline, clip_list, split_clips
from .clips import measure_block_seconds, weights_hash
from .models import WEIGHTS, load_reward, load_toy_models, sha256
from .text import embed_caption
from .tree_frames import ScoredFrames, block_scores, format_diagnostics, frames_path, rescore, reward_diagnostics
from .world import SIZE, clip_metrics

__all__ = [
    "ClipTree", "TreeBuilder", "Walk", "walk", "tree_router", "random_expectation", "random_coefficients",
    "evaluate", "analyse", "bootstrap_weights", "weights_hash", "tree_path", "load_or_build", "measure_block_seconds",
    "main", "scheduled", "random_walk", "random_counts", "evaluate_random", "evaluate_schedule", "schedule_leaf",
    "default_grids", "run_setting", "setting_value", "best_row", "best_at_speed", "pareto_front", "split_clips",
    "DESIGN_PROMPTS", "REPORT_PROMPTS", "SPLITS", "is_veto",
]

TREE_VERSION = 1
DEFAULT_CLIPS = 32
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
BAND = (0.1, 0.9)  # acceptances over which router - random is averaged
QUALITY_SHARE = 0.98  # "within 98% of target-only quality"
RATES = tuple(round(0.05 * i, 2) for i in range(1, 20))  # accept_rate grid
GRID_POINTS = 41  # fixed / relative tau grid: quantiles of the trees' own scores (or margins), plus +-inf
MODES = ("fixed", "accept_rate", "relative", "anchor", "baseline")  # the reward routers (RewardRouter tau modes)
RANDOM_P = tuple(round(0.05 * i, 2) for i in range(0, 21))  # random routing (decided before drafting) grid
VETO_MODES = ("fixed", "relative", "anchor", "baseline")  # schedule_veto_<m>: the router that may veto a draft
VETO_EVERY = (2, 3, 4, 6)  # schedule_veto: k
VETO_QUANTILES = (0.02, 0.05, 0.1, 0.2, 0.3)  # schedule_veto: taus at these quantiles of the mode's margins
SPEED_TARGET = 1.6  # "matched speed": the best quality at >= this cost-model speedup



# ============================================================================================== the tree
@dataclass
class ClipTree:
    """Every decision prefix of one clip (what the analysis needs; frames are not kept).

    ``draft[b - 1][h]`` / ``target[b - 1][h]``: per-frame reward scores of the drafter's / target's block ``b`` after
    history ``h`` (bit ``i - 1`` of ``h`` set = block ``i`` accepted, i.e. the draft kept). ``block0``: the target's
    block 0. ``leaves[L]``: :func:`world.clip_metrics` (quality, adherence, temporal) of the clip whose decisions are
    the bits of ``L``. ``draft_only``: the same metrics of a ``draft_only`` pipeline run. ``key``: what the tree
    depends on (weights hash, caption, seed, preset, frames, scoring settings).
    """

    caption: str
    seed: int
    num_frames: int
    preset: str
    block0: list[float]
    draft: list[list[list[float]]]
    target: list[list[list[float]]]
    leaves: list[dict]
    draft_only: dict
    key: dict = field(default_factory=dict)
    build_seconds: float = 0.0

    @property
    def num_decisions(self) -> int:
        """Drafted blocks per path (``B - 1``)."""
        return len(self.draft)

    def leaf_quality(self) -> np.ndarray:
        return np.array([leaf["quality"] for leaf in self.leaves], dtype=np.float64)

    def to_json(self) -> dict:
        return {"version": TREE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict, where: str = "tree") -> "ClipTree":
        if data.get("version") != TREE_VERSION:
            raise ValueError(f"{where}: tree version {data.get('version')!r}, this code reads {TREE_VERSION}; "
                             "delete the file (or the cache folder) to rebuild it")
        data = {k: v for k, v in data.items() if k != "version"}
        tree = cls(**data)
        n = tree.num_decisions
        if len(tree.leaves) != 2 ** n or any(len(tree.draft[b]) != 2 ** b or len(tree.target[b]) != 2 ** b
                                              for b in range(n)):
            raise ValueError(f"{where}: not a complete tree of {n} decisions; delete it to rebuild")
        return tree


class TreeBuilder:
    """Generates whole decision trees with the toy pipeline's own models, schedule, contexts, VAE and scorer.

    ``models``: :class:`~sdvg_engine.toy.models.ToyModels`; ``preset``: as the demo (``native`` / ``reference``).
    ``crop`` / ``preprocess``: the reward scoring settings (the routers walked on the tree must use the same).
    """

    def __init__(self, models, *, preset: str = "native", num_frames: int = NUM_FRAMES, crop: str = "center",
                 preprocess: str = "pil", weights_id: str = ""):
        self.pipe = build_pipeline(models, preset=preset, workers=1)
        self.pipe.router = RewardRouter(models.scorer, crop=crop, preprocess=preprocess)
        self.preset, self.num_frames, self.weights_id = preset, num_frames, weights_id
        fpb = self.pipe.target.frames_per_block
        self.num_blocks = video_frames_to_latent_frames(num_frames, fpb) // fpb

    def key(self, caption: str, seed: int) -> dict:
        r = self.pipe.router
        return {"weights": self.weights_id, "caption": caption, "seed": int(seed), "preset": self.preset,
                "num_frames": self.num_frames, "crop": r.crop, "preprocess": r.preprocess, "version": TREE_VERSION}

    def build(self, caption: str, seed: int, *, keep_frames: bool = False, scored: ScoredFrames | None = None):
        """The :class:`ClipTree` of ``(caption, seed)``; with ``keep_frames`` also ``{leaf: frames [T, H, W, 3]}``.
        ``scored``: an empty :class:`ScoredFrames` (``ScoredFrames.empty(B - 1)``), filled with every scored block."""
        began = time.perf_counter()
        pipe = self.pipe
        drafter, target, vae, router = pipe.drafter, pipe.target, pipe.vae, pipe.router
        gens = (drafter, target)
        B = self.num_blocks
        embeds = pad_text(embed_caption(caption))
        for gen in gens:
            gen.before_call = None
            gen.start(embeds, latent_height=SIZE // 8, latent_width=SIZE // 8, num_blocks=B)
        vae.reset()
        noise = SeededNoise(seed)
        prompt = router.scorer.encode_prompt(caption)

        def score(frames) -> list[float]:
            return block_scores(router, frames, prompt)

        def commit(b, latents, pixels):
            for gen in gens:
                gen.commit_block(b, latents, pixels if gen.context.needs_pixels else None)

        first = target.generate_block(0, noise)
        pixels0 = vae.decode_block(first.latents)
        frames0 = unit_frames(pixels0)
        block0 = score(frames0)
        if scored is not None:
            scored.block0 = ScoredFrames.keep(frames0)
        commit(0, first.latents, pixels0)
        draft_scores = [[None] * 2 ** b for b in range(B - 1)]
        target_scores = [[None] * 2 ** b for b in range(B - 1)]
        leaf_frames: dict[int, torch.Tensor] = {}
        leaves: list[dict | None] = [None] * 2 ** (B - 1)

        def visit(b: int, history: int, clip_frames: list[torch.Tensor]) -> None:
            if b == B:
                clip = torch.cat(clip_frames)
                metrics = clip_metrics(clip.numpy(), caption)
                leaves[history] = {k: metrics[k] for k in ("quality", "adherence", "temporal")}
                if keep_frames:
                    leaf_frames[history] = clip
                return
            drafted = drafter.generate_block(b, noise)  # runs the contexts' queued commits first
            regenerated = target.generate_block(b, noise)
            contexts = [gen.context.snapshot() for gen in gens]  # blocks 0 .. b-1 of this history, all in the caches
            vae_before = vae.snapshot()
            draft_pixels = vae.decode_block(drafted.latents)
            vae_draft = vae.snapshot()
            vae.restore(vae_before)
            target_pixels = vae.decode_block(regenerated.latents)
            vae_target = vae.snapshot()
            draft_frames, target_frames = unit_frames(draft_pixels), unit_frames(target_pixels)
            draft_scores[b - 1][history] = score(draft_frames)
            target_scores[b - 1][history] = score(target_frames)
            if scored is not None:
                scored.draft[b - 1][history] = ScoredFrames.keep(draft_frames)
                scored.target[b - 1][history] = ScoredFrames.keep(target_frames)
            for accept, sample, pixels, frames, vae_state in ((True, drafted, draft_pixels, draft_frames, vae_draft),
                                                               (False, regenerated, target_pixels, target_frames, vae_target)):
                if b + 1 < B:
                    for gen, snapshot in zip(gens, contexts):
                        _rewind(gen, snapshot)
                    vae.restore(vae_state)
                    commit(b, sample.latents, pixels)
                visit(b + 1, history | (int(accept) << (b - 1)), clip_frames + [frames.permute(0, 2, 3, 1).cpu()])

        visit(1, 0, [frames0.permute(0, 2, 3, 1).cpu()])
        result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=self.num_frames, width=SIZE,
                               height=SIZE, seed=seed, options=SDVGOptions(mode="draft_only"))
        draft_only = {k: v for k, v in clip_metrics(result.frames.numpy(), caption).items() if k != "per_frame"}
        tree = ClipTree(caption=caption, seed=int(seed), num_frames=self.num_frames, preset=self.preset, block0=block0,
                        draft=draft_scores, target=target_scores, leaves=leaves, draft_only=draft_only,
                        key=self.key(caption, seed), build_seconds=round(time.perf_counter() - began, 3))
        return (tree, leaf_frames) if keep_frames else tree


def _rewind(gen, snapshot) -> None:
    """Return ``gen``'s context to ``snapshot`` (taken right after it generated block ``b``, its committed blocks all in
    its KV cache). :meth:`ContextScheme.restore` queues every committed block's t=0 pass again to rebuild the cache;
    for a global cache those frames are still there, untouched: the work done since (deeper blocks of the tree) wrote
    only frames from block ``b`` on (the cache keeps no validity state, kv_cache.py), so the rebuild is skipped.
    A recompute window rebuilds before its next block anyway, as it does in the pipeline."""
    gen.context.restore(snapshot)
    if isinstance(gen.context, GlobalCache):
        gen.context.pending = []
        gen.context.committed_frames = (snapshot[-1][0] + 1) * gen.frames_per_block if snapshot else 0


# ============================================================================================== routers on the tree
def tree_router(tau_mode: str = "fixed", value: float = 0.0, *, aggregation: str = "min", **kw) -> RewardRouter:
    """A :class:`RewardRouter` for walking trees (no scorer: the scores are in the tree). ``value``: tau for
    ``fixed`` and ``relative``, the target acceptance share for ``accept_rate``."""
    if tau_mode == "accept_rate":
        return RewardRouter(None, tau_mode=tau_mode, accept_rate=value, aggregation=aggregation, **kw)
    return RewardRouter(None, tau=value, tau_mode=tau_mode, aggregation=aggregation, **kw)


@dataclass
class Walk:
    """A router's path through one tree: the leaf it ends in and its decisions (``decisions[i]`` = block ``i + 1``;
    ``None`` for a block a schedule gave the target before drafting)."""

    leaf: int
    decisions: list
    scored_target_blocks: int  # committed target blocks scored for later references (reference modes)

    @property
    def accepted(self) -> int:
        return bin(self.leaf).count("1")

    @property
    def drafted(self) -> int:
        """Blocks the drafter made (and that were decoded and scored): those with a decision."""
        return sum(d is not None for d in self.decisions)

    @property
    def drafter_last(self) -> int:
        """The last block the drafter made (0: none): with the global cache it commits every block before it."""
        return max((b for b, d in enumerate(self.decisions, 1) if d is not None), default=0)

    @property
    def target_last(self) -> int:
        """The last block the target made (block 0, a scheduled or a rejected block): with the global cache it
        commits every block before it, drafts included, one context pass each (lazily, when it next generates)."""
        return max((b for b, d in enumerate(self.decisions, 1) if d is None or not d.accept), default=0)


def scheduled(b: int, every: int) -> bool:
    """Whether mode ``schedule`` gives block ``b`` (1..n) to the target before drafting (the pipeline's rule,
    :meth:`SDVGOptions.target_makes_block`)."""
    return SDVGOptions(mode="schedule", schedule_every=every).target_makes_block(b)


def walk(tree: ClipTree, router: RewardRouter, tau_state: TauState | None = None, *, schedule_every: int = 0) -> Walk:
    """Route every drafted block of ``tree`` with ``router`` exactly as the pipeline would (same :meth:`decide`,
    a fresh :class:`TauState` per video unless one is carried in, references from the committed blocks).

    Reference modes (relative / anchor / baseline): ``committed`` holds the block score of every committed block in
    order (block 0 first): an accepted draft's decision score, a target block's ``block_score`` where
    ``router.needs_committed_score(b)`` and a later draft can read it (never the last block's), else ``None``; each
    draft is decided against ``router.reference_of(committed)``.

    ``schedule_every = k > 0``: mode ``schedule`` with its veto (``SDVGOptions.schedule_veto``): blocks ``k, 2k, ...``
    are the target's, decided before drafting (history bit 0, no draft, no decision: ``None`` in ``decisions``);
    every other block is drafted, scored and routed by ``router``."""
    if router.temporal_weight != 0.0:
        raise ValueError("trees keep no frame features: walk them with temporal_weight=0")
    state = tau_state if tau_state is not None else router.new_tau_state()
    n = tree.num_decisions
    scored_targets = 0

    def target_score(b: int, scores) -> float | None:
        """The committed target block ``b``'s score where the pipeline scores it: a reference mode that needs it
        (:meth:`RewardRouter.needs_committed_score`), not the last block (else ``None``, not scored)."""
        nonlocal scored_targets
        if router.uses_reference and router.needs_committed_score(b) and b < n:
            scored_targets += 1
            return router.block_score(scores)
        return None

    committed = [target_score(0, tree.block0)]
    history, decisions = 0, []
    for b in range(1, n + 1):
        if scheduled(b, schedule_every):
            decisions.append(None)
            committed.append(target_score(b, tree.target[b - 1][history]))
            continue
        reference = router.reference_of(committed) if router.uses_reference else None
        decision = router.decide(tree.draft[b - 1][history], tau=router.block_tau(state), reference=reference)
        state.observe(decision.block_score)
        decisions.append(decision)
        committed.append(decision.block_score if decision.accept else target_score(b, tree.target[b - 1][history]))
        history |= int(decision.accept) << (b - 1)
    return Walk(history, decisions, scored_targets)


def random_walk(tree: ClipTree, p: float) -> int:
    """The leaf of mode ``random`` with ``random_accept_prob=p`` on ``tree``'s clip: the pipeline's
    :class:`RandomRouter` keyed by ``(seed, caption, block)``, decided before drafting."""
    router = RandomRouter(p, tree.seed, key=tree.caption)
    return sum(int(router.decide_block(b).accept) << (b - 1) for b in range(1, tree.num_decisions + 1))


def _accept_counts(n: int) -> np.ndarray:
    return np.array([bin(leaf).count("1") for leaf in range(2 ** n)])


def random_coefficients(tree: ClipTree) -> np.ndarray:
    """``C[k]`` = sum of leaf qualities over the leaves with ``k`` accepted drafts (``k = 0 .. n``)."""
    n = tree.num_decisions
    return np.bincount(_accept_counts(n), weights=tree.leaf_quality(), minlength=n + 1)


def _bernstein(p, n: int) -> np.ndarray:
    """``p**k * (1 - p)**(n - k)`` for k = 0..n (rows follow ``p``'s shape)."""
    p = np.asarray(p, dtype=np.float64)[..., None]
    k = np.arange(n + 1)
    return p ** k * (1.0 - p) ** (n - k)


def random_expectation(tree: ClipTree, p: float) -> float:
    """Exact expected quality of random routing that keeps each draft with probability ``p``, independently:
    ``sum_L p**k(L) (1 - p)**(n - k(L)) Q(L)``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    return float(random_coefficients(tree) @ _bernstein(p, tree.num_decisions))


def bootstrap_weights(num_clips: int, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """``W[r, c]``: how often clip ``c`` is drawn in resample ``r`` (clips drawn with replacement; seeded)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num_clips, size=(resamples, num_clips))
    weights = np.zeros((resamples, num_clips))
    np.add.at(weights, (np.arange(resamples)[:, None], idx), 1.0)
    return weights


def _ci(values: np.ndarray) -> list[float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [float(lo), float(hi)]


@dataclass
class _Clips:
    """Per-clip arrays of a set of trees, for exact scoring and the bootstrap."""

    trees: list
    n: int
    coef: np.ndarray  # [N, n + 1] random_coefficients
    target_only: np.ndarray  # [N] quality of the all-reject leaf
    draft_only: np.ndarray  # [N]

    @classmethod
    def of(cls, trees):
        ns = {t.num_decisions for t in trees}
        if len(ns) != 1:
            raise ValueError(f"trees of different lengths ({sorted(ns)} decisions) cannot be pooled; use one --frames")
        return cls(trees, ns.pop(), np.stack([random_coefficients(t) for t in trees]),
                   np.array([t.leaves[0]["quality"] for t in trees]), np.array([t.draft_only["quality"] for t in trees]))


def evaluate(trees, router: RewardRouter, *, schedule_every: int = 0) -> dict:
    """Per-clip results of ``router`` on ``trees``: ``quality`` [N], ``accepted`` [N], ``leaves`` and the block
    counts of the cost model (drafter, target, decode, score blocks per clip), counting what the pipeline runs:
    verify-then-decide drafts, decodes and scores every block it routes, and a rejected one is generated and decoded
    again by the target; reference modes also score the committed target blocks a later reference reads.
    ``schedule_every = k > 0``: mode ``schedule`` with its veto (:func:`walk`): the scheduled blocks cost the target
    and one decode, nothing else."""
    walks = [walk(t, router, schedule_every=schedule_every) for t in trees]
    n = trees[0].num_decisions
    accepted = np.array([w.accepted for w in walks], dtype=np.float64)
    drafted = np.array([w.drafted for w in walks], dtype=np.float64)
    rejected = drafted - accepted
    scored_targets = np.array([w.scored_target_blocks for w in walks], dtype=np.float64)
    return {
        "quality": np.array([t.leaves[w.leaf]["quality"] for t, w in zip(trees, walks)]),
        "accepted": accepted,
        "leaves": [w.leaf for w in walks],
        "counts": {"drafter": drafted, "target": 1.0 + (n - drafted) + rejected, "decode": 1.0 + n + rejected,
                   "score": drafted + scored_targets,
                   "drafter_last": np.array([w.drafter_last for w in walks], dtype=np.float64),
                   "target_last": np.array([w.target_last for w in walks], dtype=np.float64)},
    }


def random_counts(n: int, p: float) -> dict:
    """Expected blocks per clip of mode ``random`` at ``p``, decided before drafting: a block it gives the target
    is never drafted, decoded twice or scored (drafter ``p n``, target ``1 + (1 - p) n``, decode ``1 + n``); and the
    expected last block of each model (``drafter_last``: the last kept block, ``target_last``: the last given to the
    target, 0 if none): block ``b`` is the last kept one with probability ``p (1 - p)^(n - b)``."""
    last = lambda q: sum(b * q * (1.0 - q) ** (n - b) for b in range(1, n + 1))  # noqa: E731
    return {"drafter": p * n, "target": 1.0 + (1.0 - p) * n, "decode": 1.0 + n, "score": 0.0,
            "drafter_last": last(p), "target_last": last(1.0 - p)}


def evaluate_random(trees, p: float) -> dict:
    """Per-clip results of random routing at ``p`` as :func:`evaluate`, in expectation (exact): ``quality`` is
    :func:`random_expectation`, ``accepted`` ``p n``, the counts :func:`random_counts`. ``leaves``: the leaf the
    pipeline's own draws reach (:func:`random_walk`), for reference."""
    n, N = trees[0].num_decisions, len(trees)
    return {
        "quality": np.array([random_expectation(t, p) for t in trees]),
        "accepted": np.full(N, p * n),
        "leaves": [random_walk(t, p) for t in trees],
        "counts": {k: np.full(N, v) for k, v in random_counts(n, p).items()},
    }


def schedule_leaf(num_decisions: int, every: int) -> int:
    """The leaf of mode ``schedule`` (:class:`sdvg_engine.pipeline.SDVGOptions.schedule_every`): block ``b`` (1..n) is
    the drafter's unless ``every > 0`` and ``b % every == 0``; bit ``b - 1`` set = the draft kept."""
    return sum(1 << (b - 1) for b in range(1, num_decisions + 1) if not scheduled(b, every))


def before_drafting_counts(leaves, n: int) -> dict:
    """The cost model's per-clip counts (as :func:`evaluate`'s) of decisions made before drafting that end in
    ``leaves`` (one per clip; bit ``b - 1`` set = block ``b`` the drafter's): the drafter makes only its own blocks,
    the target block 0 and the rest, every block is decoded once, nothing is scored; and each model's last block."""
    kept = [[b for b in range(1, n + 1) if leaf >> (b - 1) & 1] for leaf in leaves]
    last = lambda blocks: np.array([max(b, default=0) for b in blocks], dtype=np.float64)  # noqa: E731
    drafted = np.array([len(k) for k in kept], dtype=np.float64)
    return {"drafter": drafted, "target": 1.0 + n - drafted, "decode": np.full(len(leaves), 1.0 + n),
            "score": np.zeros(len(leaves)), "drafter_last": last(kept),
            "target_last": last([sorted(set(range(1, n + 1)) - set(k)) for k in kept])}


def evaluate_schedule(trees, every: int) -> dict:
    """Per-clip results of ``schedule`` mode on ``trees``, as :func:`evaluate`. Its decisions come before drafting
    (:func:`before_drafting_counts`)."""
    n = trees[0].num_decisions
    leaf = schedule_leaf(n, every)
    N = len(trees)
    return {
        "quality": np.array([t.leaves[leaf]["quality"] for t in trees]),
        "accepted": np.full(N, float(bin(leaf).count("1"))),
        "leaves": [leaf] * N,
        "counts": before_drafting_counts([leaf] * N, n),
    }


def model_calls(model: str, blocks, last, calls: dict):
    """DiT calls of ``model`` ("drafter" or "target") for ``blocks`` generated blocks whose last is block ``last``
    (numbers or per-clip arrays), with ``calls[model]`` its structure (:func:`call_costs`): ``steps`` denoising calls
    per block, plus its context passes: with the global cache one commit pass for every block before the last it
    generates (commits are lazy: a run of kept drafts is committed to the target when it next generates), with the
    recompute window one pass before every block it generates after block 0 (the target always makes block 0)."""
    c = calls[model]
    if c["context"] == "global_cache":
        passes = last
    elif c["context"] == "recompute_window":
        passes = blocks - (1.0 if model == "target" else 0.0)
    else:
        raise ValueError(f"calls[{model!r}]: unknown context scheme {c['context']!r}")
    return c["steps"] * blocks + passes


def _speedup(counts: dict, num_blocks: int, num_clips: int, seconds: dict | None) -> float | None:
    """Cost-model speedup over target-only (one worker, summed over clips): the DiTs' calls (:func:`model_calls`,
    their context passes included) times their seconds per call (``seconds["calls"]``, :func:`call_costs`), plus
    decodes and scores times their seconds per block."""
    if not seconds:
        return None
    calls = seconds.get("calls")
    if calls is None:
        raise ValueError("block_seconds has no per-call costs ('calls'; measured before the cost model counted the "
                         "DiTs' context passes): measure them again (clips.measure_block_seconds)")
    dit = sum(float(np.sum(model_calls(m, np.asarray(counts[m]), np.asarray(counts[f"{m}_last"]), calls)))
              * calls[m]["per_call"] for m in ("drafter", "target"))
    cost = dit + sum(float(np.sum(counts[c])) * seconds[c] for c in ("decode", "score"))
    target_only = model_calls("target", float(num_blocks), float(num_blocks - 1), calls) * calls["target"]["per_call"]
    baseline = num_clips * (target_only + num_blocks * seconds["decode"])
    return baseline / cost if cost > 0 else None


def _committed_min(tree: ClipTree, b: int, h: int) -> list[float]:
    """Min-aggregated block scores of the blocks committed before block ``b`` on history ``h`` (block 0 first)."""
    out = [min(tree.block0)]
    for i in range(1, b):
        prefix = h & ((1 << (i - 1)) - 1)
        out.append(min((tree.draft if (h >> (i - 1)) & 1 else tree.target)[i - 1][prefix]))
    return out


def _margins(trees, tau_mode: str) -> np.ndarray:
    """Every node's draft score (fixed) or its margin over the reference of the history before it (reference modes:
    relative, anchor, baseline; min aggregation), finite ones only."""
    values = []
    for t in trees:
        for b in range(1, t.num_decisions + 1):
            for h in range(2 ** (b - 1)):
                draft = min(t.draft[b - 1][h])
                if tau_mode == "fixed":
                    values.append(draft)
                    continue
                committed = _committed_min(t, b, h)
                ref = {"relative": committed[-1], "anchor": committed[0]}.get(tau_mode, float(np.mean(committed)))
                values.append(draft - ref)
    return np.array([v for v in values if math.isfinite(v)])


def _grid(trees, tau_mode: str) -> list[float]:
    """Default settings of a mode: quantiles of the trees' draft scores (fixed) or of the margins over the reference
    before them (relative, anchor, baseline), with -inf and +inf; the RATES grid for accept_rate."""
    if tau_mode == "accept_rate":
        return list(RATES)
    values = _margins(trees, tau_mode)
    grid = np.unique(np.quantile(values, np.linspace(0, 1, GRID_POINTS))) if values.size else np.array([])
    return [-math.inf, *[float(v) for v in grid], math.inf]


def _veto_grid(trees, tau_mode: str) -> list[tuple[int, str, float]]:
    """Default settings of ``schedule_veto_<tau_mode>``: every ``k`` of :data:`VETO_EVERY` up to ``n`` x the
    :data:`VETO_QUANTILES` of the mode's margins (low quantiles: a veto rejects few drafts) and -inf (no veto: the
    plain schedule)."""
    n = trees[0].num_decisions
    values = _margins(trees, tau_mode)
    taus = [-math.inf] + ([float(v) for v in np.quantile(values, VETO_QUANTILES)] if values.size else [])
    return [(k, tau_mode, tau) for k in VETO_EVERY if k <= n for tau in taus]


def is_veto(mode: str) -> bool:
    """Whether ``mode`` names a schedule with a veto (``schedule_veto_<tau mode>``, settings ``(k, tau_mode, tau)``)."""
    return mode.startswith("schedule_veto")


def default_grids(trees) -> dict:
    """Every mode's default settings: the routers' :func:`_grid`, ``schedule`` k = 0 .. n, ``random`` p in
    :data:`RANDOM_P`, ``schedule_veto_<m>`` for each veto mode ``m`` of :data:`VETO_MODES` (:func:`_veto_grid`)."""
    n = trees[0].num_decisions
    return {**{m: _grid(trees, m) for m in MODES}, "schedule": list(range(0, n + 1)), "random": list(RANDOM_P),
            **{f"schedule_veto_{m}": _veto_grid(trees, m) for m in VETO_MODES}}


def _setting_json(mode: str, value):
    finite = lambda v: v if math.isfinite(v) else str(v)  # noqa: E731
    if is_veto(mode):
        k, tau_mode, tau = value
        return {"every": int(k), "tau_mode": tau_mode, "tau": finite(float(tau))}
    if mode == "schedule":
        return int(value)
    return finite(float(value))


def setting_value(mode: str, setting):
    """The inverse of a row's JSON ``setting``: a float (``"inf"`` strings back to floats), ``k`` for ``schedule``,
    ``(k, tau_mode, tau)`` for ``schedule_veto_*``."""
    if is_veto(mode):
        return int(setting["every"]), setting["tau_mode"], float(setting["tau"])
    if mode == "schedule":
        return int(setting)
    return float(setting)


def run_setting(trees, mode: str, value, aggregation: str = "min") -> dict:
    """:func:`evaluate` (or its schedule / random variants) of one setting of one mode."""
    if mode == "schedule":
        return evaluate_schedule(trees, int(value))
    if mode == "random":
        return evaluate_random(trees, float(value))
    if is_veto(mode):
        k, tau_mode, tau = value
        return evaluate(trees, tree_router(tau_mode, tau, aggregation=aggregation), schedule_every=int(k))
    return evaluate(trees, tree_router(mode, value, aggregation=aggregation))


def analyse(trees, *, grids: dict | None = None, block_seconds: dict | None = None, resamples: int = RESAMPLES,
            seed: int = BOOTSTRAP_SEED, aggregation: str = "min", band: tuple = BAND,
            extra_bands: dict | None = None) -> dict:
    """Every setting of ``grids`` scored exactly on ``trees``, against random routing at the same acceptance, with
    bootstrap CIs over clips. ``grids``: ``{mode: [setting, ...]}`` with modes the routers' (:data:`MODES`: tau, or the
    share r for ``accept_rate``), ``schedule`` (k), ``random`` (p, decided before drafting) and ``schedule_veto_<m>``
    (``(k, tau_mode, tau)``: the schedule with a veto, :func:`walk`); default :func:`default_grids`. ``extra_bands``:
    ``{name: (lo, hi)}``, more acceptance bands to average router - random over (``average_in_bands[name][mode]``).
    See docs/dev/toy_tree.md for the fields."""
    if not trees:
        raise ValueError("no trees to analyse")
    clips = _Clips.of(trees)
    N, n = len(trees), clips.n
    W = bootstrap_weights(N, resamples, seed)
    grids = grids if grids is not None else default_grids(trees)
    report = {
        "clips": N, "drafted_blocks_per_clip": n,
        "bootstrap": {"resamples": resamples, "seed": seed, "level": 0.95, "over": "clips"},
        "block_seconds": block_seconds,
        "target_only": {"quality": float(clips.target_only.mean()), "ci": _ci(W @ clips.target_only / N)},
        "draft_only": {"quality": float(clips.draft_only.mean()), "ci": _ci(W @ clips.draft_only / N)},
        "modes": {}, "average_in_band": {}, "band": list(band),
    }
    extra_bands = dict(extra_bands or {})
    if extra_bands:
        report["average_in_bands"] = {name: {} for name in extra_bands}
        report["bands"] = {name: list(b) for name, b in extra_bands.items()}
    q0 = clips.target_only.mean()
    for mode, values in grids.items():
        rows, in_band, in_band_boot = [], [], []
        extra = {name: ([], []) for name in extra_bands}
        for value in values:
            result = run_setting(trees, mode, value, aggregation)
            q, a = result["quality"], result["accepted"]
            p = float(a.sum() / (N * n))
            random = float(np.mean(clips.coef @ _bernstein(p, n)))
            # bootstrap: quality, acceptance and the random expectation at the resample's own acceptance
            q_r = W @ q / N
            p_r = W @ a / (N * n)
            random_r = np.einsum("rk,rk->r", W @ clips.coef, _bernstein(p_r, n)) / N
            diff_r = q_r - random_r
            row = {
                "setting": _setting_json(mode, value), "acceptance": p, "quality": float(q.mean()),
                "quality_ci": _ci(q_r), "random_quality": random, "router_minus_random": float(q.mean()) - random,
                "router_minus_random_ci": _ci(diff_r),
                "quality_ratio_to_target": float(q.mean() / q0) if q0 > 0 else None,
                "quality_ratio_ci": _ci(q_r / (W @ clips.target_only / N)) if q0 > 0 else None,
                "counts": {k: float(v.sum()) for k, v in result["counts"].items()},
                "speedup": _speedup(result["counts"], n + 1, N, block_seconds),
            }
            rows.append(row)
            if band[0] <= p <= band[1]:
                in_band.append(row["router_minus_random"])
                in_band_boot.append(diff_r)
            for name, (lo, hi) in extra_bands.items():
                if lo <= p <= hi:
                    extra[name][0].append(row["router_minus_random"])
                    extra[name][1].append(diff_r)
        for name, (point, boot) in extra.items():
            report["average_in_bands"][name][mode] = None if not point else {
                "router_minus_random": float(np.mean(point)), "ci": _ci(np.mean(boot, axis=0)), "settings": len(point)}
        report["modes"][mode] = rows
        report["average_in_band"][mode] = None if not in_band else {
            "router_minus_random": float(np.mean(in_band)), "ci": _ci(np.mean(in_band_boot, axis=0)),
            "settings": len(in_band)}
    report["best_fixed_tau"] = _best_fixed(report)
    report["best"] = {m: best_row(rows, q0) for m, rows in report["modes"].items()}
    report["pareto"] = pareto_front(report)
    # issue 29's baseline table (draft-only / target-only, the gap block 0 closes, ...) read off the same trees
    report["baselines"] = baseline_table(rows_from_trees(trees), block_seconds, resamples=resamples, seed=seed)
    report["per_clip"] = [{"caption": t.caption, "seed": t.seed, "target_only": t.leaves[0]["quality"],
                           "draft_only": t.draft_only["quality"], "all_accept": t.leaves[-1]["quality"],
                           "best_leaf": float(t.leaf_quality().max()), "worst_leaf": float(t.leaf_quality().min()),
                           "build_seconds": t.build_seconds} for t in trees]
    return report


def best_row(rows, target_quality: float, share: float = QUALITY_SHARE) -> dict | None:
    """The row with the highest cost-model speedup (then acceptance) whose quality is >= ``share`` x target-only."""
    good = [r for r in rows if target_quality > 0 and r["quality"] >= share * target_quality]
    return max(good, key=lambda r: (r["speedup"] or 0.0, r["acceptance"])) if good else None


def best_at_speed(rows, speedup: float) -> dict | None:
    """The row with the highest quality among those with cost-model speedup >= ``speedup``."""
    fast = [r for r in rows if (r["speedup"] or 0.0) >= speedup]
    return max(fast, key=lambda r: (r["quality"], r["speedup"])) if fast else None


def pareto_front(report: dict, modes=None) -> list[dict]:
    """Rows of ``report["modes"]`` (every mode, or ``modes``) that no other row beats on both quality and cost-model
    speedup, by speedup ascending, each with its ``mode``. Empty without timings."""
    rows = [{"mode": m, **r} for m, rs in report["modes"].items() if modes is None or m in modes for r in rs
            if r["speedup"] is not None]
    front = [r for r in rows if not any(o["quality"] >= r["quality"] and o["speedup"] >= r["speedup"]
                                        and (o["quality"] > r["quality"] or o["speedup"] > r["speedup"]) for o in rows)]
    out, seen = [], set()
    for r in sorted(front, key=lambda r: (r["speedup"], r["quality"])):
        key = (round(r["speedup"], 12), round(r["quality"], 12))
        if key not in seen:  # equal points (e.g. random p=0 and tau=+inf never both): keep the first
            seen.add(key)
            out.append({k: r[k] for k in ("mode", "setting", "acceptance", "quality", "quality_ratio_to_target",
                                          "speedup", "router_minus_random", "router_minus_random_ci")})
    return out


def best_fixed_from(path: Path) -> dict:
    """``best_fixed_tau`` of another run's report (its ``--out``): the tau to try on this run's clips, so that tau is
    chosen on one set of clips and judged on another (``--tau-from``)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"--tau-from {path}: no such file (a report written by this tool's --out)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--tau-from {path}: not a JSON report ({exc})") from None
    best = data.get("best_fixed_tau") if isinstance(data, dict) else None
    if not isinstance(best, dict) or "tau" not in best:
        raise SystemExit(f"--tau-from {path}: the report has no fixed tau within {QUALITY_SHARE:.0%} of target-only "
                         "quality (best_fixed_tau is null or missing); there is no tau to carry over")
    return {**best, "tau": float(best["tau"])}  # "inf" / "-inf" are stored as strings


def _best_fixed(report: dict) -> dict | None:
    """The fixed tau with the highest acceptance (then speedup) whose quality is >= 98% of target-only."""
    target = report["target_only"]["quality"]
    rows = [r for r in report["modes"].get("fixed", []) if target > 0 and r["quality"] >= QUALITY_SHARE * target]
    if not rows:
        return None
    best = max(rows, key=lambda r: (r["speedup"] or 0.0, r["acceptance"]))
    return {"tau": best["setting"], "acceptance": best["acceptance"], "quality": best["quality"],
            "quality_ratio_to_target": best["quality_ratio_to_target"], "speedup": best["speedup"]}


# ============================================================================================== cache, timing, CLI
def tree_path(cache: Path, key: dict) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", key["caption"].lower()).strip("_")
    folder = f"{key['preset']}_{key['num_frames']}f_{key['crop']}_{key['preprocess']}"
    return Path(cache) / key["weights"] / folder / f"{slug}_seed{key['seed']}.json"


def load_or_build(builder: TreeBuilder, cache: Path | None, caption: str, seed: int, *, build: bool = True,
                  frames: bool = False, log=print):
    """The cached tree of ``(caption, seed)`` if its key matches, else a new one (saved atomically). With ``frames``:
    ``(tree, ScoredFrames)``, the frames saved beside the tree (:func:`tree_frames.frames_path`); a tree cached
    without them is an error (delete it to rebuild), never a silent rebuild."""
    key = builder.key(caption, seed)
    path = tree_path(cache, key) if cache is not None else None
    if path is not None and path.exists():
        tree = ClipTree.from_json(json.loads(path.read_text()), where=str(path))
        if tree.key != key:
            raise ValueError(f"{path}: made for {tree.key}, expected {key}; delete it to rebuild")
        if not frames:
            return tree
        kept = frames_path(path)
        if not kept.exists():
            raise ValueError(f"{path}: cached without the frames it scored ({kept.name}); delete it to rebuild it "
                             "with --keep-frames")
        return tree, ScoredFrames.load(kept, tree.num_decisions)
    if not build:
        return None
    scored = ScoredFrames.empty(builder.num_blocks - 1) if frames else None
    tree = builder.build(caption, seed, scored=scored)
    log(f"  tree {caption!r} seed {seed}: {tree.build_seconds:.1f} s")
    if path is not None:
        if scored is not None:  # first, so that a tree on disk always has its frames
            scored.save(frames_path(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(tree.to_json()))
        tmp.replace(path)
    return (tree, scored) if frames else tree


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not (0 <= int(m.group(1)) < int(m.group(2))):
        raise SystemExit(f"--shard {text}: expected i/n with 0 <= i < n (e.g. 0/2 and 1/2 for two processes)")
    return int(m.group(1)), int(m.group(2))


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def format_setting(s) -> str:
    """A row's setting for a table: a float to 3 decimals, ``k=3 relative>=-0.120`` for ``schedule_veto``."""
    if isinstance(s, dict):
        return f"k={s['every']} {s['tau_mode']}>={format_setting(s['tau'])}"
    return f"{s:.3f}" if isinstance(s, float) else str(s)


def format_report(report: dict) -> str:
    """A short table: per mode the settings nearest acceptance 0.1/0.3/0.5/0.7/0.9, then the verdicts."""
    lines = [f"{report['clips']} clips, {report['drafted_blocks_per_clip'] + 1} blocks each; "
             f"target-only quality {report['target_only']['quality']:.3f} [{report['target_only']['ci'][0]:.3f}, "
             f"{report['target_only']['ci'][1]:.3f}], draft-only {report['draft_only']['quality']:.3f} "
             f"[{report['draft_only']['ci'][0]:.3f}, {report['draft_only']['ci'][1]:.3f}] (95% CI over clips)",
             f"{'mode':<23} {'setting':>9} {'accept':>6} {'quality':>8} {'random':>7} {'router-random':>14} "
             f"{'95% CI':>18} {'speedup':>8}"]
    for mode, rows in report["modes"].items():
        shown = []
        for target in (0.1, 0.3, 0.5, 0.7, 0.9):
            row = min(rows, key=lambda r: abs(r["acceptance"] - target))
            if row not in shown:
                shown.append(row)
        for r in sorted(shown, key=lambda r: r["acceptance"]):
            setting = format_setting(r["setting"])
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            lines.append(f"{mode:<23} {setting:>9} {r['acceptance']:>6.2f} {r['quality']:>8.3f} {r['random_quality']:>7.3f} "
                         f"{r['router_minus_random']:>+14.3f} {_fmt_ci(r['router_minus_random_ci']):>18} {speed:>8}")
    lo, hi = report["band"]
    for mode, avg in report["average_in_band"].items():
        lines.append(f"{mode}: router - random averaged over acceptance {lo}-{hi}: " + (
            "no setting in the band" if avg is None else
            f"{avg['router_minus_random']:+.3f} {_fmt_ci(avg['ci'])} over {avg['settings']} settings"))
    carried = report.get("tau_from")
    if carried:
        there = carried["chosen_there"]
        speed = f", speedup {carried['speedup']:.2f}x (cost model)" if carried["speedup"] else ""
        lines.append(f"fixed tau={carried['setting']} from {carried['file']} (chosen there: acceptance "
                     f"{there['acceptance']:.2f}, {100 * there['quality_ratio_to_target']:.1f}% of target-only): here "
                     f"acceptance {carried['acceptance']:.2f}, quality {carried['quality']:.3f} "
                     f"({100 * carried['quality_ratio_to_target']:.1f}%), router - random "
                     f"{carried['router_minus_random']:+.3f} {_fmt_ci(carried['router_minus_random_ci'])}{speed}")
    best = report["best_fixed_tau"]
    lines.append("best fixed tau with >= 98% of target-only quality: " + ("none" if best is None else
                 f"tau={best['tau']} acceptance {best['acceptance']:.2f}, "
                 f"quality {best['quality']:.3f} ({100 * best['quality_ratio_to_target']:.1f}%), "
                 + (f"speedup {best['speedup']:.2f}x (cost model)" if best["speedup"] else "no timing")))
    s = report.get("block_seconds")
    if s:
        lines.append(f"seconds per block ({s.get('threads', '?')} thread(s)): drafter {1e3 * s['drafter']:.1f} ms, target "
                     f"{1e3 * s['target']:.1f} ms, decode {1e3 * s['decode']:.1f} ms, score {1e3 * s['score']:.1f} ms")
    if report.get("baselines"):
        from .baselines import format_table as format_baselines

        lines.append("baselines beside the reference's (issue 29):")
        lines.append(format_baselines(report["baselines"]))
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=str(WEIGHTS), help="toy weights folder (default: the shipped weights)")
    ap.add_argument("--cache", default="outputs/tree_cache", help="folder of per-clip trees (reused; shards share it)")
    ap.add_argument("--out", default="outputs/toy_tree.json", help="the JSON report")
    ap.add_argument("--clips", type=int, default=DEFAULT_CLIPS, help="prompts (clips.prompts_for: showcase prompts first)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per prompt (0 .. seeds-1)")
    ap.add_argument("--frames", type=int, default=NUM_FRAMES, help="frames per clip, 12n - 3 (81 = 7 blocks, 63 nodes)")
    ap.add_argument("--preset", default="native", choices=("native", "reference"))
    ap.add_argument("--shard", default=None, help="i/n: build only clips j with j %% n == i, then stop (no analysis); "
                                                  "a run without --shard then analyses every cached tree")
    ap.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples over clips")
    ap.add_argument("--bootstrap-seed", type=int, default=BOOTSTRAP_SEED)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--no-timing", action="store_true", help="skip measuring per-block seconds (no speedups)")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out the first N prompts: --clips 48 --skip 32 is 16 scenes the default 32 never use "
                         "(to choose settings or models without fitting them to the evaluation clips)")
    ap.add_argument("--split", choices=tuple(SPLITS), default=None,
                    help="the fixed held-out split instead of --clips/--skip: design = prompts 0-47 (choose settings "
                         "here), report = prompts 48-87 (quote these; nothing was chosen on them)")
    ap.add_argument("--keep-frames", action="store_true",
                    help="also save the frames every node scored (uint8, ~5 MB per 81-frame clip) beside each tree, "
                         "and compare the scores with the ground truth in the report (reward_diagnostics)")
    ap.add_argument("--reward", default=None,
                    help="score the trees' kept frames with this reward file (a toy reward.safetensors) instead of "
                         "the one they were built with; needs trees built with --keep-frames")
    ap.add_argument("--tau-from", default=None,
                    help="also judge, on these clips, the best fixed tau of another run's report (e.g. one on "
                         "--clips 48 --skip 32): tau chosen on one set of clips, measured on another")
    args = ap.parse_args(argv)
    shard = _parse_shard(args.shard)
    if args.clips < 1 or args.seeds < 1:
        raise SystemExit("--clips and --seeds must be >= 1")
    if not 0 <= args.skip < args.clips:
        raise SystemExit(f"--skip {args.skip}: must be >= 0 and below --clips {args.clips}")
    keep = args.keep_frames or args.reward is not None
    carried = best_fixed_from(Path(args.tau_from)) if args.tau_from is not None else None
    if args.reward is not None and shard is not None:
        raise SystemExit("--reward rescores the cached trees in the analysis: build them first (--shard ... "
                         "--keep-frames), then run --reward without --shard")
    reward = None
    if args.reward is not None:
        reward = Path(args.reward)
        if not reward.is_file():
            raise SystemExit(f"--reward {reward}: no such file (a toy reward.safetensors, e.g. from "
                             "scripts/train_toy.py reward --weights-dir DIR)")
    torch.set_num_threads(args.threads)
    weights = Path(args.weights)
    models = load_toy_models(weights=weights)  # checks every file against MANIFEST.json
    builder = TreeBuilder(models, preset=args.preset, num_frames=args.frames, weights_id=weights_hash(weights))
    clips = split_clips(args.split, args.seeds) if args.split else clip_list(args.clips, args.seeds, args.skip)
    mine = [c for j, c in enumerate(clips) if shard is None or j % shard[1] == shard[0]]
    print(f"toy tree: {len(mine)} of {len(clips)} clips, {builder.num_blocks} blocks ({2 ** (builder.num_blocks - 1) - 1} "
          f"nodes), preset {args.preset}, weights {weights} ({builder.weights_id}), cache {args.cache}"
          + (f", scored by {reward}" if reward is not None else ""))
    began = time.perf_counter()
    trees = [load_or_build(builder, Path(args.cache), caption, seed, frames=keep) for caption, seed in mine]
    trees, kept = (list(x) for x in zip(*trees)) if keep else (trees, None)
    built = [t.build_seconds for t in trees]
    if shard is not None:
        print(f"shard {args.shard}: {len(trees)} trees in {args.cache} ({time.perf_counter() - began:.0f} s); "
              "run again without --shard to analyse all of them")
        return None
    if reward is not None:
        router = builder.pipe.router
        router = RewardRouter(load_reward(reward), crop=router.crop, preprocess=router.preprocess)
        reward_sha = sha256(reward)
        trees = [rescore(t, f, router, reward_id=reward_sha) for t, f in zip(trees, kept)]
    block_seconds = None if args.no_timing else measure_block_seconds(models, preset=args.preset, num_frames=args.frames)
    report = analyse(trees, block_seconds=block_seconds, resamples=args.resamples, seed=args.bootstrap_seed)
    report["settings"] = {"weights": str(weights), "weights_hash": builder.weights_id, "preset": args.preset,
                          "num_frames": args.frames, "clips": [{"caption": c, "seed": s} for c, s in clips],
                          "crop": builder.pipe.router.crop, "preprocess": builder.pipe.router.preprocess,
                          "reward": None if reward is None else {"file": str(reward), "sha256": reward_sha}}
    if carried is not None:
        row = analyse(trees, grids={"fixed": [carried["tau"]]}, block_seconds=block_seconds, resamples=args.resamples,
                      seed=args.bootstrap_seed)["modes"]["fixed"][0]
        report["tau_from"] = {"file": str(args.tau_from), "chosen_there": carried, **row}
    if kept is not None:
        report["reward_diagnostics"] = reward_diagnostics(trees, kept)
    report["tree_build_seconds"] = {"mean_per_clip": float(np.mean(built)), "max_per_clip": float(np.max(built)),
                                    "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(format_report(report))
    if kept is not None:
        print(format_diagnostics(report["reward_diagnostics"]))
    print(f"trees built in {np.mean(built):.1f} s per clip (mean, {torch.get_num_threads()} thread(s)); report {out}")
    return report


if __name__ == "__main__":
    main()
