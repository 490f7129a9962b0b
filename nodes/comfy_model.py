"""A ComfyUI MODEL (a ``ModelPatcher`` around Wan2.1's ``WanModel``) as the engine's causal DiT.

The engine's :class:`~sdvg_engine.models.original_layout.OriginalLayoutCausalWan` runs the pack's one block-causal
forward over modules in the original Wan layout. This module hands it ComfyUI's own pieces, so whatever the MODEL
carries applies to every block SDVG makes:

* every op (Linear, Conv3d, LayerNorm, RMSNorm) runs through its own ``forward()``, fed the dtypes ComfyUI's own Wan
  feeds it (the patch embedding in float32, the time MLP, norms and the rest in the compute dtype): ComfyUI's ops
  (and ComfyUI-GGUF's ``GGMLLayer``) check the interrupt flag there (newer cores), cast the weight to the input's
  dtype and device and apply what is attached to them: manual cast, scaled fp8, fp8 / NVFP4 matmuls (scaled-fp8
  files on fp8-capable GPUs, mixed-precision ops, ``--fast``), LoRA patches of low-VRAM loads (``LowVramPatch``),
  GGUF dequantisation;
* raw parameters (``modulation``) are read through ``comfy.model_management.cast_to``, as ComfyUI's Wan does;
* attention is ComfyUI's ``optimized_attention`` (what the launch flags chose: sage, flash, xformers, pytorch,
  sub-quadratic; an ``optimized_attention_override`` in the MODEL's transformer options applies too). A masked call
  (the recompute window's attention bias) goes to ``attention_pytorch`` instead, which passes the mask to SDPA:
  not every backend honours masks, and the bias must never be dropped silently;
* the replay identity (:func:`patcher_identity`) is what the MODEL carries beyond its weights: LoRA patches with
  their strengths and a content fingerprint of every patch tensor, weight wrappers, object patches, storage dtypes
  and GGUF quantisation types. A LoRA on a low-VRAM load leaves the parameters untouched (it is applied per call),
  so the weights' own fingerprint cannot see it.

ComfyUI is imported lazily inside the functions that need it: :mod:`nodes.logic` imports this module without
ComfyUI, and :func:`wan_source` (the checks of a MODEL) needs none.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from sdvg_engine.checks import check_choice

from . import schema
from .loaders import SDVGModel

if TYPE_CHECKING:
    from .services import Services

__all__ = ["wan_source", "model_view", "load_model_from_comfy", "patcher_identity", "compute_dtype_of",
           "ComfyAttention", "describe_model", "dtype_name", "not_applied", "stored_as", "tensor_fingerprint"]

#: ComfyUI's Wan2.1 DiT classes whose forward inputs SDVG's causal forward covers (newer cores have the causal one).
WAN_CLASSES = ("WanModel", "CausalWanModel")
#: the original-layout modules the causal forward reads
_NEEDED = ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head")
#: samples per patch tensor in the identity (patch tensors are small: a LoRA's are rank x width)
_PATCH_SAMPLES = 4096


def _found(obj) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def wan_source(model, *, what: str = "model") -> torch.nn.Module:
    """The Wan2.1 text-to-video DiT inside the ComfyUI MODEL ``model`` (``get_model_object("diffusion_model")``),
    checked before anything else is built: a ValueError names what was connected and what to connect instead."""
    getter = getattr(model, "get_model_object", None)
    if not callable(getter):
        raise ValueError(f"{what}: expected a ComfyUI MODEL (the output of Load Diffusion Model / UNETLoader, a LoRA "
                         f"loader or Unet Loader (GGUF)), got a {_found(model)}")
    try:
        source = getter("diffusion_model")
    except AttributeError:
        raise ValueError(f"{what}: this MODEL ({_found(getattr(model, 'model', model))}) has no diffusion model; "
                         "connect a Wan2.1 text-to-video model from Load Diffusion Model") from None
    # ComfyUI's torch.compile patch (an object patch of "diffusion_model") wraps the module; SDVG runs its own forward
    # over the modules, so the compiled wrapper's forward would not be used anyway.
    source = getattr(source, "_orig_mod", source)
    name = type(source).__name__
    hint = ("SDVG runs Wan2.1 text-to-video DiTs (Self-Forcing 1.3B, Krea Realtime 14B, Wan2.1 T2V): load one with "
            "Load Diffusion Model, or use SDVG Load Drafter / SDVG Load Target for the checkpoint file")
    missing = [n for n in _NEEDED if not hasattr(source, n)]
    if missing or not hasattr(source.head, "modulation") or not isinstance(source, torch.nn.Module):
        detail = f" (no {', '.join(missing)})" if missing else ""
        raise ValueError(f"{what}: this MODEL is a {_found(source)}{detail}, not a Wan2.1 DiT in ComfyUI's layout. "
                         f"{hint}.")
    if name not in WAN_CLASSES:
        raise ValueError(f"{what}: this MODEL is a {_found(source)}, a Wan variant with inputs of its own (VACE, "
                         f"camera, sound, reference images ...) that SDVG's causal forward does not feed. {hint}.")
    model_type = getattr(source, "model_type", "t2v")
    if model_type != "t2v" or getattr(source, "img_emb", None) is not None:
        raise ValueError(f"{what}: this MODEL is a Wan {model_type} model (image conditioning); SDVG runs Wan2.1 "
                         f"text-to-video models. {hint}.")
    in_channels = source.patch_embedding.weight.shape[1]
    patch = tuple(getattr(source, "patch_size", (1, 2, 2)))
    text_width = source.text_embedding[0].weight.shape[1]
    if in_channels != 16 or patch != (1, 2, 2) or text_width != 4096:
        raise ValueError(f"{what}: this Wan MODEL has {in_channels} latent channels, patch size {patch} and text width "
                         f"{text_width}; SDVG runs Wan2.1 (16 channels, patch (1, 2, 2), UMT5 width 4096), not Wan2.2 "
                         f"5B or other variants. {hint}.")
    return source


def compute_dtype_of(patcher) -> torch.dtype:
    """The dtype ComfyUI computes this MODEL in: its manual-cast dtype (fp8 / GGUF storage, a dtype the device cannot
    compute in, or what the ModelComputeDtype node set) or else the weights' dtype.

    Read through ``get_model_object``: ModelComputeDtype sets it as an object patch of this clone, which ComfyUI
    writes onto the shared model only while this clone is loaded (the model's attribute may hold another clone's)."""
    return patcher.get_model_object("manual_cast_dtype") or patcher.model_dtype()


class ComfyAttention:
    """The engine's ``attention(q, k, v, mask)`` (``[B, H, L, d]`` in and out) through ComfyUI's attention functions.

    Unmasked calls use ``optimized_attention`` (read once, when the MODEL becomes an SDVG model: ComfyUI chooses it
    at start-up from its launch flags) with the MODEL's transformer options, so an ``optimized_attention_override``
    patch applies as in ComfyUI's own Wan. Masked calls use ``attention_pytorch`` without the override: it hands the
    additive mask to SDPA, whereas some backends (sage, flash) would drop it. Both return ``[B, L, H * d]`` (ComfyUI's
    output layout); the ``[B, H, L, d]`` view of it costs no copy, and the engine's following
    ``transpose(1, 2).flatten(2)`` gets that contiguous layout back for free."""

    def __init__(self, heads: int, unmasked, masked, transformer_options: dict | None = None):
        self.heads, self.unmasked, self.masked = heads, unmasked, masked
        self.transformer_options = transformer_options or {}

    @classmethod
    def from_comfy(cls, heads: int, transformer_options: dict | None = None) -> "ComfyAttention":
        import comfy.ldm.modules.attention as attention

        return cls(heads, attention.optimized_attention, attention.attention_pytorch, transformer_options)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        b, h, length, d = q.shape
        if mask is None:
            out = self.unmasked(q, k, v, self.heads, skip_reshape=True, transformer_options=self.transformer_options)
        else:
            out = self.masked(q, k, v, self.heads, mask=mask, skip_reshape=True)
        return out.view(b, length, h, d).transpose(1, 2)

    @property
    def name(self) -> str:
        override = self.transformer_options.get("optimized_attention_override")
        chosen = getattr(self.unmasked, "__name__", type(self.unmasked).__name__)
        return chosen if override is None else f"{chosen} (override {_callable_name(override)})"


def _call_op(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run one ComfyUI op on ``x`` as ComfyUI's own Wan does, through the op's ``forward()``: it checks the interrupt
    flag (``run_every_op``, newer cores), then either casts and patches the weights (``forward_comfy_cast_weights``)
    or runs the op's own fast path (fp8 / NVFP4 matmuls of mixed-precision ops, ``--fast``, plain torch when the
    weights are already in the compute dtype). The engine feeds it the dtypes ComfyUI's Wan feeds it
    (``ops_in_host_dtypes``)."""
    return module(x)


def model_view(patcher, *, kv_dtype: str = "auto"):
    """The engine's causal DiT over the MODEL ``patcher``'s diffusion model (checked by :func:`wan_source` first).

    It computes on ``patcher.load_device`` in :func:`compute_dtype_of`; ComfyUI's memory manager places the weights
    (``load_models_gpu``: whole, or partially with the rest streamed per call). Returns the
    :class:`~sdvg_engine.models.original_layout.OriginalLayoutCausalWan`."""
    from sdvg_engine.models.original_layout import OriginalLayoutCausalWan
    from sdvg_engine.offload import kv_cache_dtype

    source = wan_source(patcher)
    kv = kv_cache_dtype(kv_dtype)
    import comfy.model_management as model_management

    def read_param(param, dtype, device):
        return model_management.cast_to(param, dtype=dtype, device=device)

    options = patcher.model_options.get("transformer_options", {})
    attention = ComfyAttention.from_comfy(source.num_heads, options)
    view = OriginalLayoutCausalWan(source, device=patcher.load_device, compute_dtype=compute_dtype_of(patcher),
                                   call=_call_op, read_param=read_param, attention=attention,
                                   identity=lambda: patcher_identity(patcher))
    view.use_runtime(kv_cache_dtype=kv)
    return view


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float8_e4m3fn: "fp8_e4m3fn", torch.float8_e5m2: "fp8_e5m2"}


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``bf16`` (the loaders' names), other dtypes as torch prints them without ``torch.``."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def stored_as(t: torch.Tensor) -> str:
    """How one weight is stored: its GGUF type (ComfyUI-GGUF's ``GGMLTensor.tensor_type``), its quantisation layout
    (the LTS fork's ``QuantizedTensor``, whose ``dtype`` is the compute dtype), or its dtype."""
    gguf = getattr(t, "tensor_type", None)
    if gguf is not None:
        return str(getattr(gguf, "name", gguf))
    layout = getattr(t, "_layout_cls", None)
    if layout is not None:
        return getattr(layout, "__name__", str(layout))
    return dtype_name(t.dtype)


def _patched_name(key) -> str:
    """The parameter a ``ModelPatcher.patches`` key names (a name, or ``(name, offset, ...)`` for a slice)."""
    return str(key[0] if isinstance(key, tuple) else key)


def _applied_by_comfyui(key) -> bool:
    """Whether ComfyUI applies a weight patch on ``key``: its loader patches the ``weight`` and ``bias`` of modules
    (``ModelPatcher.load``), never a raw parameter such as a block's ``modulation`` table (a LoRA's ``.diff`` on it
    is kept in ``patches`` and never used, by ComfyUI's own Wan either)."""
    return _patched_name(key).rsplit(".", 1)[-1] in ("weight", "bias")


def not_applied(patcher) -> list[str]:
    """What the MODEL carries that SDVG's block forward does not run: model function wrappers, transformer patches
    (attn1/attn2 patches and replacements, block patches), patcher wrappers, hooks (``hook_patches``, forced hooks),
    RoPE options, a ``model_sampling`` object patch (the sampling shift: SDVG runs the checkpoint's own schedule), and
    weight patches on raw parameters, which ComfyUI itself never applies. Weight patches on module weights (LoRA),
    the compute dtype and the attention override do apply."""
    options = getattr(patcher, "model_options", {}) or {}
    skipped = ["model_function_wrapper"] if options.get("model_function_wrapper") is not None else []
    transformer = options.get("transformer_options", {}) or {}
    for group in ("patches", "patches_replace"):
        skipped += [f"{group}.{name}" for name, entries in (transformer.get(group) or {}).items() if entries]
    if transformer.get("rope_options"):
        skipped.append("rope_options")
    for kind, by_key in (getattr(patcher, "wrappers", {}) or {}).items():
        if any(by_key.values()):
            skipped.append(f"wrappers.{kind}")
    if getattr(patcher, "hook_patches", None) or getattr(patcher, "forced_hooks", None):
        skipped.append("hooks")
    if "model_sampling" in (getattr(patcher, "object_patches", None) or {}):
        skipped.append("model_sampling (shift)")
    raw = sorted(_patched_name(k) for k in patcher.patches if not _applied_by_comfyui(k))
    if raw:
        shown = ", ".join(name.removeprefix("diffusion_model.") for name in raw[:3])
        skipped.append(f"weight patches on {len(raw)} raw parameters ({shown}{', ...' if len(raw) > 3 else ''}): "
                       "ComfyUI never applies them")
    return sorted(skipped)


def describe_model(view, patcher) -> dict:
    """The report's lines for a MODEL-backed model: compute dtype, how its weights are stored, the attention used for
    unmasked calls, how many weights carry patches (LoRA), whether ComfyUI loaded it partially (low VRAM)."""
    storage = sorted({stored_as(p) for p in view.source.parameters()})
    attention = view.runtime.attention
    out = {"compute_dtype": dtype_name(view.compute_dtype), "weights": "/".join(storage),
           "attention": getattr(attention, "name", _callable_name(attention)),
           "patched_weights": sum(1 for key in patcher.patches if _applied_by_comfyui(key))}
    if getattr(view, "kv_cache_dtype", None) == torch.float8_e4m3fn:
        out["kv_dtype"] = "fp8"
    skipped = not_applied(patcher)
    if skipped:
        out["not_applied"] = skipped
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        # dynamic VRAM (0.33+ on CUDA): weights stream per call; the low-VRAM flag below is never set there
        out["dynamic_vram"] = True
        return out
    # 0.3.64 keeps the flag on the model, the LTS fork on the patcher's memory measurements
    lowvram = getattr(getattr(patcher, "_memory_measurements", getattr(patcher, "model", None)), "model_lowvram", None)
    if lowvram is not None:
        out["partially_loaded"] = bool(lowvram)
    return out


# ============================================================================================ the SDVG_MODEL of a MODEL
def load_model_from_comfy(model, context_scheme: str = "auto", kv_dtype: str = "auto", *, role: str,
                          services: Services | None = None) -> SDVGModel:
    """The work of SDVG Drafter from MODEL / SDVG Target from MODEL: a ComfyUI MODEL (a ModelPatcher around Wan2.1's
    ``WanModel``) as an ``SDVG_MODEL``, run by the engine's causal forward through ComfyUI's own ops, attention and
    memory manager (:mod:`nodes.comfy_model`). ``context_scheme`` ``auto`` follows the model (width 5120, the 14B:
    Krea's recompute window, else the global cache), as the file loaders do from a checkpoint. Nothing is copied:
    the sampler loads the MODEL's own patcher, and every run of it uses one worker lane."""
    from sdvg_engine.loaders import checkpoint_schedule
    from sdvg_engine.models.loading import trained_context_scheme
    from sdvg_engine.models.original_layout import original_layout_info

    check_choice("role", role, ("drafter", "target"))
    check_choice("context_scheme", context_scheme, schema.CONTEXT_SCHEMES)
    check_choice("kv_dtype", kv_dtype, schema.KV_DTYPES)
    view = model_view(model, kv_dtype=kv_dtype)  # checks the MODEL first (a clear error for non-Wan)
    own_scheme = trained_context_scheme(view.config)  # as the file loaders decide for a file that does not say
    info = original_layout_info(view, own_scheme, source="ComfyUI MODEL")
    return SDVGModel(
        model=view, info=info, path="ComfyUI MODEL", role=role, dtype=dtype_name(model.model_dtype()),
        context_scheme=own_scheme if context_scheme == "auto" else context_scheme,
        schedule=checkpoint_schedule(info.architecture), load_device=torch.device(model.load_device),
        offload_device=torch.device(model.offload_device), holder=None, patcher=model,
        requested_context_scheme=context_scheme, backend="comfy",
        describe_source=lambda: describe_model(view, model),
    )


# ====================================================================================================== identity
def _callable_name(fn) -> str:
    if fn is None:
        return "None"
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{getattr(target, '__module__', '?')}.{name}"


def tensor_fingerprint(t: torch.Tensor, samples: int = _PATCH_SAMPLES) -> tuple:
    """Shape, dtype and a hash of ``samples`` evenly strided values (plus the last) of ``t``: the same on any device,
    different for other contents (a change that leaves every sampled value as it was is not seen)."""
    data = t.detach()
    flat = data.reshape(-1)
    if flat.is_meta or flat.numel() == 0:
        digest = None
    else:
        step = max(1, flat.numel() // samples)
        picked = torch.cat([flat[::step][:samples], flat[-1:]]).float().cpu()
        digest = hashlib.sha1(picked.numpy().tobytes()).hexdigest()
    return ("tensor", tuple(t.shape), str(t.dtype), str(getattr(t, "tensor_type", "")), digest)


def _describe(value, depth: int = 0):
    """A hashable, content-based description of one patch entry (strengths, LoRA adapters, tensors ...)."""
    if depth > 6:
        return ("...", type(value).__qualname__)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return tensor_fingerprint(value)
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v, depth + 1) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _describe(v, depth + 1)) for k, v in value.items()))
    if hasattr(value, "patches") and hasattr(value, "model"):  # another ModelPatcher (a model used as a patch)
        return ("patcher", patcher_identity(value, depth + 1))
    if hasattr(value, "weights"):  # ComfyUI's weight adapters (LoRA, LoHa, LoKr, ...): the class and its tensors
        return (type(value).__qualname__, _describe(value.weights, depth + 1))
    if callable(value):
        return ("callable", _callable_name(value))
    # Unknown objects: by identity (never equal across different objects, so never a wrong replay).
    return (type(value).__qualname__, id(value))


def _storage(source: torch.nn.Module) -> str:
    """One hash of how the weights are stored: every parameter's and buffer's name, shape, dtype and GGUF type, and
    the op classes (scaled-fp8 / fp8-matmul / GGUF ops compute differently from plain casts)."""
    rows = [(n, tuple(t.shape), str(t.dtype), stored_as(t), type(t).__qualname__)
            for n, t in list(source.named_parameters()) + list(source.named_buffers())]
    ops = sorted({_found(m) for m in source.modules()})
    return hashlib.sha1(repr((rows, ops)).encode()).hexdigest()


def patcher_identity(patcher, depth: int = 0) -> tuple:
    """What a MODEL adds to its weights, for the replay key: every weight patch (key, strengths, offset, function and a
    content fingerprint of each patch tensor), the weight wrappers, the object patches, the compute dtype, the storage
    of the weights (dtypes, GGUF types, op classes) and the attention override. Equal for equal MODELs built again
    (a LoRA loader re-run with the same file and strength), different when a LoRA, its strength, the quantisation or
    any patch changes."""
    patches = tuple((str(key), _describe(list(entries), depth)) for key, entries in
                    sorted(patcher.patches.items(), key=lambda kv: str(kv[0])))
    wrappers = tuple((str(key), tuple(_callable_name(f) for f in fs)) for key, fs in
                     sorted(getattr(patcher, "weight_wrapper_patches", {}).items(), key=lambda kv: str(kv[0])))
    objects = tuple((str(key), _describe(value, depth + 1) if not isinstance(value, torch.nn.Module)
                     else (_found(value), _storage(value)))
                    for key, value in sorted(patcher.object_patches.items(), key=lambda kv: str(kv[0])))
    options = patcher.model_options.get("transformer_options", {})
    override = _callable_name(options.get("optimized_attention_override"))
    source = patcher.get_model_object("diffusion_model")
    return ("comfy-model", patches, wrappers, objects, str(compute_dtype_of(patcher)), _storage(source), override)
