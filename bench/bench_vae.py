"""Benchmark: streaming Wan2.1 VAE decode (block by block) vs one full `AutoencoderKLWan.decode()`.

Both paths decode the same latents in the same run, so the ratio is meaningful even on a noisy machine. Also times
`snapshot()` / `restore()` (the speculative-decoding rollback) and, for comparison, what a deep-copy snapshot of the
decode cache would cost.

    python bench/bench_vae.py                      # --tiny: small random VAE on CPU, < 60 s
    python bench/bench_vae.py --full --device cuda --dtype bfloat16 --height 60 --width 104   # 480x832, random weights
    python bench/bench_vae.py --weights /path/to/Wan2.1_VAE.pth --device cuda --dtype bfloat16 --height 60 --width 104

No weights are ever downloaded: `--tiny` / `--full` use random weights, `--weights` reads a local file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers import AutoencoderKLWan  # noqa: E402

from sdvg_engine.vae import StreamingWanVAE, load_wan21_vae_config, load_wan_vae  # noqa: E402


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def build_vae(args) -> StreamingWanVAE:
    dtype = DTYPES[args.dtype]
    if args.weights:
        return load_wan_vae(args.weights, device=args.device, dtype=dtype)
    config = load_wan21_vae_config()
    if not args.full:
        config["base_dim"] = args.base_dim
    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan.from_config(config).to(device=args.device).eval().requires_grad_(False)
    # torch's own `to`: diffusers' `ModelMixin.to(dtype=...)` logs a spurious "keep in float32: []" warning.
    torch.nn.Module.to(vae, dtype=dtype)
    return StreamingWanVAE(vae)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", default=True, help="small random VAE (default)")
    size.add_argument("--full", action="store_true", help="real Wan2.1 architecture (base_dim 96), random weights")
    size.add_argument("--weights", type=str, default=None, help="local Wan2.1 VAE file or diffusers folder")
    parser.add_argument("--base-dim", type=int, default=8, help="base_dim of the --tiny VAE (real: 96)")
    parser.add_argument("--height", type=int, default=None, help="latent height (default 8 tiny, 30 full)")
    parser.add_argument("--width", type=int, default=None, help="latent width (default 12 tiny, 52 full)")
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=3, help="latent frames per block")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each path (interleaved)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    big = args.full or args.weights
    height = args.height or (30 if big else 8)
    width = args.width or (52 if big else 12)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    stream = build_vae(args)
    vae = stream.vae
    n_params = sum(p.numel() for p in vae.parameters()) / 1e6
    frames = args.blocks * args.block_size
    g = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(args.batch, 16, frames, height, width, generator=g).to(device)

    def stream_decode():
        stream.reset()
        return [stream.decode_block(latents[:, :, i : i + args.block_size]) for i in range(0, frames, args.block_size)]

    def full_decode():
        with torch.no_grad():
            return vae.decode(stream.denormalize(latents.to(stream.dtype))).sample

    # Warm-up on two blocks: the first (no cache) and a later one (full cache) cover every per-frame shape both
    # paths use, so one-time kernel selection is not timed.
    stream.reset()
    stream.decode_block(latents[:, :, : args.block_size])
    stream.decode_block(latents[:, :, args.block_size : 2 * args.block_size])
    _sync(device)

    # Interleave the two paths and alternate which goes first, so drift in machine load hits both alike; report
    # the minimum (least disturbed) and the median.
    stream_times, full_times = [], []
    for r in range(args.repeats):
        for path in (("stream", "full") if r % 2 == 0 else ("full", "stream")):
            if path == "stream":
                blocks, t = _timed(stream_decode, device)
                stream_times.append(t)
            else:
                reference, t = _timed(full_decode, device)
                full_times.append(t)
    streamed = torch.cat(blocks, dim=2)
    max_diff = (streamed - reference.float()).abs().max().item()
    t_stream, t_full = min(stream_times), min(full_times)
    med_stream, med_full = statistics.median(stream_times), statistics.median(full_times)

    # Rollback cost: snapshot + restore as used per speculative block, and a deep copy for comparison.
    n_ops = 1000
    _, t_snap = _timed(lambda: [stream.restore(stream.snapshot()) for _ in range(n_ops)], device)
    cache = stream.snapshot().feat_cache
    _, t_deep = _timed(lambda: [t.clone() if isinstance(t, torch.Tensor) else t for t in cache], device)
    cache_mb = stream.decode_cache_bytes() / 2**20

    label = "weights " + args.weights if args.weights else ("full (random)" if args.full else f"tiny base_dim={args.base_dim}")
    print(f"\nWan2.1 VAE streaming decode: {label}, {n_params:.1f}M params, {args.device} {args.dtype}")
    print(
        f"latents [{args.batch}, 16, {frames}, {height}, {width}] -> pixels {tuple(streamed.shape)}; "
        f"{args.blocks} blocks x {args.block_size} latent frames; {args.repeats} interleaved repeats\n"
    )
    print("| measurement | min | median |")
    print("|---|---|---|")
    print(f"| full `vae.decode()` | {t_full * 1e3:.1f} ms | {med_full * 1e3:.1f} ms |")
    print(f"| streaming `decode_block` x{args.blocks} | {t_stream * 1e3:.1f} ms | {med_stream * 1e3:.1f} ms |")
    print(f"| streaming / full | {t_stream / t_full:.3f} | {med_stream / med_full:.3f} |")
    print(f"| per block (streaming) | {t_stream / args.blocks * 1e3:.1f} ms | {med_stream / args.blocks * 1e3:.1f} ms |")
    print(f"| max abs diff streaming vs full | {max_diff:.3g} | |")
    print(f"| snapshot()+restore() | {t_snap / n_ops * 1e6:.1f} us | |")
    print(f"| deep-copy snapshot (for comparison) | {t_deep * 1e3:.2f} ms | |")
    print(f"| decode cache size | {cache_mb:.1f} MiB | |")


if __name__ == "__main__":
    main()
