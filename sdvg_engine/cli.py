"""``sdvg``: inspect checkpoints, encode prompts, generate videos (headless, batch-friendly).

    sdvg inspect PATH
    sdvg encode-prompts --text-encoder PATH [--tokenizer DIR] --prompts-file F --out embeds.safetensors
    sdvg generate --drafter D --target T --vae V [--reward R] (--prompt P | --prompts-file F) ...
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path

import torch


def _print_err(*args):
    print(*args, file=sys.stderr, flush=True)


# ---- inspect --------------------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    from .models.loading import CheckpointError, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path, num_heads=args.num_heads)
    except CheckpointError as err:
        other = _describe_other(Path(args.path))
        if other is None:
            raise
        print(other)
        return 0
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.describe())
    return 0


def _describe_other(path: Path) -> str | None:
    """Name files that are not causal DiTs but that SDVG also reads (VAE, ImageReward)."""
    if path.is_dir() or path.suffix not in (".safetensors", ".pt", ".pth"):
        return None
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        keys = list(state) if isinstance(state, dict) else []
    if any(k.startswith("blip.") for k in keys):
        return f"file:           {path}\nkind:           ImageReward reward model ({len(keys)} tensors)"
    if any("decoder.middle.0.residual.0.gamma" in k or k.startswith("decoder.up_blocks") for k in keys):
        return f"file:           {path}\nkind:           Wan VAE ({len(keys)} tensors)"
    return None


# ---- encode-prompts ---------------------------------------------------------------------------------------
def _read_prompts(args) -> list[str]:
    prompts = []
    if getattr(args, "prompt", None):
        prompts.append(args.prompt)
    if getattr(args, "prompts_file", None):
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompts file not found: {path}")
        prompts += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return prompts


def cmd_encode_prompts(args) -> int:
    from .loaders import parse_dtype
    from .text_encoder import load_text_encoder, save_prompt_embeddings

    prompts = _read_prompts(args)
    if not prompts:
        raise SystemExit("no prompts: give --prompt or --prompts-file")
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.device, dtype=parse_dtype(args.dtype))
    contexts = []
    for i, prompt in enumerate(prompts):
        contexts.append(encoder.encode(prompt))
        _print_err(f"encoded {i + 1}/{len(prompts)}: {prompt[:70]}")
    save_prompt_embeddings(args.out, prompts, contexts)
    print(f"wrote {len(prompts)} prompt embeddings to {args.out}")
    return 0


# ---- generate -------------------------------------------------------------------------------------------------
def _contexts(args) -> list[tuple[str, torch.Tensor]]:
    from .loaders import parse_dtype
    from .text_encoder import load_prompt_embeddings, load_text_encoder

    if args.context_file:
        pairs = load_prompt_embeddings(args.context_file)
        wanted = _read_prompts(args)
        if wanted:
            by_prompt = dict(pairs)
            missing = [p for p in wanted if p not in by_prompt]
            if missing:
                raise SystemExit(f"{args.context_file} has no embeddings for: {missing[:3]}")
            pairs = [(p, by_prompt[p]) for p in wanted]
        return pairs
    prompts = _read_prompts(args)
    if not prompts:
        raise SystemExit("no prompts: give --prompt, --prompts-file or --context-file")
    if not args.text_encoder:
        raise SystemExit("prompts need a text encoder (--text-encoder, with --tokenizer for a single file) or --context-file")
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.aux_device or args.device,
                                dtype=parse_dtype(args.dtype))
    return [(p, encoder.encode(p)) for p in prompts]


def build_pipeline(args):
    from .loaders import load_generator, parse_dtype
    from .pipeline import SpeculativePipeline
    from .router import RewardRouter
    from .vae import load_wan_vae

    from .offload import resolve_memory_args

    offload, kv_dtype = resolve_memory_args(args)  # --vram-gb / --offload / --kv-dtype (docs/memory.md)
    aux = args.aux_device or args.device
    vae = load_wan_vae(args.vae, device=aux, dtype=parse_dtype(args.vae_dtype))
    drafter = load_generator(args.drafter, name="drafter", dtype=args.dtype, device=args.drafter_device or args.device,
                             context_scheme=args.drafter_context, max_frames=args.max_frames, fuse_qkv=args.fuse_qkv,
                             compile=args.compile, offload="blocks" if offload == "both" else "none", kv_dtype=kv_dtype)
    target = load_generator(args.target, name="target", dtype=args.dtype, device=args.device, fp8=args.fp8_target,
                            context_scheme=args.target_context, schedule=args.target_schedule, max_frames=args.max_frames,
                            attention_bias=args.attention_bias, fuse_qkv=args.fuse_qkv, compile=args.compile,
                            offload="none" if offload == "none" else "blocks", kv_dtype=kv_dtype)
    router = None
    if args.reward:
        from .reward import load_image_reward

        scorer = load_image_reward(args.reward, device=aux)
        router = RewardRouter(scorer, tau=args.tau, aggregation=args.aggregation, crop=args.crop, temporal_weight=args.temporal_weight)
    elif args.mode == "sdvg":
        raise SystemExit("mode 'sdvg' needs --reward (an ImageReward.pt file)")
    return SpeculativePipeline(drafter, target, vae, router)


def _progress(num_blocks: int, tau: float | None):
    started = time.perf_counter()

    def on_block(record):
        d = record.decision
        if d is None:
            verdict = "target" if record.source == "target" else "draft kept"
        elif d.frames_scored == 0:
            verdict = f"random draw -> {'accepted' if d.accept else 'rejected'}"
        else:
            verdict = f"draft score {d.block_score:+.3f} vs tau {tau:+.2f} -> {'accepted' if d.accept else 'rejected'}"
        bar = "#" * (record.index + 1) + "." * (num_blocks - record.index - 1)
        _print_err(f"[{bar}] block {record.index + 1}/{num_blocks}: {verdict} ({time.perf_counter() - started:.1f} s)")

    return on_block


def cmd_generate(args) -> int:
    from PIL import Image

    from .pipeline import CancelToken, GenerationCancelled, SDVGOptions, video_frames_to_latent_frames
    from .video_io import default_video_suffix, have_pyav, mask_strip, write_video

    options = SDVGOptions(mode=args.mode, force_first_block=args.force_first_block, random_accept_prob=args.random_p,
                          refine_from_step=args.refine_from_step, cascade=args.cascade)
    num_blocks = video_frames_to_latent_frames(args.frames) // 3
    pairs = _contexts(args)
    pipe = build_pipeline(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f".{args.format}" if args.format else default_video_suffix()
    if suffix == ".webp" and not have_pyav() and not args.format:
        _print_err("PyAV is not installed: writing animated WebP instead of MP4 (pip install av for MP4)")

    token = CancelToken()

    def on_sigint(signum, frame):
        if token.cancelled:
            raise KeyboardInterrupt
        _print_err("cancelling after the current model call (Ctrl-C again to abort)")
        token.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    reports = []
    try:
        for i, (prompt, context) in enumerate(pairs):
            _print_err(f"video {i + 1}/{len(pairs)}: {prompt[:80]}")
            try:
                result = pipe.generate(context, prompt=prompt, num_frames=args.frames, width=args.width, height=args.height,
                                       seed=args.seed + i, options=options, cancel=token,
                                       on_block=_progress(num_blocks, args.tau if args.mode == "sdvg" else None))
            except GenerationCancelled as err:
                _print_err(str(err))
                return 130
            video = write_video(result.frames, out / f"video_{i:03d}{suffix}")
            Image.fromarray(mask_strip(result.acceptance_mask)).save(out / f"mask_{i:03d}.png")
            result.report["video"] = str(video)
            reports.append(result.report)
            speed = result.report["speedup_vs_target"]
            _print_err(f"  -> {video}  acceptance {result.report['acceptance']['rate_after_first_block']}  "
                       f"speedup vs target {speed:.2f}x" if speed else f"  -> {video}")
    finally:
        signal.signal(signal.SIGINT, previous)
    report_path = Path(args.report) if args.report else out / "report.json"
    report_path.write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    print(f"wrote {len(reports)} video(s) to {out} and the report to {report_path}")
    return 0


# ---- bench -------------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from . import bench
    from .router import RewardRouter

    rank, world = bench.distributed_context()
    if not args.reward:
        raise SystemExit("sdvg bench needs --reward (ImageReward scores both the routing and the evaluation)")
    taus = [float(t) for t in args.taus.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    pairs = _contexts(args)
    contexts = dict(pairs)
    args.mode, args.tau = "sdvg", taus[0]  # the router is rebuilt per run with that run's tau
    pipe = build_pipeline(args)
    scorer = pipe.router.scorer
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = bench.runs_for([p for p, _ in pairs], taus, modes, args.seed)
    mine = bench.shard(runs, rank, world)
    my_file = bench.shard_path(out, rank) if world > 1 else out
    done = bench.read_done([out, my_file])
    factory = lambda tau: RewardRouter(scorer, tau=tau, aggregation=args.aggregation, crop=args.crop,
                                       temporal_weight=args.temporal_weight)
    ran = bench.bench_rows(pipe, scorer, contexts, mine, num_frames=args.frames, width=args.width, height=args.height,
                           out_file=my_file, done=done, router_factory=factory, log=_print_err)
    _print_err(f"rank {rank}/{world}: ran {ran} videos, skipped {len(mine) - ran} already in {out}")
    bench.barrier(world)
    if rank == 0:
        rows = bench.merge_shards(out, world)
        summary = bench.summarize(rows)
        print(bench.format_table(summary))
        plot = bench.pareto_plot(summary, Path(args.plot) if args.plot else out.with_suffix(".png"))
        print(f"\n{len(rows)} videos in {out}; Pareto plot {plot}")
    bench.barrier(world)
    return 0


def _add_model_args(p, *, reward_required: bool = False) -> None:
    p.add_argument("--drafter", required=True, help="drafter checkpoint (e.g. self_forcing_dmd.pt)")
    p.add_argument("--target", required=True, help="target checkpoint (e.g. krea-realtime-video-14b.safetensors)")
    p.add_argument("--vae", required=True, help="Wan2.1 VAE (Wan2.1_VAE.pth, wan_2.1_vae.safetensors or a diffusers folder)")
    p.add_argument("--reward", required=reward_required, help="ImageReward.pt (needed for --mode sdvg)")
    p.add_argument("--prompt")
    p.add_argument("--prompts-file")
    p.add_argument("--context-file", help="embeddings written by `sdvg encode-prompts` (skips the text encoder)")
    p.add_argument("--text-encoder")
    p.add_argument("--tokenizer")
    p.add_argument("--aggregation", choices=("min", "mean"), default="min")
    p.add_argument("--crop", choices=("center", "full"), default="center")
    p.add_argument("--temporal-weight", type=float, default=0.0)
    p.add_argument("--frames", type=int, default=81, help="video frames: 12n-3 (81 = 7 blocks)")
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drafter-device", default=None, help="put the drafter on another device")
    p.add_argument("--aux-device", default=None, help="device for the VAE, reward and text encoder")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    p.add_argument("--vae-dtype", default="fp32")
    p.add_argument("--fp8-target", action="store_true", help="store the target's block weights in float8")
    p.add_argument("--fuse-qkv", action="store_true", help="fuse attention projections (faster; inference only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile both models' block forward (first blocks pay the compilation; see bench/bench_speed.py)")
    p.add_argument("--drafter-context", default="auto", choices=("auto", "global_cache", "recompute_window"))
    p.add_argument("--target-context", default="auto", choices=("auto", "global_cache", "recompute_window"))
    p.add_argument("--target-schedule", default="auto", choices=("auto", "self_forcing", "krea"))
    p.add_argument("--attention-bias", type=float, default=None, help="Scope's KV bias for recompute-window models (0.3)")
    p.add_argument("--max-frames", type=int, default=21, help="global-cache capacity in latent frames")


# ---- parser ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from .pipeline import MODES

    parser = argparse.ArgumentParser(prog="sdvg", description="Speculative decoding for autoregressive video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="say what a checkpoint file is (format, architecture, params, dtype, context scheme)")
    p.add_argument("path")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads, for non-standard widths")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("encode-prompts", help="encode prompts with UMT5-XXL into an embeddings file")
    p.add_argument("--text-encoder", required=True, help="transformers UMT5 folder or ComfyUI umt5_xxl_*.safetensors")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (needed with a single file)")
    p.add_argument("--prompt")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16")
    p.set_defaults(func=cmd_encode_prompts)

    p = sub.add_parser("generate", help="generate videos with SDVG (or a baseline mode)")
    _add_model_args(p)
    p.add_argument("--tau", type=float, default=-0.7, help="acceptance threshold on the block's reward (default -0.7)")
    p.add_argument("--mode", choices=MODES, default="sdvg")
    p.add_argument("--force-first-block", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--random-p", type=float, default=0.73, help="acceptance probability of --mode random")
    p.add_argument("--refine-from-step", type=int, default=None, help="hybrid regeneration from the drafter's step k")
    p.add_argument("--cascade", action="store_true", help="cascade scoring (4 frames first)")
    p.add_argument("--out", default="outputs")
    p.add_argument("--format", choices=("mp4", "webp"), default=None)
    p.add_argument("--report", default=None, help="report JSON path (default OUT/report.json)")
    # one consumer GPU (docs/memory.md)
    p.add_argument("--vram-gb", type=float, default=None,
                   help="plan for ONE card of this many GiB (e.g. 24, 16): sets --fp8-target, --offload, --kv-dtype, "
                        "--vae-dtype, --drafter-context (flags given explicitly win); prints the plan")
    p.add_argument("--offload", choices=("none", "target", "both"), default=None,
                   help="stream the target's (both: and the drafter's) transformer blocks from CPU RAM to the GPU per "
                        "call (pinned memory, copies overlap compute; CUDA only)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp32", "fp8"), default=None,
                   help="KV cache storage: auto = the model dtype; fp8 = float8 with per-row scales (about half the memory)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="prompts x tau values x modes -> resumable JSONL, summary table, Pareto plot "
                                     "(shards prompts across ranks under torchrun)")
    _add_model_args(p, reward_required=True)
    p.add_argument("--taus", default="-0.7,-1.0,-1.5,-2.0", help="comma-separated tau values for sdvg mode; write --taus=-0.7,-1.5 (with =) so the minus sign is not read as an option")
    p.add_argument("--modes", default="sdvg,target_only,draft_only,first_block_only,random",
                   help="comma-separated modes")
    p.add_argument("--out", default="bench_results.jsonl")
    p.add_argument("--plot", default=None, help="Pareto PNG (default: OUT with .png)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as err:
        _print_err(f"sdvg {args.command}: error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
