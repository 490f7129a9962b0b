"""SDVG - speculative decoding for block-autoregressive Wan2.1 video: the ComfyUI node pack.

ComfyUI imports this file when the repository sits in ``custom_nodes/``. The nodes are registered
only through ``comfy_entrypoint`` (ComfyUI's V3 extension API; the LTS fork also gets an empty
``NODE_CLASS_MAPPINGS``, see ``nodes/compat.py``); the engine (``sdvg_engine``) never imports ComfyUI.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:  # installed with `pip install -e .`, or already importable
    import sdvg_engine  # noqa: F401
except ImportError:  # a plain clone in custom_nodes/ (ComfyUI-Manager installs requirements.txt only)
    sys.path.append(_HERE)
    import sdvg_engine  # noqa: F401

# Only ComfyUI (which has imported `comfy` before loading custom nodes) gets the nodes; other importers of
# this file, such as pytest collecting the repository as a package, get nothing and need no ComfyUI.
if "comfy" in sys.modules:
    if importlib.util.find_spec("comfy_api") is None or all(
            importlib.util.find_spec(f"comfy_api.{v}") is None for v in ("v0_0_3", "v0_0_2", "latest")):
        raise ImportError("SDVG needs ComfyUI 0.3.64 or newer (the V3 node API, comfy_api); please update ComfyUI")
    from .nodes.comfy_nodes import comfy_entrypoint  # noqa: E402
    from .nodes.compat import loader_calls_entrypoint_beside_mappings  # noqa: E402

    __all__ = ["comfy_entrypoint"]
    if loader_calls_entrypoint_beside_mappings():
        # The LTS fork logs "Skip ... lack of NODE_CLASS_MAPPINGS" with a traceback without it, then loads the V3
        # entry point anyway; upstream would stop at a mapping and never call comfy_entrypoint, so only there.
        NODE_CLASS_MAPPINGS: dict = {}
        __all__.append("NODE_CLASS_MAPPINGS")
