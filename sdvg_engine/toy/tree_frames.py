"""The frames every node of a decision tree scored: kept beside the tree, rescored with another reward, and compared
with the world's ground truth.

A :class:`~sdvg_engine.toy.tree.ClipTree` keeps only reward scores. Building it is the expensive part (every drafter
and target block of every decision prefix); scoring is cheap. With ``--keep-frames`` the tree tool also saves the
frames it scored, as uint8 (the reward's own PIL-exact preprocessing truncates to uint8 first, so rescoring them
gives the scores the tree holds, bit for bit). Then:

* :func:`rescore`: the same tree scored by another reward model (``--reward FILE``), without generating anything;
* :func:`reward_diagnostics`: how well the scores predict what routing needs. Per frame, the correlation of score
  and ground-truth adherence (:func:`world.frame_adherence`). Per node, the *value* of accepting its draft: the mean
  quality of the leaves below "accept" minus the mean below "reject", and its correlation with the draft's score,
  the draft's and the target's adherence, and their difference.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..reward.preprocess import frames_to_uint8
from .world import Scene, frame_adherence

FRAMES_SUFFIX = ".frames.pt"


@dataclass
class ScoredFrames:
    """uint8 frames ``[T, 3, H, W]`` of every block a tree scored, laid out as :class:`ClipTree`'s scores:
    ``draft[b - 1][h]`` / ``target[b - 1][h]`` are the drafter's / target's block ``b`` after history ``h``."""

    block0: torch.Tensor | None = None
    draft: list = field(default_factory=list)
    target: list = field(default_factory=list)

    @classmethod
    def empty(cls, decisions: int) -> "ScoredFrames":
        return cls(None, [[None] * 2 ** b for b in range(decisions)], [[None] * 2 ** b for b in range(decisions)])

    @staticmethod
    def keep(frames: torch.Tensor) -> torch.Tensor:
        """Frames ``[T, 3, H, W]`` in 0..1 as the reward's preprocessing sees them (uint8, truncated)."""
        return frames_to_uint8(frames.detach()).cpu()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"block0": self.block0, "draft": self.draft, "target": self.target}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, decisions: int) -> "ScoredFrames":
        data = torch.load(path, weights_only=True)
        frames = cls(data["block0"], data["draft"], data["target"])
        if (len(frames.draft) != decisions or any(len(frames.draft[b]) != 2 ** b or len(frames.target[b]) != 2 ** b
                                                   for b in range(decisions))):
            raise ValueError(f"{path}: not the frames of a tree of {decisions} decisions; delete it and its tree "
                             "to rebuild both")
        return frames


def frames_path(tree_path: Path) -> Path:
    """Where the frames of the tree saved at ``tree_path`` (``<clip>.json``) live: ``<clip>.frames.pt``."""
    return Path(tree_path).with_suffix(FRAMES_SUFFIX)


def block_scores(router, frames: torch.Tensor, prompt) -> list[float]:
    """Per-frame scores of one block's frames ``[T, 3, H, W]`` (0..1 or uint8) by ``router``, as plain floats."""
    return [float(v) for v in router.score_frames(frames, prompt).scores.float().reshape(-1).tolist()]


def rescore(tree, frames: ScoredFrames, router, reward_id: str = ""):
    """``tree`` with every score recomputed by ``router`` (its scorer, crop and preprocessing) from ``frames``."""
    prompt = router.scorer.encode_prompt(tree.caption)
    score = lambda x: block_scores(router, x, prompt)  # noqa: E731
    return dataclasses.replace(
        tree, block0=score(frames.block0),
        draft=[[score(x) for x in level] for level in frames.draft],
        target=[[score(x) for x in level] for level in frames.target],
        key={**tree.key, "reward": reward_id} if reward_id else tree.key)


def node_values(tree) -> np.ndarray:
    """Per drafted node, in ``(b, h)`` order: mean leaf quality below "accept" minus below "reject"."""
    q = tree.leaf_quality()
    n = tree.num_decisions
    leaves = np.arange(2 ** n)
    values = []
    for b in range(1, n + 1):
        accepted = (leaves >> (b - 1)) & 1 == 1
        for h in range(2 ** (b - 1)):
            below = (leaves & ((1 << (b - 1)) - 1)) == h
            values.append(q[below & accepted].mean() - q[below & ~accepted].mean())
    return np.array(values)


def _adherence(frames: torch.Tensor, scene: Scene) -> np.ndarray:
    pixels = frames.permute(0, 2, 3, 1).float().div(255.0).numpy()
    return np.array([frame_adherence(p, scene) for p in pixels])


def _corr(x, y) -> float:
    return float(np.corrcoef(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))[0, 1])


def reward_diagnostics(trees, frames: list[ScoredFrames], aggregation=min) -> dict:
    """How well ``trees``' scores (one :class:`ScoredFrames` per tree) predict the ground truth. ``frame_corr``:
    score vs adherence over every frame of every drafter and target block. ``value_corr``: per drafted node, the
    value of accepting (:func:`node_values`) vs the draft's block score (``aggregation`` of its frames, as the
    router), the draft's and the target's mean adherence and their difference."""
    scores, adherence = [], []
    value, draft_score, draft_adh, target_adh = [], [], [], []
    for tree, kept in zip(trees, frames):
        scene = Scene.parse(tree.caption)
        value.extend(node_values(tree))
        for b in range(tree.num_decisions):
            for h in range(2 ** b):
                a_d, a_t = _adherence(kept.draft[b][h], scene), _adherence(kept.target[b][h], scene)
                scores += tree.draft[b][h] + tree.target[b][h]
                adherence += list(a_d) + list(a_t)
                draft_score.append(aggregation(tree.draft[b][h]))
                draft_adh.append(a_d.mean())
                target_adh.append(a_t.mean())
    draft_adh, target_adh = np.array(draft_adh), np.array(target_adh)
    return {"frames": len(scores), "nodes": len(value), "frame_corr": _corr(scores, adherence),
            "value_corr": {"draft_score": _corr(draft_score, value), "draft_adherence": _corr(draft_adh, value),
                           "target_adherence": _corr(target_adh, value),
                           "draft_minus_target_adherence": _corr(draft_adh - target_adh, value)}}


def format_diagnostics(d: dict) -> str:
    v = d["value_corr"]
    return (f"reward vs ground truth ({d['frames']} frames, {d['nodes']} nodes): frame corr {d['frame_corr']:.3f}; "
            f"value of accepting a draft correlates {v['draft_score']:.3f} with its score, "
            f"{v['draft_adherence']:.3f} with its adherence, {v['target_adherence']:.3f} with the target's, "
            f"{v['draft_minus_target_adherence']:.3f} with draft - target adherence")
