"""SDVG engine: speculative decoding for block-autoregressive video diffusion.

Data flow: load (``load_generator``, ``load_wan_vae``, ``load_image_reward``) -> encode the prompt
(``text_encoder``) -> ``SpeculativePipeline.generate``: draft -> decode -> score -> route ->
commit or regenerate -> frames, acceptance mask, report.

Nothing in this package imports ComfyUI; ``nodes/`` adapts it.

The names below are imported on first use (PEP 562): ``import sdvg_engine`` (and so the ``sdvg`` command's
``--help``) imports no torch; ``from sdvg_engine import load_generator`` works as before.
"""

from importlib import import_module

from ._lazy import submodule as _submodule

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "AnchorEncoder": ".context", "GlobalCache": ".context", "RecomputeWindow": ".context",
    "make_context_scheme": ".context",
    "BlockSample": ".generator", "CausalGenerator": ".generator",
    "load_generator": ".loaders", "parse_dtype": ".loaders",
    "CausalWanTransformer3DModel": ".models.causal_wan", "TextKV": ".models.causal_wan", "wan_config": ".models.causal_wan",
    "CheckpointError": ".models.loading", "CheckpointInfo": ".models.loading", "inspect_checkpoint": ".models.loading",
    "load_causal_wan": ".models.loading",
    "MODES": ".pipeline", "CancelToken": ".pipeline", "GenerationCancelled": ".pipeline", "SDVGOptions": ".pipeline",
    "SDVGResult": ".pipeline", "SpeculativePipeline": ".pipeline",
    "StreamAbandoned": ".workers",
    "BlockRecord": ".report",
    "KREA_SCHEDULE": ".sampling", "SELF_FORCING_SCHEDULE": ".sampling", "Schedule": ".sampling",
    "SeededNoise": ".sampling", "TensorNoise": ".sampling",
    # the API's other entry points, importable from the package too
    "load_pipeline": ".loaders", "build_pipeline": ".loaders", "load_wan_vae": ".vae", "RewardRouter": ".router",
    "ReplayMemo": ".memo", "load_image_reward": ".reward",
    "PromptSchedule": ".prompt_schedule", "PromptSegment": ".prompt_schedule", "parse_schedule": ".prompt_schedule",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # ``sdvg_engine.router`` after a bare ``import sdvg_engine``: the eager package imported its submodules.
        return _submodule(__name__, name)
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
