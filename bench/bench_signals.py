"""Issue 38: which drafts are bad? Every candidate verifier signal against the trees' label, on both splits.

    python -m sdvg_engine.toy.signal_trees --split design        # trees + frames + drafter latents (resumable)
    python -m sdvg_engine.toy.signal_trees --split report
    python -m sdvg_engine.toy.signal_trees --extra 16            # training clips outside the report split
    python bench/bench_signals.py --out outputs/signals.json     # the table, the fronts, the design-chosen setting

Protocol: every orientation, learned weight, model variant and tau is chosen on the **design** split (prompts
0-47, seed 0) and the extra training clips (scenes 88-103, seed 1); the **report** split (prompts 48-87, seed 0) is
only measured. Design-split figures of learned verifiers are out of fold (4 folds of design clips).

Per signal and split: AUC for "remaking it helps", router - random at k = 1, 2, 3 rejections per clip, the lift
(router - random averaged over acceptance 0.5-0.95, 95% CI over clips) and its share of the oracle's lift, the
marginal cost on a kept draft (toy, and 832x480 with the 14B on an H200 by bench/cost_model.py), and the cost-model
speedup of every tau (toy seconds: the shipped routing table's; real size: the roofline seconds). Then per family the
setting chosen on design (fastest with >= 98% of target-only; best quality at >= 2.3x) judged on report, the report
split's Pareto fronts beside random routing and the oracle, and the anchor effect (the share of the draft -> target gap
that the target's block 0 closes) beside them. See docs/dev/routing.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from sdvg_engine.toy import signals as S  # noqa: E402
from sdvg_engine.toy import tree as T  # noqa: E402
from sdvg_engine.toy import verifier as V  # noqa: E402
from sdvg_engine.toy.baselines import rows_from_trees  # noqa: E402
from sdvg_engine.toy.baselines import table as baseline_table  # noqa: E402
from sdvg_engine.toy.clips import split_clips, weights_hash  # noqa: E402
from sdvg_engine.toy.models import WEIGHTS  # noqa: E402
from sdvg_engine.toy.routing_report import load as load_routing  # noqa: E402
from sdvg_engine.toy.signal_trees import extra_clips, load_clip  # noqa: E402

SHARE = 0.98
SPEEDS = (1.6, 2.3)
BASE_SIGNALS = ("block", *S.REWARD_SIGNALS, *S.MARGIN_SIGNALS, *S.FRAME_SIGNALS, *S.LATENT_SIGNALS,
                *S.DIAGNOSTIC_SIGNALS)
ROUTER_NAMES = {"r_min": "fixed", "m_relative_min": "relative", "m_anchor_min": "anchor", "m_baseline_min": "baseline"}


def tree_key(wid: str, caption: str, seed: int, frames: int = 81) -> dict:
    return {"weights": wid, "caption": caption, "seed": int(seed), "preset": "native", "num_frames": frames,
            "crop": "center", "preprocess": "pil", "version": T.TREE_VERSION}


def load(cache: Path, clips, wid: str):
    data, missing = [], []
    for c, s in clips:
        d = load_clip(cache, tree_key(wid, c, s))
        (data if d is not None else missing).append(d if d is not None else (c, s))
    return data, missing


def real_seconds(gpu: str = "H200", blocks: int = 7) -> dict:
    """Per-call / per-block seconds at 832x480 (1.3B drafter, 14B target, Wan VAE, ImageReward on 12 frames) by the
    roofline model of bench/cost_model.py, in the tree cost model's format: both models on the global cache (the
    toy's structure), drafter 4 and target 5 denoising calls per block; per-call seconds averaged over the blocks."""
    from cost_model import GPUS, block_times

    t = block_times(GPUS[gpu], blocks=blocks, drafter_context="global_cache", target_context="global_cache")
    mean = lambda v: float(np.mean(v))  # noqa: E731
    return {"drafter": 4 * mean(t["draft_call"]) + mean(t["draft_context"]),
            "target": 5 * mean(t["target_call"]) + mean(t["target_context"]),
            "decode": mean(t["decode"]), "score": mean(t["score"][1:]),
            "calls": {"drafter": {"steps": 4, "context": "global_cache", "per_call": mean(t["draft_call"])},
                      "target": {"steps": 5, "context": "global_cache", "per_call": mean(t["target_call"])}},
            "source": f"bench/cost_model.py roofline, {gpu}, 832x480, {blocks} blocks"}


# What a signal's own arithmetic costs per drafted block at 832x480 on the GPU (roofline, H200: ~4.8 TB/s): the frame
# statistics read the 12 decoded frames and the last kept block a few times (12 x 3 x 480 x 832 x 4 B = 58 MB, ~10
# passes: ~0.1 ms); the drafter's agreement is a few norms of 21 x 16 x 60 x 104 latents (~0 ms). Stated, not measured.
REAL_EXTRA = {"frames": 1e-4, "latents": 1e-6}


def measure_extra(fn, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def choose(rows, q0: float):
    """(fastest with >= SHARE of target-only, best quality at >= each of SPEEDS) among ``rows`` (with speedup)."""
    ok = [r for r in rows if r["quality"] >= SHARE * q0 and r.get("speedup")]
    within = max(ok, key=lambda r: (r["speedup"], r["acceptance"]), default=None)
    at = {}
    for sp in SPEEDS:
        fast = [r for r in rows if (r.get("speedup") or 0) >= sp]
        at[str(sp)] = max(fast, key=lambda r: (r["quality"], r["speedup"]), default=None)
    return {"within": within, **{f"at_{k}": v for k, v in at.items()}}


def front(rows):
    pts = [r for r in rows if r.get("speedup")]
    out = [r for r in pts if not any(o["quality"] >= r["quality"] and o["speedup"] >= r["speedup"]
                                     and (o["quality"] > r["quality"] or o["speedup"] > r["speedup"]) for o in pts)]
    uniq, seen = [], set()
    for r in sorted(out, key=lambda r: (r["speedup"], r["quality"])):
        key = (round(r["speedup"], 9), round(r["quality"], 9))
        if key not in seen:  # equal points (taus between the same two values): keep one
            seen.add(key)
            uniq.append(r)
    return uniq


def anchor_effect(trees) -> dict:
    t = baseline_table(rows_from_trees(trees), resamples=1000)
    return {k: t[k] for k in ("gap_closed", "draft_ratio", "first_block_ratio")}


def fmt_anchor(a: dict) -> str:
    g = a["gap_closed"]
    return f"anchor effect: block 0 on the target closes {100 * g['value']:.0f}% [{100 * g['ci'][0]:.0f}, {100 * g['ci'][1]:.0f}] of the draft->target gap"


def _ms(x):
    return "-" if x is None else f"{1000 * x:.2f}"


def format_md(out: dict) -> str:
    """Markdown tables of a run: the signal table per split, the design-chosen settings on report, the fronts."""
    toy, real = out["block_seconds"]["toy"], out["block_seconds"]["real"]
    tb_toy = toy["calls"]["target"]["per_call"] * (toy["calls"]["target"]["steps"] + 1) + toy["decode"]
    tb_real = real["calls"]["target"]["per_call"] * (real["calls"]["target"]["steps"] + 1) + real["decode"]
    a = out["anchor_effect"]
    lines = [f"Protocol: {out['protocol']}.", "",
             f"Design: {fmt_anchor(a['design'])}. Report: {fmt_anchor(a['report'])}.", "",
             "| signal | needs | design AUC | design gain k=1/2/3 | design lift [95% CI] | report AUC | "
             "report gain k=1/2/3 | report lift [95% CI] | report capture | report lift - fixed's, - relative's "
             "[95% CI] | cost on a kept draft: toy ms (% of a target block) | 832x480 14B ms (%) |", "|" + "---|" * 12]
    for name, e in sorted(out["signals"].items(), key=lambda kv: -kv[1]["report"]["lift"]):
        nd = e["needs"]
        needs = "+".join(k for k in ("reward", "frames", "latents", "target") if nd.get(k)) or "-"
        if nd.get("committed"):
            needs += f" (+{nd['committed']} scores)"
        cells = [name, needs]
        for split in ("design", "report"):
            r = e[split]
            g = "/".join(f"{100 * r['gain_at_k'][k]:+.1f}" for k in ("1", "2", "3"))
            cells += [f"{r['auc']:.3f}", g, f"{100 * r['lift']:+.2f} [{100 * r['lift_ci'][0]:+.2f}, {100 * r['lift_ci'][1]:+.2f}]"]
        cells.append(f"{e['report']['capture']:.2f} [{e['report']['capture_ci'][0]:.2f}, {e['report']['capture_ci'][1]:.2f}]")
        lm = e["report"]["lift_minus"]
        cells.append("; ".join(f"{100 * lm[r][0]:+.2f} [{100 * lm[r][1]:+.2f}, {100 * lm[r][2]:+.2f}]"
                               for r in ("fixed", "relative")))
        mc = e["marginal_cost"]
        cells += [f"{_ms(mc['toy'])} ({100 * mc['toy'] / tb_toy:.1f}%)", f"{_ms(mc['real'])} ({100 * mc['real'] / tb_real:.2f}%)"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Gains and lifts in points of quality x 100 (router - random at the same acceptance); capture = "
              "lift / the oracle's lift over the same acceptances "
              f"(oracle lift: design {100 * next(iter(out['signals'].values()))['design']['oracle_lift']:+.2f}, "
              f"report {100 * next(iter(out['signals'].values()))['report']['oracle_lift']:+.2f}).", "",
              "| family | pick (on design) | setting | design: % of target, speedup | report: acceptance, % of target, "
              "speedup (toy) | speedup 832x480 | report router - random |", "|" + "---|" * 7]
    for name, picks in out["chosen"].items():
        for pick, p in picks.items():
            if p is None:
                continue
            d, r = p["design"], p["report"]
            setting = d.get("tau", d.get("setting"))
            setting = f"{setting:.4g}" if isinstance(setting, float) else setting
            lines.append(f"| {name} | {pick} | {setting} | {100 * d['quality_ratio_to_target']:.1f}%, "
                         f"{d['speedup']:.2f}x | {r['acceptance']:.2f}, {100 * r['quality_ratio_to_target']:.1f}%, "
                         f"{r['speedup']:.2f}x | {r.get('speedup_real') or 0:.2f}x | {100 * r['router_minus_random']:+.2f} |")
    lines += ["", "Report-split Pareto fronts (speedup: % of target-only):", ""]
    for name, rows in out["fronts"].items():
        pts = ", ".join(f"{r['speedup']:.2f}x {100 * r['quality_ratio_to_target']:.1f}%" for r in rows
                        if r["speedup"] >= 1.0)
        lines.append(f"* {name}: {pts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path("outputs/verifier_cache"))
    ap.add_argument("--extra", type=int, default=16)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("outputs/signals.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    wid = weights_hash(WEIGHTS)
    began = time.perf_counter()
    data, feats, missing = {}, {}, {}
    for split, clips in (("design", split_clips("design")), ("report", split_clips("report")),
                         ("extra", extra_clips(args.extra))):
        data[split], missing[split] = load(args.cache, clips, wid)
        feats[split] = [S.clip_features(*d) for d in data[split]]
        print(f"{split}: {len(data[split])} clips ({len(missing[split])} missing)", flush=True)
    trees = {k: [d[0] for d in v] for k, v in data.items()}
    n = trees["design"][0].num_decisions

    # ---- signals: base, then learned (design-side: out of fold; report-side: fitted on design + extra) ----------
    sig = {split: {name: [f[name] for f in feats[split]] for name in BASE_SIGNALS} for split in ("design", "report")}
    sig["design"]["oracle_node"] = [-f["gain"] for f in feats["design"]]
    sig["report"]["oracle_node"] = [-f["gain"] for f in feats["report"]]
    learned = {}
    for fs in V.FEATURE_SETS:
        for kind in V.KINDS:
            name = f"learned_{kind}_{fs}"
            fit_fn = lambda tr, kind=kind, fs=fs: V.fit(tr, kind, V.FEATURE_SETS[fs], l2=10.0)  # noqa: E731
            sig["design"][name] = V.out_of_fold(feats["design"], feats["extra"], fit_fn)
            model = fit_fn(feats["design"] + feats["extra"])
            sig["report"][name] = [model.signal(f) for f in feats["report"]]
            learned[name] = {"needs": {"reward": fs == "all", "committed": "relative" if fs == "all" else None,
                                       "frames": True, "latents": True, "target": False},
                             "model": model.to_json()}
    # ---- the measured arithmetic of the cheap signals (toy, per drafted block) -------------------------------------
    d0 = data["report"][0]
    fr = d0[1]
    frame_seconds = measure_extra(lambda: [S.frame_features(fr.draft[b][0], fr.target[b][0]) for b in range(n)]) / n
    latent_seconds = measure_extra(lambda: [S.latent_features(d0[2]["draft_x0"][i]) for i in range(n)]) / n
    toy = load_routing()["block_seconds"]  # the shipped routing table's seconds (same weights)
    real = real_seconds()

    def needs_of(name):
        if name in learned:
            return learned[name]["needs"]
        if name == "oracle_node":
            return {"reward": False, "committed": None, "frames": False, "latents": False, "target": False}
        return S.signal_needs(name)

    def extra_of(name, scale):
        nd = needs_of(name)
        return ((frame_seconds if scale == "toy" else REAL_EXTRA["frames"]) if nd.get("frames") else 0.0) + \
            ((latent_seconds if scale == "toy" else REAL_EXTRA["latents"]) if nd.get("latents") else 0.0)

    # ---- score every signal on both splits, orientation and taus from design -------------------------------------
    q0 = {split: float(np.mean([t.leaves[0]["quality"] for t in trees[split]])) for split in ("design", "report")}
    table = {}
    for name in sig["design"]:
        pos_d = np.concatenate([f["gain"] for f in feats["design"]]) > 0
        raw_auc = S.auc(np.concatenate(sig["design"][name]), pos_d)
        sign = -1.0 if raw_auc < 0.5 and not name.startswith(("learned", "oracle")) else 1.0
        values = {split: [sign * np.asarray(v, dtype=np.float64) for v in sig[split][name]] for split in sig}
        fam_d = S.walk_family(name, trees["design"], values["design"])  # taus: quantiles of the design values
        needs = needs_of(name)
        entry = {"sign": sign, "needs": needs,
                 "marginal_cost": {"toy": S.marginal_cost(needs, toy, extra_of(name, "toy")),
                                   "real": S.marginal_cost(needs, real, extra_of(name, "real"))}}
        for split in ("design", "report"):
            fam = fam_d if split == "design" else S.walk_family(name, trees[split], values[split], taus=fam_d.taus)
            cost = S.family_cost(needs, extra_of(name, "toy"))
            res = S.score_family(fam, trees[split], seconds=toy, cost=cost, resamples=args.resamples)
            real_cost = S.family_cost(needs, extra_of(name, "real"))
            for row, leaves in zip(res["rows"], fam.leaves):
                row["speedup_real"] = S.family_speedup(leaves, n, real, real_cost)
            pos = np.concatenate([f["gain"] for f in feats[split]]) > 0
            res["auc"] = S.auc(np.concatenate(values[split]), pos)
            entry[split] = res
        table[name] = entry
        print(f"  {name:28s} AUC design {entry['design']['auc']:.3f} report {entry['report']['auc']:.3f}; lift report "
              f"{entry['report']['lift']:+.4f} [{entry['report']['lift_ci'][0]:+.4f}, {entry['report']['lift_ci'][1]:+.4f}] "
              f"capture {entry['report']['capture']:.2f}", flush=True)

    # ---- paired: each signal's report lift minus today's rules' (same resamples) ------------------------------------
    for name, entry in table.items():
        for split in ("design", "report"):
            mine = entry[split]["lift_samples"]
            entry[split]["lift_minus"] = {}
            for rule in ("r_min", "m_relative_min", "m_baseline_min"):
                d = mine - table[rule][split]["lift_samples"]
                entry[split]["lift_minus"][ROUTER_NAMES[rule]] = [float(d[0]), float(np.percentile(d[1:], 2.5)),
                                                                  float(np.percentile(d[1:], 97.5))]
    for entry in table.values():
        for split in ("design", "report"):
            entry[split].pop("lift_samples")

    # ---- the tree tool's own families (accept_rate, random, schedule) on both splits ---------------------------------
    grids = {"accept_rate": list(T.RATES), "random": list(T.RANDOM_P), "schedule": list(range(0, n + 1))}
    reports = {split: T.analyse(trees[split], grids=grids, block_seconds=toy, resamples=args.resamples)
               for split in ("design", "report")}
    reports_real = {split: T.analyse(trees[split], grids=grids, block_seconds=real, resamples=10)
                    for split in ("design", "report")}
    for split in reports:
        for m, rows in reports[split]["modes"].items():
            for r, rr in zip(rows, reports_real[split]["modes"][m]):
                r["speedup_real"] = rr["speedup"]

    # ---- choose on design, judge on report ---------------------------------------------------------------------------
    chosen = {}
    for name, entry in table.items():
        if name == "oracle_node" or name == "latent_to_target":
            continue
        picks = choose(entry["design"]["rows"], q0["design"])
        chosen[name] = {k: None if r is None else {"design": r, "report": next(x for x in entry["report"]["rows"]
                                                                                if x["tau"] == r["tau"])}
                        for k, r in picks.items()}
    for m in ("accept_rate", "random", "schedule"):
        picks = choose(reports["design"]["modes"][m], q0["design"])
        chosen[m] = {k: None if r is None else {"design": r, "report": next(x for x in reports["report"]["modes"][m]
                                                                             if x["setting"] == r["setting"])}
                     for k, r in picks.items()}
    # the one setting the design split points to: of every family's "within" pick, the fastest on design
    cands = [(name, p["within"]) for name, p in chosen.items() if p.get("within")]
    design_best = max(cands, key=lambda x: x[1]["design"]["speedup"]) if cands else None

    # ---- oracle rows (per clip the best leaf with k kept drafts, decided before drafting) ------------------------------
    oracle = {}
    for split in ("design", "report"):
        acc, best = S.oracle_curve(trees[split])
        rows = []
        k_of = np.array([bin(leaf).count("1") for leaf in range(2 ** n)])
        for k in range(n + 1):
            leaves = [int(np.flatnonzero(k_of == k)[np.argmax(t.leaf_quality()[k_of == k])]) for t in trees[split]]
            counts = T.before_drafting_counts(leaves, n)
            rows.append({"k": k, "acceptance": float(acc[k]), "quality": float(best[:, k].mean()),
                         "quality_ratio_to_target": float(best[:, k].mean() / q0[split]),
                         "speedup": T._speedup(counts, n + 1, len(leaves), toy),
                         "speedup_real": T._speedup(counts, n + 1, len(leaves), real)})
        oracle[split] = rows

    fronts = {name: front(entry["report"]["rows"]) for name, entry in table.items()}
    for m in ("accept_rate", "random", "schedule"):
        fronts[m] = front(reports["report"]["modes"][m])
    fronts["oracle"] = front(oracle["report"])

    out = {"protocol": "orientation, learned weights and taus chosen on design (48 clips, prompts 0-47, seed 0) + "
                       f"{len(data['extra'])} extra training clips (scenes 88+, seed 1); measured on report (40 clips, "
                       "prompts 48-87, seed 0); design figures of learned signals out of fold",
           "clips": {k: len(v) for k, v in data.items()}, "missing": missing,
           "target_only": q0, "block_seconds": {"toy": toy, "real": real},
           "measured_extra_seconds": {"frames": frame_seconds, "latents": latent_seconds},
           "real_extra_seconds": REAL_EXTRA,
           "anchor_effect": {split: anchor_effect(trees[split]) for split in ("design", "report")},
           "signals": table, "learned": learned, "tree_families": {s: {m: reports[s]["modes"][m] for m in grids}
                                                                   for s in reports},
           "chosen": chosen, "design_best": None if design_best is None else {"family": design_best[0], **design_best[1]},
           "oracle": oracle, "fronts": fronts, "seconds": time.perf_counter() - began}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=float))
    md = format_md(out)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(fmt_anchor(out["anchor_effect"]["report"]) + " (report split)")
    if design_best:
        d, r = design_best[1]["design"], design_best[1]["report"]
        print(f"design-chosen setting: {design_best[0]} {d.get('tau', d.get('setting'))}: design "
              f"{100 * d['quality_ratio_to_target']:.1f}% at {d['speedup']:.2f}x; report "
              f"{100 * r['quality_ratio_to_target']:.1f}% at {r['speedup']:.2f}x")
    print(f"wrote {args.out} in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
