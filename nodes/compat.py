"""What differs between the ComfyUI versions the pack runs in, as plain functions (no ComfyUI import).

Tested against stand-ins of each version's behaviour in ``tests/test_nodes.py``; ``comfy_nodes.py`` and the pack's
root ``__init__.py`` call them with the real modules.
"""

from __future__ import annotations

import importlib.util
import os

#: Pack model folders (under ComfyUI's models/) and the files they list.
_PT = (".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft")
MODEL_FOLDERS = {"sdvg": _PT, "sdvg_reward": _PT, "image_reward": _PT, "sdvg_embeddings": (".safetensors",)}


def register_folders_in(paths_module, folders: dict = MODEL_FOLDERS) -> None:
    """Register ``models/<name>`` for every folder of ``folders`` in ComfyUI's ``folder_paths`` module
    (extra_model_paths.yaml entries with these names are kept and extended).

    The extension set is updated in place, never replaced: in ComfyUI 0.3.64 (and upstream today) an entry is a
    plain ``(list, set)`` tuple, but in the LTS fork (hiddenswitch, 0.12.x) entries are live views of the mapping,
    so ``folder_names_and_paths[name] = (paths, exts)`` first drops the entry and then stores the now-empty
    ``paths`` (every model combo of the pack came up empty there)."""
    for name, extensions in folders.items():
        paths_module.add_model_folder_path(name, os.path.join(paths_module.models_dir, name))
        known = paths_module.folder_names_and_paths[name][1]
        if not len(known):  # a new key lists every file (README.txt, .DS_Store ...): restrict it to model files
            known.update(extensions)


def loader_calls_entrypoint_beside_mappings(find_spec=importlib.util.find_spec) -> bool:
    """Whether this ComfyUI's custom-node loader calls ``comfy_entrypoint`` even when the module has a
    ``NODE_CLASS_MAPPINGS``.

    Upstream ComfyUI (0.3.64 ``nodes.load_custom_node``) registers a non-None ``NODE_CLASS_MAPPINGS`` and stops, so
    the pack must not define one there (its V3 nodes would never load). The LTS fork (``comfy.nodes.
    vanilla_node_importing``) logs an error with a traceback when the name is missing, then calls the V3 entry
    point anyway: there an empty ``NODE_CLASS_MAPPINGS`` keeps the log clean."""
    try:
        return find_spec("comfy.nodes.vanilla_node_importing") is not None
    except (ImportError, ValueError):  # 'comfy.nodes' absent, or a namespace without a spec
        return False
