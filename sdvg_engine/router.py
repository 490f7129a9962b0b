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

Adaptive threshold (``tau_mode="accept_rate"``): instead of a fixed tau, each drafted block is
compared with the (1 - r) quantile of a distribution that mixes a Gaussian prior
N(prior_mean, prior_std^2) with weight ``prior_count`` and every draft block score observed so
far with weight 1 (a :class:`TauState`, one per video unless the caller carries it on):

    H(t)  = prior_count * Phi((t - prior_mean) / prior_std) + #{observed scores <= t}
    tau_b = min { t : H(t) >= (1 - r) * (prior_count + n) }        (n = scores observed so far)

so tau_0 is the prior's own (1 - r) quantile, and as n grows tau_b tends to the (1 - r)
empirical quantile (inverse ECDF) of the scores, which makes the long-run share of accepted
drafts tend to r. NaN scores (diverged drafts, always rejected) count as -inf. With
``prior_count=0`` the prior is used only for the very first block.

Reference (yuezhouhu/spec-video-gen ``release_server.py``, commit 006012c): ``REWARD_ACCEPT_RATE``
0.72, prior N(0.566414, 1.070617^2); for the first 5 scored blocks the threshold is the prior
quantile alone, afterwards the linear-interpolated (numpy "linear") empirical quantile of all
scores seen, the prior dropped; the pool is process-wide (all prompts and videos) and the first
block of each video is force-rejected and not scored, for which it raises the rate to
min(0.95, r * B / (B - 1)). Here the prior is a pseudo-count instead of a hard warm-up: the
default ``prior_count=5`` gives the prior the weight of the reference's 5 warm-up blocks and lets
it fade as 5 / (5 + n) rather than vanish at n = 5. Forcing the first block and pooling across
videos are the caller's choice (carry one ``TauState`` across videos to pool).

Relative threshold (``tau_mode="relative"``): a draft is accepted when its block score minus the
score of the last *committed* block (block 0, always the target's, or the previous block, whichever
model made it) is at least ``tau``:

    accept_b  <=>  block_score(draft_b) - block_score(committed_{b-1}) >= tau

The committed block is scored with the same aggregation, crop and preprocessing as the drafts (the
pipeline scores the target's committed blocks only in this mode). The signal is a change of quality
along the video, not its level, so it does not accept or reject whole clips wholesale when the level
varies between prompts. The decision records the reference in ``RouteDecision.reference_score`` and
``tau`` stays the margin (the configured tau).

Prompt-normalised thresholds: ``tau_mode="anchor"`` compares a draft with block 0's score (the target's first block
of the same video: one reference per video, no later target block is scored) and ``tau_mode="baseline"`` with the
mean score of every block committed so far. Like ``relative`` they remove what a fixed threshold mostly measures,
how much the reward likes the prompt (82% of the drafts' score variance in the reference's own record is between
prompts), and keep how a draft compares with what this video already holds:

    reference_b = s_{b-1} (relative) | s_0 (anchor) | mean(s_0 .. s_{b-1}) (baseline)
    accept_b  <=>  block_score(draft_b) - reference_b >= tau

with ``s_i`` the block score of committed block ``i`` (an accepted draft's own score, or the target block scored
with the same settings; see :meth:`RewardRouter.reference_of` and :meth:`RewardRouter.needs_committed_score`).

``RandomRouter`` is the ablation baseline: accepts each block with probability ``p``,
deterministically per ``(seed, key, block_index)`` whatever the call order (the pipeline's key is
the prompt text).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .choices import REFERENCE_MODES, TAU_MODES  # noqa: F401 (public here too)
from .checks import check_choice, check_number, check_seed
from .reward import CROP_MODES, PREPROCESS_MODES, FrameScores, ImageRewardScorer, PromptFeatures

__all__ = [
    "AGGREGATIONS",
    "TAU_MODES",
    "REFERENCE_MODES",
    "DEFAULT_ROUTER_OPTIONS",
    "PAPER_ROUTER_OPTIONS",
    "default_router_options",
    "RouteDecision",
    "Comparison",
    "RewardRouter",
    "RandomRouter",
    "TauState",
    "mixture_quantile",
    "temporal_consistency",
]

AGGREGATIONS = ("min", "mean")
#: The router the API (``load_pipeline``) and the CLI use when none is asked for: relative routing, chosen on the
#: toy world's held-out split (docs/dev/routing.md: of the routers, on the report set's quality/speed front from 1.7x up,
#: +0.020 over random at acceptance 0.7-0.95; fixed tau is no better than random there). Its margin -0.25 keeps the
#: share of drafts the paper's tau = -0.7 keeps (82%) on real ImageReward scores: calibrated on the reference's own
#: draft scores (reference_per_prompt.csv, the keep-every-draft run, even prompts; the odd ones give -0.27).
DEFAULT_ROUTER_OPTIONS = {"tau_mode": "relative", "tau": -0.25}
#: The paper's router (SDVG, arXiv 2604.17397): a fixed threshold of -0.7 on the minimum frame score.
PAPER_ROUTER_OPTIONS = {"tau_mode": "fixed", "tau": -0.7}


def default_router_options(options: dict | None = None) -> dict:
    """``options`` for :class:`RewardRouter` with the defaults filled in: :data:`DEFAULT_ROUTER_OPTIONS` when no
    threshold is given; a ``tau`` given without a ``tau_mode`` is on the paper's fixed scale (the only one there was
    before the default changed), so it keeps ``tau_mode="fixed"``."""
    options = dict(options or {})
    if "tau_mode" not in options:
        options["tau_mode"] = "fixed" if "tau" in options else DEFAULT_ROUTER_OPTIONS["tau_mode"]
    if "tau" not in options and options["tau_mode"] in REFERENCE_MODES:
        options["tau"] = DEFAULT_ROUTER_OPTIONS["tau"]
    return options


_REFERENCE_OF = {"relative": "the last committed block's score", "anchor": "block 0's score",
                 "baseline": "the mean score of the committed blocks"}


def _json_float(x: float | None) -> float | None:
    # Strict JSON has no NaN/Infinity: those become null.
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def _json_tau(x: float | None) -> float | str | None:
    # A threshold may be ±inf on purpose (accept all / nothing): kept as "inf"/"-inf" (as in run settings).
    if x is None or math.isnan(x):
        return None
    return float(x) if math.isfinite(x) else str(float(x))


#: What each mode compares with its threshold, as a short label (a plot's axis, a progress line).
COMPARED_QUANTITY = {
    "fixed": "draft score",
    "accept_rate": "score vs running quantile",
    "relative": "score - last committed block",
    "anchor": "score - block 0",
    "baseline": "score - mean of committed blocks",
    "random": "random draw u (keep if u < p)",
}


class Comparison(NamedTuple):
    """The quantity a decision compared with its threshold (:meth:`RouteDecision.comparison`).

    value: what was compared: the draft's block score (fixed, accept_rate), its margin over the reference score
        (relative, anchor, baseline: ``block_score - reference_score``), or the random draw u (random).
    threshold: what it was compared with: tau (fixed; the margin tau in the reference modes), the block's
        running-quantile threshold (accept_rate), the probability p (random); None when the decision has none.
    quantity: a short label for ``value`` (see :data:`COMPARED_QUANTITY`).
    keep_if: the side that keeps the draft: ``">="`` (reward routers: value >= threshold) or ``"<"`` (random:
        u < p).
    mode: the tau mode (``fixed``, ``accept_rate``, ``relative``, ``anchor``, ``baseline``) or ``random``.
    """

    value: float
    threshold: float | None
    quantity: str
    keep_if: str = ">="
    mode: str = "fixed"

    def keeps(self) -> bool | None:
        """Whether this comparison keeps the draft, by the routers' own rule (an explicit -inf threshold keeps
        everything, +inf nothing, a NaN value is rejected otherwise); None without a threshold."""
        if self.threshold is None:
            return None
        if self.keep_if == "<":
            return bool(self.value < self.threshold)
        return _threshold(self.value, self.threshold)

    def to_dict(self) -> dict:
        """JSON-safe: a NaN value becomes None; an infinite threshold "inf"/"-inf" (as ``tau`` in reports)."""
        return {"value": _json_float(self.value), "threshold": _json_tau(self.threshold), "quantity": self.quantity,
                "keep_if": self.keep_if, "mode": self.mode}


@dataclass
class RouteDecision:
    """Outcome of routing one block.

    accept: whether the drafted block is kept.
    block_score: the draft's score (reward aggregate + weighted temporal term). For ``RandomRouter`` it is the
        uniform draw u in [0, 1) (accept iff u < p). What was compared with the threshold: :meth:`comparison`.
    frame_scores: per-frame ImageReward scores of the frames actually scored.
    reward_score: aggregate of the ImageReward scores alone (NaN for RandomRouter).
    temporal_score: mean consecutive-frame cosine similarity, or None when not computed.
    frames_scored: number of frames scored.
    tau: the threshold (None for RandomRouter): fixed mode's tau, accept_rate's running quantile for this block;
        in the reference modes the margin ``block_score - reference_score`` was compared with.
    reference_score: the reference modes only: the reference score (the last committed block's, block 0's or the
        committed blocks' mean); None in other modes, whose ``to_dict`` leaves the key out.
    tau_mode: the router's tau mode when it decided, or ``"random"`` (None: a decision made by other code; read
        as ``fixed``, or as a margin when it holds a reference score).
    accept_prob: RandomRouter only: the probability p the draw was compared with.
    """

    accept: bool
    block_score: float
    frame_scores: list[float]
    reward_score: float
    temporal_score: float | None
    frames_scored: int
    tau: float | None = None
    reference_score: float | None = None
    tau_mode: str | None = None
    accept_prob: float | None = None

    def comparison(self) -> Comparison:
        """The quantity compared with the threshold, the threshold and which side keeps the draft (the one home of
        "what was compared with tau": reports, the CLI's progress line and the score plot read it)."""
        if self.tau_mode == "random" or self.accept_prob is not None:
            return Comparison(float(self.block_score), self.accept_prob, COMPARED_QUANTITY["random"], "<", "random")
        mode = self.tau_mode or ("relative" if self.reference_score is not None else "fixed")
        if self.reference_score is not None:
            quantity = COMPARED_QUANTITY.get(mode, "score - reference")
            return Comparison(float(self.block_score) - float(self.reference_score), self.tau, quantity, ">=", mode)
        return Comparison(float(self.block_score), self.tau, COMPARED_QUANTITY.get(mode, "draft score"), ">=", mode)

    def to_dict(self) -> dict:
        """JSON-serialisable dict (non-finite floats become None); ``compared``: :meth:`comparison` as a dict."""
        d = asdict(self)
        del d["tau_mode"], d["accept_prob"]  # in "compared" (mode, threshold)
        d["accept"] = bool(self.accept)
        d["block_score"] = _json_float(self.block_score)
        d["reward_score"] = _json_float(self.reward_score)
        d["temporal_score"] = _json_float(self.temporal_score)
        d["frame_scores"] = [_json_float(s) for s in self.frame_scores]
        d["frames_scored"] = int(self.frames_scored)
        d["tau"] = _json_tau(self.tau)
        if self.reference_score is None:  # other modes: the report keeps its keys
            del d["reference_score"]
        else:
            d["reference_score"] = _json_float(self.reference_score)
        d["compared"] = self.comparison().to_dict()
        return d


@dataclass
class TauState:
    """Running state of an adaptive threshold: the draft block scores observed so far, in order.

    One per video unless the caller carries it on (then the quantile pools over videos, as the
    reference server's process-wide pool does). ``copy()`` gives an independent state, e.g. to
    replay or speculate without touching the original.
    """

    scores: list[float] = field(default_factory=list)
    _sorted: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.scores = [float(s) for s in self.scores]
        self._sorted = sorted(s for s in self.scores if not math.isnan(s))

    def observe(self, score: float) -> None:
        """Record one drafted block's score. A NaN score (a diverging drafter) is recorded but takes no part in the
        quantile: ranked as -inf, two of them pulled the threshold to -inf and every later draft was kept."""
        score = float(score)
        self.scores.append(score)
        if not math.isnan(score):
            bisect.insort(self._sorted, score)

    def copy(self) -> "TauState":
        return TauState(list(self.scores))

    def sorted_scores(self) -> list[float]:
        """The observed non-NaN scores ascending (resynchronised if ``scores`` was edited directly)."""
        finite = [s for s in self.scores if not math.isnan(s)]
        if len(self._sorted) != len(finite):
            self._sorted = sorted(finite)
        return self._sorted

    def __len__(self) -> int:
        return len(self.scores)


def mixture_quantile(
    sorted_scores: Sequence[float], q: float, prior_mean: float, prior_std: float, prior_count: float
) -> float:
    """The q quantile of ``prior_count`` x N(prior_mean, prior_std^2) + one unit mass per score.

    Returns ``min{t : prior_count * Phi((t - mean) / std) + #{s <= t} >= q * (prior_count + n)}``
    for ascending ``sorted_scores`` (n of them); the prior's own q quantile when both the count
    and n are 0. Exact (inverse normal CDF on the continuous pieces, the score itself at a jump).
    """
    prior = NormalDist(prior_mean, prior_std)
    n = len(sorted_scores)
    k = float(prior_count)
    if n == 0:
        return prior.inv_cdf(q)
    target = q * (k + n)

    def mass_at(i: int) -> float:  # H(s_i), counting ties
        s = sorted_scores[i]
        return k * prior.cdf(s) + bisect.bisect_right(sorted_scores, s)

    # Smallest index m whose score reaches the target (H is non-decreasing along the sorted scores).
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if mass_at(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    m = lo
    if k == 0:
        return float(sorted_scores[m])  # target <= n, so m < n
    # On [s_{m-1}, s_m) exactly m scores are <= t (m is the first of any tie group): solve k*Phi(t) + m = target.
    p = (target - m) / k
    if m < n and p >= prior.cdf(sorted_scores[m]):
        return float(sorted_scores[m])  # the jump at s_m crosses the target
    return prior.inv_cdf(min(max(p, 1e-300), math.nextafter(1.0, 0.0)))


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


def _number(name: str, value) -> float:
    # Any real number, infinities and NaN included (each caller then says which it refuses and why); never a
    # string ('0.5' used to pass through float()) or a bool.
    return check_number(name, value, finite=False)


def _check_tau(tau, name: str = "tau") -> float:
    tau = check_number(name, tau, finite=False,
                       fix="pass a number, e.g. tau=-0.25 (relative) or tau=-0.7 (fixed); -inf keeps every draft, "
                           "+inf rejects every draft")
    if math.isnan(tau):
        raise ValueError(f"{name} must not be NaN (Python and CLI: -inf keeps every draft, +inf rejects every draft; ComfyUI refuses "
                         "infinities, so there set the sampler's mode to first_block_only or target_only instead)")
    return tau


class RewardRouter:
    """Threshold router on per-frame ImageReward scores (see module docstring).

    Args:
        scorer: the ImageReward scorer.
        tau: fixed threshold (``tau_mode="fixed"``, the default).
        aggregation: "min" or "mean" over the block's frames.
        crop: "center" (ImageReward's crop) or "full" (whole frame squashed).
        temporal_weight: weight of the temporal-consistency term in the block score.
        tau_mode: "fixed" (compare with ``tau``), "accept_rate" (per-block quantile threshold
            targeting an acceptance share ``accept_rate``; see :meth:`block_tau`), "relative"
            (compare the draft's score minus the last committed block's score with ``tau``), "anchor"
            (minus block 0's score) or "baseline" (minus the mean score of the committed blocks).
        accept_rate: target share r of drafted blocks accepted, in (0, 1).
        prior_mean, prior_std: Gaussian prior of draft block scores (the reference's
            ImageReward global statistics).
        prior_count: weight of the prior in pseudo-observations (>= 0; 5 = the reference's
            5-block warm-up; 0 = prior only for the first block).
        preprocess: frame preprocessing for scoring, "pil" (ImageReward-exact) or "torch" (fast).
    """

    def __init__(
        self,
        scorer: ImageRewardScorer,
        *,
        tau: float = -0.7,
        aggregation: str = "min",
        crop: str = "center",
        temporal_weight: float = 0.0,
        tau_mode: str = "fixed",
        accept_rate: float = 0.73,
        prior_mean: float = 0.566,
        prior_std: float = 1.071,
        prior_count: float = 5.0,
        preprocess: str = "pil",
    ):
        check_choice("aggregation", aggregation, AGGREGATIONS)
        check_choice("crop", crop, CROP_MODES)
        if preprocess not in PREPROCESS_MODES:
            raise ValueError(
                f"preprocess must be one of {PREPROCESS_MODES}, got {preprocess!r} "
                f"('pil' = ImageReward-exact 8-bit PIL path, 'torch' = fast on-device approximation)"
            )
        check_choice("tau_mode", tau_mode, TAU_MODES)
        tau = _check_tau(tau)
        temporal_weight = check_number("temporal_weight", temporal_weight,
                                       fix="pass a finite weight, e.g. temporal_weight=0.0 (off)")
        accept_rate = _number("accept_rate", accept_rate)
        if not (0.0 < accept_rate < 1.0):  # also rejects NaN
            raise ValueError(
                f"accept_rate must be in (0, 1) (the share of drafted blocks to accept), got {accept_rate}"
            )
        prior_mean = _number("prior_mean", prior_mean)
        if not math.isfinite(prior_mean):
            raise ValueError(f"prior_mean must be finite, got {prior_mean}")
        prior_std = _number("prior_std", prior_std)
        if not (0.0 < prior_std < math.inf):
            raise ValueError(f"prior_std must be > 0 and finite, got {prior_std}")
        prior_count = _number("prior_count", prior_count)
        if not (0.0 <= prior_count < math.inf):
            raise ValueError(f"prior_count must be >= 0 and finite (pseudo-observations), got {prior_count}")
        self.scorer = scorer
        self.tau = tau
        self.aggregation = aggregation
        self.crop = crop
        self.temporal_weight = temporal_weight
        self.tau_mode = tau_mode
        self.accept_rate = accept_rate
        self.prior_mean = prior_mean
        self.prior_std = prior_std
        self.prior_count = prior_count
        self.preprocess = preprocess

    # ----------------------------------------------------------------------- thresholds

    def new_tau_state(self) -> TauState:
        """An empty :class:`TauState` (start of a video)."""
        return TauState()

    @property
    def uses_reference(self) -> bool:
        """Whether drafts are compared with a reference built from the committed blocks (relative, anchor, baseline)."""
        return self.tau_mode in REFERENCE_MODES

    def needs_committed_score(self, block_index: int) -> bool:
        """Whether a later reference needs the score of committed *target* block ``block_index`` (accepted drafts
        come with theirs): every committed block for relative and baseline, only block 0 for anchor."""
        if self.tau_mode == "anchor":
            return block_index == 0
        return self.tau_mode in ("relative", "baseline")

    def reference_of(self, committed: Sequence[float | None]) -> float | None:
        """The reference the next draft is compared with, from the block scores of the blocks committed so far
        (block 0 first; ``None`` where a block was not scored because no reference needs it). ``None`` outside the
        reference modes. relative: the last one; anchor: block 0's; baseline: their mean."""
        if not self.uses_reference:
            return None
        if not committed:
            raise ValueError(f"tau_mode {self.tau_mode!r} compares a draft with the blocks committed before it, and "
                             "there are none: block 0 must be the target's (force_first_block)")
        if self.tau_mode == "anchor":
            picked = [committed[0]]
        elif self.tau_mode == "relative":
            picked = [committed[-1]]
        else:
            picked = list(committed)
        if any(s is None for s in picked):
            raise ValueError(f"tau_mode {self.tau_mode!r} needs the score of every committed block it reads; got "
                             f"{list(committed)} (score the committed target blocks: needs_committed_score)")
        return float(sum(picked) / len(picked))

    def block_tau(self, state: TauState | None) -> float:
        """The threshold for the next drafted block.

        ``fixed`` and the reference modes: ``self.tau`` (``state`` ignored; in a reference mode it is the margin
        over the reference, see :meth:`reference_of`). ``accept_rate``: the (1 - accept_rate)
        quantile of prior (weight ``prior_count``) + the scores in ``state`` (None = no scores
        yet), see the module docstring. The caller then does ``state.observe(decision.block_score)``.
        """
        if self.tau_mode != "accept_rate":
            return self.tau
        if state is not None and not isinstance(state, TauState):
            raise TypeError(f"state must be a TauState or None, got {type(state).__name__}")
        scores = state.sorted_scores() if state is not None else []
        return mixture_quantile(scores, 1.0 - self.accept_rate, self.prior_mean, self.prior_std, self.prior_count)

    def settings(self) -> dict:
        """The routing settings as a JSON-serialisable dict (±inf tau as "inf"/"-inf")."""
        return {
            "tau": _json_tau(self.tau),
            "tau_mode": self.tau_mode,
            "accept_rate": self.accept_rate,
            "prior_mean": self.prior_mean,
            "prior_std": self.prior_std,
            "prior_count": self.prior_count,
            "aggregation": self.aggregation,
            "crop": self.crop,
            "temporal_weight": self.temporal_weight,
            "preprocess": self.preprocess,
        }

    def aggregate(self, frame_scores: torch.Tensor) -> float:
        """min or mean over frames (NaN propagates, so a NaN frame gives a rejected block)."""
        s = frame_scores.float()
        if self.aggregation == "min":
            # torch.min propagates NaN, which we want.
            return float(s.min())
        return float(s.mean())

    def block_score(self, frame_scores: torch.Tensor | Sequence[float], temporal: float | None = None) -> float:
        """The score a block is routed on: the aggregate of its frame scores, plus ``temporal_weight`` x
        ``temporal`` when both are given (what :meth:`decide` compares; in relative mode also the reference
        score of a committed block)."""
        s = torch.as_tensor(frame_scores, dtype=torch.float32).reshape(-1).cpu()
        if s.numel() == 0:
            raise ValueError("a block score needs at least one frame score")
        block = self.aggregate(s)
        if temporal is not None and self.temporal_weight != 0.0:
            block = block + self.temporal_weight * float(temporal)
        return block

    def decide(
        self,
        frame_scores: torch.Tensor | Sequence[float],
        temporal: float | None = None,
        *,
        tau: float | None = None,
        reference: float | None = None,
    ) -> RouteDecision:
        """Aggregate precomputed per-frame scores [N] and threshold them.

        ``temporal`` (a precomputed ``temporal_consistency``) is added with ``temporal_weight``
        when given and the weight is non-zero; it is always reported. ``tau``: the threshold to
        use (e.g. ``block_tau(state)``); None = ``self.tau``. It is recorded in the decision.
        ``reference``: the reference modes (required there, ignored otherwise): :meth:`reference_of` the committed
        blocks' scores; the draft is accepted when ``block_score - reference >= tau`` (a NaN on either side rejects
        unless tau is -inf).
        """
        tau = self.tau if tau is None else _check_tau(tau)
        if self.uses_reference:
            if reference is None:
                raise ValueError(f"tau_mode {self.tau_mode!r} decides against {_REFERENCE_OF[self.tau_mode]}: pass "
                                 "reference=<its block score> (reference_of(<the committed blocks' scores>); block 0 "
                                 "has none: it must be the target's)")
            reference = float(reference)
        else:
            reference = None
        s = torch.as_tensor(frame_scores, dtype=torch.float32).reshape(-1).cpu()
        if s.numel() == 0:
            raise ValueError("decide() needs at least one frame score")
        reward = self.aggregate(s)
        block = self.block_score(s, temporal)
        margin = block if reference is None else block - reference
        return RouteDecision(
            accept=_threshold(margin, tau),
            block_score=block,
            frame_scores=[float(x) for x in s.tolist()],
            reward_score=reward,
            temporal_score=None if temporal is None else float(temporal),
            frames_scored=int(s.numel()),
            tau=tau,
            reference_score=reference,
            tau_mode=self.tau_mode,
        )

    def judge(
        self,
        frames: torch.Tensor,
        prompt: str | PromptFeatures,
        *,
        previous_features: torch.Tensor | None = None,
        tau: float | None = None,
        reference: float | None = None,
    ) -> tuple[RouteDecision, FrameScores]:
        """Score one decoded block ``frames`` [N, 3, H, W] (0..1) and decide.

        ``previous_features``: ViT CLS features of the last committed frame ([D] or [K, D]),
        i.e. ``FrameScores.image_features[-1]`` of the previous accepted block; used for the
        seam term of the temporal score. Returns the decision and the raw ``FrameScores``
        (whose ``image_features[-1]`` is what to pass next time if the block is committed).
        ``tau``: threshold for this block (e.g. ``block_tau(state)``); None = ``self.tau``.
        ``reference``: the reference modes: :meth:`reference_of` the committed blocks' scores (see :meth:`decide`).
        """
        if tau is not None:
            tau = _check_tau(tau)  # before the (expensive) scoring
        if self.uses_reference and reference is None:
            raise ValueError(f"tau_mode {self.tau_mode!r} decides against {_REFERENCE_OF[self.tau_mode]}: pass "
                             "reference=...")
        out = self.score_frames(frames, prompt)
        # Always reported (N cosine similarities: free); only weighted in when w != 0.
        temporal = temporal_consistency(out.image_features, previous_features)
        return self.decide(out.scores, temporal, tau=tau, reference=reference), out

    def score_frames(self, frames: torch.Tensor, prompt_features: str | PromptFeatures) -> FrameScores:
        """Score frames [N, 3, H, W] (0..1 or uint8) with this router's crop and preprocessing
        (for partial/cascade scoring and seam features, consistent with :meth:`judge`)."""
        return self.scorer.score_frames(frames, prompt_features, crop=self.crop, preprocess=self.preprocess)


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
        p = check_number("p", p, low=0.0, high=1.0, fix="the probability of keeping a drafted block, e.g. p=0.73")
        seed = check_seed("seed", seed)
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
            tau_mode="random",
            accept_prob=self.p,
        )
