"""Real-size SDVG cost: Wan2.1 1.3B drafter + 14B target, full Wan VAE and ImageReward at 832x480.

Random weights time exactly like real ones. Prints markdown tables:

1. per-block time of each component (drafter steps, drafter commit, target steps, target recompute,
   VAE decode of a 3-latent-frame block, ImageReward on its 12 frames), timed with CUDA events;
2. whole videos through the real loop: target-only, draft-only and SDVG with forced acceptance
   patterns (0%, 73.1%, 87.5%, 100% of drafted blocks), wall time, ratio vs target-only, peak memory;
3. the same for an fp8-stored target (``--fp8``).

    python bench/real_size.py                 # one GPU, ~8 min on an H200
    python bench/real_size.py --blocks 9      # the reference's 9-block variant (105 frames, recompute target)
    python bench/real_size.py --tiny          # tiny configs on the CPU (CI: keeps the script from rotting)
    python bench/real_size.py --fp8 --offload target --kv-dtype fp8   # one consumer GPU (docs/memory.md):
                                              # compare its per-block times and peak GiB with `--fp8` alone

``--offload target|both`` streams the target's (and the drafter's) blocks from pinned CPU RAM
(``sdvg_engine/offload.py``); it needs CUDA, except with ``--tiny`` where it runs CPU->CPU without a stream.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import torch
from diffusers import AutoencoderKLWan

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.models.loading import quantize_blocks_fp8
from sdvg_engine.loaders import LoadedDiT, build_pipeline
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.report import ComponentTimer
from sdvg_engine.reward import ImageRewardConfig, ImageRewardModel, ImageRewardScorer, build_tiny_image_reward
from sdvg_engine.reward.tokenizer import BlipTokenizer
from sdvg_engine.router import RewardRouter
from sdvg_engine.sampling import SeededNoise
from sdvg_engine.vae import StreamingWanVAE

from common import ForcedRouter, accept_pattern, text_context


def random_module(build, device, dtype):
    """Build on the meta device, materialise on ``device`` and fill with small random values (fast)."""
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
        for name, b in module.named_buffers():
            if b.is_floating_point():
                b.zero_()
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(dtype)  # per tensor: ModelMixin.to(dtype) warns about fp32-kept modules
    return module.eval().requires_grad_(False)


def build_stack(args, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        drafter_cfg = wan_config("tiny", num_layers=2, num_attention_heads=2, ffn_dim=512)
        target_cfg = wan_config("tiny", num_layers=4, num_attention_heads=4, ffn_dim=1024)
    else:
        drafter_cfg, target_cfg = wan_config("Wan2.1-T2V-1.3B"), wan_config("Wan2.1-T2V-14B")

    def dit(cfg):
        model = random_module(lambda: CausalWanTransformer3DModel(**cfg), device, dtype)
        for name, p in model.named_parameters():  # modulation and time embedding stay fp32, as when loading
            if any(k in name for k in ("scale_shift_table", "time_embedder", "norm")):
                p.data = p.data.float()
        return model

    drafter, target = dit(drafter_cfg), dit(target_cfg)
    if args.fp8 and not args.tiny:
        quantize_blocks_fp8(target)
    if args.offload != "none" or args.kv_dtype != "auto":
        from sdvg_engine.offload import enable_block_offload, kv_cache_dtype

        for model, streamed in ((drafter, args.offload == "both"), (target, args.offload in ("target", "both"))):
            model.use_runtime(kv_cache_dtype=kv_cache_dtype(args.kv_dtype))
            if streamed:
                model.blocks.to("cpu")
                enable_block_offload(model, device, use_stream=device.type == "cuda")
    vae_module = AutoencoderKLWan(base_dim=8 if args.tiny else 96).to(device).eval().requires_grad_(False)
    vae = StreamingWanVAE(vae_module)
    if args.tiny:
        scorer = build_tiny_image_reward(seed=0)
    else:
        model = random_module(lambda: ImageRewardModel(ImageRewardConfig.v1()), device, torch.float16)
        model.blip.text_encoder.embeddings.position_ids = torch.arange(model.config.max_position_embeddings, device=device)[None]
        scorer = ImageRewardScorer(model, BlipTokenizer())
    return drafter, target, vae, scorer


@contextmanager
def timed(device, sink: list):
    """Append the body's duration to ``sink``: CUDA events on the device's stream (perf_counter on CPU)."""
    timer = ComponentTimer()
    with timer.measure("call", device):
        yield
    sink.append(timer.seconds["call"])


def component_table(drafter, target, vae, scorer, ctx, h, w, device, repeats):
    """Per-block cost of each piece, on block 1 (so caches hold block 0 as in a real run)."""
    rows = {}
    noise = SeededNoise(0)
    for label, gen in (("drafter", CausalGenerator(drafter, context=GlobalCache(21))),
                       ("target", CausalGenerator(target, schedule="krea", context=RecomputeWindow(3, anchor_encoder=vae)))):
        gen.start(ctx, latent_height=h, latent_width=w, num_blocks=2)
        first = gen.generate_block(0, noise).latents
        pixels = vae.decode_block(first)
        vae.reset()
        for _ in range(repeats):
            gen.commit_block(0, first, pixels)
            if isinstance(gen.context, RecomputeWindow):
                gen.context.dirty = True
            gen.calls.clear(), gen.timer.clear()
            gen.generate_block(1, noise)
            for kind, secs in gen.seconds.items():
                rows.setdefault(f"{label}: {kind} ({gen.calls[kind]} call{'s' if gen.calls[kind] > 1 else ''})", []).append(secs)
            if isinstance(gen.context, GlobalCache):
                gen.context.reset()
                gen.context.pending.append((0, first))
    block = torch.randn(1, 16, 3, h, w, device=device)
    vae.decode_block(torch.randn(1, 16, 1, h, w, device=device))
    state = vae.snapshot()
    sink = []
    for _ in range(repeats):
        vae.restore(state)
        with timed(device, sink):
            frames = vae.decode_block(block)
    rows["VAE decode (3 latent -> 12 frames)"] = sink
    frames01 = ((frames[0].transpose(0, 1).float() + 1) / 2).clamp(0, 1)
    sink = []
    for _ in range(repeats):
        with timed(device, sink):
            scorer.score_frames(frames01, "a cat")
    rows["ImageReward (12 frames, batched)"] = sink
    return {k: sorted(v)[len(v) // 2] for k, v in rows.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (for CI)")
    p.add_argument("--blocks", type=int, default=7, help="7 = 81 frames; 9 = the reference's 105-frame runs")
    p.add_argument("--fp8", action="store_true", help="store the target's block weights in float8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--offload", choices=("none", "target", "both"), default="none",
                   help="stream the target's (both: and the drafter's) blocks from pinned CPU RAM (needs CUDA)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp8"), default="auto", help="KV cache storage dtype")
    p.add_argument("--workers", type=int, choices=(1, 2), default=1,
                   help="2: the target on a lane of its own beside the drafter side, on the one device (CUDA streams "
                        "are not used; the lanes are threads)")
    p.add_argument("--prompt-switch", action="store_true",
                   help="also run one SDVG video whose prompt changes at the middle block (a prompt schedule with "
                        "the engine's switch defaults: the text re-encodes and the drafter's re-cache at the switch)")
    args = p.parse_args()
    if args.offload != "none" and not args.tiny and not torch.cuda.is_available():
        p.error("--offload streams transformer blocks from CPU RAM to a CUDA GPU, and no CUDA device is visible; "
                "use --tiny to run the offload code path on the CPU")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:  # one intra-op thread: beside other work (CI's pytest workers) more threads spin and wait
        torch.set_num_threads(1)
    width, height = (48, 32) if args.tiny else (832, 480)
    if args.tiny:  # CI's check that the script runs: every code path, the fewest blocks and runs that reach them
        args.blocks = min(args.blocks, 2)
    h, w = height // 8, width // 8
    frames = 12 * args.blocks - 3

    drafter, target, vae, scorer = build_stack(args, device)
    ctx = text_context(device=device)
    per_block = component_table(drafter, target, vae, scorer, ctx, h, w, device, 1 if args.tiny else args.repeats)

    def run(mode, pattern=None, switch_at=None):
        router = ForcedRouter(scorer, pattern) if pattern is not None else RewardRouter(scorer, tau=0.0)
        # as their checkpoints say (native): the 1.3B on its global cache, the 14B (Krea) on the recompute window
        pipe = build_pipeline(LoadedDiT(drafter, "global_cache", "self_forcing"),
                              LoadedDiT(target, "recompute_window", "krea"), vae, router, preset="native",
                              max_frames=max(21, 3 * args.blocks))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prompts = {"prompt_embeds": ctx, "prompt": "a cat"} if switch_at is None else {
            "prompt_schedule": [(0, ctx, "a cat"), (switch_at, text_context(seed=2, device=device), "a dog")]}
        report = pipe.generate(**prompts, num_frames=frames, width=width, height=height, seed=42,
                               options=SDVGOptions(mode=mode), workers=args.workers).report
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return report, peak

    if not args.tiny:
        run("target_only")  # warm-up (kernels, allocator)
    drafted = args.blocks - 1
    results = [("target-only", *run("target_only")), ("draft-only", *run("draft_only"))]
    for frac in ((0.0, 1.0) if args.tiny else (0.0, 0.731, 0.875, 1.0)):
        accepted = round(frac * drafted)
        results.append((f"SDVG {accepted}/{drafted} accepted ({frac:.1%})", *run("sdvg", accept_pattern(accepted, drafted))))
    if args.prompt_switch:
        switch = args.blocks // 2
        accepted = round(0.875 * drafted)
        results.append((f"SDVG {accepted}/{drafted} accepted, prompt switch at block {switch}",
                        *run("sdvg", accept_pattern(accepted, drafted), switch_at=switch)))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"## SDVG real-size benchmark ({'tiny configs' if args.tiny else 'Wan2.1 1.3B drafter + 14B target'}, "
          f"{width}x{height}, {frames} frames = {args.blocks} blocks, {name}, "
          f"{str(target.dtype).replace('torch.', '')}{' + fp8 target blocks' if args.fp8 and not args.tiny else ''}"
          f"{f', offload {args.offload}' if args.offload != 'none' else ''}"
          f"{f', KV {args.kv_dtype}' if args.kv_dtype != 'auto' else ''}"
          f"{f', {args.workers} workers' if args.workers != 1 else ''})\n")
    print("| component, per block | seconds |\n|---|---|")
    for k, v in per_block.items():
        print(f"| {k} | {v:.4f} |")
    base = results[0][1]["seconds"]["wall"]
    print("\n| run | wall s | vs target-only | drafter s | target s | VAE s | reward s | peak GiB |\n|---|---|---|---|---|---|---|---|")
    for label, rep, peak in results:
        s = rep["seconds"]
        print(f"| {label} | {s['wall']:.2f} | {base / s['wall']:.2f}x | {s['drafter']:.2f} | {s['target']:.2f} | "
              f"{s['vae']:.2f} | {s['reward']:.2f} | {'-' if peak is None else f'{peak:.1f}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_block": per_block, "runs": [{"label": l, "report": r, "peak_gib": p} for l, r, p in results]}, f)


if __name__ == "__main__":
    main()
