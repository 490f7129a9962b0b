"""SDVG loop cost on small real-architecture models: loop overhead and speedup at forced acceptance rates.

Runs, side by side in one process: target-only, draft-only, and SDVG with the reward router whose
decisions are forced to a fixed acceptance pattern (0%, ~73%, 100% of the drafted blocks), so the
cost of drafting, decoding and scoring is paid exactly as in a real run. Prints a markdown table of
wall times, ratios against target-only and the loop overhead (wall time outside model/VAE/reward calls).

    python bench/bench_pipeline.py [--blocks 7 --threads 2]
"""

from __future__ import annotations

import argparse
import math

import torch
from diffusers import AutoencoderKLWan

from sdvg_engine.loaders import LoadedDiT, build_pipeline
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.vae import StreamingWanVAE

from common import ForcedRouter, accept_pattern


def model(layers, heads, seed):
    torch.manual_seed(seed)
    cfg = wan_config("tiny", num_layers=layers, num_attention_heads=heads, ffn_dim=4 * 128 * heads)
    return CausalWanTransformer3DModel(**cfg).eval().requires_grad_(False)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--latent", default="8x12")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest is reported")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    h, w = map(int, args.latent.split("x"))
    frames = 12 * args.blocks - 3
    # Sized like the real pair relative to the VAE: the target's block costs ~3x the VAE decode.
    drafter_model, target_model = model(2, 2, 1), model(8, 8, 2)
    torch.manual_seed(0)
    vae = StreamingWanVAE(AutoencoderKLWan(base_dim=8, z_dim=16).eval().requires_grad_(False))
    scorer = build_tiny_image_reward(seed=0)
    context = torch.zeros(1, 512, 4096)
    context[:, :8] = torch.randn(1, 8, 4096) * 0.2

    def run(mode, pattern=None):
        router = ForcedRouter(scorer, pattern) if pattern is not None else RewardRouter(scorer, tau=-math.inf)
        # both as Self-Forcing checkpoints (global cache, 4 calls), through the project's one builder
        pipe = build_pipeline(LoadedDiT(drafter_model), LoadedDiT(target_model), vae, router, preset="native",
                              max_frames=max(21, 3 * args.blocks))
        reports = [pipe.generate(context, prompt="a red ball", num_frames=frames, width=8 * w, height=8 * h, seed=0,
                                 options=SDVGOptions(mode=mode)).report for _ in range(args.repeats)]
        return min(reports, key=lambda r: r["seconds"]["wall"])

    run("target_only")  # warm-up
    n_draft = args.blocks - 1
    rows = [("target-only", run("target_only")), ("draft-only", run("draft_only"))]
    for label, accepted in (("0%", 0), ("73%", round(0.73 * n_draft)), ("100%", n_draft)):
        pattern = accept_pattern(accepted, n_draft)
        rows.append((f"SDVG, {accepted}/{n_draft} drafts accepted ({label})", run("sdvg", pattern)))

    base = rows[0][1]["seconds"]["wall"]
    d, t = (sum(p.numel() for p in m.parameters()) / 1e6 for m in (drafter_model, target_model))
    print(f"drafter {d:.1f}M params, target {t:.1f}M params; latent {h}x{w}; {args.blocks} blocks; {args.threads} threads; "
          f"fastest of {args.repeats} runs each")
    print("| run | wall s | vs target-only | drafter s | target s | VAE s | reward s | loop overhead |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        s = r["seconds"]
        print(f"| {label} | {s['wall']:.3f} | {base / s['wall']:.2f}x | {s['drafter']:.3f} | {s['target']:.3f} | "
              f"{s['vae']:.3f} | {s['reward']:.3f} | {100 * r['loop_overhead_fraction']:.1f}% |")


if __name__ == "__main__":
    main()
