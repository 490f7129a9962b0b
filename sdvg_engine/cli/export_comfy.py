"""``sdvg export-comfy``: write a drafter / target in ComfyUI's ``model.diffusion_model.*`` layout, so that a
``self_forcing_dmd.pt`` (or any file the pack reads) loads in ComfyUI's core Load Diffusion Model node.

The work is :func:`sdvg_engine.models.comfy_layout.export_comfy` (what the file holds, the metadata ComfyUI reads, the
atomic write). This module holds the command's flags (:func:`add_parser`, called by :func:`..args.build_parser`) and
the command; it imports nothing heavy at module level (``sdvg --help`` must not import torch).
"""

from __future__ import annotations

from pathlib import Path

from .common import UsageError, _print_err
from .outputs import check_output_file

COMMAND = "export-comfy"
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
#: What ComfyUI's diffusion_models folder lists and UNETLoader reads as safetensors.
SUFFIXES = (".safetensors", ".sft")


def add_parser(sub, func) -> None:
    """Add ``export-comfy`` to the ``sdvg`` subparsers ``sub``; ``func`` runs it (``args.func``)."""
    p = sub.add_parser(
        COMMAND, help="write a drafter/target checkpoint in ComfyUI's layout (model.diffusion_model.*), loadable "
                      "with ComfyUI's Load Diffusion Model node",
        description="Write a causal Wan2.1 DiT (self_forcing_dmd.pt, krea-realtime-video-14b.safetensors, any file "
                    "`sdvg inspect` reads) as ComfyUI's diffusion_models file: original Wan key names under "
                    "model.diffusion_model., and the metadata newer ComfyUI reads to build its causal Wan "
                    "(CausalWanModel); older ComfyUI loads the same file as a plain Wan2.1 model.")
    g = p.add_argument_group("input")
    g.add_argument("--in", dest="source", required=True, metavar="FILE",
                   help="the drafter or target checkpoint, e.g. self_forcing_dmd.pt (required)")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="FILE",
                   help="the output .safetensors, e.g. ComfyUI/models/diffusion_models/self_forcing_dmd_comfy"
                        ".safetensors (required; an existing file is kept unless --overwrite)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16",
                   help="the weights' dtype in the file (modulation, time embedding and norms stay fp32, as the pack "
                        "loads them)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=func)


def check_paths(args) -> tuple[Path, Path]:
    """``(source, out)`` after the checks that need no model: run before anything is read."""
    from ..models.comfy_layout import same_file

    source, out = Path(args.source).expanduser(), Path(args.out).expanduser()
    if out.suffix.lower() not in SUFFIXES:
        raise UsageError(f"--out {out}: ComfyUI reads this file as safetensors; give it a .safetensors name "
                         f"(e.g. {out.with_suffix('.safetensors').name})")
    if same_file(source, out):
        raise UsageError(f"--out {out}: is the --in file itself; the export never overwrites its input: choose "
                         "another name")
    check_output_file(out, "--out", overwrite=args.overwrite)
    return source, out


def cmd_export_comfy(args) -> int:
    source, out = check_paths(args)
    from ..models.comfy_layout import export_comfy

    _print_err(f"reading {source} ...")
    result = export_comfy(source, out, dtype=args.dtype, overwrite=args.overwrite)
    info = result.info
    print(f"wrote {result.num_tensors} tensors ({result.num_bytes / 1e9:.2f} GB, {args.dtype}; {info.architecture}, "
          f"from {info.format}" + (f" entry '{info.source_entry}'" if info.source_entry else "") + f") to {out}")
    print("ComfyUI: put it in models/diffusion_models/ and load it with Load Diffusion Model (UNETLoader)")
    return 0
