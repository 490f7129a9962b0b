"""Reward scoring throughput: one batched forward per block vs one forward per frame, and the
ImageReward-exact PIL preprocessing vs the fast torch path.

ImageReward's own ``score(prompt, list)`` loops one image at a time; SDVG scores all frames of
a drafted block in one forward. This measures both side by side on the same model and frames
(preprocessing included, prompt tokenised once) and prints a markdown table.

Second table: ``preprocess="pil"`` (default: 8-bit frames, PIL bicubic resize + centre crop,
exactly as the reference server / image-reward package) vs ``preprocess="torch"`` (antialiased
bicubic on the float frames, on the device): seconds per block for preprocessing alone and for
the whole scoring call, the max |pixel difference| (normalised CLIP units) and the max |score
difference| between the two, on smooth frames (a low-resolution random image upscaled: closer
to decoded video) and on per-pixel noise (the worst case for resampling differences).

    .venv/bin/python bench/bench_reward.py                   # moderate random config, CPU, < 60 s
    .venv/bin/python bench/bench_reward.py --real-size --device cuda --dtype float16
    .venv/bin/python bench/bench_reward.py --weights ImageReward.pt --device cuda

Random weights: throughput does not depend on the values. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdvg_engine.reward import (  # noqa: E402
    BlipTokenizer,
    ImageRewardConfig,
    ImageRewardModel,
    ImageRewardScorer,
    count_parameters,
    frames_to_uint8,
    load_image_reward,
    preprocess_frames,
    randomize_reward_head,
)

PROMPT = "a corgi running on a beach at sunset, cinematic lighting"

# A 4-layer ViT-S/16 @ 224 with a 2-layer 384-wide text encoder: same token counts as the
# real model (197 image tokens, 35 text tokens), ~1/30 of its FLOPs, so CPU runs stay short.
MODERATE = ImageRewardConfig(
    image_size=224,
    patch_size=16,
    vision_width=384,
    vision_layers=4,
    vision_heads=6,
    vision_mlp_dim=1536,
    text_width=384,
    text_layers=2,
    text_heads=6,
    text_ffn=1536,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_interleaved(fns, device, repeats: int) -> list[float]:
    """Median seconds per call of each fn; the fns alternate within every repeat so that a
    change in machine load (shared CPUs) hits all of them alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-size", action="store_true", help="ImageReward-v1.0 sizes (ViT-L/16, 446.7M params)")
    ap.add_argument("--weights", type=Path, help="load a real ImageReward.pt instead of random weights")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--frames", type=int, default=12, help="frames per block (Self-Forcing: 12)")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    if args.weights:
        scorer = load_image_reward(args.weights, device=device, dtype=dtype)
        label = f"ImageReward.pt ({args.weights.name})"
    else:
        cfg = ImageRewardConfig.v1() if args.real_size else MODERATE
        model = ImageRewardModel(cfg)
        gen = torch.Generator().manual_seed(0)
        model.init_weights(gen)
        randomize_reward_head(model, gen)  # so the batched-vs-single check compares real spreads
        model.requires_grad_(False)
        scorer = ImageRewardScorer(model.to(device=device, dtype=dtype).eval(), BlipTokenizer())
        label = "v1 (real size, random)" if args.real_size else "moderate (4-layer ViT-S/16@224, random)"
    build_s = time.perf_counter() - t0
    frames = torch.rand(
        args.frames, 3, args.height, args.width, generator=torch.Generator().manual_seed(0)
    ).to(device)
    feats = scorer.encode_prompt(PROMPT)

    def batched():
        return scorer.score_frames(frames, feats)

    def one_at_a_time():
        return [scorer.score_frames(frames[i : i + 1], feats) for i in range(frames.shape[0])]

    # Warm-up (allocator, kernels, autotuning), and a consistency check on the way.
    a = batched().scores
    b = torch.cat([o.scores for o in one_at_a_time()])
    max_diff = float((a - b).abs().max())

    t_batch, t_single = _time_interleaved([batched, one_at_a_time], device, args.repeats)
    n = args.frames
    fps_b, fps_s = n / t_batch, n / t_single

    print(f"### Reward scoring throughput: {label}")
    print()
    print(
        f"{count_parameters(scorer.model) / 1e6:.1f}M params, device {device}, {args.dtype}, "
        f"threads {torch.get_num_threads()}, {n} frames of {args.height}x{args.width} per block, "
        f"crop=center, median of {args.repeats}, build {build_s:.1f} s, "
        f"max |batched - single| = {max_diff:.2e}"
    )
    print()
    print("| mode | s / block | frames / s | speed-up |")
    print("|---|---:|---:|---:|")
    print(f"| one frame per forward (ImageReward `score(list)` style) | {t_single:.3f} | {fps_s:.1f} | 1.00x |")
    print(f"| whole block in one forward (SDVG) | {t_batch:.3f} | {fps_b:.1f} | {fps_b / fps_s:.2f}x |")
    print()
    compare_preprocessing(scorer, feats, device, args)
    return 0


def smooth_frames(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Frames closer to decoded video than noise: a 1/16-resolution random image upscaled (bicubic)
    plus mild noise, clamped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, max(2, h // 16), max(2, w // 16), generator=g)
    x = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)
    return (x + 0.02 * torch.randn(n, 3, h, w, generator=g)).clamp(0, 1)


def compare_preprocessing(scorer, feats, device, args) -> None:
    size = scorer.config.image_size
    n = args.frames
    contents = {
        "smooth": smooth_frames(n, args.height, args.width).to(device),
        "noise": torch.rand(n, 3, args.height, args.width, generator=torch.Generator().manual_seed(1)).to(device),
    }
    diffs = {}
    for name, fr in contents.items():
        a = preprocess_frames(fr, size, preprocess="pil", device=device)
        b = preprocess_frames(fr, size, preprocess="torch", device=device)
        sa = scorer.score_frames(fr, feats, preprocess="pil").scores
        sb = scorer.score_frames(fr, feats, preprocess="torch").scores
        # The torch resampler on the same 8-bit frames: what is left is the resampling difference alone.
        u8 = frames_to_uint8(fr)
        c = preprocess_frames(u8, size, preprocess="torch", device=device)
        sc = scorer.score_frames(u8, feats, preprocess="torch").scores
        diffs[name] = (float((a - b).abs().max()), float((a - b).abs().mean()), float((sa - sb).abs().max()),
                       float((a - c).abs().max()), float((sa - sc).abs().max()))
    fr = contents["smooth"]
    fns = [
        lambda: preprocess_frames(fr, size, preprocess="pil", device=device),
        lambda: preprocess_frames(fr, size, preprocess="torch", device=device),
        lambda: scorer.score_frames(fr, feats, preprocess="pil"),
        lambda: scorer.score_frames(fr, feats, preprocess="torch"),
    ]
    for fn in fns:  # warm-up
        fn()
    t_pp_pil, t_pp_torch, t_sc_pil, t_sc_torch = _time_interleaved(fns, device, args.repeats)
    print(f"### Preprocessing: PIL-exact vs torch ({n} frames of {args.height}x{args.width} -> {size}, crop=center)")
    print()
    print("| path | preprocess s / block | score_frames s / block |")
    print("|---|---:|---:|")
    print(f"| pil (ImageReward-exact, default) | {t_pp_pil:.4f} | {t_sc_pil:.4f} |")
    print(f"| torch (fast) | {t_pp_torch:.4f} | {t_sc_torch:.4f} |")
    print()
    print("pil vs torch on the float frames (what switching the option changes), and vs torch on the same 8-bit "
          "frames (the resampler alone; the rest is the reference's truncation to 8 bits, -0.5/255 on average):")
    print()
    print("| frames | max \\|pixel diff\\| (CLIP-normalised) | mean \\|pixel diff\\| | max \\|score diff\\| "
          "| resampler only: max \\|pixel diff\\| | resampler only: max \\|score diff\\| |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (mx, mean, ds, mx8, ds8) in diffs.items():
        print(f"| {name} | {mx:.4f} | {mean:.5f} | {ds:.2e} | {mx8:.4f} | {ds8:.2e} |")


if __name__ == "__main__":
    raise SystemExit(main())
