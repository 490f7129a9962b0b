"""Interactive tau where the VAE dominates: replay against independent runs, with the real Wan VAE architecture.

    python bench/bench_replay_vae.py [--width 96 --height 64 --frames 33 --repeats 3]

Replay stores no VAE decode cache (issue 23): a run that goes on after the replayed prefix decodes the reused latents
again to rebuild that cache, and a run replayed whole takes the recorded frames. On a CPU the full-size Wan VAE
(random weights: they time like real ones) costs far more than the tiny DiTs used here, so this is the case where that
choice costs most. Three runs per repeat, each timed with and without a memo, outputs checked equal:

* ``free``: tau moves inside the free interval (nothing flips: the whole run replayed, nothing decoded);
* ``lowest``: tau moves just above the lowest draft score: that block flips, every block before it is replayed
  (their latents re-decoded to rebuild the VAE cache) and the rest is generated;
* ``all``: tau moves to +inf: every draft flips, only block 0 is replayed (re-decoded).

The recording each move starts from keeps every draft (tau = -inf).

Prints the median over repeats of each run's seconds with and without replay and their ratio. Run it alone.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from diffusers import AutoencoderKLWan

from sdvg_engine.loaders import LoadedDiT, build_pipeline
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.pipeline import SpeculativePipeline
from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.vae import StreamingWanVAE

from common import text_context

PROMPT = "a red fox running through fresh snow"


def build(seed: int = 0) -> SpeculativePipeline:
    torch.manual_seed(seed)
    drafter = CausalWanTransformer3DModel(**wan_config("tiny", num_layers=2, num_attention_heads=2, ffn_dim=256))
    target = CausalWanTransformer3DModel(**wan_config("tiny", num_layers=4, num_attention_heads=2, ffn_dim=512))
    vae = StreamingWanVAE(AutoencoderKLWan(base_dim=96, z_dim=16).eval().requires_grad_(False))  # the real size
    dits = [LoadedDiT(m.eval().requires_grad_(False)) for m in (drafter, target)]  # global cache, 4 calls
    return build_pipeline(*dits, vae, RewardRouter(build_tiny_image_reward(seed=0), tau=0.0), preset="native")


def run(pipe, tau, args):
    pipe.router.tau = tau
    started = time.perf_counter()
    result = pipe.generate(text_context(pipe.target.model.config.text_dim), prompt=PROMPT, num_frames=args.frames,
                           width=args.width, height=args.height, seed=7, workers=1)
    return time.perf_counter() - started, result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pipe = build()
    # From a run that keeps every draft (tau=-inf), the three slider moves: inside the free interval, just above the
    # lowest draft score (that block flips; every block before it is replayed), and to +inf (only block 0 replayed).
    _, probe = run(pipe, -math.inf, args)
    scores = [b.decision.block_score for b in probe.blocks if b.decision is not None]
    taus = {"base": -math.inf, "free": min(scores) - 1e-3, "lowest": min(scores) + 1e-6, "all": math.inf}
    rows = {k: {"replay": [], "fresh": []} for k in ("free", "lowest", "all")}
    replayed = {}
    for _ in range(args.repeats):
        for name in rows:
            pipe.memo = ReplayMemo()
            run(pipe, taus["base"], args)  # the recording the slider move starts from
            seconds, with_memo = run(pipe, taus[name], args)
            rows[name]["replay"].append(seconds)
            replayed[name] = with_memo.report["replay"]["replayed_blocks"]
            pipe.memo = None
            seconds, fresh = run(pipe, taus[name], args)
            rows[name]["fresh"].append(seconds)
            assert torch.equal(with_memo.frames, fresh.frames) and torch.equal(with_memo.latents, fresh.latents), name
    print(f"## tau change with the real Wan VAE: {args.width}x{args.height}, {args.frames} frames, tiny DiTs, 1 worker, "
          f"median of {args.repeats}\n")
    print("| tau move | blocks replayed | with replay s | fresh run s | fresh / replay |")
    print("|---|---|---|---|---|")
    out = {}
    for name, r in rows.items():
        rep, fresh = statistics.median(r["replay"]), statistics.median(r["fresh"])
        out[name] = {"replayed_blocks": replayed[name], "replay_s": rep, "fresh_s": fresh, "ratio": fresh / rep}
        print(f"| {name} | {replayed[name]} of {len(probe.blocks)} | {rep:.2f} | {fresh:.2f} | {fresh / rep:.2f}x |")
    return out


if __name__ == "__main__":
    main()
