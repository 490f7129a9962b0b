"""Accept/reject routing of drafted video blocks.

``RewardRouter`` scores every decoded frame of a drafted block with ImageReward, aggregates
per block (``min`` by default: one bad frame sinks the block; ``mean`` is more lenient) and
accepts when ``block_score >= tau``. Optionally a temporal-consistency term is added:

    temporal    = mean cosine similarity of consecutive frames' ViT CLS features, including
                  the seam pair (last committed frame, first drafted frame) when
                  ``previous_features`` is given;
    block_score = reward_agg + temporal_weight * temporal.

The features come for free with the reward forward (VBench-style subject consistency, with
BLIP features instead of DINO). Note that similarity alone favours static video.

``RandomRouter`` is the ablation baseline: accepts each block with probability ``p``,
deterministically per ``(seed, key, block_index)`` whatever the call order (the pipeline's key is
the prompt text).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .reward import CROP_MODES, FrameScores, ImageRewardScorer, PromptFeatures

__all__ = ["AGGREGATIONS", "RouteDecision", "RewardRouter", "RandomRouter", "temporal_consistency"]

AGGREGATIONS = ("min", "mean")


def _json_float(x: float | None) -> float | None:
    # Strict JSON has no NaN/Infinity: those become null.
    if x is None or not math.isfinite(x):
        return None
    return float(x)


@dataclass
class RouteDecision:
    """Outcome of routing one block.

    accept: whether the drafted block is kept.
    block_score: value compared with tau (reward aggregate + weighted temporal term).
        For ``RandomRouter`` it is the uniform draw u in [0, 1) (accept iff u < p).
    frame_scores: per-frame ImageReward scores of the frames actually scored.
    reward_score: aggregate of the ImageReward scores alone (NaN for RandomRouter).
    temporal_score: mean consecutive-frame cosine similarity, or None when not computed.
    frames_scored: number of frames scored.
    """

    accept: bool
    block_score: float
    frame_scores: list[float]
    reward_score: float
    temporal_score: float | None
    frames_scored: int

    def to_dict(self) -> dict:
        """JSON-serialisable dict (non-finite floats become None)."""
        d = asdict(self)
        d["accept"] = bool(self.accept)
        d["block_score"] = _json_float(self.block_score)
        d["reward_score"] = _json_float(self.reward_score)
        d["temporal_score"] = _json_float(self.temporal_score)
        d["frame_scores"] = [_json_float(s) for s in self.frame_scores]
        d["frames_scored"] = int(self.frames_scored)
        return d


def _threshold(score: float, tau: float) -> bool:
    # Explicit infinities: tau=-inf accepts everything (even a NaN/-inf score), tau=+inf
    # accepts nothing (even a +inf score). Otherwise a NaN score (diverged block) is rejected.
    if tau == -math.inf:
        return True
    if tau == math.inf:
        return False
    return bool(score >= tau)


def temporal_consistency(
    features: torch.Tensor, previous_features: torch.Tensor | None = None
) -> float | None:
    """Mean cosine similarity of consecutive rows of ``features`` [N, D].

    ``previous_features`` ([D] or [K, D]; its last row is used) is prepended so that the seam
    between the committed video and the drafted block counts too. Returns None when there is
    no pair (a single frame and no previous features).
    """
    feats = features.float()
    if feats.ndim != 2:
        raise ValueError(f"features must be [N, D], got shape {tuple(features.shape)}")
    if previous_features is not None:
        prev = previous_features.float().to(feats.device)
        prev = prev.reshape(-1, prev.shape[-1])[-1:]
        if prev.shape[-1] != feats.shape[-1]:
            raise ValueError(
                f"previous_features width {prev.shape[-1]} != frame feature width {feats.shape[-1]}"
            )
        feats = torch.cat([prev, feats], dim=0)
    if feats.shape[0] < 2:
        return None
    return float(F.cosine_similarity(feats[:-1], feats[1:], dim=-1).mean())


class RewardRouter:
    """Threshold router on per-frame ImageReward scores (see module docstring)."""

    def __init__(
        self,
        scorer: ImageRewardScorer,
        *,
        tau: float = -0.7,
        aggregation: str = "min",
        crop: str = "center",
        temporal_weight: float = 0.0,
    ):
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if crop not in CROP_MODES:
            raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
        try:
            tau = float(tau)
        except (TypeError, ValueError):
            raise ValueError(f"tau must be a number (±inf allowed), got {tau!r}") from None
        if math.isnan(tau):
            raise ValueError("tau must not be NaN (use -inf to accept all, +inf to reject all)")
        try:
            temporal_weight = float(temporal_weight)
        except (TypeError, ValueError):
            raise ValueError(f"temporal_weight must be a number, got {temporal_weight!r}") from None
        if not math.isfinite(temporal_weight):
            raise ValueError(f"temporal_weight must be finite, got {temporal_weight}")
        self.scorer = scorer
        self.tau = tau
        self.aggregation = aggregation
        self.crop = crop
        self.temporal_weight = temporal_weight

    def aggregate(self, frame_scores: torch.Tensor) -> float:
        """min or mean over frames (NaN propagates, so a NaN frame gives a rejected block)."""
        s = frame_scores.float()
        if self.aggregation == "min":
            # torch.min propagates NaN, which we want.
            return float(s.min())
        return float(s.mean())

    def decide(
        self,
        frame_scores: torch.Tensor | Sequence[float],
        temporal: float | None = None,
    ) -> RouteDecision:
        """Aggregate precomputed per-frame scores [N] and threshold them.

        ``temporal`` (a precomputed ``temporal_consistency``) is added with ``temporal_weight``
        when given and the weight is non-zero; it is always reported.
        """
        s = torch.as_tensor(frame_scores, dtype=torch.float32).reshape(-1).cpu()
        if s.numel() == 0:
            raise ValueError("decide() needs at least one frame score")
        reward = self.aggregate(s)
        block = reward
        if temporal is not None and self.temporal_weight != 0.0:
            block = reward + self.temporal_weight * float(temporal)
        return RouteDecision(
            accept=_threshold(block, self.tau),
            block_score=block,
            frame_scores=[float(x) for x in s.tolist()],
            reward_score=reward,
            temporal_score=None if temporal is None else float(temporal),
            frames_scored=int(s.numel()),
        )

    def judge(
        self,
        frames: torch.Tensor,
        prompt: str | PromptFeatures,
        *,
        previous_features: torch.Tensor | None = None,
    ) -> tuple[RouteDecision, FrameScores]:
        """Score one decoded block ``frames`` [N, 3, H, W] (0..1) and decide.

        ``previous_features``: ViT CLS features of the last committed frame ([D] or [K, D]),
        i.e. ``FrameScores.image_features[-1]`` of the previous accepted block; used for the
        seam term of the temporal score. Returns the decision and the raw ``FrameScores``
        (whose ``image_features[-1]`` is what to pass next time if the block is committed).
        """
        out = self.scorer.score_frames(frames, prompt, crop=self.crop)
        # Always reported (N cosine similarities: free); only weighted in when w != 0.
        temporal = temporal_consistency(out.image_features, previous_features)
        return self.decide(out.scores, temporal), out


class RandomRouter:
    """Accepts a block with probability ``p``, deterministically per ``(seed, key, block_index)``.

    The draw is a hash of ``(seed, key, block_index)`` (BLAKE2b), so the decision for a block does
    not depend on how many other blocks were decided before it, nor on any global RNG. The pipeline
    passes the prompt as ``key``: a benchmark that runs many prompts with the same seed then gets
    independent decisions per prompt (keyed by the seed alone, every prompt accepted the same blocks,
    and 24 blocks at p = 0.29 could all be rejected). An empty key (e.g. the ComfyUI node with an empty
    reward prompt) keys by the seed alone, as before.
    """

    def __init__(self, p: float, seed: int, key: str = ""):
        try:
            p = float(p)
        except (TypeError, ValueError):
            raise ValueError(f"p must be a number in [0, 1], got {p!r}") from None
        if not (0.0 <= p <= 1.0):  # also rejects NaN
            raise ValueError(f"p must be in [0, 1], got {p}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.p = p
        self.seed = seed
        self.key = str(key)

    def draw(self, block_index: int) -> float:
        """Uniform u in [0, 1) for this block."""
        if isinstance(block_index, bool) or not isinstance(block_index, int):
            raise ValueError(f"block_index must be an int, got {block_index!r}")
        name = f"{self.seed}:{block_index}" if not self.key else f"{self.seed}:{self.key}:{block_index}"
        digest = hashlib.blake2b(f"sdvg.RandomRouter:{name}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64

    def decide_block(self, block_index: int) -> RouteDecision:
        u = self.draw(block_index)
        return RouteDecision(
            accept=u < self.p,  # p=0 never accepts, p=1 always (u < 1)
            block_score=u,
            frame_scores=[],
            reward_score=math.nan,
            temporal_score=None,
            frames_scored=0,
        )
