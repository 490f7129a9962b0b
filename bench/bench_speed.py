"""Speed switches of the causal DiT, each measured before/after on the same model in one run.

* fused QKV: one matmul for q/k/v (and k/v in cross-attention) instead of three (two);
* attention backend: PyTorch SDPA as dispatched vs forced math kernel (on CUDA: flash/efficient vs math);
* ``--compile``: ``torch.compile`` of the block forward (dynamic shapes), compilation excluded (printed apart).

    python bench/bench_speed.py [--layers 4 --heads 4 --latent 16x24 --threads 2 --device cpu]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdvg_engine.context import GlobalCache
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.sampling import SeededNoise


def video(gen, context, h, w, blocks):
    gen.start(context, latent_height=h, latent_width=w, num_blocks=blocks)
    for b in range(blocks):
        gen.commit_block(b, gen.generate_block(b, SeededNoise(0)).latents)
    if gen.model.device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--latent", default="16x24")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="also measure torch.compile (compiles for a minute or more)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    h, w = map(int, args.latent.split("x"))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    base = CausalWanTransformer3DModel(**wan_config("tiny", num_layers=args.layers, num_attention_heads=args.heads,
                                                    ffn_dim=4 * 128 * args.heads)).eval().requires_grad_(False)
    base = base.to(args.device)
    fused = copy.deepcopy(base)
    fused.fuse_qkv()
    context = torch.zeros(1, 512, 4096, device=args.device)
    context[:, :8] = torch.randn(1, 8, 4096, device=args.device) * 0.2
    gens = {name: CausalGenerator(m, context=GlobalCache(21)) for name, m in (("unfused", base), ("fused", fused))}
    for g in gens.values():
        video(g, context, h, w, 1)  # warm-up

    rows = []
    t_unfused = timed(lambda: video(gens["unfused"], context, h, w, args.blocks), args.repeats)
    t_fused = timed(lambda: video(gens["fused"], context, h, w, args.blocks), args.repeats)
    rows.append(("fused QKV", t_unfused, t_fused))
    with sdpa_kernel([SDPBackend.MATH]):
        t_math = timed(lambda: video(gens["unfused"], context, h, w, args.blocks), args.repeats)
    rows.append(("SDPA dispatch vs forced math kernel", t_math, t_unfused))
    if args.compile:
        compiled = copy.deepcopy(base)
        compiled.compile_forward_block()
        gen = CausalGenerator(compiled, context=GlobalCache(21))
        t0 = time.perf_counter()
        video(gen, context, h, w, args.blocks)  # compiles every block position once
        compile_s = time.perf_counter() - t0
        rows.append((f"torch.compile (dynamic; compiling took {compile_s:.0f} s)", t_unfused,
                     timed(lambda: video(gen, context, h, w, args.blocks), args.repeats)))

    params = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"{args.layers} layers, width {128 * args.heads} ({params:.1f}M params), latent {h}x{w}, {args.blocks} blocks, "
          f"{args.device} {str(dtype).replace('torch.', '')}, {args.threads} threads, best of {args.repeats}")
    print("| change | before s | after s | speedup |\n|---|---|---|---|")
    for name, before, after in rows:
        print(f"| {name} | {before:.3f} | {after:.3f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()
