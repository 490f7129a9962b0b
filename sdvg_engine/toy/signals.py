"""Which drafts are bad? Candidate block-verifier signals scored against the trees' own label (issue 38).

    python -m sdvg_engine.toy.signals --cache outputs/verifier_cache --out outputs/signals.json

**The label.** For every drafted node ``(b, h)`` of a decision tree (:mod:`.signal_trees`), the gain from remaking the
block: the mean quality of the leaves below "reject" (the target remakes block ``b``) minus the mean below "accept"
(``-tree_frames.node_values``). "Remaking it helps" is ``gain > 0``.

**A signal** is one number per node, oriented so that a router keeps the draft when it is high (the orientation is
chosen on the design split: a signal whose design AUC is below 0.5 is negated before anything else is measured).
Every signal is a function of what the pipeline has when it decides: the draft (its latents at each denoising step,
its decoded frames, their reward scores), the committed blocks before it (their frames and, where the pipeline
scores them, their scores), the block index and the caption. ``latent_to_target`` is the one exception (a
diagnostic: it needs the target's block).

**Measures**, per split (:func:`score_signal`):

* ``auc``: P(signal of a node where remaking helps < signal of a node where it does not), ties half;
* ``gain_at_k``: a router that keeps a draft when its signal >= tau, walked down every tree, minus random routing at
  the same acceptance (exact expectation, ``tree.random_expectation``), at ``k`` = 1, 2, 3 rejections per clip (linear
  in acceptance between the two taus around ``1 - k / n``);
* ``lift``: router - random averaged over acceptance 0.5 .. 0.95 (:data:`LIFT_GRID`), with a 95% bootstrap CI over
  clips, and ``capture``: that lift over the oracle's (the best leaf with ``k`` kept drafts per clip, ``bench_routing``'s
  oracle) at the same acceptances.
* ``cost``: what the signal adds to a kept draft (:func:`marginal_cost`), at toy size and at 832x480 with the 14B.

The signals themselves: :func:`clip_features`. The learned ones (fitted on design-split trees and extra training
clips only): :mod:`.verifier`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .signal_trees import node_index
from .tree import _bernstein, _speedup, bootstrap_weights, random_coefficients
from .tree_frames import node_values

LIFT_GRID = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))  # acceptance 0.5 .. 0.95
K_REJECTIONS = (1, 2, 3)
TAU_POINTS = 61

# --- what each signal needs (for the cost model) --------------------------------------------------------------------
# reward: the draft's block is scored (one reward pass per drafted block); committed: the pipeline also scores the
# committed target blocks the signal reads ("relative": every committed target block but the last, as tau_mode
# relative; "anchor": block 0 only); frames: cheap arithmetic on the decoded block and the last kept frames;
# latents: norms of the drafter's per-step x0 (kept during denoising); target: the target's block (not a router).
REWARD_SIGNALS = ("r_min", "r_mean", "r_max", "r_first", "r_last", "r_std", "r_median", "r_q25", "r_prev_draft")
MARGIN_SIGNALS = {"m_relative_min": "relative", "m_relative_mean": "relative", "m_anchor_min": "anchor",
                  "m_baseline_min": "relative", "m_continuity": "relative", "m_relative_gain": "relative"}
FRAME_SIGNALS = ("f_jump", "f_jump_rel", "f_motion", "f_motion_ratio", "f_flicker", "f_color_drift",
                 "f_fg_area_change", "f_track_error", "f_fg_std_change", "f_sharpness_ratio")
LATENT_SIGNALS = ("c_step0", "c_step1", "c_step2", "c_lastframe", "c_step2_max", "c_step2_rel")
POSITION_SIGNALS = ("block",)
DIAGNOSTIC_SIGNALS = ("latent_to_target",)


def signal_needs(name: str) -> dict:
    """What computing signal ``name`` adds to a kept draft, as flags: ``reward`` (a reward pass on the drafted block),
    ``committed`` (None / "relative" / "anchor": reward passes on committed target blocks), ``frames``, ``latents``,
    ``target``. Learned signals declare theirs in :mod:`.verifier`."""
    return {"reward": name in REWARD_SIGNALS or name in MARGIN_SIGNALS, "committed": MARGIN_SIGNALS.get(name),
            "frames": name in FRAME_SIGNALS, "latents": name in LATENT_SIGNALS, "target": name in DIAGNOSTIC_SIGNALS}


# ============================================================================================== features per node
def _float(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255.0


def _foreground(frames: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """[T, H, W] soft mask of pixels far from the background colour (per-channel median of the border)."""
    return ((frames - background[None, :, None, None]).abs().amax(dim=1) > 0.15).float()


def _border_colour(frame: torch.Tensor) -> torch.Tensor:
    border = torch.cat([frame[:, 0], frame[:, -1], frame[:, :, 0], frame[:, :, -1]], dim=1)
    return border.median(dim=1).values


def _centroids(mask: torch.Tensor) -> torch.Tensor:
    """[T, 2] centroid (x, y) of each frame's mask (NaN where empty)."""
    T, H, W = mask.shape
    ys = torch.arange(H, dtype=torch.float32)[None, :, None]
    xs = torch.arange(W, dtype=torch.float32)[None, None, :]
    area = mask.sum(dim=(1, 2))
    cx = (mask * xs).sum(dim=(1, 2)) / area
    cy = (mask * ys).sum(dim=(1, 2)) / area
    out = torch.stack([cx, cy], dim=1)
    out[area < 1] = float("nan")
    return out


def frame_features(draft: torch.Tensor, previous: torch.Tensor) -> dict:
    """Per-frame and temporal statistics of a decoded block ``draft`` [T, 3, H, W] against the last kept block
    ``previous`` (uint8 or 0..1): the jump from the last kept frame, motion and its continuity, flicker, colour drift,
    the foreground's area and the continuation of its track."""
    d = _float(draft) if draft.dtype == torch.uint8 else draft.float()
    p = _float(previous) if previous.dtype == torch.uint8 else previous.float()
    step = lambda x: (x[1:] - x[:-1]).abs().mean(dim=(1, 2, 3))  # noqa: E731
    motion_d, motion_p = step(d), step(p)
    jump = (d[0] - p[-1]).abs().mean()
    bg = _border_colour(p[-1])
    fg_d, fg_p = _foreground(d, bg), _foreground(p, bg)
    area_d, area_p = fg_d.sum(dim=(1, 2)), fg_p.sum(dim=(1, 2))
    # track continuation: extrapolate the kept block's centroid velocity over the draft's frames
    c_p, c_d = _centroids(fg_p), _centroids(fg_d)
    valid_p = ~torch.isnan(c_p[:, 0])
    if valid_p.sum() >= 2:
        idx = torch.nonzero(valid_p).flatten()
        v = (c_p[idx[-1]] - c_p[idx[0]]) / max(int(idx[-1] - idx[0]), 1)
        t = torch.arange(1, d.shape[0] + 1, dtype=torch.float32)[:, None] + (p.shape[0] - 1 - int(idx[-1]))
        pred = c_p[idx[-1]][None] + t * v[None]
        err = (c_d - pred).norm(dim=1)
        track = float(torch.nan_to_num(err, nan=float(d.shape[-1])).mean())
    else:
        track = float(d.shape[-1])
    lap = lambda x: (4 * x[..., 1:-1, 1:-1] - x[..., :-2, 1:-1] - x[..., 2:, 1:-1] - x[..., 1:-1, :-2]  # noqa: E731
                     - x[..., 1:-1, 2:]).abs().mean()
    return {
        "f_jump": -float(jump),
        "f_jump_rel": -float(jump / (motion_p.mean() + 1e-3)),
        "f_motion": float(motion_d.mean()),
        "f_motion_ratio": -abs(math.log((float(motion_d.mean()) + 1e-3) / (float(motion_p.mean()) + 1e-3))),
        "f_flicker": -float(d.mean(dim=(1, 2, 3)).std()),
        "f_color_drift": -float((d.mean(dim=(0, 2, 3)) - p.mean(dim=(0, 2, 3))).abs().sum()),
        "f_fg_area_change": -abs(math.log((float(area_d.mean()) + 1.0) / (float(area_p.mean()) + 1.0))),
        "f_track_error": -track,
        "f_fg_std_change": -float((area_d.std() + 1.0) / (area_p.std() + 1.0)),
        "f_sharpness_ratio": -abs(math.log((float(lap(d)) + 1e-3) / (float(lap(p)) + 1e-3))),
    }


def latent_features(x0: torch.Tensor) -> dict:
    """The drafter's agreement with itself: ``x0`` [steps, C, F, h, w], its prediction at each denoising step (the
    last is the block). Relative distance of each earlier prediction to the final one (negated: high = consistent)."""
    x0 = x0.float()
    final = x0[-1]
    norm = final.norm() + 1e-6
    out = {f"c_step{k}": -float((x0[k] - final).norm() / norm) for k in range(min(3, x0.shape[0] - 1))}
    per_frame = (x0[-2] - final).pow(2).sum(dim=(0, 2, 3)).sqrt() / (final.pow(2).sum(dim=(0, 2, 3)).sqrt() + 1e-6)
    out["c_lastframe"] = -float(per_frame[-1])
    out["c_step2_max"] = -float(per_frame.max())
    return out


def committed_path(b: int, h: int):
    """(model, block, history) of each committed block before block ``b`` on history ``h``: block 0 is the target's;
    block ``i`` the drafter's if bit ``i - 1`` of ``h`` is set."""
    out = [("target0", 0, 0)]
    for i in range(1, b):
        prefix = h & ((1 << (i - 1)) - 1)
        out.append(("draft" if (h >> (i - 1)) & 1 else "target", i, prefix))
    return out


def clip_features(tree, frames, signals) -> dict:
    """Every signal of every drafted node of one clip: ``{name: array [nodes]}`` in ``(b, h)`` order, plus ``gain``
    (the label: -node value), ``block`` and ``history``."""
    n = tree.num_decisions
    rows = []
    for b in range(1, n + 1):
        for h in range(2 ** (b - 1)):
            i = node_index(b, h)
            s = np.asarray(tree.draft[b - 1][h], dtype=np.float64)
            path = committed_path(b, h)
            def scores_of(item):  # noqa: E306
                model, blk, hist = item
                return np.asarray(tree.block0 if model == "target0" else
                                  (tree.draft if model == "draft" else tree.target)[blk - 1][hist], dtype=np.float64)
            def frames_of(item):  # noqa: E306
                model, blk, hist = item
                return frames.block0 if model == "target0" else (frames.draft if model == "draft" else frames.target)[blk - 1][hist]
            prev = scores_of(path[-1])
            committed_mins = [scores_of(item).min() for item in path]
            row = {"block": float(b), "history": h,
                   "r_min": s.min(), "r_mean": s.mean(), "r_max": s.max(), "r_first": s[0], "r_last": s[-1],
                   "r_std": -s.std(), "r_median": float(np.median(s)), "r_q25": float(np.quantile(s, 0.25)),
                   "m_relative_min": s.min() - prev.min(), "m_relative_mean": s.mean() - prev.mean(),
                   "m_anchor_min": s.min() - committed_mins[0], "m_baseline_min": s.min() - float(np.mean(committed_mins)),
                   "m_continuity": s[0] - prev[-1], "m_relative_gain": (s.min() - prev.min()) / (abs(prev.min()) + 1e-3)}
            row.update(frame_features(frames.draft[b - 1][h], frames_of(path[-1])))
            row.update(latent_features(signals["draft_x0"][i]))
            # against the drafter's own draft of the block before (made and scored whatever was kept): no extra pass
            prev_draft = (b - 1, h & ((1 << (b - 2)) - 1)) if b > 1 else None
            if prev_draft is None:
                row["c_step2_rel"], row["r_prev_draft"] = 0.0, 0.0
            else:
                row["c_step2_rel"] = row["c_step2"] - latent_features(signals["draft_x0"][node_index(*prev_draft)])["c_step2"]
                row["r_prev_draft"] = s.min() - min(tree.draft[prev_draft[0] - 1][prev_draft[1]])
            target = signals["target"][i].float()
            row["latent_to_target"] = -float((signals["draft_x0"][i, -1].float() - target).norm() / (target.norm() + 1e-6))
            rows.append(row)
    out = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in rows[0]}
    out["gain"] = -node_values(tree)
    return out


# ============================================================================================== scoring a signal
def auc(signal: np.ndarray, positive: np.ndarray) -> float:
    """P(signal[pos] < signal[neg]) + 0.5 P(tie): how well a LOW signal picks the nodes where remaking helps."""
    signal, positive = np.asarray(signal, dtype=np.float64), np.asarray(positive, dtype=bool)
    pos, neg = signal[positive], signal[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([neg, pos]), kind="mergesort")
    allv = np.concatenate([neg, pos])[order]
    # average ranks with ties
    ranks = np.empty(len(allv))
    i = 0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1] == allv[i]:
            j += 1
        ranks[i:j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty(len(allv))
    r[order] = ranks
    rank_neg = r[:len(neg)].sum()
    return float((rank_neg - len(neg) * (len(neg) + 1) / 2.0) / (len(pos) * len(neg)))


def walk_leaf(signal: np.ndarray, n: int, tau: float) -> int:
    """The leaf a router reaches that keeps a draft when its node's ``signal`` (in ``(b, h)`` order) >= ``tau``."""
    h = 0
    for b in range(1, n + 1):
        if signal[node_index(b, h)] >= tau:
            h |= 1 << (b - 1)
    return h


@dataclass
class Family:
    """One signal walked at every tau on a set of trees: per tau and clip, the leaf reached."""

    name: str
    taus: np.ndarray  # [S]
    leaves: np.ndarray  # [S, N]


def walk_family(name: str, trees, signals: list, taus=None) -> Family:
    n = trees[0].num_decisions
    if taus is None:
        values = np.concatenate(signals)
        taus = np.unique(np.quantile(values[np.isfinite(values)], np.linspace(0, 1, TAU_POINTS)))
        taus = np.concatenate([[-np.inf], taus, [np.inf]])
    leaves = np.array([[walk_leaf(s, n, t) for s in signals] for t in taus])
    return Family(name, np.asarray(taus, dtype=np.float64), leaves)


def _clip_arrays(trees):
    n = trees[0].num_decisions
    q = np.stack([t.leaf_quality() for t in trees])  # [N, 2^n]
    coef = np.stack([random_coefficients(t) for t in trees])  # [N, n+1]
    return n, q, coef


def oracle_curve(trees) -> tuple[np.ndarray, np.ndarray]:
    """Per clip, the best leaf quality with exactly ``k`` kept drafts: (acceptance [n+1], quality [N, n+1])."""
    n, q, _ = _clip_arrays(trees)
    k_of = np.array([bin(leaf).count("1") for leaf in range(2 ** n)])
    best = np.stack([q[:, k_of == k].max(axis=1) for k in range(n + 1)], axis=1)
    return np.arange(n + 1) / n, best


def _interp_rows(acc: np.ndarray, diff: np.ndarray, grid) -> np.ndarray:
    """diff [R, S] at acceptances acc [R, S] (per resample) -> [R, len(grid)], linear in acceptance."""
    out = np.empty((diff.shape[0], len(grid)))
    for r in range(diff.shape[0]):
        order = np.argsort(acc[r], kind="mergesort")
        out[r] = np.interp(grid, acc[r][order], diff[r][order])
    return out


def score_family(fam: Family, trees, *, seconds: dict | None = None, cost: dict | None = None, resamples: int = 1000,
                 seed: int = 0) -> dict:
    """Router rows (per tau: acceptance, quality, % of target-only, random at the same acceptance, speedup) and the
    summary: gain over random at k rejections, lift averaged over :data:`LIFT_GRID` with its CI, capture of the
    oracle's lift; ``lift_samples`` (full set first, then each resample; the resamples are seeded, so two signals'
    samples on the same trees pair up). ``cost``: :func:`family_cost` of the signal (None: not costed)."""
    n, q, coef = _clip_arrays(trees)
    N = len(trees)
    S = len(fam.taus)
    quality = q[np.arange(N)[None, :], fam.leaves]  # [S, N]
    accepted = np.vectorize(lambda leaf: bin(int(leaf)).count("1"))(fam.leaves).astype(np.float64)  # [S, N]
    W = np.vstack([np.ones(N), bootstrap_weights(N, resamples, seed)])  # row 0: the full set
    tot = W.sum(axis=1, keepdims=True)
    acc_r = (W @ accepted.T) / (tot * n)  # [R, S]
    q_r = (W @ quality.T) / tot
    rand_r = np.stack([((W @ coef) / tot * _bernstein(acc_r[:, s], n)).sum(axis=1) for s in range(S)], axis=1)
    diff = q_r - rand_r
    # the oracle on the same resamples
    oacc, obest = oracle_curve(trees)
    o_q = (W @ obest) / tot  # [R, n+1]
    o_rand = np.stack([((W @ coef) / tot * _bernstein(np.full(W.shape[0], a), n)).sum(axis=1) for a in oacc], axis=1)
    o_diff = o_q - o_rand
    grid = np.array(LIFT_GRID)
    lift = _interp_rows(acc_r, diff, grid).mean(axis=1)
    o_lift = np.stack([np.interp(grid, oacc, o_diff[r]) for r in range(W.shape[0])]).mean(axis=1)
    capture = lift / o_lift
    at_k = _interp_rows(acc_r[:1], diff[:1], [1 - k / n for k in K_REJECTIONS])[0]
    q0 = q[:, 0].mean()
    rows = []
    for s in range(S):
        row = {"tau": float(fam.taus[s]) if math.isfinite(fam.taus[s]) else str(fam.taus[s]),
               "acceptance": float(acc_r[0, s]), "quality": float(q_r[0, s]),
               "quality_ratio_to_target": float(q_r[0, s] / q0), "random_quality": float(rand_r[0, s]),
               "router_minus_random": float(diff[0, s])}
        if seconds is not None and cost is not None:
            row["speedup"] = family_speedup(fam.leaves[s], n, seconds, cost)
        rows.append(row)
    ci = lambda x: [float(np.percentile(x[1:], 2.5)), float(np.percentile(x[1:], 97.5))]  # noqa: E731
    return {"rows": rows, "gain_at_k": {str(k): float(v) for k, v in zip(K_REJECTIONS, at_k)},
            "lift": float(lift[0]), "lift_ci": ci(lift), "oracle_lift": float(o_lift[0]),
            "capture": float(capture[0]), "capture_ci": ci(capture), "lift_samples": lift}


# ============================================================================================== cost
def family_cost(needs: dict, extra_seconds: float = 0.0) -> dict:
    """How a verify-then-decide router on this signal is charged: every drafted block drafted and decoded, a reward
    pass per drafted block if it needs the reward, the committed target blocks' reward passes of the reference modes,
    and ``extra_seconds`` per drafted block (the signal's own arithmetic or network)."""
    return {"reward": bool(needs.get("reward")), "committed": needs.get("committed"), "extra": float(extra_seconds),
            "target": bool(needs.get("target"))}


def family_counts(leaves, n: int, cost: dict) -> dict:
    """The cost model's per-clip counts (as ``tree.evaluate``) of a verify-then-decide router ending in ``leaves``."""
    leaves = np.asarray(leaves)
    accepted = np.array([bin(int(L)).count("1") for L in leaves], dtype=np.float64)
    rejected = n - accepted
    if cost.get("committed") == "relative":  # every committed target block but the last: block 0 + rejected ones
        committed = np.array([1 + sum(1 for b in range(1, n) if not (int(L) >> (b - 1)) & 1) for L in leaves],
                             dtype=np.float64)
    elif cost.get("committed") == "anchor":
        committed = np.ones(len(leaves))
    else:
        committed = np.zeros(len(leaves))
    target_last = np.array([max([b for b in range(1, n + 1) if not (int(L) >> (b - 1)) & 1], default=0) for L in leaves],
                           dtype=np.float64)
    drafted = np.full(len(leaves), float(n))
    if cost.get("target"):  # the diagnostic that looks at the target's block: the target makes every block
        return {"drafter": drafted, "target": np.full(len(leaves), 1.0 + n), "decode": 1.0 + n + rejected,
                "score": committed, "drafter_last": np.full(len(leaves), float(n)),
                "target_last": np.full(len(leaves), float(n)), "extra": drafted}
    return {"drafter": drafted, "target": 1.0 + rejected, "decode": 1.0 + n + rejected,
            "score": (drafted if cost.get("reward") else 0.0) + committed,
            "drafter_last": np.full(len(leaves), float(n)), "target_last": target_last, "extra": drafted}


def family_speedup(leaves, n: int, seconds: dict, cost: dict) -> float | None:
    """Cost-model speedup (``tree._speedup``) with the signal's own seconds per drafted block added."""
    counts = family_counts(leaves, n, cost)
    base = _speedup({k: v for k, v in counts.items() if k != "extra"}, n + 1, len(leaves), seconds)
    if base is None:
        return None
    extra = float(np.sum(counts["extra"])) * cost.get("extra", 0.0)
    if not extra:
        return base
    # speedup = baseline / cost; add the extra seconds to the cost
    calls = seconds["calls"]
    t_only = ((calls["target"]["steps"] * (n + 1) + n) * calls["target"]["per_call"] + (n + 1) * seconds["decode"])
    baseline = len(leaves) * t_only
    return baseline / (baseline / base + extra)


def marginal_cost(needs: dict, seconds: dict, extra_seconds: float = 0.0) -> float:
    """Seconds a signal adds to a kept draft (beyond drafting and decoding it, which keeping it needs anyway): a
    reward pass if it reads the reward, plus its own arithmetic. Committed-block scores are charged per clip, not
    here; a rejected draft's wasted draft + decode is the same for every verify-then-decide signal."""
    return (seconds["score"] if needs.get("reward") else 0.0) + extra_seconds
