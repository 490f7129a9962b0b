"""The toy world's baseline table beside the reference's (issue 29).

    python -m sdvg_engine.toy.baselines --split report --out outputs/toy_baselines.json

Per clip (caption, seed 0) three pipeline runs with the shipped weights: ``target_only``, ``draft_only`` and ``sdvg``
with tau = -inf (block 0 by the target, every later draft kept: ``first_block_only``'s frames, with the drafts'
scores). From them, with 95% bootstrap CIs over clips (the tree tool's resamples):

* ``draft_ratio``: draft-only quality / target-only quality (the reference: 0.0644 / 0.0788 = 81.7%);
* ``gap_closed``: (first-block-only - draft-only) / (target-only - draft-only), the share of the draft->target gap
  that the target's block 0 alone closes (the reference: (0.0757 - 0.0644) / (0.0788 - 0.0644) = 78%);
* ``between_prompt_share``: of the drafts' block scores (min over frames) when every draft is kept, the share of
  their variance that lies between clips, var(per-clip mean) / var(all) (the reference: 82%, computed the same way
  from its per-prompt record, config ``fixed_-2.5``, the one that keeps every draft);
* with ``block_seconds`` (:func:`sdvg_engine.toy.clips.measure_block_seconds`): ``cost_ratio`` = target / drafter
  seconds per block, and ``verification_share`` = (drafter + decode + score) / (target + decode): what verifying a
  rejected draft adds to the block the target makes anyway (the reference: 3.3 s against 97 s / 9 blocks).

``BANDS`` are issue 29's: draft-only at 0.78-0.86 of target-only, and the target's block 0 closing >= 70% of the gap.
The shipped table (``BASELINES_FILE``, keyed by the weights' hash) is what ``tests/test_toy.py`` checks the bands on,
after re-running some of its clips and finding the same numbers.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..pipeline import SDVGOptions
from .clips import build_pipeline, measure_block_seconds, run_clip, split_clips, weights_hash
from .models import WEIGHTS

# the reference's per-prompt record, where a checkout has it (shared/ inside or beside the repository)
REFERENCE_CSV = next((p for p in (Path(__file__).resolve().parents[k] / "shared" / "reference" / "reference_per_prompt.csv"
                                  for k in (2, 3)) if p.exists()), None)
BASELINES_FILE = Path(__file__).resolve().parent / "baselines_report.json"
BANDS = {"draft_ratio": (0.78, 0.86), "gap_closed": (0.70, 1.0)}

# The reference's table (paper and repository; /work/shared/reference/README.md and sdvg_and_peers.md): VisionReward
# means over 1003 prompts and speedups against its target-only 97.0 s.
REFERENCE = {
    "target_only": {"quality": 0.0788, "speedup": 1.0},
    "draft_only": {"quality": 0.0644, "speedup": 3.77},
    "first_block_only": {"quality": 0.0757, "speedup": 2.21},
    "random_block0": {"quality": 0.0771, "speedup": 1.67},
    "sdvg_tau-0.7": {"quality": 0.0773, "speedup": 1.59, "acceptance": 0.731},
    "random_no_block0": {"quality": 0.0706, "speedup": None},
}
REFERENCE_BETWEEN_SHARE = 0.816  # from reference_per_prompt.csv, config fixed_-2.5 (reference_between_share())
REFERENCE_COST = {"target_video_seconds": 97.0, "blocks": 9, "verification_seconds": 3.3,
                  "seconds_saved_per_kept_draft": 9.40, "cost_ratio": 10.0}


def reference_table() -> dict:
    t, d, f = (REFERENCE[k]["quality"] for k in ("target_only", "draft_only", "first_block_only"))
    per_block = REFERENCE_COST["target_video_seconds"] / REFERENCE_COST["blocks"]
    return {"target_only": t, "draft_only": d, "first_block_only": f, "draft_ratio": d / t,
            "first_block_ratio": f / t, "gap_closed": (f - d) / (t - d), "between_prompt_share": REFERENCE_BETWEEN_SHARE,
            "cost_ratio": REFERENCE_COST["cost_ratio"],
            "verification_share": REFERENCE_COST["verification_seconds"] / per_block,
            "rows": REFERENCE}


def between_share(scores: np.ndarray) -> float:
    """``scores[clip, block]``: var(per-clip means) / var(all scores) (population variances)."""
    scores = np.asarray(scores, dtype=np.float64)
    total = scores.var()
    return float(scores.mean(axis=1).var() / total) if total > 0 else float("nan")


def reference_between_share(path: Path | None = REFERENCE_CSV, config: str = "fixed_-2.5") -> float | None:
    """The reference's between-prompt share of its drafts' score variance, from its per-prompt record (None if the
    file is not here)."""
    if path is None or not Path(path).exists():
        return None
    with open(path, newline="") as f:
        rows = [[float(r[f"s{i}"]) for i in range(1, 9)] for r in csv.DictReader(f) if r["config"] == config]
    return between_share(np.array(rows))


def clip_row(pipe, caption: str, seed: int = 0, num_frames: int = 81) -> dict:
    """The three baseline runs of one clip on ``pipe`` (:func:`sdvg_engine.toy.clips.build_pipeline`)."""
    row = {"caption": caption, "seed": int(seed)}
    for mode in ("target_only", "draft_only"):
        _, metrics = run_clip(pipe, caption, seed, SDVGOptions(mode=mode), num_frames)
        row[mode] = metrics["quality"]
    tau = pipe.router.tau
    pipe.router.tau = -math.inf  # every draft kept after the target's block 0: first_block_only, with the scores
    try:
        result, metrics = run_clip(pipe, caption, seed, SDVGOptions(mode="sdvg"), num_frames)
    finally:
        pipe.router.tau = tau
    row["first_block_only"] = metrics["quality"]
    row["draft_scores"] = [s for s in result.report["draft_scores"] if s is not None]
    return row


def rows_from_trees(trees) -> list[dict]:
    """The same rows read off whole decision trees (:class:`sdvg_engine.toy.tree.ClipTree`): target-only is the
    all-reject leaf, first-block-only the all-accept one, whose drafts' scores lie on the all-accept path."""
    rows = []
    for t in trees:
        n = t.num_decisions
        scores = [float(np.min(t.draft[b - 1][2 ** (b - 1) - 1])) for b in range(1, n + 1)]
        rows.append({"caption": t.caption, "seed": t.seed, "target_only": t.leaves[0]["quality"],
                     "draft_only": t.draft_only["quality"], "first_block_only": t.leaves[2 ** n - 1]["quality"],
                     "draft_scores": scores})
    return rows


def _stats(T, D, F, S):
    t, d, f = T.mean(), D.mean(), F.mean()
    return {"target_only": t, "draft_only": d, "first_block_only": f, "draft_ratio": d / t, "first_block_ratio": f / t,
            "gap_closed": (f - d) / (t - d) if t != d else float("nan"), "between_prompt_share": between_share(S)}


def table(rows: list[dict], block_seconds: dict | None = None, *, resamples: int = 2000, seed: int = 0) -> dict:
    """The toy's baseline table with 95% bootstrap CIs over clips, the bands and the reference's table beside it."""
    T = np.array([r["target_only"] for r in rows])
    D = np.array([r["draft_only"] for r in rows])
    F = np.array([r["first_block_only"] for r in rows])
    S = np.array([r["draft_scores"] for r in rows])
    point = _stats(T, D, F, S)
    rng = np.random.default_rng(seed)
    boot = [_stats(T[i], D[i], F[i], S[i]) for i in rng.integers(0, len(rows), size=(resamples, len(rows)))]
    out = {k: {"value": float(v), "ci": [float(x) for x in np.nanpercentile([b[k] for b in boot], [2.5, 97.5])]}
           for k, v in point.items()}
    if block_seconds:
        s = block_seconds
        out["cost_ratio"] = {"value": s["target"] / s["drafter"], "ci": None}
        out["verification_share"] = {"value": (s["drafter"] + s["decode"] + s["score"]) / (s["target"] + s["decode"]),
                                     "ci": None}
        out["block_seconds"] = s
    out["in_band"] = {k: bool(lo <= point[k] <= hi) for k, (lo, hi) in BANDS.items()}
    out["bands"] = {k: list(v) for k, v in BANDS.items()}
    out["reference"] = reference_table()
    out["clips"] = len(rows)
    return out


def shipped(weights: str) -> dict | None:
    """The shipped report-set table (:data:`BASELINES_FILE`: ``weights``, ``rows``, ``table``) when it exists and was
    made with weights ``weights`` (a :func:`sdvg_engine.toy.clips.weights_hash`), else None: its figures would
    describe other models."""
    if not BASELINES_FILE.exists():
        return None
    data = json.loads(BASELINES_FILE.read_text())
    return data if data.get("weights") == weights else None


def typical_clips(rows: list[dict], n: int) -> list[tuple[str, int]]:
    """The ``n`` clips of ``rows`` (a baseline table's per-clip rows) that look most like the whole set: on each, its
    draft-only and block-0-plus-drafts quality as shares of its target-only are nearest the set's two ratios (summed
    distance), in the rows' order. ``make demo`` shows these, so that its few videos tell what the 40 clips say
    (the first clips of the report set happen to be ones where the drafter alone nearly matches the target)."""
    if not 1 <= n <= len(rows):
        raise ValueError(f"asked for {n} typical clips of {len(rows)}")
    T, D, F = (np.array([r[k] for r in rows]) for k in ("target_only", "draft_only", "first_block_only"))
    with np.errstate(divide="ignore", invalid="ignore"):
        distance = np.abs(D / T - D.mean() / T.mean()) + np.abs(F / T - F.mean() / T.mean())
    distance[~np.isfinite(distance)] = np.inf  # a clip the target scores 0 on says nothing about ratios
    chosen = sorted(np.argsort(distance, kind="stable")[:n])
    return [(rows[i]["caption"], rows[i]["seed"]) for i in chosen]


def format_table(tab: dict) -> str:
    ref = tab["reference"]
    lines = [f"{'':24} {'toy (' + str(tab['clips']) + ' clips) [95% CI]':>34} {'reference':>10} {'band':>12}"]
    for key, label, pct in (("target_only", "target-only quality", False), ("draft_only", "draft-only quality", False),
                            ("first_block_only", "block 0 target + drafts", False),
                            ("draft_ratio", "draft-only / target", True), ("first_block_ratio", "block0+drafts / target", True),
                            ("gap_closed", "gap closed by block 0", True),
                            ("between_prompt_share", "draft-score var. between", True),
                            ("cost_ratio", "target/drafter per block", False),
                            ("verification_share", "verification / target blk", True)):
        if key not in tab:
            continue
        v, ci = tab[key]["value"], tab[key]["ci"]

        def f(x):
            return f"{100 * x:.1f}%" if pct else f"{x:.3f}"
        band = BANDS.get(key)
        lines.append(f"{label:<24} {f(v):>12} {('[' + f(ci[0]) + ', ' + f(ci[1]) + ']') if ci else '':>21} "
                     f"{f(ref[key]):>10} {(f(band[0]) + '-' + f(band[1])) if band else '':>12}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    from .models import load_toy_models

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("design", "report"), default="report")
    ap.add_argument("--clips", type=int, default=None, help="only the first N clips of the split")
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-timing", action="store_true", help="skip the per-block seconds (cost ratio, verification)")
    ap.add_argument("--out", type=Path, default=Path("outputs/toy_baselines.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = load_toy_models(weights=args.weights)
    pipe = build_pipeline(models)
    clips = split_clips(args.split)[: args.clips]
    began = time.perf_counter()
    rows = [clip_row(pipe, c, s) for c, s in clips]
    seconds = None if args.no_timing else measure_block_seconds(models)
    tab = table(rows, seconds)
    report = {"weights": weights_hash(args.weights), "split": args.split, "rows": rows, "table": tab,
              "seconds": round(time.perf_counter() - began, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(format_table(tab))
    print(f"({len(rows)} {args.split}-set clips, {report['seconds']:.0f} s; written to {args.out})")
    return report


if __name__ == "__main__":
    main()
