"""Read the causal Wan checkpoints users actually have and build a :class:`CausalWanTransformer3DModel`.

Formats (all offline; nothing here touches a hub):

==================  ===================================================  =============================
format              what it looks like                                   where it comes from
==================  ===================================================  =============================
``self_forcing``    torch pickle ``{generator_ema, generator, critic}``,  ``self_forcing_dmd.pt``
                    keys ``model.blocks.0.self_attn.q.weight``
``krea``            safetensors, keys ``model.blocks.0...``               ``krea-realtime-video-14b``
``comfyui``         safetensors, keys ``model.diffusion_model.blocks...`` ComfyUI ``diffusion_models/``
``wan_original``    bare original keys ``blocks.0.self_attn.q.weight``    Wan repos, converted files
``diffusers``       diffusers keys ``blocks.0.attn1.to_q.weight``         a diffusers folder or file
==================  ===================================================  =============================

Original keys are converted with diffusers' own ``convert_wan_transformer_to_diffusers``. The
architecture is read from tensor shapes; the model is built on the meta device and the weights are
assigned, so a 14B model is never allocated twice.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diffusers import WanTransformer3DModel

from ..checkpoint_io import (CheckpointError, check_float_weights, check_tensors, json_metadata, missing_reason,
                             read_tensor_file, sniff_format)
from .causal_wan import CausalWanTransformer3DModel, architecture_name

CONTEXT_SCHEMES = ("global_cache", "recompute_window")
#: Kept in float32 whatever the requested dtype (diffusers' ``_keep_in_fp32_modules`` for Wan).
_FP32_PATTERNS = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
#: Metadata keys this project writes into safetensors files it produces (toy models, exports).
META_CONFIG = "sdvg.config"
META_CONTEXT = "sdvg.context_scheme"
#: Heads of the released Wan2.1 widths; shapes cannot tell heads from head dim.
_KNOWN_HEADS = {1536: 12, 5120: 40}




@dataclass
class CheckpointInfo:
    """What a checkpoint file is: printed by ``sdvg inspect`` and attached to loaded models."""

    path: str
    format: str
    architecture: str
    config: dict
    num_parameters: int
    stored_dtype: str
    context_scheme: str
    source_entry: str | None = None
    notes: list[str] = field(default_factory=list)
    #: per-tensor scales of float8-stored weights (applied while building; not part of the description)
    fp8_scales: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fp8_scales")
        d["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.config.items()}
        return d

    def describe(self) -> str:
        lines = [
            f"file:           {self.path}",
            f"format:         {self.format}" + (f" (entry '{self.source_entry}')" if self.source_entry else ""),
            f"architecture:   {self.architecture}",
            f"parameters:     {self.num_parameters:,} ({self.num_parameters / 1e9:.2f} B)",
            f"stored dtype:   {self.stored_dtype}",
            f"context scheme: {self.context_scheme}",
            "config:         " + ", ".join(f"{k}={v}" for k, v in sorted(self.config.items())),
        ]
        lines += [f"note:           {n}" for n in self.notes]
        return "\n".join(lines)


# ---- reading raw tensors ----------------------------------------------------------------------------
_DIT_HINT = "pass a causal Wan2.1 transformer (self_forcing_dmd.pt, krea-realtime-video-14b.safetensors, ...)"


def _read_diffusers_folder(path: Path) -> tuple[dict, dict]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: a model folder needs a config.json (diffusers layout); {_DIT_HINT}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path}: no .safetensors weights in the folder; {_DIT_HINT}")
    tensors = {}
    for shard in shards:
        tensors.update(read_tensor_file(shard, what="transformer weights")[0])
    try:
        raw = config_file.read_text()
    except OSError as e:
        raise CheckpointError(f"{config_file}: cannot be read ({e.strerror or e})") from e
    config = json_metadata(raw, "config.json", config_file)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, found {type(config).__name__}")
    if config.get("_class_name", "WanTransformer3DModel") not in ("WanTransformer3DModel", "CausalWanTransformer3DModel"):
        if config["_class_name"] == "AutoencoderKLWan":
            raise CheckpointError(f"{path}: this is a Wan VAE folder, not a Wan DiT (the drafter or target "
                                  "transformer); pass it as the VAE (vae= in the Python API, --vae in the CLI)")
        raise CheckpointError(f"{path}: config.json describes {config['_class_name']}, not a Wan transformer; {_DIT_HINT}")
    return tensors, {META_CONFIG: json.dumps(config)}


# ---- files of the other models -----------------------------------------------------------------------
#: (key prefixes, what the file is, where it goes) for the other models of the stack: a file given in the wrong slot
#: is named for what it is instead of failing on its first odd tensor.
_OTHER_MODELS = (
    (("blip.visual_encoder.", "blip.text_encoder.", "mlp.layers."), "an ImageReward checkpoint",
     "pass it as the reward model (reward= in the Python API, --reward in the CLI, the SDVG Reward Router's model)"),
    (("encoder.block.", "shared.weight", "encoder.final_layer_norm."), "a UMT5 text encoder",
     "pass it to `sdvg encode-prompts --text-encoder` (or ComfyUI's CLIP loader) to encode prompts"),
    (("encoder.", "decoder.", "conv1.", "conv2.", "quant_conv.", "post_quant_conv."),
     "a Wan VAE", "pass it as the VAE (vae= in the Python API, --vae in the CLI)"),
)  # in this order: UMT5's keys start with "encoder." too


def _other_model(state: dict, path: Path) -> None:
    """Refuse a file of another model of the stack, naming what it is and where it goes."""
    keys = [k for k in state if isinstance(k, str)]
    for strip in ("", "model.", "first_stage_model.", "vae."):
        stripped = [k[len(strip):] for k in keys if k.startswith(strip)] if strip else keys
        if len(stripped) != len(keys):
            continue
        for prefixes, what, fix in _OTHER_MODELS:
            if stripped and sum(k.startswith(prefixes) for k in stripped) * 2 > len(stripped):
                raise CheckpointError(f"{path}: this is {what}, not a Wan DiT (the drafter or target transformer); "
                                      f"{fix}")


# ---- key formats ------------------------------------------------------------------------------------
def _strip_prefix(state: dict) -> tuple[dict, str]:
    keys = list(state)
    for prefix, fmt in (("model.diffusion_model.", "comfyui"), ("diffusion_model.", "comfyui"), ("model.", "model.")):
        if keys and all(k.startswith(prefix) for k in keys if not k.startswith("scaled_fp8")):
            return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}, fmt
    return dict(state), ""


def _is_original(state: dict) -> bool:
    return any(".self_attn." in k for k in state) or "head.head.weight" in state


def _split_fp8_scales(state: dict) -> tuple[dict, dict]:
    """ComfyUI's ``*_fp8_scaled`` files: float8 weights with a ``.scale_weight`` each.

    Returns the weights (still float8: dequantizing a 14B file up front would need ~56 GB of float32)
    and ``{weight_key: scale}``; :func:`build_model` dequantizes one tensor at a time.
    """
    weights, scales = {}, {}
    for key, tensor in state.items():
        if key == "scaled_fp8" or key.endswith((".scale_weight", ".scale_input")):
            continue
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = state.get(key.rsplit(".", 1)[0] + ".scale_weight")
            scales[key] = scale if scale is not None else torch.ones(())
        weights[key] = tensor
    return weights, scales


def _infer_config(state: dict, path: Path, num_heads: int | None) -> dict:
    def shape(key):
        if key not in state:
            raise CheckpointError(f"{path}: key '{key}' is missing; this is not a Wan2.1 transformer checkpoint "
                                  f"({_DIT_HINT})")
        return tuple(state[key].shape)

    if any(k.startswith("condition_embedder.image_embedder") for k in state):
        raise CheckpointError(f"{path}: image-to-video Wan checkpoints are not supported; use a text-to-video causal model")
    if len(shape("patch_embedding.weight")) != 5:
        raise CheckpointError(f"{path}: key 'patch_embedding.weight' has shape {shape('patch_embedding.weight')}, expected "
                              f"5 dimensions [width, channels, pt, ph, pw]; this is not a Wan2.1 transformer ({_DIT_HINT})")
    dim, in_ch, *patch = shape("patch_embedding.weight")
    blocks = [int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))]
    if not blocks:
        raise CheckpointError(f"{path}: no 'blocks.N.*' keys; this is not a Wan2.1 transformer checkpoint ({_DIT_HINT})")
    layers = 1 + max(blocks)
    if num_heads is None:
        num_heads = _KNOWN_HEADS.get(dim) or (dim // 128 if dim % 128 == 0 else None)
        if num_heads is None:
            raise CheckpointError(f"{path}: cannot infer the number of heads for width {dim}; pass num_heads "
                                  "(sdvg inspect: --num-heads)")
    if dim % num_heads:
        raise CheckpointError(f"{path}: width {dim} is not divisible by {num_heads} heads; choose a num_heads "
                              f"(sdvg inspect: --num-heads) that divides {dim}")
    out_total = shape("proj_out.weight")[0]
    return dict(
        patch_size=tuple(patch), num_attention_heads=num_heads, attention_head_dim=dim // num_heads,
        in_channels=in_ch, out_channels=out_total // (patch[0] * patch[1] * patch[2]),
        text_dim=shape("condition_embedder.text_embedder.linear_1.weight")[1],
        freq_dim=shape("condition_embedder.time_embedder.linear_1.weight")[1],
        ffn_dim=shape("blocks.0.ffn.net.0.proj.weight")[0], num_layers=layers,
        cross_attn_norm="blocks.0.norm2.weight" in state, qk_norm="rms_norm_across_heads", eps=1e-6,
    )


def _config_from_metadata(metadata: dict, path: Path) -> dict | None:
    if META_CONFIG not in metadata:
        return None
    raw = json_metadata(metadata[META_CONFIG], META_CONFIG, path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: metadata '{META_CONFIG}' must be a JSON object, found {type(raw).__name__}; "
                              "re-export the file with save_checkpoint")
    # The signature, not __code__: diffusers' register_to_config wraps __init__ in (*args, **kwargs).
    allowed = set(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}
    config = {k: v for k, v in raw.items() if k in allowed}
    if "patch_size" in config and isinstance(config["patch_size"], (list, tuple)):
        config["patch_size"] = tuple(config["patch_size"])
    return config


_POSITIVE_INTS = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
                  "ffn_dim", "num_layers")


def trained_context_scheme(config) -> str:
    """The context scheme a Wan2.1 DiT's weights were trained with, where nothing says otherwise: the 14B (width
    5120, Krea Realtime) Krea's recompute window, any other (the 1.3B Self-Forcing drafter) the global cache."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return "recompute_window" if dim == 5120 else "global_cache"


def _check_config(config: dict, path: Path, source: str) -> None:
    """Refuse configs that cannot describe a Wan transformer (``source`` says where the config came from)."""
    for key in _POSITIVE_INTS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            flag = " (sdvg inspect: --num-heads)" if key == "num_attention_heads" else ""
            raise CheckpointError(f"{path}: {source} '{key}' must be a positive integer, got {value!r}{flag}")
    patch = config.get("patch_size")
    if patch is not None and (len(patch) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in patch)):
        raise CheckpointError(f"{path}: {source} 'patch_size' must be 3 positive integers, got {patch!r}")


def _is_allowed_non_float(key: str) -> bool:
    return key == "scaled_fp8"


def read_checkpoint(path: str | os.PathLike, *, num_heads: int | None = None) -> tuple[dict, CheckpointInfo]:
    """Read any supported file into diffusers-keyed tensors (still on CPU, stored dtype) plus its description.

    Everything :func:`load_causal_wan` checks is checked here (readable file, float weights, config,
    every key and shape of the architecture), so ``sdvg inspect`` fails exactly when a load would.
    """
    path = Path(path)
    if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1):
        raise CheckpointError(f"{path}: num_heads (--num-heads) must be a positive integer, got {num_heads!r}")
    if not path.exists():
        reason = missing_reason(path)
        if reason != "not found":
            raise CheckpointError(f"{path}: {reason}")
        raise FileNotFoundError(f"checkpoint not found: {path}")
    entry = None
    if path.is_dir():
        state, metadata = _read_diffusers_folder(path)
        container = "folder"
    else:
        state, metadata, entry = read_tensor_file(path, what="checkpoint", hint=_DIT_HINT,
                                                  entries=("generator_ema", "generator", "state_dict", "model"))
        container = sniff_format(path)
    _other_model(state, path)
    check_tensors(state, path)
    check_float_weights(state, path, allow=_is_allowed_non_float)

    stored_dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    state, prefix = _strip_prefix(state)
    state, fp8_scales = _split_fp8_scales(state)
    if _is_original(state):
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        state = convert_wan_transformer_to_diffusers(state)
        fp8_scales = convert_wan_transformer_to_diffusers(fp8_scales)  # same renames for the scales
        if prefix == "comfyui":
            fmt = "comfyui"
        elif prefix == "model.":
            fmt = "self_forcing" if container == "pickle" else "krea"
        else:
            fmt = "wan_original"
    else:
        fmt = "diffusers" if container != "folder" else "diffusers_folder"

    config = _config_from_metadata(metadata, path)
    if config is not None:
        _check_config(config, path, f"config metadata ('{META_CONFIG}' or config.json)")
        if "patch_embedding.weight" not in state:
            raise CheckpointError(f"{path}: key 'patch_embedding.weight' is missing; this is not a Wan2.1 transformer "
                                  f"checkpoint ({_DIT_HINT})")
    else:
        config = _infer_config(state, path, num_heads)
    if num_heads is not None and config["num_attention_heads"] != num_heads:
        dim = config["num_attention_heads"] * config["attention_head_dim"]
        if dim % num_heads:
            raise CheckpointError(f"{path}: width {dim} is not divisible by {num_heads} heads; "
                                  f"choose a --num-heads that divides {dim}")
        config.update(num_attention_heads=num_heads, attention_head_dim=dim // num_heads)
    _check_config(config, path, "config")
    scheme = metadata.get(META_CONTEXT) or trained_context_scheme(config)
    if scheme not in CONTEXT_SCHEMES:
        raise CheckpointError(f"{path}: metadata '{META_CONTEXT}' is {scheme!r}, expected one of {CONTEXT_SCHEMES}; "
                              "re-export the file with save_checkpoint")
    _check_keys(_meta_model(config, path), state, str(path))
    notes = []
    if trained_context_scheme(config) == "recompute_window":
        notes.append("14B: Krea Realtime defaults (KV recompute window, 5-call schedule)")
    info = CheckpointInfo(
        path=str(path), format=fmt, architecture=architecture_name(config), config=config,
        num_parameters=sum(v.numel() for v in state.values()), stored_dtype="/".join(stored_dtypes),
        context_scheme=scheme, source_entry=entry, notes=notes, fp8_scales=fp8_scales,
    )
    return state, info


def _meta_model(config: dict, path) -> CausalWanTransformer3DModel:
    """The architecture ``config`` describes, built on the meta device (no memory)."""
    try:
        with torch.device("meta"):
            return CausalWanTransformer3DModel(**config)
    except (TypeError, ValueError, RuntimeError, AssertionError) as e:
        raise CheckpointError(f"{path}: its config cannot build a Wan2.1 transformer ({type(e).__name__}: {e}); "
                              "re-export the file or give the original release") from e


def inspect_checkpoint(path: str | os.PathLike, *, num_heads: int | None = None) -> CheckpointInfo:
    """Describe a file without building a model (``sdvg inspect``)."""
    return read_checkpoint(path, num_heads=num_heads)[1]


# ---- building -----------------------------------------------------------------------------------------
class Fp8Linear(torch.nn.Module):
    """A Linear whose weight is stored in float8 (e4m3, per-tensor scale) and upcast for each matmul.

    Halves weight memory against bf16 at a small accuracy cost; compute stays in the input dtype.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        self.register_buffer("weight_fp8", (weight / scale).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.reshape(()))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        # Scale in float32, then cast: a bf16 scale would shift the whole matrix by up to 0.2%.
        return (self.weight_fp8.float() * self.weight_scale.float()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.dequantized_weight(x.dtype), bias)


def quantize_blocks_fp8(model: CausalWanTransformer3DModel) -> int:
    """Swap every Linear inside the transformer blocks for :class:`Fp8Linear`; returns how many."""
    count = 0
    for block in model.blocks:
        for name, module in list(block.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
                setattr(parent, name.rsplit(".", 1)[-1], Fp8Linear(module))
                count += 1
    return count


def _check_keys(model: torch.nn.Module, state: dict, path: str) -> None:
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # once: state_dict() walks every module
    expected = set(shapes)
    found = set(state)
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        parts = [f"{path}: the weights do not match the Wan2.1 architecture read from the file"]
        if missing:
            parts.append(f"{len(missing)} missing keys, e.g. {missing[:10]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys, e.g. {unexpected[:10]}")
        raise CheckpointError("; ".join(parts))
    for key in expected:
        want = shapes[key]
        if tuple(state[key].shape) != want:
            raise CheckpointError(f"{path}: key '{key}' has shape {tuple(state[key].shape)}, expected {want}")


def build_model(config: dict, state: dict, *, dtype=torch.bfloat16, device="cpu", path: str = "<state dict>",
                fp8_scales: dict | None = None) -> CausalWanTransformer3DModel:
    """Meta-device build + ``assign`` load: weights are converted once, one tensor at a time, onto ``device``."""
    model = _meta_model(config, path)
    _check_keys(model, state, path)
    fp8_scales = fp8_scales or {}
    converted = {}
    for key in list(state):
        target = torch.float32 if any(p in key for p in _FP32_PATTERNS) else dtype
        tensor = state.pop(key)
        if key in fp8_scales:
            tensor = tensor.to(device=device, dtype=torch.float32) * fp8_scales[key].to(device=device, dtype=torch.float32)
        converted[key] = tensor.to(device=device, dtype=target)
    model.load_state_dict(converted, strict=True, assign=True)
    # diffusers' own RoPE buffers are non-persistent, so still on the meta device; the causal forward
    # builds its tables from the config. Rebuild them anyway so diffusers' forward() works too.
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    model.rope = WanRotaryPosEmbed(config["attention_head_dim"], config["patch_size"], config.get("rope_max_seq_len", 1024)).to(device)
    return model.eval().requires_grad_(False)


def load_causal_wan(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    num_heads: int | None = None,
    fp8: bool = False,
    fuse_qkv: bool = False,
    compile: bool = False,
) -> tuple[CausalWanTransformer3DModel, CheckpointInfo]:
    """Load a causal Wan2.1 transformer from any supported file. See the module docstring for formats.

    Args:
        dtype: compute/storage dtype (float32, bfloat16 or float16). Modulation tables and the time
            embedding stay in float32, as in diffusers.
        fp8: store the block Linear weights in float8 (e4m3) and upcast per matmul.
        fuse_qkv: fuse the attention projections into one matmul each (inference only).
        compile: ``torch.compile`` the block forward (:meth:`CausalWanTransformer3DModel.compile_forward_block`).
    Returns:
        ``(model, info)``; ``info.context_scheme`` is the scheme the checkpoint was trained with.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    state, info = read_checkpoint(path, num_heads=num_heads)
    model = build_model(info.config, state, dtype=dtype, device=device, path=str(path), fp8_scales=info.fp8_scales)
    if fuse_qkv:
        model.fuse_qkv()
    if fp8:
        n = quantize_blocks_fp8(model)
        info.notes.append(f"{n} block Linear layers stored in float8_e4m3fn")
    if compile:
        model.compile_forward_block()
    return model, info


def save_checkpoint(model: CausalWanTransformer3DModel, path: str | os.PathLike, *, context_scheme: str | None = None) -> None:
    """Write diffusers-keyed safetensors with the config (and scheme) in the metadata; loads back exactly."""
    from safetensors.torch import save_file

    metadata = {META_CONFIG: json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in model.config.items()})}
    if context_scheme is not None:
        if context_scheme not in CONTEXT_SCHEMES:
            raise ValueError(f"context_scheme must be one of {CONTEXT_SCHEMES}, got {context_scheme!r}")
        metadata[META_CONTEXT] = context_scheme
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=metadata)
