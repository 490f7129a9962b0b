"""The work of the loader nodes and what the sampler takes from ComfyUI's own objects.

* SDVG Load Drafter / SDVG Load Target: a checkpoint file as an :class:`SDVGModel` (the memory plan's ``card``
  settings, block streaming, fp8), the same type SDVG Drafter / Target from MODEL make (``comfy_model.py``);
* SDVG Reward Router: an :class:`SDVGRouter` over a cached ImageReward scorer;
* ComfyUI's VAE converted once into the engine's streaming decoder (:func:`streaming_vae`);
* CONDITIONING and SDVG Load Prompt Embeddings: the UMT5 context the models read.

Objects passed between nodes are cached by ComfyUI and shared by every later run: nothing here mutates them.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from sdvg_engine.checks import check_choice, check_int
from sdvg_engine.comfy_bridge import ModuleHolder
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.loaders import LoadedDiT, build_generator, load_generator, parse_dtype
from sdvg_engine.offload import ResidentPart, check_offload_device, enable_block_offload
from sdvg_engine.reward import ImageRewardScorer, load_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.text_encoder import load_prompt_embeddings
from sdvg_engine.vae import StreamingWanVAE, wan_vae_from_state_dict

from . import schema
from .services import Services, check_model_name, resolve_devices

__all__ = ["SDVGModel", "SDVGRouter", "build_router", "card_settings", "clear_reward_cache",
           "context_from_conditioning", "load_embeddings_node", "load_model_node", "load_prompt_embedding",
           "load_reward_scorer", "load_sdvg_model", "reward_dtype", "streaming_vae"]

TEXT_DIM = 4096
_REWARD_CACHE_SIZE = 2


# =========================================================================================================== models
@dataclass(eq=False)
class SDVGModel:
    """An ``SDVG_MODEL``: a loaded causal Wan DiT plus how to run it. Read-only once built."""

    model: torch.nn.Module
    info: Any
    path: str
    role: str
    dtype: str
    context_scheme: str
    schedule: str
    load_device: torch.device
    offload_device: torch.device
    holder: torch.nn.Module
    patcher: Any
    max_frames: int = 21
    #: the loader's context_scheme input ("auto" lets the sampler's preset decide)
    requested_context_scheme: str = "auto"
    #: where the weights come from: "file" (SDVG Load Drafter / Target) or "comfy" (a ComfyUI MODEL, whose
    #: ModelPatcher is ``patcher``; see :func:`load_model_from_comfy`)
    backend: str = "file"
    #: a MODEL's own report lines (``comfy_model.describe_model`` of its view and patcher), given by its adapter
    describe_source: Any = None

    @property
    def comfy_backed(self) -> bool:
        return self.backend == "comfy"

    def new_generator(self, preset: str | None = None) -> CausalGenerator:
        """A fresh generator for one run (own KV cache, context state and counters), configured by ``preset``
        (``None``: as loaded, i.e. as the checkpoint says), through the one builder
        (:func:`sdvg_engine.loaders.build_generator`, where presets are applied)."""
        if preset is None:
            dit = LoadedDiT(self.model, self.context_scheme, self.schedule, self.info)
            return build_generator(dit, name=self.role, max_frames=self.max_frames)
        dit = LoadedDiT(self.model, self.info.context_scheme, self.schedule, self.info)
        return build_generator(dit, name=self.role, preset=preset, context_scheme=self.requested_context_scheme,
                               max_frames=self.max_frames)

    def describe(self) -> dict:
        if self.comfy_backed:
            return {"source": "ComfyUI MODEL", "architecture": self.info.architecture, "dtype": self.dtype,
                    "device": str(self.load_device), "context_scheme": self.context_scheme, "schedule": self.schedule,
                    **(self.describe_source() if self.describe_source is not None else {})}
        return {"file": os.path.basename(self.path), "architecture": self.info.architecture, "dtype": self.dtype,
                "device": str(self.load_device), "context_scheme": self.context_scheme, "schedule": self.schedule,
                **({"offload": "blocks"} if getattr(self.model, "block_hooks", None) is not None else {}),
                **({"kv_dtype": "fp8"} if getattr(self.model, "kv_cache_dtype", None) == torch.float8_e4m3fn else {})}


def load_sdvg_model(path: str, *, role: str, dtype: str = "bf16", device: str = "auto",
                    context_scheme: str = "auto", services: Services | None = None, offload: str = "none",
                    kv_dtype: str = "auto") -> SDVGModel:
    """Load a drafter or target checkpoint (the work of SDVGLoadDrafter / SDVGLoadTarget).

    ``offload="blocks"``: the blocks stay in CPU RAM and stream to the load device per call
    (``sdvg_engine/offload.py``); the memory manager then handles only the resident rest.
    """
    services = services or Services()
    if context_scheme not in schema.CONTEXT_SCHEMES:
        raise ValueError(f"context_scheme must be one of {schema.CONTEXT_SCHEMES}, got {context_scheme!r}")
    if offload not in schema.OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {schema.OFFLOAD_MODES}, got {offload!r}")
    if kv_dtype not in schema.KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {schema.KV_DTYPES}, got {kv_dtype!r}")
    fp8 = dtype == "fp8"
    torch_dtype = torch.bfloat16 if fp8 else parse_dtype(dtype)
    load_device, offload_device = resolve_devices(device, services)
    if offload == "blocks":
        check_offload_device(load_device, f"the {role}")
    gen = load_generator(path, name=role, dtype=torch_dtype, device=offload_device, context_scheme=context_scheme, fp8=fp8,
                         kv_dtype=kv_dtype)
    managed = gen.model
    if offload == "blocks":  # ComfyUI moves the resident part; the streamer moves the blocks
        streamer = enable_block_offload(gen.model, load_device, offload_device=offload_device,
                                        use_stream=load_device.type == "cuda", move_resident=False)
        managed = ResidentPart(gen.model, streamer)
    holder = ModuleHolder(managed, device=offload_device)
    return SDVGModel(
        model=gen.model, info=gen.info, path=str(path), role=role, dtype=dtype, context_scheme=gen.context.name,
        schedule=gen.schedule.name, load_device=load_device, offload_device=offload_device, holder=holder,
        patcher=services.wrap(holder, load_device, offload_device), requested_context_scheme=context_scheme,
    )


def card_settings(card: str, role: str, on_cuda: bool = True) -> dict:
    """The loader settings (``dtype``, ``offload``, ``kv_dtype``, ``context_scheme``) the memory plan picks for a
    ``card`` of the loaders' ``card`` input, for the ``role`` ``drafter`` or ``target``; ``{}`` for ``manual``.

    One rule with the CLI's ``--vram-gb``: :func:`sdvg_engine.offload.plan_memory` at 832x480, 81 frames. Off CUDA
    (``on_cuda=False``) nothing is streamed: the weights are in RAM already and block offload needs a GPU."""
    from sdvg_engine.offload import plan_memory

    check_choice("card", card, schema.CARDS)
    if card == "manual":
        return {}
    plan = plan_memory(float(card.split()[0]))
    streamed = {"target": ("target", "both"), "drafter": ("both",)}[role]
    settings = {"dtype": "fp8" if role == "target" and plan.fp8_target else "bf16",
                "offload": "blocks" if on_cuda and plan.offload in streamed else "none",
                "kv_dtype": plan.kv_dtype}
    if role == "drafter" and plan.drafter_context != "auto":
        settings["context_scheme"] = plan.drafter_context
    return settings


def load_model_node(ckpt_name: str, dtype: str, device: str, context_scheme: str, *, role: str,
                    services: Services, offload: str = "none", kv_dtype: str = "auto", card: str = "manual") -> SDVGModel:
    """The work of SDVGLoadDrafter / SDVGLoadTarget. ``card`` other than ``manual`` replaces ``dtype``, ``offload``,
    ``kv_dtype`` (and the drafter's ``context_scheme`` where the plan changes it) with the memory plan's."""
    dtypes = schema.DRAFTER_DTYPES if role == "drafter" else schema.TARGET_DTYPES
    if not isinstance(dtype, str) or dtype not in dtypes:
        fix = "; fp8 is for the target (the drafter is small: use bf16)" if role == "drafter" and dtype == "fp8" else ""
        raise ValueError(f"dtype of the {role} must be one of {dtypes}, got {dtype!r}{fix}")
    check_model_name(ckpt_name, schema.DRAFTER_FOLDERS)  # also under ComfyUI, whose own resolver may normalise the name
    if card != "manual":
        on_cuda = resolve_devices(device, services)[0].type == "cuda"
        chosen = card_settings(card, role, on_cuda)
        dtype, offload, kv_dtype = chosen["dtype"], chosen["offload"], chosen["kv_dtype"]
        context_scheme = chosen.get("context_scheme", context_scheme)
    else:
        check_choice("card", card, schema.CARDS)
    path = services.resolve(schema.DRAFTER_FOLDERS, ckpt_name)
    return load_sdvg_model(path, role=role, dtype=dtype, device=device, context_scheme=context_scheme, services=services,
                           offload=offload, kv_dtype=kv_dtype)


# =========================================================================================================== router
@dataclass(eq=False)
class SDVGRouter:
    """An ``SDVG_ROUTER``: the loaded scorer (shared, cached per file) and the routing settings of this node."""

    scorer: ImageRewardScorer
    patcher: Any
    path: str
    tau: float
    aggregation: str
    crop: str
    temporal_weight: float
    tau_mode: str = "fixed"
    accept_rate: float = 0.73
    preprocess: str = "pil"

    def new_router(self) -> RewardRouter:
        """A fresh router for one run; this object is never changed."""
        return RewardRouter(self.scorer, tau=self.tau, aggregation=self.aggregation, crop=self.crop,
                            temporal_weight=self.temporal_weight, tau_mode=self.tau_mode,
                            accept_rate=self.accept_rate, preprocess=self.preprocess)


_reward_cache: "OrderedDict[tuple, tuple[ImageRewardScorer, Any]]" = OrderedDict()
_reward_lock = threading.Lock()


def reward_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def load_reward_scorer(path: str, services: Services) -> tuple[ImageRewardScorer, Any]:
    """Load (or reuse) the ImageReward scorer of ``path``: cached by file, size and mtime, so routers that
    differ only in tau, aggregation ... share one loaded model."""
    st = os.stat(path)
    load_device = services.main_device()
    dtype = reward_dtype(load_device)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, str(load_device), str(dtype))
    with _reward_lock:
        hit = _reward_cache.get(key)
        if hit is not None:
            _reward_cache.move_to_end(key)
            return hit
        offload = torch.device("cpu") if load_device.type == "cpu" else services.offload_device()
        scorer = load_image_reward(path, device=offload, dtype=dtype)
        holder = ModuleHolder(scorer.model, device=offload)
        entry = (scorer, services.wrap(holder, load_device, offload))
        _reward_cache[key] = entry
        while len(_reward_cache) > _REWARD_CACHE_SIZE:
            _reward_cache.popitem(last=False)
        return entry


def clear_reward_cache() -> None:
    with _reward_lock:
        _reward_cache.clear()


def build_router(reward_model: str, tau: float, aggregation: str, crop: str, temporal_weight: float, *,
                 services: Services, tau_mode: str = "fixed", accept_rate: float = 0.73,
                 preprocess: str = "pil") -> SDVGRouter:
    """The work of SDVGRewardRouter."""
    check_model_name(reward_model, schema.REWARD_FOLDERS)  # also under ComfyUI, whose own resolver may normalise the name
    path = services.resolve(schema.REWARD_FOLDERS, reward_model)
    # Validate the settings now (RewardRouter raises with a message), before the sampler runs.
    scorer, patcher = load_reward_scorer(path, services)
    router = SDVGRouter(scorer=scorer, patcher=patcher, path=path, tau=float(tau), aggregation=aggregation, crop=crop,
                        temporal_weight=float(temporal_weight), tau_mode=tau_mode, accept_rate=float(accept_rate),
                        preprocess=preprocess)
    router.new_router()
    return router


# ============================================================================================================== VAE
@dataclass(eq=False)
class _ConvertedVAE:
    vae: Any  # diffusers AutoencoderKLWan
    holder: torch.nn.Module
    patcher: Any


_vae_cache: "weakref.WeakKeyDictionary[Any, _ConvertedVAE]" = weakref.WeakKeyDictionary()
_vae_lock = threading.Lock()


def _vae_conversion(source, services: Services) -> _ConvertedVAE:
    """Convert ComfyUI's VAE (``.first_stage_model`` = original-key Wan VAE) once, cached per VAE object."""
    with _vae_lock:
        try:
            hit = _vae_cache.get(source)
        except TypeError:  # not weak-referenceable
            hit = None
        if hit is not None:
            return hit
        first_stage = getattr(source, "first_stage_model", None)
        if first_stage is None or not hasattr(first_stage, "state_dict"):
            raise ValueError("vae: expected ComfyUI's Wan2.1 VAE (VAELoader with wan_2.1_vae.safetensors)")
        load_device = torch.device(getattr(source, "device", None) or services.main_device())
        dtype = getattr(source, "vae_dtype", None) or torch.float32
        patcher = getattr(source, "patcher", None)
        offload = torch.device(getattr(patcher, "offload_device", None) or "cpu")
        try:
            vae = wan_vae_from_state_dict(first_stage.state_dict(), device=offload, dtype=dtype, copy=True,
                                          source=f"the connected VAE ({type(first_stage).__name__})")
        except ValueError as e:
            raise ValueError(f"{e}\nSDVG needs the Wan2.1 VAE: VAELoader with wan_2.1_vae.safetensors.") from e
        holder = ModuleHolder(vae, device=offload)
        converted = _ConvertedVAE(vae=vae, holder=holder, patcher=services.wrap(holder, load_device, offload))
        try:
            _vae_cache[source] = converted
        except TypeError:
            pass
        return converted


def streaming_vae(source, services: Services) -> tuple[StreamingWanVAE, Any]:
    """A fresh :class:`StreamingWanVAE` (own decode state) for one run, and the patcher to load.

    ``source``: ComfyUI's VAE object, a diffusers ``AutoencoderKLWan`` or a ``StreamingWanVAE``.
    """
    from diffusers import AutoencoderKLWan

    if isinstance(source, StreamingWanVAE):
        return StreamingWanVAE(source.vae), None
    if isinstance(source, AutoencoderKLWan):
        return StreamingWanVAE(source), None
    converted = _vae_conversion(source, services)
    return StreamingWanVAE(converted.vae), converted.patcher


# ===================================================================================================== conditioning
def context_from_conditioning(conditioning, text_dim: int = TEXT_DIM, name: str = "positive") -> torch.Tensor:
    """The UMT5 context ``[1, L, text_dim]`` of a ComfyUI CONDITIONING ``[[tensor, {...}]]`` (not copied); errors name
    the input ``name`` (the sampler's ``positive``, or a switch of its ``prompt_schedule``)."""
    hint = ("SDVG needs Wan2.1's UMT5-XXL text encoding [1, >=512, 4096]: use CLIPLoader with type 'wan' and "
            "umt5_xxl (e.g. umt5_xxl_fp8_e4m3fn_scaled.safetensors) -> CLIPTextEncode, or SDVG Load Prompt Embeddings.")
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{name}: expected a CONDITIONING, got {type(conditioning).__name__}. {hint}")
    if len(conditioning) != 1:
        raise ValueError(f"{name}: SDVG takes one prompt, got a CONDITIONING with {len(conditioning)} entries "
                         "(combined or concatenated conditionings are not supported).")
    entry = conditioning[0]
    cond = entry[0] if isinstance(entry, (list, tuple)) and entry else None
    if not isinstance(cond, torch.Tensor) or cond.ndim != 3:
        shape = tuple(cond.shape) if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise ValueError(f"{name}: expected a conditioning tensor [1, L, {text_dim}], got {shape}. {hint}")
    if cond.shape[-1] != text_dim:
        raise ValueError(f"{name}: the text encoding is {cond.shape[-1]} wide, but the models expect {text_dim} "
                         f"(shape {tuple(cond.shape)}). {hint}")
    if cond.shape[0] != 1:
        raise ValueError(f"{name}: batch size {cond.shape[0]}; SDVG generates one video per run (batch 1)")
    return cond


def load_prompt_embedding(path: str, index: int) -> tuple[list, str]:
    """CONDITIONING ``[[context, {"pooled_output": None}]]`` and the prompt text of entry ``index``."""
    entries = load_prompt_embeddings(path)
    if not 0 <= index < len(entries):
        raise ValueError(f"{os.path.basename(path)} holds {len(entries)} prompt(s) (index 0..{len(entries) - 1}); "
                         f"got index {index}")
    prompt, context = entries[index]
    return [[context.float(), {"pooled_output": None}]], prompt


def load_embeddings_node(embeddings_file: str, index: int, *, services: Services) -> tuple[list, str]:
    index = check_int("index", index, low=0, fix="pass the prompt's position in the file, 0 for the first")
    check_model_name(embeddings_file, schema.EMBEDDINGS_FOLDERS)  # also under ComfyUI, whose own resolver may normalise the name
    path = services.resolve(schema.EMBEDDINGS_FOLDERS, embeddings_file)
    conditioning, prompt = load_prompt_embedding(path, index)
    device = services.intermediate_device()
    return [[conditioning[0][0].to(device), conditioning[0][1]]], prompt
