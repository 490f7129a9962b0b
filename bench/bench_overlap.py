"""The overlapped schedule on the toy world: every mode and the demo's taus on 1 and 2 workers, side by side.

    python bench/bench_overlap.py [--prompts 4 --repeats 3 --taus -2 -1.5 -1 0 --threads 1]

Every configuration runs on the same prompts and seeds on 1 worker (sequential) and on 2 workers (CPU threads:
the target on one, drafter + VAE + reward on the other); outputs are bit-identical, so only time differs. Prints,
per configuration, the median over repeats of the summed wall time, the speedup against target-only **on the same
workers**, and the per-worker busy seconds and the dropped speculative seconds of the 2-worker runs. Then it feeds
the measured per-component times into the cost model's schedule simulator (``bench/cost_model.py``) with the target
scaled to the real target/drafter ratio, to project what the same schedule gives when the target costs what a 14B does.
Run it alone: it times two threads on a CPU that must have two free cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.toy.demo import DEFAULT_TAUS, NUM_FRAMES, build_pipeline, prompts_for
from sdvg_engine.toy.models import load_toy_models
from sdvg_engine.toy.text import embed_caption
from sdvg_engine.toy.world import SIZE


def run_config(pipe, prompts, mode, tau, workers):
    """Summed wall seconds over the prompts, acceptance, and the 2-worker schedule figures."""
    if tau is not None:
        pipe.router.tau = tau
    wall, accepted, drafted, busy, dropped, component = 0.0, 0, 0, {}, 0.0, {}
    for caption in prompts:
        started = time.perf_counter()
        result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=NUM_FRAMES, width=SIZE, height=SIZE,
                               seed=0, options=SDVGOptions(mode=mode), workers=workers)
        wall += time.perf_counter() - started
        report = result.report
        accepted += report["acceptance"]["accepted_blocks"]
        drafted += report["acceptance"]["drafted_blocks"]
        for lane, s in report["schedule"]["worker_busy_seconds"].items():
            busy[lane] = busy.get(lane, 0.0) + s
        dropped += report["schedule"]["dropped_speculative_seconds"]
        for c in ("drafter", "target", "vae", "reward"):
            component[c] = component.get(c, 0.0) + report["seconds"][c]
        if mode == "target_only":
            calls = report["model_calls"]["target"]
            component["target_calls"] = component.get("target_calls", 0) + sum(calls.values())
        if mode == "draft_only":
            calls = report["model_calls"]["drafter"]
            component["drafter_calls"] = component.get("drafter_calls", 0) + sum(calls.values())
    return {"wall": wall, "acceptance": accepted / drafted if drafted else None, "busy": busy, "dropped": dropped,
            "component": component}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--taus", type=float, nargs="+", default=list(DEFAULT_TAUS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (1 on a 2-core machine)")
    ap.add_argument("--real-ratio", type=float, default=9.0,
                    help="target/drafter time per call at real size for the projection (cost model: ~9 at 832x480)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = load_toy_models()
    prompts = prompts_for(args.prompts)
    configs = [("target_only", None), ("draft_only", None), ("first_block_only", None)] + [("sdvg", t) for t in args.taus]
    pipes = {w: build_pipeline(models, workers=w) for w in (1, 2)}
    run_config(pipes[1], prompts[:1], "target_only", None, 1)  # warm-up
    run_config(pipes[2], prompts[:1], "sdvg", 0.0, 2)
    rows = {}
    for repeat in range(args.repeats):  # interleaved, so drifting machine load hits both layouts alike
        for mode, tau in configs:
            for w in (1, 2):
                rows.setdefault((mode, tau, w), []).append(run_config(pipes[w], prompts, mode, tau, w))
    med = {k: statistics.median(r["wall"] for r in v) for k, v in rows.items()}
    print(f"toy world, {len(prompts)} prompts x {NUM_FRAMES} frames, median of {args.repeats} repeats, "
          f"{torch.get_num_threads()} torch thread(s) per worker\n")
    print("| config | accept | 1 worker s | speedup (1w) | 2 workers s | speedup (2w) | 2w vs 1w | 2w busy target / side s | dropped s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, tau in configs:
        name = mode if tau is None else f"sdvg tau={tau:g}"
        one, two = med[(mode, tau, 1)], med[(mode, tau, 2)]
        last = rows[(mode, tau, 2)][-1]
        busy = last["busy"]
        acc = last["acceptance"]
        print(f"| {name} | {'-' if acc is None else f'{acc:.2f}'} | {one:.2f} | {med[('target_only', None, 1)] / one:.2f}x | "
              f"{two:.2f} | {med[('target_only', None, 2)] / two:.2f}x | {one / two:.2f}x | "
              f"{busy.get('lead', 0):.2f} / {busy.get('side', 0):.2f} | {last['dropped']:.2f} |")
    # Per-component times of the sequential runs, per block, for the projection.
    seq_t = rows[("target_only", None, 1)][-1]["component"]
    seq_d = rows[("draft_only", None, 1)][-1]["component"]
    blocks = len(prompts) * (NUM_FRAMES - 1) // 12 + len(prompts)
    per_block = {"target": seq_t["target"] / blocks, "drafter": seq_d["drafter"] / blocks,
                 "decode": seq_t["vae"] / blocks, "score": rows[("sdvg", args.taus[0], 1)][-1]["component"]["reward"] / max(1, blocks - len(prompts))}
    print(f"\nper block, 1 worker: target {1000 * per_block['target']:.1f} ms, drafter {1000 * per_block['drafter']:.1f} ms, "
          f"decode {1000 * per_block['decode']:.1f} ms, score {1000 * per_block['score']:.1f} ms "
          f"(target / drafter = {per_block['target'] / per_block['drafter']:.1f}x; decode + score = "
          f"{(per_block['decode'] + per_block['score']) / per_block['target']:.0%} of a target block)")
    try:
        from cost_model import ScheduleOptions, simulate_schedule
    except ImportError:  # run from another folder
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from cost_model import ScheduleOptions, simulate_schedule
    steps = 4
    times = {"draft_call": per_block["drafter"] / (steps + 1), "draft_context": per_block["drafter"] / (steps + 1),
             "target_call": per_block["target"] / (steps + 1), "target_context": per_block["target"] / (steps + 1),
             "decode": per_block["decode"], "score": per_block["score"]}
    scaled = dict(times, target_call=times["draft_call"] * args.real_ratio, target_context=times["draft_context"] * args.real_ratio)
    opts = ScheduleOptions(blocks=7, draft_steps=steps, target_steps=steps, speculate_draft=False)
    print(f"\nprojection from these per-component times (cost model's simulator, 7 blocks, 2 workers vs 2-worker target-only):")
    print("| accept | toy ratio: sequential | toy ratio: overlapped | target = {:.0f}x drafter: sequential | overlapped |".format(args.real_ratio))
    print("|---|---|---|---|---|")
    for rate in (0.0, 0.3, 0.6, 0.8, 1.0):
        cells = []
        for t in (times, scaled):
            for schedule in ("sequential", "overlapped"):
                cells.append(simulate_schedule(t, rate, schedule, opts=opts, sequences=400)["speedup"])
        print(f"| {rate:.1f} | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")


if __name__ == "__main__":
    main()
