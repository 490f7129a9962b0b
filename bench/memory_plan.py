"""VRAM plan at 832x480 / 81 frames, computed from the real architectures (meta device, no GPU needed).

Counts weights, KV caches, cross-attention caches and the VAE decode cache exactly from shapes; the
activation allowance is an estimate (largest per-block temporaries). Prints a markdown table for bf16
and fp8 targets, which placement fits 24 / 32 / 48 / 80 GB cards, and the single-card plans of
``sdvg_engine.offload.plan_memory`` (24 / 16 / 12 GB) with their exact flags and the expected slowdown
of block streaming from the cost model (bytes streamed per call / PCIe bandwidth vs compute per call).

    python bench/memory_plan.py [--width 832 --height 480 --tflops 50 --pcie-gbs 24]
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


def plan_table(width: int = 832, height: int = 480, frames: int = 81) -> tuple[dict, dict]:
    """The first table's rows in bytes: ``(items, extras)``. ``items`` are the components every placement holds
    (summed by the placement table); ``extras`` the target's weights, the text encoder and host RAM for replay.
    ``bench/dry_run.py`` and ``tests/test_dry_run.py`` compare a real-size run on the meta device with these."""
    from sdvg_engine.memo import DEFAULT_MAX_BYTES, recording_bytes

    tokens_per_frame = (height // 16) * (width // 16)
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
    vae_cache_fp32 = 9.68e6 / 16 * (height // 8) * (width // 8)
    # Largest per-block temporaries of the 14B target: hidden + FFN intermediate + q/k/v of one layer (bf16).
    block_tokens = 3 * tokens_per_frame
    activations = block_tokens * (5120 * 6 + 13824) * 2 * 2
    from sdvg_engine.offload import _VAE_DECODE_TRANSIENT_FP32_PER_PIXEL

    items = {
        "drafter 1.3B weights (bf16)": d_params * 2,
        "drafter KV cache (global, 21 frames)": kv(d_cfg, 21) + text_kv(d_cfg),
        "VAE weights (fp32)": vae_params * 4,
        "VAE decode cache (fp32)": vae_cache_fp32,
        "VAE rollback snapshot (fp32; mode sdvg, until each draft's verdict)": vae_cache_fp32,
        "VAE decode temporaries (fp32; measured by bench/dry_run.py)": _VAE_DECODE_TRANSIENT_FP32_PER_PIXEL * height * width,
        "ImageReward (fp16)": ir_params * 2,
        "target KV cache (recompute window, 6 frames)": kv(t_cfg, 6) + text_kv(t_cfg),
        "target activations (estimate)": activations,
    }
    recording = recording_bytes(width, height, frames)
    extras = {
        "target 14B weights, bf16": t_params * 2,
        "target 14B weights, fp8 blocks (`--fp8-target`)": t_linear * 1 + (t_params - t_linear) * 2,
        "UMT5-XXL encoder (bf16; not needed with `--context-file`)": 5.68e9 * 2,
        f"host RAM: one replay recording, {frames} frames (interactive tau; cap `SDVG_REPLAY_GB`, "
        f"default {DEFAULT_MAX_BYTES / GiB:.0f})": recording,
        f"host RAM: replay memo, at most the cap (the newest recordings that fit: {DEFAULT_MAX_BYTES // recording} of "
        "this size; a replayed run shares its prefix with the recording it replayed)": DEFAULT_MAX_BYTES,
    }
    return items, extras


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--tflops", type=float, default=None,
                   help="achieved bf16 TFLOP/s for the cost model (default: per card, see the table)")
    p.add_argument("--pcie-gbs", type=float, default=None, help="host->GPU GB/s (default 24: PCIe 4.0 x16, pinned)")
    args = p.parse_args()
    tokens_per_frame = (args.height // 16) * (args.width // 16)
    d_cfg, t_cfg = wan_config("Wan2.1-T2V-1.3B"), wan_config("Wan2.1-T2V-14B")
    d_params = params(lambda: CausalWanTransformer3DModel(**d_cfg))
    t_params = params(lambda: CausalWanTransformer3DModel(**t_cfg))
    items, extras = plan_table(args.width, args.height, args.frames)
    target_bf16 = extras["target 14B weights, bf16"]
    target_fp8 = extras["target 14B weights, fp8 blocks (`--fp8-target`)"]
    print(f"## VRAM plan, {args.width}x{args.height}, 81 frames ({tokens_per_frame} tokens per latent frame)\n")
    print("| component | GiB |\n|---|---|")
    for k, v in {**items, **extras}.items():
        print(f"| {k} | {v / GiB:.2f} |")
    common = sum(items.values())
    gpu0_target = items["target KV cache (recompute window, 6 frames)"] + items["target activations (estimate)"]
    rest = common - gpu0_target
    print("\n| placement | bf16 target | fp8 target |\n|---|---|---|")
    print(f"| everything on one GPU | {(common + target_bf16) / GiB:.1f} | {(common + target_fp8) / GiB:.1f} |")
    print(f"| GPU 0: target + its cache; GPU 1: drafter, VAE, reward (`--drafter-device cuda:1 --aux-device cuda:1`) | "
          f"{(target_bf16 + gpu0_target) / GiB:.1f} + {rest / GiB:.1f} | {(target_fp8 + gpu0_target) / GiB:.1f} + {rest / GiB:.1f} |")
    single_card(args, d_cfg, t_cfg, t_params, d_params)


#: (card GiB, example cards, achieved bf16 TFLOP/s assumed by the cost model)
CARDS = ((24, "RTX 4090 / 3090", 50.0), (16, "RTX 4080 / 4060 Ti 16GB", 30.0), (12, "RTX 4070 / 3060 12GB", 20.0),
         (8, "RTX 4060 8GB", 12.0))


def single_card(args, d_cfg, t_cfg, t_params, d_params):
    from sdvg_engine.offload import LADDER, memory_components, plan_memory, wan_param_counts

    # the plan's arithmetic counts parameters from the configs; check it against the meta builds above
    assert wan_param_counts(t_cfg)["total"] == t_params and wan_param_counts(d_cfg)["total"] == d_params
    pcie = args.pcie_gbs or 24.0
    print(f"\n## One card: `sdvg generate --vram-gb N` ({args.width}x{args.height}, {args.frames} frames)\n")
    print("Each step of the ladder adds one saving, lossless ones first (GiB on the card; the largest transient "
          "and a 1 GiB CUDA reserve included):\n")
    steps = [memory_components(**s, width=args.width, height=args.height, frames=args.frames) for s in LADDER]
    names = list(dict.fromkeys(k for c in steps for k in c))
    print("| component | " + " | ".join(f"step {i}" for i in range(len(LADDER))) + " |")
    print("|---|" + "---|" * len(LADDER))
    from sdvg_engine.offload import MemorySettings
    flags = [MemorySettings(vram_gb=0, fits=True, total_gib=0, **s).flags for s in LADDER]
    print("| flags | " + " | ".join(f"`{f}`" for f in flags) + " |")
    generic = {}
    for c in steps:
        for k, v in c.items():
            generic.setdefault(k.split(" (")[0], []).append((k, v))
    for name in dict.fromkeys(k.split(" (")[0] for k in names):
        row = []
        for c in steps:
            hit = [(k, v) for k, v in c.items() if k.split(" (")[0] == name]
            row.append(" ".join(f"{v:.2f}" + (f" ({k.split(' (', 1)[1].rstrip(')')})" if "(" in k else "") for k, v in hit))
        print(f"| {name} | " + " | ".join(row) + " |")
    print("| **total** | " + " | ".join(f"**{sum(c.values()):.1f}**" for c in steps) + " |")

    print(f"\nPlans (cost model: per DiT call, offloaded time = max(compute, transfer) + transfer / layers, "
          f"transfer = streamed block bytes / {pcie:g} GB/s; compute = FLOPs / achieved TFLOP/s; "
          "video = DiT time of 7 blocks at 73.1% acceptance):\n")
    print("| card | fits | planned GiB | flags | pinned host RAM GiB | target call s (resident -> offloaded) | "
          "drafter call s | video DiT time vs resident | same on PCIe x8 (12 GB/s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gb, example, tflops in CARDS:
        tflops = args.tflops or tflops
        plan = plan_memory(gb, width=args.width, height=args.height, frames=args.frames, tflops=tflops, pcie_gbs=pcie)
        x8 = plan_memory(gb, width=args.width, height=args.height, frames=args.frames, tflops=tflops, pcie_gbs=12.0)
        pinned = 0.0
        for role, cfg, fp8 in (("target", t_cfg, plan.fp8_target), ("drafter", d_cfg, False)):
            if plan.offload == "both" or (plan.offload == "target" and role == "target"):
                c = wan_param_counts(cfg)
                pinned += ((c["blocks"] - c["fp32_blocks"]) * 2 + c["fp32_blocks"] * 4 - (c["block_linear"] if fp8 else 0)) / GiB
        t0, t1 = plan.slowdown["target call s (resident -> offloaded)"]
        d0, d1 = plan.slowdown["drafter call s (resident -> offloaded)"]
        print(f"| {gb} GB ({example}, {tflops:g} TFLOP/s) | {'yes' if plan.fits else '**no**'} | {plan.total_gib:.1f} | "
              f"`--vram-gb {gb}` = `{plan.flags}` | {pinned:.1f} | {t0:.2f} -> {t1:.2f} | {d0:.2f} -> {d1:.2f} | "
              f"{plan.slowdown['video DiT time']:.3f}x | {x8.slowdown['video DiT time']:.3f}x |")


if __name__ == "__main__":
    main()
