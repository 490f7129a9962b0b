"""Learned block verifiers (issue 38): combiners of the candidate signals, fitted on design-split trees and extra
training clips (captions outside the report split) only.

    # collect the trees (design split + N extra training clips; resumable) and fit; writes the verifier as JSON
    python -m sdvg_engine.toy.verifier --cache outputs/verifier_cache --extra 16 --out outputs/verifier.json
    python -m sdvg_engine.toy.verifier --no-build ...          # fit on what the cache holds

The label of a node is the gain from remaking its block (:mod:`.signals`). Two combiners over the signals of
:mod:`.signals` (standardised; the block index one-hot):

* ``logistic``: P(gain > 0), L2-regularised logistic regression (LBFGS);
* ``ridge``: the gain itself, ridge regression.

Each comes in two feature sets: ``cheap`` (frame statistics against the last kept frames, the drafter's per-step
agreement, the block index: no reward pass) and ``all`` (+ the reward's aggregations and margins, which need the reward
on the draft and, for the margins, on the committed target blocks). The verifier's signal is minus its predicted gain
(or minus P(gain > 0)): high = keep.

Out of sample: design-split figures use out-of-fold predictions (folds of design clips; the extra clips are always
in training), report-split figures the verifier fitted on every design and extra clip.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .signals import FRAME_SIGNALS, LATENT_SIGNALS, REWARD_SIGNALS

CHEAP = (*FRAME_SIGNALS, *LATENT_SIGNALS)
MARGINS = ("m_relative_min", "m_relative_mean", "m_continuity", "m_baseline_min", "m_anchor_min")
ALL = (*CHEAP, *REWARD_SIGNALS, *MARGINS)
FEATURE_SETS = {"cheap": CHEAP, "all": ALL}
KINDS = ("logistic", "ridge")
FOLDS = 4


def design_matrix(feats: list[dict], names, blocks: int) -> np.ndarray:
    """Rows = nodes of every clip in ``feats`` (:func:`signals.clip_features`), columns = ``names`` + block one-hot."""
    cols = []
    for f in feats:
        x = np.stack([f[k] for k in names], axis=1)
        onehot = np.eye(blocks)[f["block"].astype(int) - 1]
        cols.append(np.concatenate([x, onehot], axis=1))
    return np.concatenate(cols)


@dataclass
class Verifier:
    """A fitted linear verifier: ``signal = -(x - mean) / std @ coef - bias`` (high = keep)."""

    kind: str
    features: tuple
    blocks: int
    mean: list
    std: list
    coef: list
    bias: float
    trained_on: dict = field(default_factory=dict)

    def predict(self, feats: dict) -> np.ndarray:
        x = design_matrix([feats], self.features, self.blocks)
        z = (x - np.array(self.mean)) / np.array(self.std)
        return z @ np.array(self.coef) + self.bias

    def signal(self, feats: dict) -> np.ndarray:
        return -self.predict(feats)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("kind", "features", "blocks", "mean", "std", "coef", "bias", "trained_on")}

    @classmethod
    def from_json(cls, data: dict) -> "Verifier":
        return cls(**{**data, "features": tuple(data["features"])})


def fit(feats: list[dict], kind: str = "logistic", names=CHEAP, *, l2: float = 1.0, trained_on: dict | None = None) -> Verifier:
    """Fit a linear verifier on the nodes of ``feats`` (one dict per clip)."""
    blocks = int(max(f["block"].max() for f in feats))
    x = design_matrix(feats, names, blocks)
    gain = np.concatenate([f["gain"] for f in feats])
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[std < 1e-9] = 1.0
    z = (x - mean) / std
    if kind == "ridge":
        y = gain / gain.std()
        a = np.concatenate([z, np.ones((len(z), 1))], axis=1)
        reg = l2 * np.eye(a.shape[1])
        reg[-1, -1] = 0.0
        w = np.linalg.solve(a.T @ a + reg, a.T @ y)
        coef, bias = w[:-1], float(w[-1])
    elif kind == "logistic":
        zt = torch.tensor(z, dtype=torch.float64)
        yt = torch.tensor((gain > 0).astype(np.float64))
        w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(zt @ w + b, yt) + 0.5 * l2 * (w @ w) / len(z)
            loss.backward()
            return loss

        opt.step(closure)
        coef, bias = w.detach().numpy(), float(b.detach())
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Verifier(kind, tuple(names), blocks, mean.tolist(), std.tolist(), [float(c) for c in coef], bias,
                    trained_on or {"clips": len(feats), "nodes": int(len(z))})


def out_of_fold(design: list[dict], extra: list[dict], fit_fn, folds: int = FOLDS) -> list[np.ndarray]:
    """Per design clip, the signal of a verifier fitted without that clip's fold (``fit_fn(train feats) -> object with
    .signal(feats)``); the extra clips are always in training."""
    out: list = [None] * len(design)
    for k in range(folds):
        train = [f for i, f in enumerate(design) if i % folds != k] + list(extra)
        model = fit_fn(train)
        for i, f in enumerate(design):
            if i % folds == k:
                out[i] = model.signal(f)
    return out


# ============================================================================================== the command
def main(argv=None) -> int:
    from .clips import split_clips, weights_hash
    from .models import WEIGHTS, load_toy_models
    from .signal_trees import build_clip, extra_clips, load_clip
    from .signals import clip_features
    from .tree import TreeBuilder

    ap = argparse.ArgumentParser(description="Collect design-split (+ extra) trees and fit a block verifier.")
    ap.add_argument("--cache", type=Path, default=Path("outputs/verifier_cache"))
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument("--extra", type=int, default=16, help="extra training clips (captions outside the report split)")
    ap.add_argument("--clips", type=int, default=0, help="design clips to use (0: all 48)")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--kind", choices=KINDS, default="ridge")
    ap.add_argument("--features", choices=tuple(FEATURE_SETS), default="cheap")
    ap.add_argument("--l2", type=float, default=10.0)
    ap.add_argument("--no-build", action="store_true", help="fit on the trees the cache holds; build none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("outputs/verifier.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clips = split_clips("design")[: args.clips or None] + extra_clips(args.extra)
    builder = TreeBuilder(load_toy_models(weights=args.weights), num_frames=args.frames,
                          weights_id=weights_hash(args.weights))
    began = time.perf_counter()
    feats = []
    for caption, seed in clips:
        if not args.no_build:
            build_clip(builder, args.cache, caption, seed)
        data = load_clip(args.cache, builder.key(caption, seed))
        if data is not None:
            feats.append(clip_features(*data))
    if not feats:
        raise SystemExit(f"no trees in {args.cache} for these clips (drop --no-build to collect them)")
    verifier = fit(feats, args.kind, FEATURE_SETS[args.features], l2=args.l2,
                   trained_on={"clips": len(feats), "nodes": int(sum(len(f["gain"]) for f in feats)),
                               "weights": builder.weights_id, "frames": args.frames, "design_clips": args.clips or 48,
                               "extra": args.extra})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(verifier.to_json(), indent=1))
    print(f"fitted a {args.kind} verifier ({args.features}) on {len(feats)} clips, "
          f"{verifier.trained_on['nodes']} nodes, in {time.perf_counter() - began:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
