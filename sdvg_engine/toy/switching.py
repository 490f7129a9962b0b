"""Switching clips on the toy world: prompt schedules whose caption changes one attribute at a block boundary, their
quality metric and cost-model speed, and the study of routing across a switch (issue 39; docs/dev/prompt_schedule.md).

    python -m sdvg_engine.toy.switching --split design --clips 14 --out outputs/switching/design.json
    python -m sdvg_engine.toy.switching --split report --clips 14 --seconds outputs/switching/design.json \
        --out outputs/switching/report.json
    python -m sdvg_engine.toy.switching --analyse outputs/switching/design.json outputs/switching/report.json \
        --ship sdvg_engine/toy/switching_report.json

* :func:`switch_clips`: a split's switching clips, pairs of its own captions (:data:`clips.SPLITS`) that differ in
  one attribute (motion, colour or shape, in turn), the switch at the middle block (block 3 of 7 at 81 frames, video
  frame 33). Both captions of a pair come from the same split, so the design and report clips share no caption.
* :func:`schedule_metrics`: the ground-truth quality of a scheduled clip, each segment's frames against its own
  caption (:func:`world.clip_metrics`), weighted by their frames.
* :func:`run_counts` / :func:`cost_seconds`: a run's cost in the toy's cost model (one worker): the DiTs' calls by
  kind from the pipeline's counters (denoising, commit passes, the re-cache of the committed blocks under the new
  prompt at a switch, text encodes), the decodes and the scores, at seconds measured once (:func:`measure_seconds`).

Imports ``clips``, ``world``, ``text`` (and the shipped routing table for the study's design taus); ``demo`` imports it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..pipeline import SDVGOptions, video_frames_to_latent_frames
from ..prompt_schedule import block_start_frame
from ..router import RewardRouter
from .clips import NUM_FRAMES, SPLITS, measure_block_seconds, prompts_for
from .text import embed_caption
from .world import SIZE, Scene, clip_metrics

SWITCH_ATTRIBUTES = ("motion", "colour", "shape")  # what a switching clip changes, in turn
ROUTER_MODES = ("fixed", "relative", "anchor", "baseline", "accept_rate")
REFERENCE_MODES = ("relative", "anchor", "baseline")
RANDOM_P = (0.5, 0.8)  # random routing's grid (p = 0 is target-only, p = 1 the first-block-only run)
SWITCHING_FILE = Path(__file__).resolve().parent / "switching_report.json"
RESAMPLES, BOOTSTRAP_SEED = 2000, 0
ONE_PROMPT = "target_only, first caption alone"  # target-only without the switch: what the re-cache costs


# ---- the clips ---------------------------------------------------------------------------------------------------
def num_blocks(num_frames: int = NUM_FRAMES, frames_per_block: int = 3) -> int:
    return video_frames_to_latent_frames(num_frames, frames_per_block) // frames_per_block


def switch_block(num_frames: int = NUM_FRAMES) -> int:
    """The block where a switching clip's second caption starts: the middle one (3 of 7 at 81 frames: frame 33)."""
    return num_blocks(num_frames) // 2


@dataclass(frozen=True)
class SwitchClip:
    """Caption ``before`` from block 0, ``after`` from :func:`switch_block`; they differ in ``attribute`` only."""

    before: str
    after: str
    attribute: str
    seed: int = 0

    def segments(self, num_frames: int = NUM_FRAMES) -> list[tuple[int, str]]:
        return [(0, self.before), (switch_block(num_frames), self.after)]

    def schedule(self, num_frames: int = NUM_FRAMES) -> list[tuple[int, torch.Tensor, str]]:
        """The pipeline's ``prompt_schedule``: each caption's toy text embedding and reward prompt."""
        return [(b, embed_caption(c), c) for b, c in self.segments(num_frames)]

    @property
    def name(self) -> str:
        return f"{self.before} -> {self.after}"


def _differs_in(a: Scene, b: Scene) -> list[str]:
    return [f for f in ("colour", "shape", "motion", "background") if getattr(a, f) != getattr(b, f)]


def switch_clips(split: str, n: int | None = None, seed: int = 0) -> list[SwitchClip]:
    """The switching clips of a split (:data:`clips.SPLITS`), deterministic: its captions in order; the k-th clip
    changes the attribute of :data:`SWITCH_ATTRIBUTES` made least so far that has a partner, its partner the first
    caption after it (cyclically, in the split's order) that differs in that attribute only, each unordered pair once.
    ``n``: the first ``n`` of them."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    lo, hi = SPLITS[split]
    captions = prompts_for(hi)[lo:hi]
    scenes = [Scene.parse(c) for c in captions]
    used, out = set(), []
    for i, a in enumerate(scenes):
        made = [c.attribute for c in out]  # the attribute made least so far first (ties: SWITCH_ATTRIBUTES' order)
        for attribute in sorted(SWITCH_ATTRIBUTES, key=lambda x: (made.count(x), SWITCH_ATTRIBUTES.index(x))):
            order = [(i + d) % len(scenes) for d in range(1, len(scenes))]
            j = next((j for j in order if _differs_in(a, scenes[j]) == [attribute]
                      and frozenset((i, j)) not in used), None)
            if j is not None:
                used.add(frozenset((i, j)))
                out.append(SwitchClip(captions[i], captions[j], attribute, seed))
                break
    if n is not None:
        if n > len(out):
            raise ValueError(f"the {split} split has {len(out)} switching clips; asked for {n}")
        out = out[:n]
    return out


# ---- quality ---------------------------------------------------------------------------------------------------
def segment_frames(segments, num_frames: int = NUM_FRAMES, frames_per_block: int = 3) -> list[tuple[int, int, str]]:
    """``[(first frame, end frame, caption), ...]`` of ``segments`` ``[(first_block, caption), ...]``."""
    starts = [block_start_frame(b, frames_per_block) for b, _ in segments] + [num_frames]
    return [(starts[i], starts[i + 1], c) for i, (_, c) in enumerate(segments)]


def schedule_metrics(frames, segments, num_frames: int | None = None) -> dict:
    """Ground-truth quality of a scheduled clip ``frames`` ``[T, SIZE, SIZE, 3]``: each segment's frames scored against
    its own caption (:func:`world.clip_metrics`: adherence per frame, motion within the segment), the clip's
    ``quality`` their mean weighted by frames. ``segments``: ``[(first_block, caption), ...]``."""
    frames = np.asarray(frames)
    T = frames.shape[0] if num_frames is None else num_frames
    parts = []
    for start, end, caption in segment_frames(segments, T):
        m = clip_metrics(frames[start:end], caption)
        parts.append({"caption": caption, "frames": [start, end], "quality": m["quality"],
                      "adherence": m["adherence"], "temporal": m["temporal"]})
    quality = sum(p["quality"] * (p["frames"][1] - p["frames"][0]) for p in parts) / T
    return {"quality": float(quality), "segments": parts}


def run_switch_clip(pipe, clip: SwitchClip, options: SDVGOptions, num_frames: int = NUM_FRAMES):
    """One switching clip on ``pipe``: its result and :func:`schedule_metrics`."""
    result = pipe.generate(prompt_schedule=clip.schedule(num_frames), num_frames=num_frames, width=SIZE, height=SIZE,
                           seed=clip.seed, options=options)
    return result, schedule_metrics(result.frames.numpy(), clip.segments(num_frames), num_frames)


# ---- speed: the cost model -------------------------------------------------------------------------------------
def run_counts(result, router: RewardRouter, options: SDVGOptions, segments) -> dict:
    """What a run cost, in the cost model's units: each DiT's calls by kind (the pipeline's counters: ``denoise``,
    ``commit`` (with the global cache: one t=0 pass per committed block, the re-cache at a switch included),
    ``text``), the VAE decodes (every block once, a rejected draft once more) and the reward's block scores (each
    drafted block, and each committed target block a reference mode reads: :meth:`RewardRouter.needs_committed_score`
    counted from the segment's start under ``switch_routing="reset"``)."""
    n = len(result.blocks)
    firsts = [b for b, _ in segments]
    scores_drafts = options.mode in ("sdvg", "cascade") or (options.mode == "schedule" and options.schedule_veto)
    drafted = [r.drafted for r in result.blocks]
    decodes = n + sum(1 for r in result.blocks if r.drafted and r.source == "target")
    scored = sum(drafted) if scores_drafts else 0
    if scores_drafts and router.uses_reference:
        for r in result.blocks:
            first = max(f for f in firsts if f <= r.index)
            index = r.index - first if options.switch_routing == "reset" else r.index
            if r.source == "target" and r.index + 1 < n and router.needs_committed_score(index):
                scored += 1
    return {"drafter": dict(result.report["model_calls"]["drafter"]),
            "target": dict(result.report["model_calls"]["target"]), "decode": decodes, "score": scored}


def cost_seconds(counts: dict, seconds: dict) -> float:
    """Cost-model seconds of a run (one worker): every DiT call but a text encode at the model's seconds per call
    (``seconds["calls"][model]["per_call"]``, :func:`clips.call_costs`: a t=0 pass has the shape of a denoising call),
    text encodes at ``seconds["text"][model]``, decodes and scores at their seconds per block."""
    total = 0.0
    for model in ("drafter", "target"):
        calls = counts[model]
        total += sum(v for k, v in calls.items() if k != "text") * seconds["calls"][model]["per_call"]
        total += calls.get("text", 0) * seconds["text"][model]
    return total + counts["decode"] * seconds["decode"] + counts["score"] * seconds["score"]


def measure_seconds(models, num_frames: int = NUM_FRAMES, repeats: int = 2) -> dict:
    """The cost model's seconds. Per DiT call, decode and score: the shipped routing table's
    (:mod:`routing_report`, measured on a quiet machine, one thread) when it was made with these weights, else
    :func:`clips.measure_block_seconds` here. Per text encode (what a switch adds besides its commit passes): measured
    here as a share of the model's own call (the fastest of 5 encodes against this machine's seconds per call), times
    that seconds per call, so that a busy machine does not skew it against the rest."""
    from .clips import weights_hash
    from .models import WEIGHTS
    from .routing_report import shipped

    here = measure_block_seconds(models, num_frames=num_frames, repeats=repeats)
    table = shipped(weights_hash(WEIGHTS))
    if table and table.get("block_seconds", {}).get("calls"):
        out = dict(table["block_seconds"], source="routing_report.json (the shipped routing table's run)")
    else:
        out = dict(here, source="measured here")
    embeds = embed_caption("a red ball moving right on black")
    out["text"], out["text_share_of_call"] = {}, {}
    for name, model in (("drafter", models.drafter), ("target", models.target)):
        times = []
        for _ in range(6):
            t = time.perf_counter()
            model.encode_text(embeds)
            times.append(time.perf_counter() - t)
        share = min(times[1:]) / here["calls"][name]["per_call"]
        out["text_share_of_call"][name] = share
        out["text"][name] = share * out["calls"][name]["per_call"]
    return out


# ---- the study ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One configuration of the study: a mode, its router (``tau_mode`` and its setting), and the two switch
    options."""

    name: str
    mode: str
    tau_mode: str | None = None
    value: float | None = None
    target_after_switch: bool = True
    switch_routing: str = "reset"
    schedule: bool = True  # False: the first caption alone (target-only, to measure what a switch costs)
    clips: int | None = None  # run on the first ``clips`` clips only (None: all)

    def setup(self, scorer) -> tuple[RewardRouter, SDVGOptions]:
        opts = dict(target_after_switch=self.target_after_switch, switch_routing=self.switch_routing)
        if self.mode == "random":
            return RewardRouter(scorer), SDVGOptions(mode="random", random_accept_prob=self.value, **opts)
        if self.mode != "sdvg":
            return RewardRouter(scorer), SDVGOptions(mode=self.mode, **opts)
        if self.tau_mode == "accept_rate":
            return RewardRouter(scorer, tau_mode="accept_rate", accept_rate=self.value), SDVGOptions(**opts)
        return RewardRouter(scorer, tau_mode=self.tau_mode, tau=self.value), SDVGOptions(**opts)


def switch_tag(target_after_switch: bool, switch_routing: str) -> str:
    return f"{'on' if target_after_switch else 'off'}/{switch_routing}"


def design_settings() -> dict:
    """Each router's setting chosen on the design trees for one-prompt clips (best quality at >= 1.6x; the shipped
    routing table, :func:`routing_report.design_choices`)."""
    from .routing_report import design_choices

    choice = design_choices("at_speed")
    return {m: float(choice[m]) for m in ROUTER_MODES}


def study_configs(settings: dict | None = None) -> list[Config]:
    """target-only (with the schedule, and the first caption alone), first-block-only and random routing (p in
    :data:`RANDOM_P`) with ``target_after_switch`` on and off, and every router of :data:`ROUTER_MODES` at its
    ``settings`` value with each allowed (``target_after_switch``, ``switch_routing``): ``fixed`` reads no reference
    nor pool (reset = carry: run once), a reference mode refuses reset without the target after the switch."""
    settings = design_settings() if settings is None else settings
    out = [Config("target_only", "target_only"), Config(ONE_PROMPT, "target_only", schedule=False, clips=3)]
    for on in (True, False):
        tag = "on" if on else "off"
        out.append(Config(f"first_block_only {tag}", "first_block_only", target_after_switch=on))
        out += [Config(f"random p={p:g} {tag}", "random", value=p, target_after_switch=on) for p in RANDOM_P]
    for mode in ROUTER_MODES:
        for on in (True, False):
            for routing in ("reset", "carry"):
                if mode == "fixed" and routing == "carry":
                    continue
                if mode in REFERENCE_MODES and routing == "reset" and not on:
                    continue
                out.append(Config(f"{mode} {switch_tag(on, routing)}", "sdvg", mode, settings[mode], on, routing))
    return out


def run_study(models, clips_: list[SwitchClip], configs: list[Config], *, num_frames: int = NUM_FRAMES,
              seconds: dict | None = None, log=print) -> dict:
    """Every config on every clip (interleaved per clip, one worker): per run its quality (:func:`schedule_metrics`),
    decisions, counts (:func:`run_counts`) and wall seconds."""
    from .clips import build_pipeline

    pipe = build_pipeline(models, workers=1)
    setups = [c.setup(models.scorer) for c in configs]
    seconds = measure_seconds(models, num_frames) if seconds is None else seconds
    runs = []
    began = time.perf_counter()
    for ci, clip in enumerate(clips_):
        for config, (router, options) in zip(configs, setups):
            if config.clips is not None and ci >= config.clips:
                continue
            pipe.router = router
            if config.schedule:
                result, metrics = run_switch_clip(pipe, clip, options, num_frames)
                segments = clip.segments(num_frames)
            else:
                result = pipe.generate(embed_caption(clip.before), prompt=clip.before, num_frames=num_frames,
                                       width=SIZE, height=SIZE, seed=clip.seed, options=options)
                segments = [(0, clip.before)]
                metrics = schedule_metrics(result.frames.numpy(), segments, num_frames)
            counts = run_counts(result, router, options, segments)
            runs.append({"clip": ci, "config": config.name, "quality": metrics["quality"],
                         "segments": [s["quality"] for s in metrics["segments"]],
                         "decisions": result.report["decisions"],
                         "accepted": result.report["acceptance"]["accepted_blocks"],
                         "drafted": result.report["acceptance"]["drafted_blocks"], "counts": counts,
                         "cost": cost_seconds(counts, seconds), "wall": result.report["seconds"]["wall"],
                         "text_seconds": {m: result.report["model_call_seconds"][m].get("text", 0.0)
                                          for m in ("drafter", "target")}})
        log(f"  clip {ci + 1}/{len(clips_)} {clip.name!r}: {time.perf_counter() - began:.0f}s")
    return {"num_frames": num_frames, "switch_block": switch_block(num_frames), "threads": torch.get_num_threads(),
            "clips": [asdict(c) for c in clips_], "configs": [asdict(c) for c in configs], "seconds": seconds,
            "runs": runs, "study_seconds": time.perf_counter() - began}


# ---- analysis ----------------------------------------------------------------------------------------------------
def _bootstrap(num_clips: int, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num_clips, size=(resamples, num_clips))
    weights = np.zeros((resamples, num_clips))
    np.add.at(weights, (np.arange(resamples)[:, None], idx), 1.0)
    return weights


def _ci(values) -> list[float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return [float(lo), float(hi)]


def _interp(x: float, xs, ys) -> np.ndarray:
    """Piecewise-linear in ``x`` through the points ``(xs[i], ys[i])`` (``ys[i]``: per-clip arrays), xs increasing."""
    xs = list(xs)
    if x <= xs[0]:
        return np.asarray(ys[0], dtype=np.float64)
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            w = 0.0 if xs[i] == xs[i - 1] else min(1.0, (x - xs[i - 1]) / (xs[i] - xs[i - 1]))
            return (1 - w) * np.asarray(ys[i - 1], dtype=np.float64) + w * np.asarray(ys[i], dtype=np.float64)
    raise AssertionError


def analyse(study: dict, resamples: int = RESAMPLES) -> dict:
    """Per config (means over the clips, 95% bootstrap CIs over clips): acceptance (accepted / decided blocks),
    quality and its share of target-only on the same schedule, the share after the switch (the second segment's
    quality), cost-model and measured speedup against target-only on the same schedule, and two comparisons with
    random routing (its runs, linearly interpolated between its grid points, per clip):

    * ``minus_random``: router - random at the same acceptance with the same ``target_after_switch`` (between
      target-only at 0, p in :data:`RANDOM_P` and first-block-only at 1);
    * ``minus_random_at_speed``: share of target-only minus random routing's at the same cost-model speedup, on the
      upper envelope of both random families (with and without the target after the switch): the quality-speed
      trade-off in one number, which compares settings that differ in speed.

    ``decision``: the defaults (``target_after_switch``, ``switch_routing``) an engine can ship for every router,
    ranked by ``minus_random_at_speed`` averaged over the five routers (docs/dev/prompt_schedule.md)."""
    names = [c["name"] for c in study["configs"] if c["name"] != ONE_PROMPT]
    N = len(study["clips"])
    by = {name: sorted((r for r in study["runs"] if r["config"] == name), key=lambda r: r["clip"]) for name in names}
    Q = {k: np.array([r["quality"] for r in v]) for k, v in by.items()}
    S2 = {k: np.array([r["segments"][-1] for r in v]) for k, v in by.items()}
    C = {k: np.array([r["cost"] for r in v]) for k, v in by.items()}
    Wl = {k: np.array([r["wall"] for r in v]) for k, v in by.items()}
    W = _bootstrap(N, resamples)
    t = "target_only"

    def share(x, base):  # ratio of means, and its bootstrap CI
        return float(x.sum() / base.sum()), _ci((W @ x) / (W @ base))

    def acceptance(name):
        runs = by[name]
        decided = sum(r["drafted"] for r in runs)
        return sum(r["accepted"] for r in runs) / decided if decided else 0.0

    rows = {}
    for name in names:
        q, q_ci = share(Q[name], Q[t])
        s2, s2_ci = share(S2[name], S2[t])
        rows[name] = {"name": name, "acceptance": acceptance(name), "quality": float(Q[name].mean()),
                      "segment_quality": [float(np.mean([r["segments"][i] for r in by[name]]))
                                          for i in range(len(by[name][0]["segments"]))],
                      "quality_ratio": q, "quality_ratio_ci": q_ci, "after_switch_ratio": s2,
                      "after_switch_ratio_ci": s2_ci, "speedup": float(C[t].sum() / C[name].sum()),
                      "measured_speedup": float(Wl[t].sum() / Wl[name].sum())}
    # random routing: per target_after_switch, its curve in acceptance (per clip) and in speed (shares)
    curves, envelope = {}, []
    for tag in ("on", "off"):
        pts = [(0.0, Q[t], C[t].sum())] + [(acceptance(f"random p={p:g} {tag}"), Q[f"random p={p:g} {tag}"],
                                            C[f"random p={p:g} {tag}"].sum()) for p in RANDOM_P]
        pts.append((1.0, Q[f"first_block_only {tag}"], C[f"first_block_only {tag}"].sum()))
        pts.sort(key=lambda p: p[0])
        curves[tag] = pts
        envelope += [(C[t].sum() / c, q) for _, q, c in pts]
    envelope.sort(key=lambda p: p[0])
    front = []  # the upper envelope in speed: each point better than every faster one
    for s, q in sorted(envelope, key=lambda p: -p[0]):
        if not front or (W @ q).mean() > (W @ front[-1][1]).mean():
            front.append((s, q))
    front.reverse()
    base_b = W @ Q[t]
    for name in names:
        row = rows[name]
        cfg = next(c for c in study["configs"] if c["name"] == name)
        if cfg["mode"] not in ("sdvg", "random", "first_block_only"):
            continue
        tag = "on" if cfg["target_after_switch"] else "off"
        xs, ys = [p[0] for p in curves[tag]], [p[1] for p in curves[tag]]
        rnd = _interp(row["acceptance"], xs, ys)
        diff = Q[name] - rnd
        row["random_quality"] = float(rnd.mean())
        row["minus_random"], row["minus_random_ci"] = float(diff.mean()), _ci((W @ diff) / N)
        at = _interp(row["speedup"], [p[0] for p in front], [p[1] for p in front])
        margin_b = (W @ Q[name] - W @ at) / base_b
        row["random_at_speed_ratio"] = float(at.sum() / Q[t].sum())
        row["minus_random_at_speed"] = float((Q[name].sum() - at.sum()) / Q[t].sum())
        row["minus_random_at_speed_ci"] = _ci(margin_b)
    # the defaults: each pair an engine can ship for every router (reset without the target after a switch is refused
    # for the reference modes), averaged over the routers
    pairs = {}
    for on, routing in ((True, "reset"), (True, "carry"), (False, "carry")):
        members = []
        for mode in ROUTER_MODES:
            r = "reset" if mode == "fixed" else routing
            members.append(f"{mode} {switch_tag(on, r)}")
        pairs[switch_tag(on, routing)] = {
            "members": members,
            "minus_random_at_speed": float(np.mean([rows[m]["minus_random_at_speed"] for m in members])),
            "minus_random": float(np.mean([rows[m]["minus_random"] for m in members])),
            "quality_ratio": float(np.mean([rows[m]["quality_ratio"] for m in members])),
            "after_switch_ratio": float(np.mean([rows[m]["after_switch_ratio"] for m in members])),
            "speedup": float(np.mean([rows[m]["speedup"] for m in members]))}
    # paired differences between the pairs, averaged over the routers, with CIs
    def pair_margin_b(members):
        out = np.zeros(resamples)
        for m in members:
            at = _interp(rows[m]["speedup"], [p[0] for p in front], [p[1] for p in front])
            out += (W @ Q[m] - W @ at) / base_b
        return out / len(members)

    margins = {k: pair_margin_b(v["members"]) for k, v in pairs.items()}
    best = max(pairs, key=lambda k: pairs[k]["minus_random_at_speed"])
    comparisons = {f"{best} - {k}": {"value": pairs[best]["minus_random_at_speed"] - pairs[k]["minus_random_at_speed"],
                                     "ci": _ci(margins[best] - margins[k])} for k in pairs if k != best}
    alone = sorted((r for r in study["runs"] if r["config"] == ONE_PROMPT), key=lambda r: r["clip"])
    same = [by[t][r["clip"]] for r in alone]
    recache = {"clips": len(alone), "target_calls_schedule": same[0]["counts"]["target"] if same else None,
               "target_calls_one_prompt": alone[0]["counts"]["target"] if alone else None,
               "cost_share": float(sum(r["cost"] for r in same) / sum(r["cost"] for r in alone) - 1) if alone else None,
               "measured_share": (float(sum(r["wall"] for r in same) / sum(r["wall"] for r in alone) - 1)
                                  if alone else None)}
    return {"clips": N, "rows": rows, "random_front": [[s, float(q.sum() / Q[t].sum())] for s, q in front],
            "pairs": pairs, "best_pair": best, "pair_comparisons": comparisons, "recache": recache,
            "target_quality": float(Q[t].mean())}


# ---- reporting ---------------------------------------------------------------------------------------------------
def format_table(analysis: dict) -> str:
    lines = [f"{'config':<34} {'accept':>6} {'% target':>8} {'CI':>15} {'after sw.':>9} {'speed':>6} {'meas.':>6} "
             f"{'- random':>8} {'- rnd@speed':>11}"]
    for r in analysis["rows"].values():
        mr = f"{r['minus_random']:+.3f}" if "minus_random" in r else "-"
        ms = f"{100 * r['minus_random_at_speed']:+.1f}" if "minus_random_at_speed" in r else "-"
        ci = r["quality_ratio_ci"]
        lines.append(f"{r['name']:<34} {r['acceptance']:>6.2f} {100 * r['quality_ratio']:>7.1f}% "
                     f"[{100 * ci[0]:5.1f},{100 * ci[1]:5.1f}] {100 * r['after_switch_ratio']:>8.1f}% "
                     f"{r['speedup']:>5.2f}x {r['measured_speedup']:>5.2f}x {mr:>8} {ms:>11}")
    lines.append("")
    for k, p in analysis["pairs"].items():
        lines.append(f"defaults {k}: minus random at speed {100 * p['minus_random_at_speed']:+.2f} points, "
                     f"% target {100 * p['quality_ratio']:.1f}, after switch {100 * p['after_switch_ratio']:.1f}, "
                     f"speed {p['speedup']:.2f}x (mean over routers)")
    for k, c in analysis["pair_comparisons"].items():
        lines.append(f"  {k}: {100 * c['value']:+.2f} points [{100 * c['ci'][0]:+.2f}, {100 * c['ci'][1]:+.2f}]")
    rc = analysis["recache"]
    lines.append(f"re-cache at the switch, target-only: calls {rc['target_calls_schedule']} vs one prompt "
                 f"{rc['target_calls_one_prompt']}: +{100 * rc['cost_share']:.1f}% (cost model), "
                 f"+{100 * rc['measured_share']:.1f}% (measured)")
    return "\n".join(lines)


def shipped() -> dict | None:
    """The shipped summary of the study (:data:`SWITCHING_FILE`) when it was made with the weights loaded here."""
    from .clips import weights_hash
    from .models import WEIGHTS

    if not SWITCHING_FILE.exists():
        return None
    data = json.loads(SWITCHING_FILE.read_text())
    return data if data.get("weights") == weights_hash(WEIGHTS) else None


def summary(analyses: dict, seconds: dict | None = None) -> dict:
    """The compact table shipped for the demo (:data:`SWITCHING_FILE`): per split, each config's row and the pairs;
    the cost model's seconds (``seconds``, :func:`measure_seconds`) and the weights' hash."""
    from .clips import weights_hash
    from .models import WEIGHTS

    keep = ("acceptance", "segment_quality", "quality_ratio", "quality_ratio_ci", "after_switch_ratio", "speedup",
            "minus_random",
            "minus_random_ci", "minus_random_at_speed", "minus_random_at_speed_ci")
    out = {"weights": weights_hash(WEIGHTS), "seconds": seconds}
    for split, a in analyses.items():
        out[split] = {"clips": a["clips"], "target_quality": a["target_quality"], "best_pair": a["best_pair"],
                      "pairs": {k: {x: v[x] for x in v if x != "members"} for k, v in a["pairs"].items()},
                      "pair_comparisons": a["pair_comparisons"], "recache": {k: a["recache"][k] for k in
                                                                            ("cost_share", "measured_share")},
                      "rows": {n: {k: _round(r[k]) for k in keep if k in r} for n, r in a["rows"].items()}}
    return out


def _round(v):
    if isinstance(v, float):
        return round(v, 5)
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=tuple(SPLITS), help="run the study on this split's switching clips")
    ap.add_argument("--clips", type=int, default=20, help="switching clips of the split (the first N)")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N clips (to run a split in parts)")
    ap.add_argument("--frames", type=int, default=NUM_FRAMES)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", help="a study JSON whose measured cost-model seconds to reuse")
    ap.add_argument("--out", help="study JSON to write")
    ap.add_argument("--analyse", nargs="+", help="study JSON(s) to analyse (several of one split are merged)")
    ap.add_argument("--ship", help="write the compact summary of the analysed studies here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.split:
        from .models import load_toy_models

        models = load_toy_models()
        clips_ = switch_clips(args.split, args.clips + args.skip)[args.skip:]
        seconds = json.loads(Path(args.seconds).read_text())["seconds"] if args.seconds else None
        print(f"{args.split}: {len(clips_)} switching clips, {len(study_configs())} configs each")
        study = run_study(models, clips_, study_configs(), num_frames=args.frames, seconds=seconds)
        study["split"] = args.split
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(study))
        print(format_table(analyse(study)))
    if args.analyse:
        studies = {}
        for path in args.analyse:
            s = json.loads(Path(path).read_text())
            if s["split"] in studies:  # parts of one split: renumber the clips
                prev = studies[s["split"]]
                offset = len(prev["clips"])
                prev["clips"] += s["clips"]
                prev["runs"] += [dict(r, clip=r["clip"] + offset) for r in s["runs"]]
            else:
                studies[s["split"]] = s
        analyses = {split: analyse(s) for split, s in studies.items()}
        for split, a in analyses.items():
            print(f"\n== {split}: {a['clips']} clips, target-only quality {a['target_quality']:.3f}")
            print(format_table(a))
        if args.ship:
            seconds = next(iter(studies.values()))["seconds"]
            Path(args.ship).write_text(json.dumps(summary(analyses, seconds), indent=1) + "\n")


if __name__ == "__main__":
    main()
