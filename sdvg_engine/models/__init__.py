"""Model families of the engine: the causal Wan DiT (``causal_wan``), its KV cache (``kv_cache``), checkpoint reading
(``loading``) and ComfyUI's checkpoint layout (``comfy_layout``). Submodules import on first use, so
``sdvg_engine.models.causal_wan`` works after a bare ``import sdvg_engine``."""

from importlib import import_module


def __getattr__(name: str):
    try:
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
