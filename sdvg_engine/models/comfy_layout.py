"""Write a drafter / target in ComfyUI's ``diffusion_models`` layout (``sdvg export-comfy``).

ComfyUI's core **Load Diffusion Model** node (``UNETLoader``) reads a Wan2.1 DiT from a safetensors file whose keys
are the original Wan names under ``model.diffusion_model.`` (``blocks.0.self_attn.q.weight``, ``head.modulation``
...). ``self_forcing_dmd.pt`` is a training pickle (``{generator_ema, generator, critic}``) that UNETLoader cannot
read; this module turns it, or any other file :mod:`sdvg_engine.models.loading` reads, into that layout.

What the file holds
    * every tensor exactly as :func:`~sdvg_engine.models.loading.load_causal_wan` builds it from the source at the
      chosen dtype (the same :func:`~sdvg_engine.models.loading.build_model` call makes them: time embedding,
      modulation tables and the affine norm stay float32, float8-scaled sources are dequantised), renamed to the
      original Wan names (:func:`comfy_key`);
    * header metadata (:func:`comfy_metadata`):

      - ``config = {"transformer": {"causal_ar": true}}``: what ComfyUI core reads to build its causal Wan. Core
        since the auto-regressive video PR (Comfy-Org/ComfyUI#13082, merged spring 2026; current core 0.47 has it)
        reads the safetensors metadata in UNETLoader, merges ``config["transformer"]`` into the Wan config found from
        the tensor shapes (``comfy/model_detection.py``), and ``supported_models.WAN21_CausalAR_T2V`` (unet config
        ``image_model wan2.1, model_type t2v, causal_ar True``) then builds ``model_base.WAN21_CausalAR``, i.e.
        ``comfy.ldm.wan.ar_model.CausalWanModel``, whose ``forward_block`` serves core's AR sampler. The same value
        is in Comfy-Org's own repackaged Causal Forcing file.
      - Older cores ignore it and load the same weights as the ordinary ``WanModel`` (``WAN21_T2V``): ComfyUI 0.3.64
        (Oct 2025) does not pass file metadata from UNETLoader to detection at all; the LTS fork 0.12.1 (Feb 2026)
        passes it but its Wan branch does not read it and it has no causal class. Either way the file loads, and
        the SDVG "from MODEL" nodes run their own block-causal forward over its modules.
      - ``sdvg.config`` / ``sdvg.context_scheme``: the architecture and context scheme the pack read from the
        source, so the pack's own loader (which also reads this layout) gets them back exactly;
        ``sdvg.source``: the source's file name, format and entry (provenance only).

ComfyUI detects Wan from the tensors alone (0.3.64 ``detect_unet_config``: ``head.modulation`` marks Wan, width from
its shape, ``num_heads = width // 128``, ``ffn_dim`` from ``blocks.0.ffn.0``, ``in_dim`` from ``patch_embedding``,
``out_dim = head.head rows // 4``; text width 4096, freq dim 256, patch (1, 2, 2), qk and cross-attention norms
assumed). A checkpoint outside those assumptions would load there with the wrong heads or shapes, so
:func:`check_comfy_compatible` refuses it before anything is written.

The output is written to a temporary file in the destination folder, flushed to disk and only then given its name
(:func:`write_safetensors_atomic`): an interrupted or failed export leaves no file, and an existing file is never
replaced unless asked.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint_io import CheckpointError
from .loading import META_CONFIG, META_CONTEXT, CheckpointInfo, build_model, read_checkpoint

#: The prefix ComfyUI's full checkpoints and repackaged ``diffusion_models`` files put before the Wan names.
COMFY_PREFIX = "model.diffusion_model."
#: The metadata key ComfyUI reads (``json.loads(metadata["config"])["transformer"]``) and the value that makes newer
#: cores build ``CausalWanModel``.
COMFY_CONFIG_KEY = "config"
COMFY_CAUSAL_CONFIG = {"transformer": {"causal_ar": True}}
META_SOURCE = "sdvg.source"
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# diffusers name -> original Wan name. Whole-name rules for the embeddings and the head, per-block rules for the
# rest; anchored so that no rule can fire inside another name (diffusers' own converter renames by substring).
_TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
}
_ATTN = {"attn1": "self_attn", "attn2": "cross_attn"}
_ATTN_PARTS = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k"}
# diffusers' affine norm2 sits before cross-attention: the original norm3 (diffusers swapped the two names).
_BLOCK = {"norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)")
_TOP_KEY = re.compile(r"(.+)\.(weight|bias)")


def comfy_key(key: str) -> str:
    """The ComfyUI key of one of the pack's (diffusers) parameter names, e.g. ``blocks.3.attn1.to_out.0.weight`` ->
    ``model.diffusion_model.blocks.3.self_attn.o.weight``. A name outside the Wan2.1 text-to-video DiT raises
    ``KeyError``."""
    if key == "scale_shift_table":
        return COMFY_PREFIX + "head.modulation"
    if m := re.fullmatch(r"blocks\.(\d+)\.scale_shift_table", key):
        return f"{COMFY_PREFIX}blocks.{m[1]}.modulation"
    if m := _BLOCK_KEY.fullmatch(key):
        block, module, kind = m.groups()
        attn, _, part = module.partition(".")
        if attn in _ATTN and part in _ATTN_PARTS:
            return f"{COMFY_PREFIX}blocks.{block}.{_ATTN[attn]}.{_ATTN_PARTS[part]}.{kind}"
        if module in _BLOCK:
            return f"{COMFY_PREFIX}blocks.{block}.{_BLOCK[module]}.{kind}"
    elif (m := _TOP_KEY.fullmatch(key)) and m[1] in _TOP:
        return f"{COMFY_PREFIX}{_TOP[m[1]]}.{m[2]}"
    raise KeyError(f"'{key}' is not a parameter of the Wan2.1 text-to-video DiT; ComfyUI's layout has no name for it")


def check_comfy_compatible(config: dict, path) -> None:
    """Refuse an architecture ComfyUI's Wan detection would read wrongly (it reads width, depth, ffn and channels
    from the tensors and assumes the rest; see the module docstring)."""
    fixed = {"attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, "patch_size": (1, 2, 2),
             "cross_attn_norm": True, "eps": 1e-6}
    for key, want in fixed.items():
        value = tuple(config[key]) if key == "patch_size" else config.get(key)
        if value != want:
            raise CheckpointError(
                f"{path}: config '{key}' is {value!r}; ComfyUI's Wan detection assumes {want!r} (it reads only width, "
                "depth, ffn width and channels from the tensors, with heads = width // 128), so it would build a "
                "different model from this file. Only Wan2.1-shaped DiTs can be exported for ComfyUI; use the file "
                "with the SDVG file loaders instead")
    if not config.get("qk_norm"):
        raise CheckpointError(f"{path}: config 'qk_norm' is {config.get('qk_norm')!r}; ComfyUI's Wan always applies "
                              "q/k RMS norms, so it would run this model wrongly; use the SDVG file loaders instead")


def comfy_metadata(info: CheckpointInfo) -> dict[str, str]:
    """The header metadata of an export (all strings, as safetensors requires): see the module docstring."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in info.config.items()}
    source = {"file": Path(info.path).name, "format": info.format, "entry": info.source_entry}
    return {
        COMFY_CONFIG_KEY: json.dumps(COMFY_CAUSAL_CONFIG),
        META_CONFIG: json.dumps(config),
        META_CONTEXT: info.context_scheme,
        META_SOURCE: json.dumps(source),
        "format": "pt",  # what torch-side readers (transformers, diffusers) expect of a safetensors file
    }


def comfy_state_dict(state: dict) -> dict:
    """``{comfy_key(k): tensor}`` for a model's (diffusers-named) state dict; the tensors are not copied."""
    out = {}
    for key, tensor in state.items():
        out[comfy_key(key)] = tensor.contiguous()
    return out


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (the same path, a link to it, or a hard link)."""
    if Path(os.path.abspath(a)) == Path(os.path.abspath(b)) or a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _save_file(tensors: dict, path: str, metadata: dict) -> None:
    """The one place bytes are written (a seam the interruption test replaces)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)


def write_safetensors_atomic(tensors: dict, out: str | os.PathLike, metadata: dict, *, overwrite: bool = False) -> None:
    """Write ``tensors`` to ``out`` so that ``out`` is either absent/unchanged or the complete new file.

    The bytes go to a temporary file next to ``out`` (same file system), are flushed to disk, and the file is then
    linked to its name: ``os.link`` refuses an existing name atomically, so a file that appeared meanwhile is not
    replaced without ``overwrite``; with ``overwrite`` (or where hard links are not supported) ``os.replace`` swaps
    it in whole. Any failure or Ctrl-C removes the temporary file.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists; pass --overwrite (overwrite=True) to replace it or choose "
                              "another name")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        _save_file(tensors, tmp, metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)
            except FileExistsError:
                raise FileExistsError(f"{out}: appeared while the export was written; pass --overwrite "
                                      "(overwrite=True) to replace it or choose another name") from None
            except OSError:  # no hard links on this file system: check, then rename
                if out.exists():
                    raise FileExistsError(f"{out}: appeared while the export was written; pass --overwrite "
                                          "(overwrite=True) to replace it or choose another name") from None
                os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass
class ExportResult:
    """What :func:`export_comfy` wrote."""

    path: Path
    info: CheckpointInfo
    num_tensors: int
    num_bytes: int
    dtype: torch.dtype


def export_comfy(source: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | str = torch.bfloat16,
                 overwrite: bool = False) -> ExportResult:
    """Write the DiT in ``source`` (any format :func:`~sdvg_engine.models.loading.load_causal_wan` reads) to ``out``
    in ComfyUI's layout, at ``dtype`` (bf16 / fp16 / fp32, or a torch dtype). See the module docstring.

    Refuses, before reading any weights: ``out`` equal to ``source``, an existing ``out`` without ``overwrite``, an
    ``out`` that is a folder. Refuses a source that is not a Wan2.1 DiT with the loader's own error (file and key).
    """
    if isinstance(dtype, str):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
        dtype = EXPORT_DTYPES[dtype]
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    source, out = Path(source).expanduser(), Path(out).expanduser()
    if same_file(source, out):
        raise ValueError(f"{out}: is the source file itself; the export never overwrites its input: choose another "
                         "output name")
    if out.is_dir():
        raise ValueError(f"{out}: is a folder; give a file name (e.g. {out / 'sdvg_drafter_comfy.safetensors'})")
    if out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists; pass --overwrite (overwrite=True) to replace it or choose another "
                         "name")
    state, info = read_checkpoint(source)
    check_comfy_compatible(info.config, source)
    model = build_model(info.config, state, dtype=dtype, device="cpu", path=str(source), fp8_scales=info.fp8_scales)
    tensors = comfy_state_dict(model.state_dict())
    write_safetensors_atomic(tensors, out, comfy_metadata(info), overwrite=overwrite)
    return ExportResult(path=out, info=info, num_tensors=len(tensors),
                        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()), dtype=dtype)
