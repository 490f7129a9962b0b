"""The ComfyUI MODEL path on a real ComfyUI and a real device (``make gpu-check`` with ``COMFYUI_PATH``).

A ``*_fp8_scaled`` target and a bf16 drafter (random weights in Wan2.1's layout, written as ComfyUI's files) are
loaded by ComfyUI's own loader (Load Diffusion Model: ``comfy.sd.load_diffusion_model``), wrapped by SDVG Drafter /
Target from MODEL and run by the sampler with ComfyUI's memory manager, beside the same weights (dequantised to bf16)
through the pack's file loaders. Written to ``model_path.json``:

* the fp8 matmuls (``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm`` calls) per target DiT call: on an sm_89+
  card ComfyUI switches them on for scaled-fp8 files; each Linear of the target makes one per call;
* compute dtypes, decisions, each model's resident bytes after the sampler's load, wall seconds of each path
  (median of ``--repeats``), and the largest latent difference between the two paths (fp8 matmuls round the
  activations to fp8, so it is a report, not a check).

``--tiny`` runs it on the CPU as an fp8 card would (``tests/cuda_rules.py``: ComfyUI's fp8 switch on, CUDA's checks
in front of an emulated ``_scaled_mm``) with tiny models: ``make e2e`` runs it so it cannot rot before a GPU is lent.

    python scripts/gpu_model_path.py --comfyui /path/to/ComfyUI --out outputs/gpu_check       # GPU
    .e2e/venv/bin/python scripts/gpu_model_path.py --comfyui .e2e/ComfyUI --tiny --out /tmp/mp  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_comfyui(path: Path, cpu: bool):
    """ComfyUI from the checkout ``path`` (``tests/comfyui_in_process.py``) and its loader module ``comfy.sd``."""
    sys.path.insert(0, str(ROOT / "tests"))  # tiny real-architecture models, the CUDA rules, the in-process import
    from comfyui_in_process import import_comfyui, is_checkout

    if not is_checkout(path):
        raise SystemExit(f"--comfyui {path}: not a ComfyUI checkout (no comfy/model_management.py)")
    mm = import_comfyui(path, cpu=cpu)
    import comfy.sd

    return mm, comfy.sd


def _fp8_linears_per_call(source) -> int:
    """The Linears of one DiT call (not the text projections, made once per prompt) whose weights ComfyUI keeps in
    fp8: each should make one fp8 matmul per call on an fp8 card. (0.3.64's scaled-fp8 ops store every Linear in fp8;
    newer cores keep the layers a file left unquantised in their own dtype.)"""
    from nodes.comfy_model import stored_as

    per_call = [source.time_embedding[0], source.time_embedding[2], source.time_projection[1], source.head.head]
    for block in source.blocks:
        per_call += [block.self_attn.q, block.self_attn.k, block.self_attn.v, block.self_attn.o, block.cross_attn.q,
                     block.cross_attn.o, block.ffn[0], block.ffn[2]]
    return sum(1 for linear in per_call if "fp8" in stored_as(linear.weight).lower())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", required=True, help="a ComfyUI checkout (0.3.64, the LTS fork 0.12.1, 0.33.0, ...)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"))
    p.add_argument("--tiny", action="store_true", help="CPU, tiny models, an fp8 card emulated (tests/cuda_rules.py)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    mm, sd = _import_comfyui(Path(args.comfyui).resolve(), cpu=args.tiny)

    import torch

    from comfyui_in_process import dequantised
    from cuda_rules import cuda_scaled_mm, fp8_card
    from nodes import comfy_nodes, logic
    from node_fixtures import FakeComfyVAE
    from wan_fixtures import text_context, tiny_wan, write_checkpoint, write_scaled_fp8

    device = mm.get_torch_device()
    if not args.tiny and device.type != "cuda":
        p.error(f"ComfyUI chose {device}, not a CUDA device: run this on the GPU machine, or pass --tiny")
    # Real widths, few layers: the 14B's (5120, 40 heads) as the target and the 1.3B's (1536, 12) as the drafter.
    sizes = {"target": dict(num_attention_heads=2, num_layers=2), "drafter": dict(num_attention_heads=2, num_layers=2)}
    width, height, frames = 48, 32, 33
    if not args.tiny:
        sizes = {"target": dict(num_attention_heads=40, ffn_dim=13824, num_layers=2),
                 "drafter": dict(num_attention_heads=12, ffn_dim=8960, num_layers=4)}
        width, height, frames = 832, 480, 33
    emulated = fp8_card(mm) if args.tiny else contextlib.nullcontext()

    def fp8_matmuls():  # --tiny: CUDA's checks in front of an emulated kernel; on a GPU the real kernels, logged
        return cuda_scaled_mm(emulate=args.tiny)

    report = {"comfyui": args.comfyui, "device": str(device) if args.tiny else torch.cuda.get_device_name(0),
              "emulated_fp8_card": args.tiny, "geometry": [width, height, frames], "sizes": sizes}
    positive = [[text_context(seed=1), {"pooled_output": None}]]
    vae = FakeComfyVAE()
    if not args.tiny:
        vae.device, vae.vae_dtype = device, torch.bfloat16

    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        tmp = Path(tmp)
        files = {"target": write_scaled_fp8(tiny_wan(seed=2, **sizes["target"]), tmp / "target_fp8_scaled.safetensors",
                                            marker="model.diffusion_model.scaled_fp8")}
        (tmp / "drafter").mkdir()
        files["drafter"] = write_checkpoint("comfyui", tiny_wan(seed=1, **sizes["drafter"]), tmp / "drafter")
        with emulated:
            target_patcher = sd.load_diffusion_model(str(files["target"]))
            drafter_patcher = sd.load_diffusion_model(str(files["drafter"]), model_options={"dtype": torch.bfloat16})
        target = logic.load_model_from_comfy(target_patcher, role="target")
        drafter = logic.load_model_from_comfy(drafter_patcher, role="drafter")
        report["models"] = {"target": target.describe(), "drafter": drafter.describe()}

        # the reference: the same weights, dequantised, through the pack's file loaders
        from safetensors.torch import save_file

        source = target_patcher.get_model_object("diffusion_model")
        plain = {"model.diffusion_model." + key: value.to(torch.bfloat16).contiguous()
                 for key, value in dequantised(source).items()}
        save_file(plain, str(tmp / "target_dequantised.safetensors"))
        pack_device = "cpu" if args.tiny else "cuda"
        pack = {"target": logic.load_sdvg_model(str(tmp / "target_dequantised.safetensors"), role="target",
                                                dtype="bf16", device=pack_device, services=logic.Services()),
                "drafter": logic.load_sdvg_model(str(files["drafter"]), role="drafter", dtype="bf16",
                                                 device=pack_device, services=logic.Services())}

        def run(d, t, services, mode):
            return logic.run_sampler(drafter=d, target=t, router=None, positive=positive, vae=vae, width=width,
                                     height=height, length=frames, seed=3, mode=mode, services=services, replay=False)

        # one target DiT call's fp8 matmuls
        view = target.model
        with fp8_matmuls() as log:
            text_kv = view.encode_text(positive[0][0].to(device))
            before = len(log)
            lat = torch.randn(1, 16, 3, height // 8, width // 8, device=device)
            mm.load_models_gpu([target_patcher])
            view.forward_block(lat, torch.full((1, 3), 937.5), text_kv, None, 0)
            report["fp8_matmuls"] = {"encode_text": before, "per_dit_call": len(log) - before,
                                     "fp8_linears_per_dit_call": _fp8_linears_per_call(source)}

        timings = {}
        outputs = {}
        for mode in ("target_only", "first_block_only"):
            for path in ("model", "file"):
                services = comfy_nodes.ComfyServices() if path == "model" else logic.Services()
                d, t = (drafter, target) if path == "model" else (pack["drafter"], pack["target"])
                seconds = []
                for _ in range(max(1, args.repeats)):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                    with fp8_matmuls():
                        out = run(d, t, services, mode)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds.append(time.perf_counter() - started)
                timings[f"{mode} {path}"] = round(statistics.median(seconds), 3)
                outputs[(mode, path)] = out
            model_out, file_out = outputs[(mode, "model")], outputs[(mode, "file")]
            report[mode] = {
                "decisions": json.loads(model_out.report)["decisions"],
                "latent_max_diff_vs_file_loaders": (model_out.result.latents.float().cpu()
                                                    - file_out.result.latents.float().cpu()).abs().max().item(),
                "finite": bool(model_out.result.latents.isfinite().all()),
                "model_path_over_file_loaders": round(timings[f"{mode} model"] / timings[f"{mode} file"], 3)}
        report["seconds_median"] = timings
        report["resident_bytes"] = {role: int(getattr(pt, "loaded_size", lambda: 0)()) for role, pt in
                                    (("target", target_patcher), ("drafter", drafter_patcher))}
        mm.unload_all_models()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_path.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    ok = report["fp8_matmuls"]["per_dit_call"] == report["fp8_matmuls"]["fp8_linears_per_dit_call"] and all(
        report[m]["finite"] for m in ("target_only", "first_block_only"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
