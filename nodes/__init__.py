"""ComfyUI adapters of SDVG.

* ``schema``: static node descriptions (no ComfyUI, no torch) - the single source of truth.
* ``logic``: everything the nodes do, as plain functions (no ComfyUI).
* ``comfy_nodes``: the thin ComfyUI V3 classes and ``comfy_entrypoint`` (imports ComfyUI).

Importing this package imports nothing else, so tests can use ``nodes.schema`` and ``nodes.logic``
without ComfyUI.
"""
