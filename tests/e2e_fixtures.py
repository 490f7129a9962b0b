"""Tiny model files for ComfyUI's own loaders (the end-to-end test of the "SDVG ... from MODEL" path).

=============================================  ====================================================================
models/diffusion_models/sdvg_drafter_comfy...  the tiny drafter / target of ``node_fixtures.write_tiny_models`` in
models/diffusion_models/sdvg_target_comfy...   ComfyUI's ``model.diffusion_model.*`` layout (original Wan names),
                                               written by ``sdvg export-comfy``'s own function at fp32: UNETLoader
                                               loads them, and so do the pack's file loaders (the same weights)
models/loras/<name>                            a rank-4 LoRA in the kohya-style ``diffusion_model.<module>.lora_up /
                                               lora_down / alpha`` keys that core's LoraLoaderModelOnly reads
                                               (``comfy/lora.py``: the ``diffusion_model.<module>`` key of every
                                               ``.weight``), on both blocks' attention and FFN linears
models/diffusion_models/<stem>.gguf            a Q8_0 GGUF of a comfy-layout file as ComfyUI-GGUF's loader reads it
models/diffusion_models/<stem>_dequant...      the same tensors dequantised to fp32 (the GGUF's reference)
=============================================  ====================================================================

The tiny Wan (``wan_fixtures.tiny_wan``: width 256, 2 heads of 128, 2 layers, text width 4096) is what ComfyUI's
detection reads as a Wan2.1 T2V (``head.modulation``; heads = width // 128; text width 4096 assumed).

The GGUF follows ComfyUI-GGUF's ``tools/convert.py`` (arch ``wan``, keys without the ``model.diffusion_model.``
prefix, which its ``gguf_sd_loader`` also accepts): 2-D+ weights with more than 1024 elements quantised, and kept in
F32 what convert.py keeps there (1-D tensors, small tensors, ``.modulation``) or cannot quantise (the 5-D
``patch_embedding``, which its ``fix_5d_tensors.py`` adds back as F32). Every quantisable weight becomes Q8_0
(llama.cpp's ``quantize`` step, done here with the ``gguf`` package's own quantiser), so each weight is an int8 per
value and an fp16 scale per 32 values; :func:`write_q8_0_gguf` writes the dequantised values beside it, which
UNETLoader then loads as the GGUF's exact reference. They are dequantised as ComfyUI-GGUF does by default
(``dequant.py``: ``dequant_dtype`` None keeps the scale in fp16, so ``scale * int8`` is rounded to fp16, then cast to
the compute dtype; the LTS fork's built-in ``comfy/gguf.py`` is the same code), not in fp32 as ``gguf.quants``
does: the two differ by up to one fp16 rounding (2^-11 relative) per weight.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COMFY_DRAFTER_FILE = "sdvg_drafter_comfy.safetensors"
COMFY_TARGET_FILE = "sdvg_target_comfy.safetensors"
#: what ComfyUI-GGUF's convert.py keeps in F32 (besides 1-D and small tensors)
_GGUF_KEEP_F32 = (".modulation",)
_GGUF_SMALL = 1024  # convert.py's QUANTIZATION_THRESHOLD
COMFY_PREFIX = "model.diffusion_model."


def write_comfy_files(models: Path, drafter_source: Path, target_source: Path) -> dict[str, Path]:
    """The tiny drafter and target (files the pack's loaders read) exported to ComfyUI's layout at fp32, in
    ``models/diffusion_models/``: what ``sdvg export-comfy --dtype fp32`` writes."""
    from sdvg_engine.models.comfy_layout import export_comfy

    out = {"drafter": models / "diffusion_models" / COMFY_DRAFTER_FILE,
           "target": models / "diffusion_models" / COMFY_TARGET_FILE}
    export_comfy(drafter_source, out["drafter"], dtype="fp32")
    export_comfy(target_source, out["target"], dtype="fp32")
    return out


def write_tiny_lora(path: Path, *, seed: int = 0, rank: int = 4, scale: float = 0.05, alpha: float | None = None,
                    blocks: int = 2, width: int = 256, ffn: int = 256) -> Path:
    """A LoRA for the tiny Wan in the keys core's LoraLoaderModelOnly reads: for each patched linear
    ``diffusion_model.<module>.lora_up.weight`` [out, rank], ``.lora_down.weight`` [rank, in] and ``.alpha``
    (the patch is ``strength * alpha / rank * up @ down``; ``alpha`` defaults to ``rank``). ``scale`` sets the
    size of up and down: 0.05 changes the tiny model's latents visibly but keeps them finite."""
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for b in range(blocks):
        for attn in ("self_attn", "cross_attn"):
            for part in ("q", "k", "v", "o"):
                shapes[f"blocks.{b}.{attn}.{part}"] = (width, width)
        shapes[f"blocks.{b}.ffn.0"] = (ffn, width)
        shapes[f"blocks.{b}.ffn.2"] = (width, ffn)
    tensors = {}
    for module, (out_f, in_f) in shapes.items():
        key = f"diffusion_model.{module}"
        tensors[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * scale * 4
        tensors[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * scale
        tensors[f"{key}.alpha"] = torch.tensor(float(rank if alpha is None else alpha))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def write_q8_0_gguf(source: Path, gguf_path: Path, dequant_path: Path) -> dict[str, int]:
    """``source`` (a comfy-layout safetensors file) as a Q8_0 GGUF for ComfyUI-GGUF's UnetLoaderGGUF, and the
    dequantised tensors as a comfy-layout safetensors file for UNETLoader (its reference). Returns the count of
    tensors per GGUF type."""
    import gguf
    import numpy as np

    state = {k[len(COMFY_PREFIX):] if k.startswith(COMFY_PREFIX) else k: v for k, v in load_file(str(source)).items()}
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    dequantised, counts = {}, {}
    for key, tensor in state.items():
        data = tensor.to(torch.float32).numpy()
        quantise = (data.ndim in (2, 3, 4) and data.size > _GGUF_SMALL and data.shape[-1] % 32 == 0
                    and not any(k in key for k in _GGUF_KEEP_F32))
        qtype = gguf.GGMLQuantizationType.Q8_0 if quantise else gguf.GGMLQuantizationType.F32
        raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(key, raw, raw_dtype=qtype)
        if quantise:  # ComfyUI-GGUF's dequantisation: fp16 scale times int8 values, the product in fp16, then fp32
            blocks = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, 34)  # Q8_0: 2 bytes scale + 32 int8
            scale, values = blocks[:, :2].contiguous().view(torch.float16), blocks[:, 2:].contiguous().view(torch.int8)
            back = (scale * values).reshape(data.shape).to(torch.float32)
        else:
            back = torch.from_numpy(data)
        dequantised[COMFY_PREFIX + key] = back.contiguous()
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    gguf_path, dequant_path = Path(gguf_path), Path(dequant_path)
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(path=str(gguf_path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(dequantised, str(dequant_path))
    return counts
