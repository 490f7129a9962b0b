"""VRAM plan at 832x480 / 81 frames, computed from the real architectures (meta device, no GPU needed).

Counts weights, KV caches, cross-attention caches and the VAE decode cache exactly from shapes; the
activation allowance is an estimate (largest per-block temporaries). Prints a markdown table for bf16
and fp8 targets, and which placement fits 24 / 32 / 48 / 80 GB cards.

    python bench/memory_plan.py [--width 832 --height 480]
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKLWan

from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.reward import ImageRewardConfig, ImageRewardModel

GiB = 2**30


def params(build) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def block_linear_params(cfg) -> int:
    with torch.device("meta"):
        model = CausalWanTransformer3DModel(**cfg)
    return sum(m.weight.numel() for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--height", type=int, default=480)
    args = p.parse_args()
    tokens_per_frame = (args.height // 16) * (args.width // 16)
    d_cfg, t_cfg = wan_config("Wan2.1-T2V-1.3B"), wan_config("Wan2.1-T2V-14B")
    d_params = params(lambda: CausalWanTransformer3DModel(**d_cfg))
    t_params = params(lambda: CausalWanTransformer3DModel(**t_cfg))
    t_linear = block_linear_params(t_cfg)
    vae_params = params(lambda: AutoencoderKLWan())
    ir_params = params(lambda: ImageRewardModel(ImageRewardConfig.v1()))

    def kv(cfg, frames, bytes_per=2):
        dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        return cfg["num_layers"] * 2 * frames * tokens_per_frame * dim * bytes_per

    def text_kv(cfg):
        return cfg["num_layers"] * 2 * 512 * cfg["num_attention_heads"] * cfg["attention_head_dim"] * 2

    # Wan VAE decode cache: 2 cached time steps per causal conv; measured 9.68 MB fp32 at 4x4 latents
    # (33 slots) and proportional to the latent area.
    vae_cache_fp32 = 9.68e6 / 16 * (args.height // 8) * (args.width // 8)
    # Largest per-block temporaries of the 14B target: hidden + FFN intermediate + q/k/v of one layer (bf16).
    block_tokens = 3 * tokens_per_frame
    activations = block_tokens * (5120 * 6 + 13824) * 2 * 2

    items = {
        "drafter 1.3B weights (bf16)": d_params * 2,
        "drafter KV cache (global, 21 frames)": kv(d_cfg, 21) + text_kv(d_cfg),
        "VAE weights (fp32)": vae_params * 4,
        "VAE decode cache (fp32)": vae_cache_fp32,
        "ImageReward (fp16)": ir_params * 2,
        "target KV cache (recompute window, 6 frames)": kv(t_cfg, 6) + text_kv(t_cfg),
        "activations (estimate)": activations,
    }
    target_bf16 = t_params * 2
    target_fp8 = t_linear * 1 + (t_params - t_linear) * 2
    print(f"## VRAM plan, {args.width}x{args.height}, 81 frames ({tokens_per_frame} tokens per latent frame)\n")
    print("| component | GiB |\n|---|---|")
    for k, v in items.items():
        print(f"| {k} | {v / GiB:.2f} |")
    print(f"| target 14B weights, bf16 | {target_bf16 / GiB:.2f} |")
    print(f"| target 14B weights, fp8 blocks (`--fp8-target`) | {target_fp8 / GiB:.2f} |")
    print(f"| UMT5-XXL encoder (bf16; not needed with `--context-file`) | {5.68e9 * 2 / GiB:.2f} |")
    common = sum(items.values())
    gpu0_target = items["target KV cache (recompute window, 6 frames)"] + items["activations (estimate)"]
    rest = common - gpu0_target
    print("\n| placement | bf16 target | fp8 target |\n|---|---|---|")
    print(f"| everything on one GPU | {(common + target_bf16) / GiB:.1f} | {(common + target_fp8) / GiB:.1f} |")
    print(f"| GPU 0: target + its cache; GPU 1: drafter, VAE, reward (`--drafter-device cuda:1 --aux-device cuda:1`) | "
          f"{(target_bf16 + gpu0_target) / GiB:.1f} + {rest / GiB:.1f} | {(target_fp8 + gpu0_target) / GiB:.1f} + {rest / GiB:.1f} |")


if __name__ == "__main__":
    main()
