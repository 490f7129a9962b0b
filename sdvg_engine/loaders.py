"""One-call loaders that turn checkpoint files into the objects the pipeline takes, and the one pipeline builder.

Every pipeline of the project is configured here, the preset applied once (:mod:`sdvg_engine.presets`):

* :func:`load_dit` reads a checkpoint into a :class:`LoadedDiT` (the model and what its checkpoint says about running
  it: context scheme, schedule); no preset is involved yet.
* :func:`build_generator` turns a :class:`LoadedDiT` into a :class:`CausalGenerator` under a preset (or as the
  checkpoint says), recording where each setting came from (``settings_source``).
* :func:`build_pipeline` makes the :class:`SpeculativePipeline` from loaded parts (two :class:`LoadedDiT`, a VAE, an
  optional router) and a preset; :func:`load_pipeline` (files in), the CLI, the ComfyUI nodes, the toy demo and the
  real-size dry run all go through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import presets
from .checks import check_device, check_exists, check_path
from .context import ContextScheme, make_context_scheme
from .generator import CausalGenerator
from .models.loading import CONTEXT_SCHEMES, load_causal_wan

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
#: the checkpoint's own schedule, by architecture: Krea 14B was distilled for 5 calls; Self-Forcing 1.3B for 4, also
#: when it runs with a recompute window (long videos). The schedule belongs to the weights, not the context scheme.
_OWN_SCHEDULE = {"Wan2.1-T2V-14B": "krea"}
DEFAULT_SCHEDULE = "self_forcing"


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def checkpoint_schedule(architecture: str) -> str:
    """The schedule a checkpoint of ``architecture`` was distilled for (``krea`` for the 14B, else ``self_forcing``)."""
    return _OWN_SCHEDULE.get(architecture, DEFAULT_SCHEDULE)


@dataclass(frozen=True)
class LoadedDiT:
    """A loaded causal Wan DiT and what its checkpoint says about running it (what a preset's ``"checkpoint"`` means).

    ``context_scheme``: the scheme it was trained with (``global_cache`` / ``recompute_window``); ``schedule``: the
    schedule it was distilled for. ``info``: the :class:`~sdvg_engine.models.loading.CheckpointInfo` when it came
    from a file."""

    model: torch.nn.Module
    context_scheme: str = "global_cache"
    schedule: str = DEFAULT_SCHEDULE
    info: object = None

    @classmethod
    def of(cls, model: torch.nn.Module, info) -> "LoadedDiT":
        """From a model and its ``CheckpointInfo`` (``load_causal_wan``'s pair; the nodes' ``SDVGModel.info``)."""
        return cls(model, info.context_scheme, checkpoint_schedule(info.architecture), info)


def load_dit(path: str | os.PathLike, *, name: str = "model", dtype="bfloat16", device="cpu", fp8: bool = False,
             num_heads: int | None = None, fuse_qkv: bool = False, compile: bool = False,
             offload: "bool | str" = "none", kv_dtype: str = "auto") -> LoadedDiT:
    """Read a causal Wan checkpoint onto ``device`` (see :func:`load_generator` for the options). The arguments are
    checked before anything loads."""
    from .offload import apply_memory_options, load_device_for

    check_path("path", path)
    device = check_device("device", device)
    torch_dtype = parse_dtype(dtype)
    load_device = load_device_for(offload, device, name, compile, kv_dtype)
    model, info = load_causal_wan(path, dtype=torch_dtype, num_heads=num_heads, fp8=fp8, fuse_qkv=fuse_qkv,
                                  compile=compile, device=load_device)
    apply_memory_options(model, device, offload=offload, kv_dtype=kv_dtype)
    return LoadedDiT.of(model, info)


def build_generator(dit: LoadedDiT, *, name: str = "model", preset: str | None = None, context_scheme: str = "auto",
                    schedule: str = "auto", max_frames: int = 21, attention_bias: float | None = None,
                    anchor_encoder=None) -> CausalGenerator:
    """A fresh :class:`CausalGenerator` for ``dit`` under ``preset`` (the one place a preset is applied).

    ``"auto"`` settings follow the preset's recipe for role ``name`` (``drafter`` / ``target``), or the checkpoint when
    ``preset`` is ``None``; explicit settings win. ``settings_source`` records which applied."""
    if preset is not None:
        presets.recipe(preset, name)  # a bad preset or role fails with its own message
    if context_scheme != "auto" and context_scheme not in CONTEXT_SCHEMES:
        raise ValueError(f"context_scheme must be 'auto' or one of {CONTEXT_SCHEMES}, got {context_scheme!r}")
    scheme_name, schedule, source = presets.resolve(preset, name, context_scheme=context_scheme, schedule=schedule,
                                                    checkpoint_context=dit.context_scheme,
                                                    checkpoint_schedule=dit.schedule)
    if attention_bias is not None and scheme_name != "recompute_window":
        where = getattr(dit.info, "path", None) or "this model"
        raise ValueError(f"{name}: attention_bias={attention_bias} only applies to the recompute-window context, but "
                         f"{where} runs with '{scheme_name}' ({source['context_scheme']}); drop the attention bias or "
                         "choose context_scheme='recompute_window'")
    scheme: ContextScheme = make_context_scheme(scheme_name, max_frames=max_frames, attention_bias=attention_bias,
                                                anchor_encoder=anchor_encoder)
    gen = CausalGenerator(dit.model, schedule=schedule, context=scheme, name=name)
    if dit.info is not None:
        gen.info = dit.info
    gen.settings_source = source
    return gen


def build_pipeline(drafter: LoadedDiT, target: LoadedDiT, vae, router=None, *, preset: str = presets.DEFAULT_PRESET,
                   drafter_context: str = "auto", target_context: str = "auto", drafter_schedule: str = "auto",
                   target_schedule: str = "auto", max_frames: int = 21, drafter_attention_bias: float | None = None,
                   target_attention_bias: float | None = None, anchor_encoder=None, workers: "int | str | None" = None,
                   memo=None):
    """The :class:`SpeculativePipeline` of loaded parts under ``preset`` (``"reference"`` / ``"native"``).

    Args:
        drafter, target: :class:`LoadedDiT` (from :func:`load_dit`, or ``LoadedDiT.of(model, info)``, or
            ``LoadedDiT(model, context_scheme, schedule)`` for a model built in memory).
        vae: a :class:`~sdvg_engine.vae.StreamingWanVAE`; router: a :class:`RewardRouter` or ``None``.
        drafter_context / target_context / drafter_schedule / target_schedule: ``"auto"`` (the preset's) or explicit.
        max_frames: the global cache's capacity in latent frames (both models).
        drafter_attention_bias / target_attention_bias: the recompute window's attention bias per model.
        anchor_encoder: what re-encodes a recompute window's anchor frame (``None``: the pipeline's ``vae``).
        workers: the pipeline's default worker layout (``None``: the pipeline's own default, ``"auto"``).
        memo: a :class:`~sdvg_engine.memo.ReplayMemo` (``None``: replay off).
    Fresh generators are made on every call (own KV caches and context state), so one loaded model may serve
    several pipelines one after another.
    """
    from .pipeline import SpeculativePipeline

    presets.check_preset(preset)
    gens = [build_generator(dit, name=role, preset=preset, context_scheme=context, schedule=schedule,
                            max_frames=max_frames, attention_bias=bias, anchor_encoder=anchor_encoder)
            for role, dit, context, schedule, bias in (
                ("drafter", drafter, drafter_context, drafter_schedule, drafter_attention_bias),
                ("target", target, target_context, target_schedule, target_attention_bias))]
    pipe = SpeculativePipeline(gens[0], gens[1], vae, router)
    pipe.preset = preset
    if workers is not None:
        pipe.workers = workers
    pipe.memo = memo
    return pipe


def load_generator(path: str | os.PathLike, *, name: str = "model", dtype="bfloat16", device="cpu",
                   context_scheme: str = "auto", schedule: str = "auto", fp8: bool = False,
                   num_heads: int | None = None, max_frames: int = 21, attention_bias: float | None = None,
                   anchor_encoder=None, fuse_qkv: bool = False, compile: bool = False,
                   preset: str | None = None, offload: "bool | str" = "none", kv_dtype: str = "auto") -> CausalGenerator:
    """Load a causal Wan checkpoint and wrap it as a :class:`CausalGenerator` (:func:`load_dit` + :func:`build_generator`).

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
    Bad arguments (path, device, preset, role, context scheme) are refused before the (long) load.
    """
    check_path("path", path)
    check_device("device", device)
    if preset is not None:
        presets.recipe(preset, name)
    if context_scheme != "auto" and context_scheme not in CONTEXT_SCHEMES:
        raise ValueError(f"context_scheme must be 'auto' or one of {CONTEXT_SCHEMES}, got {context_scheme!r}")
    dit = load_dit(path, name=name, dtype=dtype, device=device, fp8=fp8, num_heads=num_heads, fuse_qkv=fuse_qkv,
                   compile=compile, offload=offload, kv_dtype=kv_dtype)
    return build_generator(dit, name=name, preset=preset, context_scheme=context_scheme, schedule=schedule,
                           max_frames=max_frames, attention_bias=attention_bias, anchor_encoder=anchor_encoder)


def _offload_per_role(offload) -> tuple[str, str]:
    """``load_pipeline``'s ``offload`` -> (drafter's, target's) ``load_dit`` offload: ``"none"`` / ``"target"`` /
    ``"both"`` (:data:`sdvg_engine.offload.OFFLOAD_CHOICES`, as the CLI's ``--offload``); ``"blocks"`` / ``True``
    stream both (what ``load_generator``'s ``offload`` meant when it reached both models)."""
    from .offload import OFFLOAD_CHOICES

    if offload is True or offload == "blocks":
        offload = "both"
    elif offload is False:
        offload = "none"
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {OFFLOAD_CHOICES} (which models stream their blocks from CPU RAM), "
                         f"got {offload!r}")
    return ("blocks" if offload == "both" else "none"), ("none" if offload == "none" else "blocks")


def load_pipeline(*, drafter: str | os.PathLike, target: str | os.PathLike, vae: str | os.PathLike,
                  reward: str | os.PathLike | None = None, preset: str = "reference", device="cpu", drafter_device=None,
                  aux_device=None, dtype="bfloat16", vae_dtype="float32", drafter_context: str = "auto",
                  target_context: str = "auto", drafter_schedule: str = "auto", target_schedule: str = "auto",
                  fp8_target: bool = False, router_options: dict | None = None, offload: "str | bool" = "none",
                  target_attention_bias: float | None = None, workers: "int | str | None" = None,
                  **model_options):
    """Load drafter, target, VAE (and ImageReward) into a :class:`SpeculativePipeline`, in the paper's
    configuration by default (``preset="reference"``; ``"native"`` runs each model as distilled).

    ``router_options`` go to :class:`RewardRouter` (``tau``, ``tau_mode``, ``accept_rate``, ``aggregation`` ...),
    with :func:`sdvg_engine.router.default_router_options`: relative routing with margin -0.25 when no threshold is
    given (the held-out choice, docs/dev/routing.md), the paper's fixed scale when only ``tau`` is
    (``router_options=PAPER_ROUTER_OPTIONS``: the paper's tau = -0.7);
    ``offload``: ``"none"`` / ``"target"`` / ``"both"`` stream those models' blocks from CPU RAM (``"blocks"`` = both);
    ``target_attention_bias``: the target's recompute-window attention bias (``attention_bias`` in ``model_options``
    applies to both models);
    ``model_options`` to both :func:`load_dit` / :func:`build_generator` calls (``max_frames``, ``fuse_qkv``,
    ``compile``, ``kv_dtype``, ``attention_bias`` ...).
    Checks the preset, the paths, the devices and the router options before loading anything; the pipeline is made
    by :func:`build_pipeline`.
    """
    from .router import RewardRouter, default_router_options
    from .vae import load_wan_vae

    presets.check_preset(preset)
    for arg, value in (("drafter", drafter), ("target", target), ("vae", vae)):
        check_path(arg, value, "a checkpoint file" if arg != "vae" else "a Wan2.1 VAE file or folder")
    if reward is not None:
        check_path("reward", reward, "an ImageReward file")
    check_device("device", device)
    for arg, value in (("drafter_device", drafter_device), ("aux_device", aux_device)):
        if value is not None:
            check_device(arg, value)
    drafter_offload, target_offload = _offload_per_role(model_options.pop("offload", offload))
    build_keys = ("max_frames", "attention_bias", "anchor_encoder")
    build_options = {k: model_options.pop(k) for k in build_keys if k in model_options}
    router_options = default_router_options(router_options)
    if router_options:
        # Checked before anything loads (the router keeps the scorer without touching it): a typo in the options
        # should not cost the minutes a 14B takes to load.
        try:
            RewardRouter(None, **router_options)
        except TypeError as e:
            raise ValueError(f"router_options: {e}; valid keys are RewardRouter's (tau, tau_mode, accept_rate, "
                             "aggregation, crop, temporal_weight, preprocess, prior_mean, prior_std, prior_count)") from None
    for arg, value in (("drafter", drafter), ("target", target), ("vae", vae), ("reward", reward)):
        if value is not None:
            check_exists(arg, value)  # every file before the first load: a typo must not cost a 14B's load time
    aux = aux_device or device
    router = None
    if reward is not None:  # first: a wrong reward file is found before the DiTs (minutes for a 14B) load
        from .reward import load_image_reward

        router = RewardRouter(load_image_reward(reward, device=aux), **router_options)
    streaming_vae = load_wan_vae(vae, device=aux, dtype=parse_dtype(vae_dtype))
    draft_dit = load_dit(drafter, name="drafter", dtype=dtype, device=drafter_device or device,
                         offload=drafter_offload, **model_options)
    target_dit = load_dit(target, name="target", dtype=dtype, device=device, fp8=fp8_target, offload=target_offload,
                          **model_options)
    bias = build_options.get("attention_bias")
    return build_pipeline(draft_dit, target_dit, streaming_vae, router, preset=preset, drafter_context=drafter_context,
                          target_context=target_context, drafter_schedule=drafter_schedule,
                          target_schedule=target_schedule, max_frames=build_options.get("max_frames", 21),
                          drafter_attention_bias=bias,
                          target_attention_bias=bias if target_attention_bias is None else target_attention_bias,
                          anchor_encoder=build_options.get("anchor_encoder"), workers=workers)
