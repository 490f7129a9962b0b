"""ComfyUI imported in this process from a checkout, the one way the in-process checks need it
(``tests/test_comfy_model.py``, ``tests/test_load_order.py``, ``scripts/gpu_model_path.py``): the pack's ``nodes``
package ahead of ComfyUI's own ``nodes.py``, the launch flags set before ``comfy.model_management`` is first imported
(it reads them once), and the LTS fork's ``comfy.cmd.folder_paths`` under upstream's name ``folder_paths``; and
:func:`dequantised`, the float weights a loaded ComfyUI DiT computes with (the reference for its fp8 / scaled-fp8
storage).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def is_checkout(path) -> bool:
    return bool(path) and (Path(path) / "comfy" / "model_management.py").is_file()


def import_comfyui(path, *, cpu: bool = True):
    """Import ComfyUI from the checkout ``path`` (``--cpu`` unless ``cpu=False``); returns
    ``comfy.model_management``. Flags only apply if nothing imported ``comfy.model_management`` before."""
    for entry in (str(ROOT / "tests"), str(ROOT)):  # ROOT first: its `nodes` package, not ComfyUI's nodes.py
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if str(path) not in sys.path:
        sys.path.append(str(path))
    if "comfy.model_management" not in sys.modules:
        import comfy.cli_args

        comfy.cli_args.args.cpu = cpu
    import comfy.model_management

    try:
        import folder_paths  # noqa: F401  (upstream: a top-level module of the checkout)
    except ImportError:  # the LTS fork, whose custom-node loader aliases it the same way
        from comfy.cmd import folder_paths

        sys.modules["folder_paths"] = folder_paths
    return comfy.model_management


def comfyui_or_skip(test_file: str):
    """``(path, comfy.model_management)`` of the ComfyUI checkout ``COMFYUI_PATH`` names, imported with ``--cpu``; without
    one, skip the calling test module (``test_file``: its ``__file__``), saying how to run it."""
    path = os.environ.get("COMFYUI_PATH", "")
    if not is_checkout(path):
        import pytest

        name = Path(test_file).name
        pytest.skip("in-process ComfyUI tests: set COMFYUI_PATH to a ComfyUI checkout and run them with its Python, "
                    f"e.g. COMFYUI_PATH=.e2e/ComfyUI .e2e/venv/bin/python -m pytest -p no:xdist tests/{name}",
                    allow_module_level=True)
    return path, import_comfyui(path)


#: per-tensor scale keys of scaled-fp8 weights: 0.3.64 (scaled_fp8 ops) / the LTS fork (QuantizedTensor layouts)
SCALE_KEYS = ("scale_weight", "weight_scale")


def dequantised(source: torch.nn.Module) -> dict:
    """The weights a ComfyUI DiT holds, in float32: fp8 values widened, scaled-fp8 ones times their scale."""
    state = source.state_dict()
    out = {}
    for key, value in state.items():
        if key.rsplit(".", 1)[-1] in SCALE_KEYS + ("scale_input", "input_scale", "comfy_quant"):
            continue
        scales = [state.get(f"{key[:-len('weight')]}{name}") for name in SCALE_KEYS] if key.endswith(".weight") else []
        scale = next((s for s in scales if s is not None), None)
        out[key] = value.float() * (scale.float() if scale is not None else 1.0)
    return out
