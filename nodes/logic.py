"""Everything the SDVG nodes do, as plain functions that never import ComfyUI.

The V3 node classes (``comfy_nodes.py``) only translate between ComfyUI and these functions, passing a
:class:`Services` object that provides ComfyUI's memory manager, progress bar, interrupt check and model
folders. The default :class:`Services` is plain PyTorch on the CPU (or wherever models are asked to
go), so the tests and scripts run the exact code the nodes run.

Objects passed between nodes (:class:`SDVGModel`, :class:`SDVGRouter`) are cached by ComfyUI and shared
by every later run: nothing here mutates them. Each sampler run builds its own generators, router,
streaming VAE state and pipeline.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from sdvg_engine.checks import check_choice, check_int
from sdvg_engine.choices import SCHEDULE_EVERY
from sdvg_engine.comfy_bridge import ModuleHolder
from sdvg_engine.vae import wan_vae_from_state_dict
from sdvg_engine.generator import CausalGenerator
from sdvg_engine import presets
from sdvg_engine.loaders import LoadedDiT, build_generator, build_pipeline, load_generator, parse_dtype
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.offload import ResidentPart, check_offload_device, enable_block_offload
from sdvg_engine.pipeline import SDVGOptions, SDVGResult, video_frames_to_latent_frames
from sdvg_engine.reward import ImageRewardScorer, load_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.text_encoder import load_prompt_embeddings
from sdvg_engine.vae import StreamingWanVAE

from . import schema

FPS = 16.0
TEXT_DIM = 4096
PREVIEW_MAX_PX = 512
_REWARD_CACHE_SIZE = 2


# ==================================================================================================== host services
class _PlainPatcher:
    """Stand-in for ComfyUI's ModelPatcher outside ComfyUI: ``load()`` moves the module to its device."""

    def __init__(self, holder: torch.nn.Module, load_device: torch.device, offload_device: torch.device):
        self.model, self.load_device, self.offload_device = holder, load_device, offload_device

    def load(self) -> None:
        self.model.to(self.load_device)
        self.model.device = self.load_device


class Services:
    """What the node logic needs from its host. This default is plain PyTorch (tests, scripts).

    Args:
        folders: model folder name -> directories, for :meth:`list_files` / :meth:`resolve`.
        device: the main compute device (``auto``).
    """

    def __init__(self, folders: dict[str, list[str]] | None = None, device: str | torch.device = "cpu"):
        self.folders = {k: [str(p) for p in v] for k, v in (folders or {}).items()}
        self._device = torch.device(device)

    # devices
    def main_device(self) -> torch.device:
        return self._device

    def offload_device(self) -> torch.device:
        return torch.device("cpu")

    def intermediate_device(self) -> torch.device:
        return torch.device("cpu")

    def cuda_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    # memory management
    def wrap(self, holder: torch.nn.Module, load_device: torch.device, offload_device: torch.device):
        """A memory-manager handle for ``holder`` (ComfyUI: a ModelPatcher)."""
        return _PlainPatcher(holder, load_device, offload_device)

    def load(self, patchers: list) -> None:
        """Put the models on their compute devices before sampling."""
        for p in patchers:
            p.load()

    def load_run(self, patchers: list, memory_required: int = 0) -> None:
        """Load every model of one run at once, reserving ``memory_required`` bytes beside the weights for what the
        memory manager cannot see (KV caches, activations: :func:`run_memory_required`). Default: :meth:`load`
        (hosts without a memory budget; subclasses that override only :meth:`load` keep working)."""
        self.load(patchers)

    # run control
    def check_interrupt(self) -> None:
        """Raise to stop the run (called before every model call)."""

    def progress(self, value: int, total: int, preview=None) -> None:
        """Report ``value`` of ``total`` blocks done, with a PIL preview of the newest frame."""

    def activity(self, text: str) -> None:
        """Say what the running node is doing now ("drafting block 2/7"); may be called from worker threads."""

    # model files
    def list_files(self, folders: Iterable[str]) -> list[str]:
        names: list[str] = []
        for folder in folders:
            for root in self.folders.get(folder, []):
                if os.path.isdir(root):
                    for dirpath, _, files in os.walk(root):
                        for f in files:
                            names.append(os.path.relpath(os.path.join(dirpath, f), root))
        return sorted(dict.fromkeys(names))

    def resolve(self, folders: Iterable[str], name: str) -> str:
        folders = list(folders)
        check_model_name(name, folders)
        for folder in folders:
            for root in self.folders.get(folder, []):
                path = os.path.join(root, name)
                # By name only: symlinked model files (common for large weights) stay usable.
                if not _inside(path, root):
                    raise ValueError(f"model file {name!r} resolves outside the {folder!r} folder {root}; "
                                     "pick a file inside ComfyUI's model folders")
                if os.path.isfile(path) or os.path.isdir(path):
                    return path
        raise FileNotFoundError(f"model file {name!r} not found in the folders {folders}")


def _inside(path: str, root: str) -> bool:
    root = os.path.abspath(root)
    return os.path.commonpath([os.path.abspath(path), root]) == root


def check_model_name(name: str, folders: Iterable[str] = ()) -> str:
    """Refuse a model file name that could leave ComfyUI's model folders (absolute, ``..``, empty).

    Node inputs are names relative to a models/ folder (``sub/dir/file.safetensors``); anything else
    would let a workflow read arbitrary files.
    """
    where = f" in {list(folders)}" if folders else ""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model file name is empty; pick a file{where} (ComfyUI models/ folders)")
    if "\x00" in name:
        raise ValueError(f"model file name {name!r} contains a NUL byte; pick a file{where}")
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ValueError(f"model file {name!r} is an absolute path; give a name relative to the model folders{where} "
                         "(put the file in ComfyUI/models/... or list its folder in extra_model_paths.yaml)")
    if ".." in parts:
        raise ValueError(f"model file {name!r} contains '..'; give a name inside the model folders{where} "
                         "(put the file in ComfyUI/models/... or list its folder in extra_model_paths.yaml)")
    return name


def combo_options(spec: schema.InputSpec, services: Services) -> list:
    """The values a combo input offers now (static options, model files or devices)."""
    if spec.options:
        return list(spec.options)
    if spec.options_from and spec.options_from[0] == "files":
        return services.list_files(spec.options_from[1:])
    if spec.options_from == (schema.DEVICES,):
        return schema.device_options(services.cuda_count())
    raise ValueError(f"input {spec.name!r} has no options")


def resolve_devices(device: str, services: Services) -> tuple[torch.device, torch.device]:
    """``(load_device, offload_device)`` for a loader's device choice: ``auto`` or one of the devices the node's
    combo lists here (``cpu``, ``cuda:N`` for each visible GPU); anything else is refused by name."""
    if device == "auto":
        load = services.main_device()
    else:
        options = schema.device_options(services.cuda_count())
        if not isinstance(device, str) or device not in options:
            if isinstance(device, str) and re.fullmatch(r"cuda:\d+", device):
                raise ValueError(f"device {device!r} does not exist: {services.cuda_count()} CUDA device(s) visible; "
                                 f"pick one of {options}")
            raise ValueError(f"device must be one of {options} on this machine, got {device!r}; pick 'auto' (ComfyUI's "
                             "main device) or one listed")
        load = torch.device(device)
    offload = torch.device("cpu") if load.type == "cpu" else services.offload_device()
    return load, offload


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
            from .comfy_model import describe_model

            return {"source": "ComfyUI MODEL", "architecture": self.info.architecture, "dtype": self.dtype,
                    "device": str(self.load_device), "context_scheme": self.context_scheme, "schedule": self.schedule,
                    **describe_model(self.model, self.patcher)}
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


def load_model_from_comfy(model, context_scheme: str = "auto", kv_dtype: str = "auto", *, role: str,
                          services: Services | None = None) -> SDVGModel:
    """The work of SDVG Drafter from MODEL / SDVG Target from MODEL: a ComfyUI MODEL (a ModelPatcher around Wan2.1's
    ``WanModel``) as an ``SDVG_MODEL``, run by the engine's causal forward through ComfyUI's own ops, attention and
    memory manager (:mod:`nodes.comfy_model`). ``context_scheme`` ``auto`` follows the model (width 5120, the 14B:
    Krea's recompute window, else the global cache), as the file loaders do from a checkpoint. Nothing is copied:
    the sampler loads the MODEL's own patcher, and every run of it uses one worker lane."""
    from . import comfy_model
    from sdvg_engine.loaders import checkpoint_schedule
    from sdvg_engine.models.loading import trained_context_scheme
    from sdvg_engine.models.original_layout import original_layout_info

    check_choice("role", role, ("drafter", "target"))
    check_choice("context_scheme", context_scheme, schema.CONTEXT_SCHEMES)
    check_choice("kv_dtype", kv_dtype, schema.KV_DTYPES)
    view = comfy_model.model_view(model, kv_dtype=kv_dtype)  # checks the MODEL first (a clear error for non-Wan)
    own_scheme = trained_context_scheme(view.config)  # as the file loaders decide for a file that does not say
    info = original_layout_info(view, own_scheme, source="ComfyUI MODEL")
    return SDVGModel(
        model=view, info=info, path="ComfyUI MODEL", role=role, dtype=comfy_model.dtype_name(model.model_dtype()),
        context_scheme=own_scheme if context_scheme == "auto" else context_scheme,
        schedule=checkpoint_schedule(info.architecture), load_device=torch.device(model.load_device),
        offload_device=torch.device(model.offload_device), holder=None, patcher=model,
        requested_context_scheme=context_scheme, backend="comfy",
    )


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
def context_from_conditioning(conditioning, text_dim: int = TEXT_DIM) -> torch.Tensor:
    """The UMT5 context ``[1, L, text_dim]`` of a ComfyUI CONDITIONING ``[[tensor, {...}]]`` (not copied)."""
    hint = ("SDVG needs Wan2.1's UMT5-XXL text encoding [1, >=512, 4096]: use CLIPLoader with type 'wan' and "
            "umt5_xxl (e.g. umt5_xxl_fp8_e4m3fn_scaled.safetensors) -> CLIPTextEncode, or SDVG Load Prompt Embeddings.")
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"positive: expected a CONDITIONING, got {type(conditioning).__name__}. {hint}")
    if len(conditioning) != 1:
        raise ValueError(f"positive: SDVG takes one prompt, got a CONDITIONING with {len(conditioning)} entries "
                         "(combined or concatenated conditionings are not supported).")
    entry = conditioning[0]
    cond = entry[0] if isinstance(entry, (list, tuple)) and entry else None
    if not isinstance(cond, torch.Tensor) or cond.ndim != 3:
        shape = tuple(cond.shape) if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise ValueError(f"positive: expected a conditioning tensor [1, L, {text_dim}], got {shape}. {hint}")
    if cond.shape[-1] != text_dim:
        raise ValueError(f"positive: the text encoding is {cond.shape[-1]} wide, but the models expect {text_dim} "
                         f"(shape {tuple(cond.shape)}). {hint}")
    if cond.shape[0] != 1:
        raise ValueError(f"positive: batch size {cond.shape[0]}; SDVG generates one video per run (batch 1)")
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


# ========================================================================================================== sampler
def geometry_problem(width, height, length) -> str | None:
    """Why ``width``/``height``/``length`` cannot work (``None`` when they can); linked values (``None``) pass."""
    for name, value in (("width", width), ("height", height), ("length", length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return (f"{name} must be a whole number, got {value!r} ({type(value).__name__}); "
                    f"e.g. {name}={schema.SAMPLER.input(name).default}")
    for name, value in (("width", width), ("height", height)):
        if value is not None and (value < 16 or value > 2048 or value % 16):
            return f"{name} must be a multiple of 16 in 16..2048, got {value}"
    if length is not None:
        if length > schema.MAX_LENGTH:
            return f"length must be at most {schema.MAX_LENGTH}, got {length}"
        try:
            video_frames_to_latent_frames(int(length))
        except ValueError as e:
            return f"length: {e}"
    return None


def needed_inputs(mode: str, drafter=None, target=None, router=None, schedule_veto: bool = False) -> list[str]:
    """The lazy sampler inputs ``mode`` uses that are not evaluated yet (ComfyUI's ``check_lazy_status``): the
    router only where drafts are scored (``sdvg``, or ``schedule`` with ``schedule_veto``)."""
    needs = SDVGOptions(mode=mode, schedule_veto=bool(schedule_veto))
    needed = []
    if drafter is None and needs.uses_drafter:
        needed.append("drafter")
    if target is None and needs.uses_target:
        needed.append("target")
    if router is None and needs.scores_drafts:
        needed.append("router")
    return needed


def advanced_values(options) -> dict:
    """The settings an SDVG Advanced Options output carries (checked: a wrong socket gives a clear error)."""
    if not isinstance(options, dict) or set(options) != set(schema.ADVANCED_NAMES):
        raise ValueError(f"advanced_options: expected the output of SDVG Advanced Options, got "
                         f"{type(options).__name__}; connect that node or leave the input empty")
    return dict(options)


def advanced_options_node(**values) -> dict:
    """The work of SDVG Advanced Options: its widget values, by name, for the sampler's advanced_options input."""
    return {name: values[name] for name in schema.ADVANCED_NAMES}


def effective_schedule_veto(schedule_veto: bool, advanced_options=None) -> bool:
    """The schedule_veto a sampler run uses (the Advanced Options node's when connected): the lazy router check
    needs it before the run starts."""
    if isinstance(advanced_options, dict) and "schedule_veto" in advanced_options:
        return bool(advanced_options["schedule_veto"])
    return bool(schedule_veto)


@dataclass
class SamplerOutput:
    frames: torch.Tensor       # [T, H, W, 3] float32 0..1
    mask: torch.Tensor         # [T, H, W] float32 0/1
    latent: dict               # {"samples": [1, 16, T_lat, h, w]} in ComfyUI's Wan21 latent space
    fps: float
    report: str                # JSON
    plot: torch.Tensor         # [1, h, w, 3]
    result: SDVGResult = field(repr=False)


def _json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _json_safe(x.tolist())
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def frame_to_pil(frame: torch.Tensor):
    """``[H, W, 3]`` 0..1 -> PIL RGB image."""
    from PIL import Image

    array = (frame.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array)


def run_sampler(*, drafter: SDVGModel | None, target: SDVGModel | None, router: SDVGRouter | None, positive, vae,
                reward_prompt: str = "", width: int = 832, height: int = 480, length: int = 81, seed: int = 42,
                mode: str = "sdvg", force_first_block: bool = True, refine_from_step: int = 0, cascade: bool = False,
                random_accept_prob: float = 0.73, services: Services | None = None, preset: str = "reference",
                workers: str = "auto", replay: bool = True, schedule_every: int = SCHEDULE_EVERY,
                schedule_veto: bool = False, advanced_options: dict | None = None) -> SamplerOutput:
    """The work of SDVGSpeculativeSampler: one speculative generation, all per-run state built here.

    With ``replay`` the module's :data:`REPLAY_MEMO` carries earlier runs across executions, so a run that
    differs only in the router's tau settings reuses every block before its first changed decision."""
    services = services or Services()
    if advanced_options is not None:  # SDVG Advanced Options wins over the sampler's own widgets
        chosen = advanced_values(advanced_options)
        refine_from_step, cascade, random_accept_prob = (chosen["refine_from_step"], chosen["cascade"],
                                                         chosen["random_accept_prob"])
        preset, workers, replay = chosen["preset"], chosen["workers"], chosen["replay"]
        schedule_every, schedule_veto = chosen["schedule_every"], chosen["schedule_veto"]
    presets.check_preset(preset)
    if str(workers) not in schema.WORKER_CHOICES:
        raise ValueError(f"workers must be one of {schema.WORKER_CHOICES}, got {workers!r}")
    if mode not in schema.MODES:
        raise ValueError(f"mode must be one of {schema.MODES}, got {mode!r}")
    problem = geometry_problem(width, height, length)
    if problem:
        raise ValueError(problem)
    # target_only never runs the drafter and draft_only never runs the target: ComfyUI does not even load
    # the unused one (lazy input), and the model in use stands in for it.
    options = SDVGOptions(mode=mode, force_first_block=bool(force_first_block),
                          random_accept_prob=float(random_accept_prob),
                          refine_from_step=int(refine_from_step) or None, cascade=bool(cascade),
                          schedule_every=int(schedule_every), schedule_veto=bool(schedule_veto))
    missing = [role for role in needed_inputs(mode, drafter, target, router=True) if role in ("drafter", "target")]
    if missing:
        raise ValueError(f"mode {mode!r} needs the {' and the '.join(missing)}")
    used = [m for m in (drafter, target) if m is not None]
    drafter_model, target_model = drafter or target, target or drafter
    running = list(dict.fromkeys(m for m, runs in ((drafter_model, options.uses_drafter),
                                                   (target_model, options.uses_target)) if runs))
    check_comfy_models(running)
    # A MODEL's ops cast (and on low-VRAM loads patch and move) its weights per call through ComfyUI's shared state;
    # a second worker thread would race that, so a run with a MODEL-backed model is one lane.
    one_lane = [m.role for m in running if m.comfy_backed]
    if one_lane:
        workers = "1"
    context = context_from_conditioning(positive, text_dim=used[0].model.config.text_dim)
    for m in used:
        if m.model.config.text_dim != context.shape[-1]:
            raise ValueError(f"the {m.role} expects text width {m.model.config.text_dim}, the conditioning is "
                             f"{context.shape[-1]} wide")
    prompt = reward_prompt or ""
    scores_drafts = options.scores_drafts
    if scores_drafts:
        if router is None:
            raise ValueError("mode 'sdvg' needs a router (SDVG Reward Router)" if mode == "sdvg" else
                             "schedule_veto scores the drafted blocks: link a router (SDVG Reward Router) or turn "
                             "schedule_veto off")
        if not prompt.strip():
            raise ValueError("reward_prompt is empty: ImageReward scores frames against the prompt TEXT, which "
                             "CONDITIONING does not carry. Type the positive prompt into reward_prompt or link "
                             "SDVG Load Prompt Embeddings' prompt output.")

    stream, vae_patcher = streaming_vae(vae, services)
    # Per-run objects: the cached SDVG_MODEL / SDVG_ROUTER values are never modified.
    run_router = router.new_router() if (scores_drafts and router is not None) else None
    # The one pipeline builder (presets applied there); a loader's explicit context_scheme wins over the preset.
    pipe = build_pipeline(LoadedDiT.of(drafter_model.model, drafter_model.info),
                          LoadedDiT.of(target_model.model, target_model.info), stream, run_router, preset=preset,
                          drafter_context=drafter_model.requested_context_scheme,
                          target_context=target_model.requested_context_scheme,
                          workers=workers if workers == "auto" else int(workers),
                          memo=replay_memo_for(drafter_model, target_model) if replay else None)

    patchers = [drafter_model.patcher if options.uses_drafter else None,
                target_model.patcher if options.uses_target else None,
                vae_patcher, router.patcher if run_router is not None else None]
    # One load call for every model of the run, so that loading one never evicts another of the same run, with room
    # reserved for what the memory manager cannot see (KV caches, VAE decode state, activations).
    memory = run_memory_required(pipe, options, int(width), int(height), stream)
    services.load_run([p for p in dict.fromkeys(patchers) if p is not None], memory_required=int(sum(memory.values())))

    total = video_frames_to_latent_frames(int(length), pipe.target.frames_per_block) // pipe.target.frames_per_block
    services.progress(0, total, None)

    activity = _Activity(services, total, options)

    def on_block(record) -> None:
        activity.done = record.index + 1
        preview = frame_to_pil(record.frames[-1]) if record.frames is not None and len(record.frames) else None
        services.progress(record.index + 1, total, preview)

    result = pipe.generate(context, prompt=prompt, num_frames=int(length), width=int(width), height=int(height),
                           seed=int(seed), options=options, before_call=activity.before_call, on_block=on_block)

    out_device = services.intermediate_device()
    frames = result.frames.float()
    t, h, w, _ = frames.shape
    mask = result.acceptance_mask.float().view(t, 1, 1).expand(t, h, w).contiguous()
    samples = stream.denormalize(result.latents.float())
    report = dict(result.report)
    report["models"] = {"drafter": drafter.describe() if options.uses_drafter and drafter else None,
                        "target": target.describe() if options.uses_target and target else None,
                        "reward": os.path.basename(router.path) if run_router is not None else None}
    report["output"] = {"frames": t, "height": h, "width": w, "fps": FPS, "latent_shape": list(samples.shape)}
    report["memory_required"] = {"bytes": int(sum(memory.values())),
                                 "components": {k: int(v) for k, v in memory.items()}}
    if one_lane:
        workers_report = dict(report.get("settings", {}).get("workers", {}))
        workers_report["one_lane"] = (f"the {' and the '.join(one_lane)} {'is a' if len(one_lane) == 1 else 'are'} "
                                      "ComfyUI MODEL: one worker lane (ComfyUI casts and moves its weights per call)")
        report["settings"] = {**report.get("settings", {}), "workers": workers_report}
    plot = score_plot(report)
    return SamplerOutput(
        frames=frames.to(out_device), mask=mask.to(out_device), latent={"samples": samples.to(out_device)},
        fps=FPS, report=json.dumps(_json_safe(report), indent=2, allow_nan=False), plot=plot.to(out_device),
        result=result,
    )


def check_comfy_models(models: list) -> None:
    """Refuse two MODEL-backed models of one run that are clones of one ComfyUI model with different patches (e.g. one
    Load Diffusion Model feeding the drafter directly and the target through a LoRA): ComfyUI holds one set of patches
    per loaded model, so loading one would unpatch the other."""
    comfy = [m for m in models if m.comfy_backed]
    for i, a in enumerate(comfy):
        for b in comfy[i + 1:]:
            if a.patcher is not b.patcher and a.patcher.is_clone(b.patcher):
                raise ValueError(f"the {a.role} and the {b.role} are the same ComfyUI model with different patches "
                                 "(LoRAs or other model patches on one Load Diffusion Model): ComfyUI keeps one set of "
                                 "patches per loaded model, so they cannot run side by side. Use two Load Diffusion "
                                 "Model nodes, or connect the same MODEL to both.")


def run_memory_required(pipe, options: SDVGOptions, width: int, height: int, stream) -> dict:
    """Bytes the run needs beside the weights (its DiTs' KV caches and text K/V for their context schemes and KV
    dtypes, the VAE decode cache and its rollback snapshot, the largest transient), for the memory manager to reserve
    (:func:`sdvg_engine.offload.run_memory_components`, the memory plan's terms)."""
    from sdvg_engine.offload import run_memory_components

    models = []
    for role, gen, runs in (("drafter", pipe.drafter, options.uses_drafter),
                            ("target", pipe.target, options.uses_target)):
        if not runs:
            continue
        model = gen.model
        kv = "fp8" if model.kv_cache_dtype == torch.float8_e4m3fn else "auto"
        compute_bytes = torch.empty((), dtype=model.compute_dtype).element_size()
        models.append((role, dict(model.config), gen.context.capacity_frames(gen.frames_per_block), kv, compute_bytes))
    vae_param = next(iter(stream.vae.parameters()), None)
    vae_dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(getattr(vae_param, "dtype", None), "fp32")
    return run_memory_components(models, width=width, height=height, vae_dtype=vae_dtype)


class _Activity:
    """The sampler's ``before_call``: checks the host's interrupt before every model call, then labels the node with
    what runs now ("drafting block 2/7", "verifying ...", "target regenerating ..."), sending only changes."""

    _PHASES = {"drafter": "drafting", "vae": "decoding", "reward": "verifying", "replay": "replaying"}

    def __init__(self, services: Services, total: int, options: SDVGOptions):
        self.services, self.total, self.options = services, total, options
        self.done = 0  # blocks final so far (set by on_block)
        self._last = None
        self._lock = threading.Lock()

    def before_call(self, component: str, kind: str) -> None:
        self.services.check_interrupt()  # first: a cancel must raise whatever the label
        if component == "target":
            first = self.done == 0 or not self.options.uses_drafter  # target_only: every target block is new
            phase = "target context" if kind in ("commit", "recompute") else \
                "target generating" if first else "target regenerating"
        else:
            phase = self._PHASES.get(component, component)
        text = f"{phase} block {min(self.done + 1, self.total)}/{self.total}"
        with self._lock:
            if text == self._last:
                return
            self._last = text
        self.services.activity(text)


# ============================================================================================================ nodes
@dataclass
class NodeResult:
    """What a node's ``execute`` returns: its outputs in schema order, and the text its UI shows (or ``None``)."""

    outputs: tuple
    ui_text: str | None = None


def _sampler_node(services: Services, **inputs) -> NodeResult:
    out = run_sampler(services=services, **inputs)
    return NodeResult((out.frames, out.mask, out.latent, out.fps, out.report, out.plot), sampler_summary(out.report))


def _embeddings_node(services: Services, **inputs) -> NodeResult:
    return NodeResult(load_embeddings_node(services=services, **inputs))


_NODE_FUNCTIONS = {
    "SDVGLoadDrafter": lambda services, **kw: NodeResult((load_model_node(role="drafter", services=services, **kw),)),
    "SDVGLoadTarget": lambda services, **kw: NodeResult((load_model_node(role="target", services=services, **kw),)),
    "SDVGRewardRouter": lambda services, **kw: NodeResult((build_router(services=services, **kw),)),
    "SDVGSpeculativeSampler": _sampler_node,
    "SDVGLoadPromptEmbeddings": _embeddings_node,
    "SDVGAdvancedOptions": lambda services, **kw: NodeResult((advanced_options_node(**kw),)),
    "SDVGDrafterFromModel": lambda services, **kw: NodeResult((load_model_from_comfy(role="drafter", services=services,
                                                                                     **kw),)),
    "SDVGTargetFromModel": lambda services, **kw: NodeResult((load_model_from_comfy(role="target", services=services,
                                                                                    **kw),)),
}


def run_node(node_id: str, services: Services, **inputs) -> NodeResult:
    """The body of every SDVG node's ``execute``: node ``node_id`` run on ``inputs`` (input name -> value).

    Optional inputs a workflow saved before they existed are absent; they take the schema's default here, so the
    V3 classes, the tests' executor and scripts all run one code path with one set of defaults."""
    spec = schema.BY_ID.get(node_id)
    if spec is None:
        raise ValueError(f"unknown SDVG node {node_id!r}; known: {sorted(schema.BY_ID)}")
    names = {i.name for i in spec.inputs}
    unknown = sorted(set(inputs) - names)
    if unknown:
        raise TypeError(f"{node_id} has no input(s) {unknown}; its inputs are {[i.name for i in spec.inputs]}")
    values = {i.name: i.default for i in spec.inputs if i.optional or i.lazy}
    values.update(inputs)
    missing = [i.name for i in spec.inputs if i.name not in values]
    if missing:
        raise TypeError(f"{node_id} is missing the required input(s) {missing}")
    return _NODE_FUNCTIONS[node_id](services, **values)


# =========================================================================================================== replay
#: Earlier sampler runs, for replay across executions (CPU RAM; SDVG_REPLAY_GB caps it, default 4).
REPLAY_MEMO = ReplayMemo(max_bytes=int(float(os.environ.get("SDVG_REPLAY_GB", "4")) * (1 << 30)))
_replay_models: tuple | None = None
_replay_lock = threading.Lock()


def replay_memo_for(drafter: SDVGModel, target: SDVGModel) -> ReplayMemo:
    """The shared memo, emptied first when the models differ from the last run's (a reload, other files, or
    ComfyUI's "free memory", which makes the loaders run again)."""
    global _replay_models
    models = (id(drafter.model), id(target.model))
    with _replay_lock:
        if models != _replay_models:
            REPLAY_MEMO.clear()
            _replay_models = models
    return REPLAY_MEMO


def clear_replay_memo() -> None:
    global _replay_models
    with _replay_lock:
        REPLAY_MEMO.clear()
        _replay_models = None


# ============================================================================================================= plot
def score_plot(report: dict, width: int = 640, height: int = 360) -> torch.Tensor:
    """The report's score plot (:mod:`sdvg_engine.score_view`: per block, the quantity compared with tau against the
    block's own threshold) as a ComfyUI IMAGE ``[1, height, width, 3]`` float 0..1."""
    from sdvg_engine.score_view import draw_score_plot

    array = torch.from_numpy(draw_score_plot(report, width, height))
    return (array.float() / 255.0).unsqueeze(0)


# ========================================================================================================= reports
def sampler_summary(report_json: str) -> str:
    """A short human-readable line for the node's UI."""
    report = json.loads(report_json)
    acc = report.get("acceptance", {})
    rate = acc.get("rate_of_drafted")
    speed = report.get("speedup_vs_target")
    parts = [f"{report.get('num_blocks', 0)} blocks", " ".join(s[0].upper() for s in report.get("decisions", []))]
    if rate is not None:
        parts.append(f"kept {acc.get('accepted_blocks')}/{acc.get('drafted_blocks')} drafts ({rate:.0%})")
    if speed is not None:
        parts.append(f"~{speed:.2f}x vs target-only")
    return " | ".join(p for p in parts if p)


__all__ = [
    "FPS", "NodeResult", "SDVGModel", "SDVGRouter", "SamplerOutput", "Services", "build_router", "clear_reward_cache",
    "combo_options", "context_from_conditioning", "geometry_problem", "load_embeddings_node", "load_model_node",
    "load_prompt_embedding", "load_reward_scorer", "run_node",
    "check_model_name", "load_sdvg_model", "needed_inputs", "resolve_devices", "run_sampler",
    "sampler_summary", "score_plot", "streaming_vae",
]
