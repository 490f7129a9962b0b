"""One-call loaders that turn checkpoint files into the objects the pipeline takes."""

from __future__ import annotations

import os

import torch

from . import presets
from .context import ContextScheme, make_context_scheme
from .generator import CausalGenerator
from .models.loading import CONTEXT_SCHEMES, load_causal_wan

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def load_generator(path: str | os.PathLike, *, name: str = "model", dtype="bfloat16", device="cpu",
                   context_scheme: str = "auto", schedule: str = "auto", fp8: bool = False,
                   num_heads: int | None = None, max_frames: int = 21, attention_bias: float | None = None,
                   anchor_encoder=None, fuse_qkv: bool = False, compile: bool = False,
                   preset: str | None = None, offload: "bool | str" = "none", kv_dtype: str = "auto") -> CausalGenerator:
    """Load a causal Wan checkpoint and wrap it as a :class:`CausalGenerator`.

    ``context_scheme="auto"`` takes the scheme the checkpoint was trained with (14B Krea: recompute
    window; Self-Forcing 1.3B: global cache); ``schedule="auto"`` takes the schedule the weights were
    distilled for (``krea``'s 5 calls for the 14B, ``self_forcing``'s 4 otherwise). ``fuse_qkv``
    fuses the attention projections and ``compile`` wraps the block forward in ``torch.compile``
    (inference only; see ``bench/bench_speed.py`` for their effect). ``offload="blocks"`` (or ``True``)
    keeps the transformer blocks in CPU RAM and streams them to the CUDA ``device`` per call;
    ``kv_dtype="fp8"`` stores the KV cache in float8 (see ``sdvg_engine/offload.py``, ``docs/memory.md``).

    ``preset`` (``"reference"`` / ``"native"``, see :mod:`sdvg_engine.presets`; ``name`` must then be
    ``"drafter"`` or ``"target"``) decides what ``"auto"`` means; explicit settings still win. Without a preset
    ``"auto"`` is the checkpoint's own choice, as :func:`load_pipeline` with ``preset="native"``.
    """
    from .offload import apply_memory_options, load_device_for

    if preset is not None:
        presets.recipe(preset, name)  # a bad preset or role fails before the (long) load
    if context_scheme != "auto" and context_scheme not in CONTEXT_SCHEMES:
        raise ValueError(f"context_scheme must be 'auto' or one of {CONTEXT_SCHEMES}, got {context_scheme!r}")
    model, info = load_causal_wan(path, dtype=parse_dtype(dtype), num_heads=num_heads, fp8=fp8, fuse_qkv=fuse_qkv,
                                  compile=compile, device=load_device_for(offload, device, name, compile, kv_dtype))
    apply_memory_options(model, device, offload=offload, kv_dtype=kv_dtype)
    # The schedule belongs to the weights, not to the context scheme: Krea 14B was distilled for
    # 5 calls; Self-Forcing 1.3B for 4, also when it runs with a recompute window (long videos).
    own_schedule = "krea" if info.architecture == "Wan2.1-T2V-14B" else "self_forcing"
    scheme_name, schedule, source = presets.resolve(preset, name, context_scheme=context_scheme, schedule=schedule,
                                                    checkpoint_context=info.context_scheme, checkpoint_schedule=own_schedule)
    if attention_bias is not None and scheme_name != "recompute_window":
        raise ValueError(f"{name}: attention_bias={attention_bias} only applies to the recompute-window context, but "
                         f"{path} runs with '{scheme_name}' ({source['context_scheme']}); drop the attention bias or "
                         "choose context_scheme='recompute_window'")
    scheme: ContextScheme = make_context_scheme(scheme_name, max_frames=max_frames, attention_bias=attention_bias,
                                                anchor_encoder=anchor_encoder)
    gen = CausalGenerator(model, schedule=schedule, context=scheme, name=name)
    gen.info = info
    gen.settings_source = source
    return gen


def load_pipeline(*, drafter: str | os.PathLike, target: str | os.PathLike, vae: str | os.PathLike,
                  reward: str | os.PathLike | None = None, preset: str = "reference", device="cpu", drafter_device=None,
                  aux_device=None, dtype="bfloat16", vae_dtype="float32", drafter_context: str = "auto",
                  target_context: str = "auto", drafter_schedule: str = "auto", target_schedule: str = "auto",
                  fp8_target: bool = False, router_options: dict | None = None, **model_options):
    """Load drafter, target, VAE (and ImageReward) into a :class:`SpeculativePipeline`, in the paper's
    configuration by default (``preset="reference"``; ``"native"`` runs each model as distilled).

    ``router_options`` go to :class:`RewardRouter` (``tau``, ``tau_mode``, ``accept_rate``, ``aggregation`` ...),
    with :func:`sdvg_engine.router.default_router_options`: relative routing with margin -0.25 when no threshold is
    given (the held-out choice, docs/routing.md), the paper's fixed scale when only ``tau`` is
    (``router_options=PAPER_ROUTER_OPTIONS``: the paper's tau = -0.7);
    ``model_options`` to both :func:`load_generator` calls (``max_frames``, ``fuse_qkv``, ``compile`` ...).
    Checks the preset before loading anything.
    """
    from .pipeline import SpeculativePipeline
    from .router import RewardRouter, default_router_options
    from .vae import load_wan_vae

    presets.check_preset(preset)
    router_options = default_router_options(router_options)
    if router_options:
        # Checked before anything loads (the router keeps the scorer without touching it): a typo in the options
        # should not cost the minutes a 14B takes to load.
        try:
            RewardRouter(None, **router_options)
        except TypeError as e:
            raise ValueError(f"router_options: {e}; valid keys are RewardRouter's (tau, tau_mode, accept_rate, "
                             "aggregation, crop, temporal_weight, preprocess, prior_mean, prior_std, prior_count)") from None
    aux = aux_device or device
    streaming_vae = load_wan_vae(vae, device=aux, dtype=parse_dtype(vae_dtype))
    draft_gen = load_generator(drafter, name="drafter", dtype=dtype, device=drafter_device or device,
                               context_scheme=drafter_context, schedule=drafter_schedule, preset=preset, **model_options)
    target_gen = load_generator(target, name="target", dtype=dtype, device=device, fp8=fp8_target,
                                context_scheme=target_context, schedule=target_schedule, preset=preset, **model_options)
    router = None
    if reward is not None:
        from .reward import load_image_reward

        router = RewardRouter(load_image_reward(reward, device=aux), **router_options)
    pipe = SpeculativePipeline(draft_gen, target_gen, streaming_vae, router)
    pipe.preset = preset
    return pipe
