"""ComfyUI imported in this process from a checkout, the one way the in-process checks need it
(``tests/test_comfy_model.py``, ``tests/test_load_order.py``, ``scripts/gpu_model_path.py``): the pack's ``nodes``
package ahead of ComfyUI's own ``nodes.py``, the launch flags set before ``comfy.model_management`` is first imported
(it reads them once), and the LTS fork's ``comfy.cmd.folder_paths`` under upstream's name ``folder_paths``.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
