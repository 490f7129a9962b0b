"""Real-size dry run of the whole loop (meta device, no GPU, nothing computed): bytes per category, checked against
bench/memory_plan.py.

Runs :func:`sdvg_engine.dry_run.dry_run` for every configuration (both presets, 1 and 2 workers, every mode, fp8 KV,
fp8 target, offload, replay) at 832x480x81 with the real 1.3B, 14B, Wan VAE and ImageReward architectures, and prints

1. per configuration, the bytes each category holds on the device (GiB) and in host RAM for replay;
2. per memory setting, the dry run against the plan's rows (``sdvg_engine.offload.memory_components``, the ladder
   ``--vram-gb`` walks, and the first table of ``bench/memory_plan.py`` for host RAM).

Fails (exit 1, naming each row) when a recording at this size would not fit the memo's default cap or a figure
leaves the plan (:func:`plan_problems`: the tolerance of each row). ``--plan-scale`` multiplies every plan figure
(a check of the check: ``--plan-scale 0.9`` must fail).

    PYTHONPATH=. python bench/dry_run.py            # the whole matrix, ~2-3 min on 2 CPU cores
    PYTHONPATH=. python bench/dry_run.py --quick    # one configuration per memory setting
    PYTHONPATH=. python bench/dry_run.py --config "reference sdvg w1"   # the configurations with this label
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sdvg_engine.dry_run import GiB, DryRunConfig, check_recording_fits, configurations, dry_run  # noqa: E402
from sdvg_engine.memo import DEFAULT_MAX_BYTES  # noqa: E402
from sdvg_engine.offload import memory_components  # noqa: E402
from sdvg_engine.options import SDVGOptions  # noqa: E402

#: dry-run row -> the ladder's row (prefix of a memory_components label)
PLAN_ROWS = {
    "weights: drafter": "drafter weights",
    "weights: target": "target weights",
    "weights: vae": "VAE weights",
    "weights: reward": "ImageReward",
    "KV cache: drafter": "drafter KV",
    "KV cache: target": "target KV",
    "VAE decode cache": "VAE decode cache",
    "VAE decode cache: older states kept by snapshots": "VAE rollback snapshot",
    "activations (largest per-call transient, per lane, summed)": "largest transient",
}


def plan_for(config: DryRunConfig, width: int = 832, height: int = 480, frames: int = 81) -> dict[str, float]:
    """The plan's bytes for each dry-run row of ``config`` (``memory_components`` of the same settings)."""
    comp = memory_components(offload=config.offload, kv_dtype=config.kv_dtype, vae_dtype="fp32",
                             fp8_target=config.fp8_target,
                             drafter_context="recompute_window" if config.preset == "reference" else "auto",
                             width=width, height=height, frames=frames)
    out = {}
    for row, prefix in PLAN_ROWS.items():
        hits = [v for k, v in comp.items() if k.startswith(prefix)]
        out[row] = hits[0] * GiB if hits else 0.0
    if not SDVGOptions(mode=config.mode).scores_drafts:  # only a mode whose router may reject a draft keeps a snapshot
        out["VAE decode cache: older states kept by snapshots"] = 0.0
    return out


def compare(result, width=832, height=480, frames=81) -> list[tuple[str, int, float | None]]:
    """``(row, dry-run bytes, plan bytes or None)`` for every device and host row of ``result``."""
    import memory_plan

    plan = plan_for(result.config, width, height, frames)
    _, extras = memory_plan.plan_table(width, height, frames)
    recording = next(v for k, v in extras.items() if "one replay recording" in k)
    memo = next(v for k, v in extras.items() if "replay memo" in k)
    rows = [(k, v, plan.get(k)) for k, v in result.device.items()]
    replay = result.config.replay
    rows.append(("recording (one run)", result.host["recording (one run)"], recording if replay else None))
    rows.append(("memo (all kept recordings)", result.host["memo (all kept recordings)"], memo if replay else None))
    return rows


#: how far a dry-run figure may sit from the plan before it "leaves the plan" (relative; see plan_problems)
EXACT_REL, EXACT_ABS = 1e-9, 2e6  # closed forms (weights, KV caches, the recording): bytes of the same tensors
SLOPE_REL = 1e-3  # the VAE decode cache rows: the plan's measured slope per latent pixel
TRANSIENT_REL = 1e-3  # one worker: the plan's transient is the one largest call's
TWO_LANES = 1.25  # two workers: the target's lane adds its own transient beside the VAE's, which the plan does not count


def plan_problems(result, width=832, height=480, frames=81, plan_scale: float = 1.0, rows=None) -> list[str]:
    """Every row of ``result`` whose dry-run figure leaves the plan, as ``"<configuration>: <row>: ..."`` lines.

    The rules: a streamed model's weights must stay below the plan (the plan allows 3 streamed blocks; the streamer
    holds 2); the activations must equal the plan's largest transient with one worker and lie in [plan, 1.25 x plan)
    with two (the target's lane adds its own); the VAE cache rows must equal the plan's slope (0.1%), and the rollback
    snapshot row must be 0 where the plan has none; the memo must stay within the plan; every other row (weights,
    KV caches, the recording) must equal its closed form (within 2 MB). ``rows``: :func:`compare`'s, if at hand."""
    problems = []
    streamed = {"drafter": result.config.offload == "both", "target": result.config.offload in ("target", "both")}
    for row, measured, plan in rows or compare(result, width, height, frames):
        if plan is None:
            continue
        plan *= plan_scale
        if row.startswith("weights:") and streamed.get(row.split(": ")[1]):
            ok, rule = measured <= plan, "at most the plan"
        elif row.startswith("activations"):
            high = plan * (1 + TRANSIENT_REL) if result.config.workers == 1 else plan * TWO_LANES
            ok, rule = plan * (1 - TRANSIENT_REL) <= measured < high, f"in [{plan / GiB:.3f}, {high / GiB:.3f})"
        elif row.startswith("VAE decode cache"):
            ok, rule = abs(measured - plan) <= SLOPE_REL * plan, f"within {SLOPE_REL:.1%}"
        elif row.startswith("memo"):
            ok, rule = measured <= plan, "at most the plan"
        else:
            ok, rule = abs(measured - plan) <= max(EXACT_REL * plan, EXACT_ABS), "equal (2 MB)"
        if not ok:
            problems.append(f"{result.config.label}: {row}: dry run {measured / GiB:.3f} GiB, plan {plan / GiB:.3f} GiB "
                            f"(must be {rule})")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one configuration per memory setting (and one replay)")
    p.add_argument("--config", action="append", default=[], metavar="LABEL",
                   help="only the configurations with this label (e.g. 'reference sdvg w1'; repeatable)")
    p.add_argument("--plan-scale", type=float, default=1.0,
                   help="multiply every plan figure by this (a check of the check: 0.9 must fail)")
    args = p.parse_args(argv)
    configs = configurations()
    if args.config:
        labels = {c.label for c in configs}
        unknown = [label for label in args.config if label not in labels]
        if unknown:
            p.error(f"--config {unknown[0]!r} is not a configuration; choose from {sorted(labels)}")
        configs = [c for c in configs if c.label in args.config]
    if args.quick:
        seen, picked = set(), []
        for c in configs:
            key = (c.fp8_target, c.offload, c.kv_dtype, c.replay, c.preset)
            if key not in seen:
                seen.add(key)
                picked.append(c)
        configs = picked
    results = [dry_run(c) for c in configs]
    cats = list(dict.fromkeys(k for r in results for k in r.device))
    print("## Real-size dry run, 832x480, 81 frames (meta device; GiB)\n")
    print("| configuration | " + " | ".join(cats) + " | device total | recording (host) | memo (host) | "
          "replayed blocks | calls (real forwards): drafter / target / VAE decode / VAE encode / reward | s |")
    print("|---" * (len(cats) + 7) + "|")
    for r in results:
        calls = " / ".join(f"{r.calls.get(c, 0)} ({r.real_calls.get(c, 0)})"
                           for c in ("drafter", "target", "vae decode", "vae encode", "reward"))
        print(f"| {r.config.label} | " + " | ".join(f"{r.device.get(c, 0) / GiB:.2f}" for c in cats)
              + f" | {r.device_total / GiB:.2f} | {r.host['recording (one run)'] / GiB:.3f} | "
                f"{r.host['memo (all kept recordings)'] / GiB:.3f} | {r.report['replay']['replayed_blocks']} | "
                f"{calls} | {r.seconds:.1f} |")
    print("\nA call runs the real forward on meta the first time its shapes are seen; later calls with the same shapes "
          "replay that measurement (sdvg_engine/dry_run.py).")
    failures = []
    print("\n## Against the plan (`sdvg_engine.offload.memory_components`, `bench/memory_plan.py`; GiB)\n")
    shown = set()
    for r in results:
        key = (r.config.preset, r.config.fp8_target, r.config.offload, r.config.kv_dtype, r.config.replay)
        if key in shown:
            continue
        shown.add(key)
        print(f"\n### {r.config.label}\n\n| row | dry run | plan | dry - plan |\n|---|---|---|---|")
        for row, dry, plan in compare(r):
            plan = None if plan is None else plan * args.plan_scale
            diff = "" if plan is None else f"{(dry - plan) / GiB:+.3f}"
            print(f"| {row} | {dry / GiB:.3f} | {'-' if plan is None else f'{plan / GiB:.3f}'} | {diff} |")
    for r in results:
        failures += plan_problems(r, plan_scale=args.plan_scale)
        try:
            check_recording_fits(r, DEFAULT_MAX_BYTES)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        print("\nFAILED (a figure left the plan or a recording does not fit):\n" + "\n".join(failures))
        return 1
    print("\nEvery figure is within the plan.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
