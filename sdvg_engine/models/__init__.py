"""Model families of the engine: the causal Wan DiT (``causal_wan``), its KV cache (``kv_cache``), checkpoint reading
(``loading``) and ComfyUI's checkpoint layout (``comfy_layout``). Submodules import on first use, so
``sdvg_engine.models.causal_wan`` works after a bare ``import sdvg_engine``."""

from .._lazy import submodule as _submodule


def __getattr__(name: str):
    return _submodule(__name__, name)
