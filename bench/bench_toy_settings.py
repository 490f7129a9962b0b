"""Toy world: decisions and quality under the two presets, and the realised acceptance of the adaptive threshold.

    python bench/bench_toy_settings.py [--prompts 8 --tau -1]

* ``native`` vs ``reference`` preset (same prompts, seeds and tau): ground-truth quality of target-only and SDVG,
  acceptance, and how many block decisions agree. The toy models were trained on a global cache with 4 calls, so
  ``reference`` runs them off their training setup; the comparison shows how much the configuration matters.
* ``tau_mode="accept_rate"`` at r = 0.5 / 0.73 / 0.9: realised acceptance of drafted blocks with a fresh threshold
  state per video, and with one state carried across the videos (as the reference server's shared pool does).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.router import RewardRouter
from sdvg_engine.toy.demo import NUM_FRAMES, build_pipeline, prompts_for
from sdvg_engine.toy.models import load_toy_models
from sdvg_engine.toy.text import embed_caption
from sdvg_engine.toy.world import SIZE, clip_metrics


def run(pipe, caption, mode="sdvg", tau_state=None):
    result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=NUM_FRAMES, width=SIZE, height=SIZE,
                           seed=0, options=SDVGOptions(mode=mode), tau_state=tau_state)
    return result, clip_metrics(result.frames.numpy(), caption)["quality"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tau", type=float, default=-1.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = load_toy_models()
    prompts = prompts_for(args.prompts)

    print(f"presets, {len(prompts)} prompts, seed 0, tau {args.tau:g}:\n")
    print("| preset | target-only quality | SDVG quality | acceptance | decisions equal to native |")
    print("|---|---|---|---|---|")
    decisions = {}
    for preset in ("native", "reference"):
        pipe = build_pipeline(models, tau=args.tau, preset=preset)
        target_q, sdvg_q, acc, dec = [], [], [], []
        for caption in prompts:
            target_q.append(run(pipe, caption, "target_only")[1])
            result, q = run(pipe, caption)
            sdvg_q.append(q)
            acc.append(result.report["acceptance"]["rate_of_drafted"])
            dec.append(result.report["decisions"])
        decisions[preset] = dec
        same = sum(a == b for x, y in zip(decisions["native"], dec) for a, b in zip(x, y))
        total = sum(len(x) for x in dec)
        print(f"| {preset} | {np.mean(target_q):.3f} | {np.mean(sdvg_q):.3f} | {np.mean(acc):.2f} | {same}/{total} |")

    print("\nadaptive threshold (tau_mode=accept_rate), native preset, acceptance of drafted blocks:\n")
    print("| r | fresh state per video | one state across videos | last threshold |")
    print("|---|---|---|---|")
    pipe = build_pipeline(models, preset="native")
    for rate in (0.5, 0.73, 0.9):
        pipe.router = RewardRouter(models.scorer, tau_mode="accept_rate", accept_rate=rate)
        fresh, carried = [], []
        state = pipe.router.new_tau_state()
        for caption in prompts:
            r1, _ = run(pipe, caption)
            fresh += [b.accept for b in (x.decision for x in r1.blocks) if b is not None]
            r2, _ = run(pipe, caption, tau_state=state)
            carried += [b.accept for b in (x.decision for x in r2.blocks) if b is not None]
        print(f"| {rate} | {np.mean(fresh):.2f} ({len(fresh)} drafts) | {np.mean(carried):.2f} | "
              f"{pipe.router.block_tau(state):+.3f} |")


if __name__ == "__main__":
    main()
