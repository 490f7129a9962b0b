"""The shipped routing table of the toy world: every router's design-chosen settings judged on the report set.

``bench/bench_routing.py --ship sdvg_engine/toy/routing_report.json`` writes it from a full run (48 design trees, 40
report trees, cost model from one timing); it is keyed by the weights' hash like the baseline table
(:data:`sdvg_engine.toy.baselines.BASELINES_FILE`). Two readers:

* ``make demo``: its chart and tables put the 40 held-out clips' figures beside the demo's own few clips and the
  reference's, so that a page made from 4 clips does not stand alone;
* :func:`design_choices`: the setting each router chose on the design trees (best quality at >= 1.6x), which the demo
  judges again on its own clips (``demo.ROUTING_CHOICE``).

The file holds, per router family (``points``): for each pick (``within``: fastest with >= 98% of target-only on the
design set; ``at_speed``: best quality at >= 1.6x there) the design row and the report row (acceptance, quality,
% of target-only with its CI, cost-model speedup, router - random at the same acceptance with its CI); the report
set's baselines and random routing's curve; each family's router - random averaged over the acceptance bands.
"""

from __future__ import annotations

import json
from pathlib import Path

ROUTING_FILE = Path(__file__).resolve().parent / "routing_report.json"
PICKS = ("within", "at_speed")
ROW_KEYS = ("setting", "acceptance", "quality", "quality_ratio_to_target", "quality_ratio_ci", "speedup",
            "router_minus_random", "router_minus_random_ci")


def _row(row: dict | None) -> dict | None:
    return None if row is None else {k: row.get(k) for k in ROW_KEYS}


def summarize(bench: dict, weights: str) -> dict:
    """The compact table of a ``bench_routing`` report (``bench``: its JSON output) made with weights ``weights``."""
    rep, des = bench["report"], bench["design"]
    seconds = rep["block_seconds"]
    n = rep["drafted_blocks_per_clip"]
    # draft-only: every block (block 0 too) drafted and decoded, nothing scored; per block against target + decode
    draft_speedup = (seconds["target"] + seconds["decode"]) / (seconds["drafter"] + seconds["decode"]) if seconds else None
    first_block = next(r for r in rep["modes"]["schedule"] if r["setting"] == 0)  # k = 0: every draft after block 0
    t = rep["target_only"]["quality"]
    return {
        "weights": weights,
        "clips": {"design": des["clips"], "report": rep["clips"]},
        "drafted_blocks_per_clip": n,
        "block_seconds": seconds,
        "speed_target": bench["speed_target"], "quality_share": bench["quality_share"],
        "target_only": rep["target_only"],
        "baselines": {
            "draft_only": {"quality": rep["draft_only"]["quality"], "quality_ratio_to_target": rep["draft_only"]["quality"] / t,
                           "speedup": draft_speedup},
            "first_block_only": _row(first_block),
        },
        "random": [_row(r) for r in rep["modes"]["random"]],
        "points": {m: {pick: None if picks[pick] is None else
                       {"design": _row(picks[pick]["design"]), "report": _row(picks[pick]["report"])}
                       for pick in PICKS} for m, picks in bench["judged"].items()},
        # router - random averaged over the settings in each acceptance band ("band": 0.1-0.9; "fast": 0.7-0.95)
        "bands": {"band": list(rep["band"]), **{k: list(v) for k, v in rep["bands"].items()}},
        "band_average": {name: {m: v for m, v in averages.items() if v is not None and m != "random"}
                         for name, averages in (("band", rep["average_in_band"]), *rep["average_in_bands"].items())},
        "oracle": bench["oracle"],
        "winner": {k: bench["winner"][k] for k in ("mode", "setting", "beats_random")},
        "held_out_best": held_out_best(bench["judged"], bench["quality_share"]),
        "design_best": design_best(bench["judged"], bench["quality_share"]),
    }


def _fastest(judged: dict, share: float, side: str):
    """Of every router's design-chosen settings (both picks), the fastest on the ``side`` ("design" or "report")
    trees that keeps >= ``share`` of target-only there: (mode, pick, its rows) or None."""
    ok = [(m, pick, p) for m, picks in judged.items() for pick, p in picks.items()
          if p is not None and p[side]["quality_ratio_to_target"] >= share and p[side]["speedup"]]
    return max(ok, key=lambda x: (x[2][side]["speedup"], x[2][side]["quality_ratio_to_target"]), default=None)


def design_best(judged: dict, share: float) -> dict | None:
    """The one setting the design trees alone point to: of every router's design-chosen settings, the fastest on the
    design trees that keeps >= ``share`` of target-only there; its design row and its report row."""
    best = _fastest(judged, share, "design")
    if best is None:
        return None
    m, pick, p = best
    return {"mode": m, "pick": pick, "design": _row(p["design"]), "report": _row(p["report"])}


def held_out_best(judged: dict, share: float) -> dict | None:
    """Of every setting chosen on the design trees (both picks of every router), the fastest on the report trees
    that keeps >= ``share`` of target-only there (P0: >= 98% at >= 1.6x). Each setting's figures are held out; the
    pick among them looks at the report trees (:func:`design_best` does not)."""
    best = _fastest(judged, share, "report")
    if best is None:
        return None
    m, pick, p = best
    return {"mode": m, "pick": pick, **_row(p["report"])}


def load(path: Path = ROUTING_FILE) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no routing table (python bench/bench_routing.py --ship {path})") from None


def shipped(weights: str) -> dict | None:
    """The shipped table when it was made with weights ``weights`` (a :func:`sdvg_engine.toy.clips.weights_hash`),
    else None: its figures would describe other models."""
    data = load()
    return data if data.get("weights") == weights else None


def design_choices(pick: str = "at_speed", path: Path = ROUTING_FILE) -> dict:
    """{family: setting} chosen on the design trees (``pick``: ``at_speed`` or ``within``), as the tree tool's grids
    take them (:func:`sdvg_engine.toy.tree.setting_value`); families with no qualifying setting are left out."""
    from .tree import setting_value

    if pick not in PICKS:
        raise ValueError(f"pick {pick!r}: expected one of {PICKS}")
    return {mode: setting_value(mode, picks[pick]["design"]["setting"])
            for mode, picks in load(path)["points"].items() if picks.get(pick) is not None}

