"""Routing benchmark on a fixed held-out split of the toy world (issue 24): choose on the design set, report on the other.

    python bench/bench_routing.py                      # trees of both sets (built if missing), choose, report
    python bench/bench_routing.py --time --repeats 3   # + measured wall-clock speedup of the chosen settings (run alone)

The tree tool's clips (``sdvg_engine.toy.tree``) are split once, in the repo (``tree.SPLITS``): **design** = prompts
0-47 of ``demo.prompts_for`` (every earlier figure, tau and rate was chosen on these) and **report** = prompts 48-87
(used by nothing before the split), seed 0. Every router is walked on the same trees:

* the reward routers (``fixed``, ``accept_rate``, ``relative``, ``anchor``, ``baseline``): verify-then-decide: every
  drafted block is drafted, decoded and scored, a rejected one generated and decoded again by the target, and the
  reference modes also score the committed target blocks their references read;
* ``random`` (decided before drafting: a block it gives the target is never drafted, decoded twice or scored) and
  ``schedule`` (k): decided before drafting;
* ``schedule_veto_<m>``: the schedule with a veto by router ``m`` on its drafted blocks (``SDVGOptions.schedule_veto``).

On the design trees each router's setting is chosen twice: the fastest (cost model) with >= 98% of target-only
quality, and the best quality at >= 1.6x. Those settings are then judged on the report trees, beside every setting's
router - random (exact random expectation at the same acceptance) with 95% bootstrap CIs over clips and the
quality/speed Pareto front of all of them. The cost model's per-block seconds are measured in the same run
(``tree.measure_block_seconds``; ``--block-seconds FILE`` reuses a report's). ``--time``: each chosen setting run by
the pipeline on the first ``--time-prompts`` report prompts, 1 worker, median of ``--repeats`` summed wall times
against target-only's (run it alone on the machine). Writes ``--out`` (JSON), and with ``--ship FILE`` the compact
table ``make demo`` reads (``sdvg_engine/toy/routing_report.json``). See docs/dev/routing.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sdvg_engine.pipeline import SDVGOptions  # noqa: E402
from sdvg_engine.router import RewardRouter  # noqa: E402
from sdvg_engine.toy import routing_report  # noqa: E402
from sdvg_engine.toy import tree as T  # noqa: E402
from sdvg_engine.toy.demo import NUM_FRAMES, build_pipeline  # noqa: E402
from sdvg_engine.toy.models import WEIGHTS, load_toy_models  # noqa: E402
from sdvg_engine.toy.text import embed_caption  # noqa: E402
from sdvg_engine.toy.world import SIZE, clip_metrics  # noqa: E402

FAMILIES = (*T.MODES, "schedule", "random", *(f"schedule_veto_{m}" for m in T.VETO_MODES))
FAST_BAND = (0.7, 0.95)  # the acceptances where verify-then-decide reaches >= 1.5x (a definition, not a fit)


def oracle_rows(trees, seconds: dict | None) -> list[dict]:
    """The ceiling of any router: per clip the best leaf with exactly ``k`` accepted drafts (k = 0 .. n), at the cost
    of a decision made before drafting (the cheapest a router can pay at that acceptance)."""
    n = trees[0].num_decisions
    k_of = np.array([bin(leaf).count("1") for leaf in range(2 ** n)])
    q0 = float(np.mean([t.leaves[0]["quality"] for t in trees]))
    rows = []
    for k in range(n + 1):
        best = [int(np.flatnonzero(k_of == k)[np.argmax(t.leaf_quality()[k_of == k])]) for t in trees]
        q = float(np.mean([t.leaves[leaf]["quality"] for t, leaf in zip(trees, best)]))
        counts = T.before_drafting_counts(best, n)
        rows.append({"accepted_per_clip": k, "acceptance": k / n, "quality": q, "quality_ratio_to_target": q / q0,
                     "speedup": T._speedup(counts, n + 1, len(trees), seconds)})
    return rows


def load_trees(builder, cache: Path, clips, *, build: bool, log=print):
    trees, missing = [], []
    for caption, seed in clips:
        tree = T.load_or_build(builder, cache, caption, seed, build=build, log=log)
        (trees if tree is not None else missing).append(tree if tree is not None else (caption, seed))
    return trees, missing


def choose(design: dict) -> dict:
    """Per family, the settings chosen on the design report: ``within`` (fastest with >= 98% of target-only
    quality) and ``at_speed`` (best quality at >= SPEED_TARGET); each the design row (None if none qualifies)."""
    q0 = design["target_only"]["quality"]
    return {m: {"within": T.best_row(design["modes"][m], q0), "at_speed": T.best_at_speed(design["modes"][m], T.SPEED_TARGET)}
            for m in FAMILIES if m in design["modes"]}


def random_at_speed(report: dict, speedup: float) -> float | None:
    """Quality of random routing (decided before drafting) at the same cost-model speedup: linear between the two
    ``random`` rows around ``speedup`` (its speedup grows with p)."""
    rows = sorted((r["speedup"], r["quality"]) for r in report["modes"].get("random", []) if r["speedup"])
    if not rows or speedup is None or not rows[0][0] <= speedup <= rows[-1][0]:
        return None
    return float(np.interp(speedup, [x for x, _ in rows], [q for _, q in rows]))


def _row_for(report: dict, mode: str, setting) -> dict | None:
    return next((r for r in report["modes"][mode] if r["setting"] == setting), None)


def judge(chosen: dict, report: dict) -> dict:
    """The chosen settings' rows on the report trees (same grids, so the same settings exist there)."""
    out = {m: {k: None if row is None else {"design": row, "report": _row_for(report, m, row["setting"])}
               for k, row in picks.items()} for m, picks in chosen.items()}
    for picks in out.values():
        for pick in picks.values():
            if pick is not None:
                r = pick["report"]
                q = random_at_speed(report, r["speedup"])
                pick["random_quality_at_same_speed"] = q
                pick["router_minus_random_at_same_speed"] = None if q is None else r["quality"] - q
    return out


def router_and_options(mode: str, setting, scorer) -> tuple[RewardRouter, SDVGOptions]:
    """The pipeline configuration of one row (for ``--time``)."""
    value = T.setting_value(mode, setting)
    if mode == "schedule":
        return RewardRouter(scorer), SDVGOptions(mode="schedule", schedule_every=value)
    if mode == "random":
        return RewardRouter(scorer), SDVGOptions(mode="random", random_accept_prob=value)
    if T.is_veto(mode):
        k, tau_mode, tau = value
        return RewardRouter(scorer, tau_mode=tau_mode, tau=tau), SDVGOptions(mode="schedule", schedule_every=k,
                                                                            schedule_veto=True)
    if mode == "accept_rate":
        return RewardRouter(scorer, tau_mode=mode, accept_rate=value), SDVGOptions()
    return RewardRouter(scorer, tau_mode=mode, tau=value), SDVGOptions()


def time_settings(models, picks: list[tuple[str, object]], clips, repeats: int, *, num_frames: int = NUM_FRAMES) -> dict:
    """Measured wall-clock speedup (1 worker, median of ``repeats`` summed walls over ``clips``) of each pick against
    target-only; also each run's ground-truth quality (the tree walk's, when the trees were built on this machine).
    Interleaved per clip (every config runs a clip before the next clip starts), so that a slow spell of a shared
    machine lands on all the configs alike instead of on one config's whole repeat."""
    pipe = build_pipeline(models, workers=1)
    configs = [("target_only", None)] + picks
    setups = []
    for mode, setting in configs:
        if mode == "target_only":
            setups.append((RewardRouter(models.scorer), SDVGOptions(mode="target_only")))
        else:
            setups.append(router_and_options(mode, setting, models.scorer))

    def run(i, caption, seed):
        pipe.router, options = setups[i]
        began = time.perf_counter()
        result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=num_frames, width=SIZE,
                               height=SIZE, seed=seed, options=options)
        return time.perf_counter() - began, clip_metrics(result.frames.numpy(), caption)["quality"]

    for i in range(len(configs)):  # warm-up
        run(i, *clips[0])
    walls = {i: [] for i in range(len(configs))}
    quality = {i: [] for i in range(len(configs))}
    for r in range(repeats):
        totals = [0.0] * len(configs)
        for caption, seed in clips:
            for i in range(len(configs)):
                wall, q = run(i, caption, seed)
                totals[i] += wall
                if r == 0:
                    quality[i].append(q)
        for i, total in enumerate(totals):
            walls[i].append(total)
    base = statistics.median(walls[0])
    return {"clips": len(clips), "repeats": repeats, "threads": torch.get_num_threads(), "workers": 1,
            "target_only_wall": base, "interleaved": "per clip",
            "rows": [{"mode": m, "setting": s, "wall_median": statistics.median(walls[i]), "walls": walls[i],
                      "speedup": base / statistics.median(walls[i]), "quality": float(np.mean(quality[i]))}
                     for i, (m, s) in enumerate(configs)]}


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def format_bench(out: dict) -> str:
    rep, des = out["report"], out["design"]
    lines = [f"design: {des['clips']} clips (prompts {T.DESIGN_PROMPTS[0]}-{T.DESIGN_PROMPTS[1] - 1}), target-only "
             f"{des['target_only']['quality']:.3f}; report: {rep['clips']} clips (prompts {T.REPORT_PROMPTS[0]}-"
             f"{T.REPORT_PROMPTS[1] - 1}), target-only {rep['target_only']['quality']:.3f} "
             f"[{rep['target_only']['ci'][0]:.3f}, {rep['target_only']['ci'][1]:.3f}], draft-only "
             f"{rep['draft_only']['quality']:.3f}"]
    lo, hi = rep["band"]
    lines.append(f"\nreport set: router - random at the same acceptance, averaged over the settings with acceptance "
                 f"{lo}-{hi} (95% CI over clips)")
    for m in FAMILIES:
        avg = rep["average_in_band"].get(m)
        if avg is not None and m != "random":
            lines.append(f"  {m:<24} {avg['router_minus_random']:+.4f} {T._fmt_ci(avg['ci'])} over {avg['settings']} settings")
    lo, hi = rep["bands"]["fast"]
    lines.append(f"report set: the same averaged over acceptance {lo}-{hi} (the fast band)")
    for m in FAMILIES:
        avg = rep["average_in_bands"]["fast"].get(m)
        if avg is not None and m != "random":
            lines.append(f"  {m:<24} {avg['router_minus_random']:+.4f} {T._fmt_ci(avg['ci'])} over {avg['settings']} settings")
    lines.append("\nchosen on design (>= 98% of target-only there, fastest), judged on report:")
    lines.append(f"  {'router':<24} {'setting':>24} | {'design ratio':>12} {'speedup':>7} | {'report accept':>13} "
                 f"{'ratio':>6} {'speedup':>7} {'router-random':>14} {'95% CI':>18} {'vs random at same speed':>9}")
    for label in ("within", "at_speed"):
        if label == "at_speed":
            lines.append(f"\nchosen on design (best quality at >= {T.SPEED_TARGET}x there), judged on report:")
        for m, picks in out["judged"].items():
            pick = picks[label]
            if pick is None:
                lines.append(f"  {m:<24} {'(none on design)':>24}")
                continue
            d, r = pick["design"], pick["report"]
            same = pick.get("router_minus_random_at_same_speed")
            lines.append(f"  {m:<24} {T.format_setting(d['setting']):>24} | {_pct(d['quality_ratio_to_target']):>12} "
                         f"{_x(d['speedup']):>7} | {r['acceptance']:>13.2f} {_pct(r['quality_ratio_to_target']):>6} "
                         f"{_x(r['speedup']):>7} {r['router_minus_random']:>+14.4f} {T._fmt_ci(r['router_minus_random_ci']):>18}"
                         + ("" if same is None else f" {same:>+9.4f}"))
    lines.append("\nreport set: quality/speed Pareto front over every setting of every router (cost model):")
    for p in out["report"]["pareto"]:
        lines.append(f"  {_x(p['speedup']):>6} {p['quality']:.4f} ({_pct(p['quality_ratio_to_target'])}) {p['mode']:<24} "
                     f"{T.format_setting(p['setting']):>24} accept {p['acceptance']:.2f} router-random "
                     f"{p['router_minus_random']:+.4f} {T._fmt_ci(p['router_minus_random_ci'])}")
    lines.append("\nreport set: best of each router on the report set itself (NOT a held-out figure: for reference):")
    for m in FAMILIES:
        b = rep["best"].get(m)
        lines.append(f"  {m:<24} " + ("none >= 98%" if b is None else
                     f"{T.format_setting(b['setting']):>24} {_pct(b['quality_ratio_to_target'])} at {_x(b['speedup'])}"))
    lines.append("\nreport set: the oracle (per clip the best leaf with k accepted drafts, decided before drafting):")
    lines.append("  " + ", ".join(f"k={o['accepted_per_clip']} {_pct(o['quality_ratio_to_target'])} at {_x(o['speedup'])}"
                                  for o in out["oracle"]))
    w = out["winner"]
    lines.append("\n" + w["text"])
    s = rep.get("block_seconds")
    if s:
        lines.append(f"seconds per block ({s.get('threads', '?')} thread(s)): drafter {1e3 * s['drafter']:.1f} ms, target "
                     f"{1e3 * s['target']:.1f} ms, decode {1e3 * s['decode']:.1f} ms, score {1e3 * s['score']:.1f} ms")
    timed = out.get("timing")
    if timed:
        lines.append(f"\nmeasured (pipeline, {timed['clips']} report clips, 1 worker, median of {timed['repeats']}):")
        for r in timed["rows"]:
            lines.append(f"  {r['mode']:<24} {T.format_setting(r['setting']) if r['setting'] is not None else '':>24} "
                         f"{r['speedup']:.2f}x quality {r['quality']:.4f}")
    return "\n".join(lines)


def winner(judged: dict, report: dict) -> dict:
    """The router whose design-chosen (>= 98%) setting is fastest on the report set while keeping >= 98% there; and
    the routers whose report-set band average of router - random has a CI above 0."""
    q0 = report["target_only"]["quality"]
    held = [(m, p["within"]["report"]) for m, p in judged.items() if p["within"] is not None]
    ok = [(m, r) for m, r in held if r["quality"] >= T.QUALITY_SHARE * q0]
    best = max(ok, key=lambda mr: mr[1]["speedup"] or 0.0) if ok else None
    beats = [m for m in FAMILIES if m != "random" and report["average_in_band"].get(m)
             and report["average_in_band"][m]["ci"][0] > 0]
    text = ("fastest design-chosen setting that keeps >= 98% of target-only on the report set: " +
            ("none" if best is None else f"{best[0]} {T.format_setting(best[1]['setting'])}: "
             f"{_pct(best[1]['quality_ratio_to_target'])} at {_x(best[1]['speedup'])}") +
            "\nrouters above random on the report set (band average, CI > 0): " + (", ".join(beats) or "none"))
    return {"mode": None if best is None else best[0], "setting": None if best is None else best[1]["setting"],
            "beats_random": beats, "text": text}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=str(WEIGHTS))
    ap.add_argument("--cache", default="outputs/tree_cache", help="the tree tool's cache (shared with it)")
    ap.add_argument("--out", default="outputs/routing.json")
    ap.add_argument("--no-build", action="store_true", help="use the cached trees only (say which are missing)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--frames", type=int, default=NUM_FRAMES, help="frames per clip (81: the trees of the tree tool)")
    ap.add_argument("--resamples", type=int, default=T.RESAMPLES)
    ap.add_argument("--block-seconds", default=None, help="reuse block_seconds from this JSON (a report of this tool "
                                                            "or of the tree tool) instead of measuring them")
    ap.add_argument("--time", action="store_true", help="also time the chosen settings with the pipeline (run alone)")
    ap.add_argument("--time-prompts", type=int, default=8, help="report prompts for --time (the first N)")
    ap.add_argument("--repeats", type=int, default=3, help="--time: repeats (median)")
    ap.add_argument("--ship", default=None, metavar="FILE",
                    help="also write the compact table the demo reads (sdvg_engine/toy/routing_report.json, keyed by "
                         "the weights' hash; sdvg_engine.toy.routing_report)")
    ap.add_argument("--time-picks", choices=("within", "at_speed", "both"), default="both",
                    help="--time: the settings chosen for >= 98%% quality, for >= 1.6x, or both (default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = Path(args.weights)
    models = load_toy_models(weights=weights)
    builder = T.TreeBuilder(models, num_frames=args.frames, weights_id=T.weights_hash(weights))
    cache = Path(args.cache)
    sets = {}
    for split in ("design", "report"):
        trees, missing = load_trees(builder, cache, T.split_clips(split), build=not args.no_build)
        if missing:
            print(f"{split}: {len(missing)} of {len(trees) + len(missing)} trees not in {cache} (--no-build): "
                  f"analysing {len(trees)}")
        if not trees:
            raise SystemExit(f"no {split} trees in {cache}: build them (python -m sdvg_engine.toy.tree --split {split} "
                             f"--shard 0/2 & ... --shard 1/2)")
        sets[split] = trees
    if args.block_seconds:
        try:
            seconds = json.loads(Path(args.block_seconds).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--block-seconds {args.block_seconds}: not a JSON report of this tool or of the tree tool "
                             f"({exc})") from None
        seconds = seconds.get("block_seconds") or seconds.get("report", {}).get("block_seconds")
        if not seconds or "calls" not in seconds:
            raise SystemExit(f"--block-seconds {args.block_seconds}: no block_seconds with per-call costs ('calls') in "
                             "it (reports made before the cost model counted the DiTs' context passes lack them): "
                             "leave the option out to measure them again")
    else:
        seconds = T.measure_block_seconds(models, num_frames=args.frames)
    grids = T.default_grids(sets["design"])  # the grids too come from the design trees only
    design = T.analyse(sets["design"], grids=grids, block_seconds=seconds, resamples=args.resamples)
    report = T.analyse(sets["report"], grids=grids, block_seconds=seconds, resamples=args.resamples,
                       extra_bands={"fast": FAST_BAND})
    chosen = choose(design)
    judged = judge(chosen, report)
    out = {"split": {"design": list(T.DESIGN_PROMPTS), "report": list(T.REPORT_PROMPTS),
                     "design_clips": [t.caption for t in sets["design"]], "report_clips": [t.caption for t in sets["report"]]},
           "speed_target": T.SPEED_TARGET, "quality_share": T.QUALITY_SHARE,
           "design": design, "report": report, "judged": judged, "winner": winner(judged, report),
           "oracle": oracle_rows(sets["report"], seconds)}
    if args.time:
        picks = []
        for label in (("within", "at_speed") if args.time_picks == "both" else (args.time_picks,)):
            picks += [(m, p[label]["design"]["setting"]) for m, p in judged.items() if p[label] is not None
                      and (m, p[label]["design"]["setting"]) not in picks]
        clips = T.split_clips("report")[:args.time_prompts]
        out["timing"] = time_settings(models, picks, clips, args.repeats, num_frames=args.frames)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else str(o)))
    if args.ship:
        ship = Path(args.ship)
        ship.write_text(json.dumps(routing_report.summarize(out, T.weights_hash(weights)), indent=1))
        print(f"shipped table {ship}")
    print(format_bench(out))
    print(f"report {path}")
    return out


if __name__ == "__main__":
    main()
