"""Real-size dry run of the whole loop (meta device, no GPU, nothing computed): bytes per category, checked against
bench/memory_plan.py.

Runs :func:`sdvg_engine.dry_run.dry_run` for every configuration (both presets, 1 and 2 workers, every mode, fp8 KV,
fp8 target, offload, replay) at 832x480x81 with the real 1.3B, 14B, Wan VAE and ImageReward architectures, and prints

1. per configuration, the bytes each category holds on the device (GiB) and in host RAM for replay;
2. per memory setting, the dry run against the plan's rows (``sdvg_engine.offload.memory_components``, the ladder
   ``--vram-gb`` walks, and the first table of ``bench/memory_plan.py`` for host RAM).

Fails (exit 1) when a recording at this size would not fit the memo's default cap or a figure leaves the plan.

    PYTHONPATH=. python bench/dry_run.py            # the whole matrix, ~2-3 min on 2 CPU cores
    PYTHONPATH=. python bench/dry_run.py --quick    # one configuration per memory setting
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sdvg_engine.dry_run import GiB, DryRunConfig, check_recording_fits, configurations, dry_run  # noqa: E402
from sdvg_engine.memo import DEFAULT_MAX_BYTES  # noqa: E402
from sdvg_engine.offload import memory_components  # noqa: E402

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
    if config.mode != "sdvg":  # only a mode whose router may reject a draft keeps a rollback snapshot
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one configuration per memory setting (and one replay)")
    args = p.parse_args()
    configs = configurations()
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
          "replayed blocks | DiT/VAE/reward calls (real) | s |")
    print("|---" * (len(cats) + 7) + "|")
    for r in results:
        calls = " / ".join(f"{r.calls.get(c, 0)} ({r.real_calls.get(c, 0)})"
                           for c in ("drafter", "target", "vae", "reward"))
        print(f"| {r.config.label} | " + " | ".join(f"{r.device.get(c, 0) / GiB:.2f}" for c in cats)
              + f" | {r.device_total / GiB:.2f} | {r.host['recording (one run)'] / GiB:.3f} | "
                f"{r.host['memo (all kept recordings)'] / GiB:.3f} | {r.report['replay']['replayed_blocks']} | "
                f"{calls} | {r.seconds:.1f} |")
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
            diff = "" if plan is None else f"{(dry - plan) / GiB:+.3f}"
            print(f"| {row} | {dry / GiB:.3f} | {'-' if plan is None else f'{plan / GiB:.3f}'} | {diff} |")
    for r in results:
        try:
            check_recording_fits(r, DEFAULT_MAX_BYTES)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        print("\nFAILED:\n" + "\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
