"""The ComfyUI MODEL path against the pack's own loader: same weights, side by side in one run, median of repeats.

The MODEL path (Load Diffusion Model -> SDVG Drafter/Target from MODEL) runs the pack's own block forward over
ComfyUI's modules, with ComfyUI's per-call weight casts and its attention function; this measures what that costs
against the pack's loader on the same file (goal: at most 1.05x with the same attention). It needs a ComfyUI:

    COMFYUI_PATH=.e2e/ComfyUI .e2e/venv/bin/python bench/bench_model_path.py

Rows: the pack's loader; the MODEL with ComfyUI's selected attention (on the CPU 0.3.64 picks its sub-quadratic
attention, on CUDA usually PyTorch's SDPA); the MODEL with ``attention_pytorch`` (SDPA, the pack's own attention).
Run it alone: the 2-core machine's other jobs move single timings by 20%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per row (the median is reported)")
    parser.add_argument("--width", type=int, default=512, help="model width (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--pixels", default="320x192", help="frame size WxH in pixels (multiples of 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    comfy_root = os.environ.get("COMFYUI_PATH")
    if not comfy_root or not Path(comfy_root, "comfy").is_dir():
        print("bench_model_path: set COMFYUI_PATH to a ComfyUI checkout (make e2e builds one in .e2e/ComfyUI) and run "
              "it with that ComfyUI's Python", file=sys.stderr)
        return 2
    width_px, height_px = (int(v) for v in args.pixels.split("x"))
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    sys.path.append(comfy_root)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.ldm.modules.attention as attention
    import comfy.model_management as model_management
    import comfy.sd
    import torch

    from nodes import comfy_model, logic
    from sdvg_engine.models.loading import load_causal_wan
    from wan_fixtures import text_context, tiny_wan, write_checkpoint

    torch.set_num_threads(args.threads)
    heads = args.width // 128
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint("comfyui", tiny_wan(seed=1, num_attention_heads=heads, num_layers=args.layers,
                                                    ffn_dim=4 * args.width), Path(tmp))
        own, _ = load_causal_wan(path, dtype=torch.float32)
        patcher = comfy.sd.load_diffusion_model(str(path))
        model_management.load_models_gpu([patcher])
        selected = logic.load_model_from_comfy(patcher, role="drafter").model
        sdpa = logic.load_model_from_comfy(patcher, role="drafter").model
        sdpa.use_runtime(attention=comfy_model.ComfyAttention(heads, attention.attention_pytorch,
                                                              attention.attention_pytorch))
        h, w = height_px // 8, width_px // 8
        context = text_context()
        x = torch.randn(1, 16, 3, h, w, generator=torch.Generator().manual_seed(0))
        t = torch.full((1, 3), 700.0)

        def run(model):  # text K/V + three blocks through the KV cache, two calls each
            with torch.inference_mode():
                text = model.encode_text(context)
                cache = model.new_kv_cache(1, h, w, 9)
                return [model.forward_block(x, t, text, cache, start) for start in (0, 0, 3, 3, 6, 6)]

        rows = {"pack loader": own, f"MODEL, {attention.optimized_attention.__name__}": selected,
                "MODEL, attention_pytorch": sdpa}
        reference = run(own)
        for name, model in rows.items():
            diff = max((a - b).abs().max().item() for a, b in zip(run(model), reference))
            print(f"{name}: max |diff| vs the pack loader {diff:.2e}")
        times = {name: [] for name in rows}
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every row alike
            for name, model in rows.items():
                start = time.perf_counter()
                run(model)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["pack loader"])
    print(f"width {args.width}, {args.layers} layers, {width_px}x{height_px}, {args.threads} thread(s), "
          f"median of {args.repeats}:")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:32s} {median:7.3f} s  ({', '.join(f'{v:.3f}' for v in values)})  {median / base:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
