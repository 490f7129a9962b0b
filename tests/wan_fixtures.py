"""Tiny real-architecture Wan DiTs and writers for every checkpoint format the loader reads."""

from __future__ import annotations

import re

import torch
from safetensors.torch import save_file

from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config

# diffusers -> original Wan key renames (the inverse of diffusers' convert_wan_transformer_to_diffusers).
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    (".norm2.", ".norm__tmp."), (".norm3.", ".norm2."), (".norm__tmp.", ".norm3."),
]


def to_original_keys(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        new = key
        for a, b in _TO_ORIGINAL:
            new = new.replace(a, b)
        if new == "scale_shift_table":
            new = "head.modulation"
        elif new.endswith(".scale_shift_table"):
            new = new.replace(".scale_shift_table", ".modulation")
        out[new] = value.clone()
    return out


def tiny_wan(seed: int = 0, **overrides) -> CausalWanTransformer3DModel:
    """A 2-layer Wan2.1 DiT (width 256, 2 heads of 128) with every weight randomized."""
    torch.manual_seed(seed)
    model = CausalWanTransformer3DModel(**wan_config("tiny", **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model.requires_grad_(False)


def text_context(seed: int = 1, length: int = 512, prompt_tokens: int = 7, dim: int = 4096) -> torch.Tensor:
    """A UMT5-like context: ``prompt_tokens`` nonzero rows, the rest zero padding."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.zeros(1, length, dim)
    ctx[:, :prompt_tokens] = torch.randn(1, prompt_tokens, dim, generator=g) * 0.2
    return ctx


class PoolingAnchorEncoder:
    """A deterministic stand-in for the VAE's single-frame encode (8x spatial pooling + channel map)."""

    def __init__(self, channels: int = 16, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.randn(channels, 3, generator=g)
        self.calls = 0

    def encode_frame(self, pixels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        pooled = torch.nn.functional.avg_pool2d(pixels.float(), 8)
        return torch.einsum("oc,bchw->bohw", self.proj, pooled).unsqueeze(2)


# ---- Wan VAE: diffusers -> original key layout (Wan2.1_VAE.pth, ComfyUI files) --------------------------
def vae_key_to_original(key: str) -> str:
    """Inverse of diffusers' `convert_wan_vae_to_diffusers` for the Wan2.1 layout (test-only helper)."""
    top = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2."}
    for new, old in top.items():
        if key.startswith(new):
            return old + key[len(new) :]
    resnet = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.", "conv2.": "residual.6."}
    resnet.update({"conv_shortcut.": "shortcut."})

    def map_resnet(rest: str) -> str:
        for new, old in resnet.items():
            if rest.startswith(new):
                return old + rest[len(new) :]
        raise KeyError(rest)

    side, rest = key.split(".", 1)
    if rest.startswith("conv_in."):
        return f"{side}.conv1." + rest[len("conv_in.") :]
    if rest.startswith("norm_out."):
        return f"{side}.head.0." + rest[len("norm_out.") :]
    if rest.startswith("conv_out."):
        return f"{side}.head.2." + rest[len("conv_out.") :]
    if m := re.match(r"mid_block\.resnets\.(\d)\.(.*)", rest):
        return f"{side}.middle.{2 * int(m[1])}." + map_resnet(m[2])
    if m := re.match(r"mid_block\.attentions\.0\.(.*)", rest):
        return f"{side}.middle.1.{m[1]}"
    if m := re.match(r"down_blocks\.(\d+)\.(.*)", rest):
        sub = m[2] if m[2].startswith(("resample.", "time_conv.")) else map_resnet(m[2])
        return f"{side}.downsamples.{m[1]}.{sub}"
    if m := re.match(r"up_blocks\.(\d)\.resnets\.(\d)\.(.*)", rest):
        # Original decoder: a flat list of 3 resnets + 1 upsampler per stage.
        return f"{side}.upsamples.{4 * int(m[1]) + int(m[2])}.{map_resnet(m[3])}"
    if m := re.match(r"up_blocks\.(\d)\.upsamplers\.0\.(.*)", rest):
        return f"{side}.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
    raise KeyError(key)


#: the checkpoint layouts users have, as :func:`write_checkpoint` writes them
CHECKPOINT_FORMATS = ("self_forcing", "krea", "comfyui", "wan_original", "diffusers_folder", "diffusers")


def write_checkpoint(fmt: str, source, tmp_path):
    """``source`` saved in one of the formats users have (:data:`CHECKPOINT_FORMATS`); returns the file or folder."""
    diffusers_sd = {k: v.clone() for k, v in source.state_dict().items()}
    original = to_original_keys(diffusers_sd)
    if fmt == "self_forcing":
        path = tmp_path / "self_forcing_dmd.pt"
        prefixed = {f"model.{k}": v for k, v in original.items()}
        noise = {k: torch.randn_like(v) for k, v in prefixed.items()}
        torch.save({"generator": noise, "critic": {"x": torch.zeros(1)}, "generator_ema": prefixed}, path)
    elif fmt == "krea":
        path = tmp_path / "krea-realtime-video-14b.safetensors"
        save_file({f"model.{k}": v for k, v in original.items()}, str(path))
    elif fmt == "comfyui":
        path = tmp_path / "wan_causal_comfy.safetensors"
        save_file({f"model.diffusion_model.{k}": v for k, v in original.items()}, str(path))
    elif fmt == "wan_original":
        path = tmp_path / "wan_original.pth"
        torch.save(original, path)
    elif fmt == "diffusers_folder":
        path = tmp_path / "transformer"
        source.save_pretrained(path)
    elif fmt == "diffusers":
        path = tmp_path / "diffusers_keys.safetensors"
        save_file(diffusers_sd, str(path))
    return path


def write_scaled_fp8(source, path, *, marker: str = "scaled_fp8"):
    """``source`` as ComfyUI's ``*_fp8_scaled`` files store it: 2-D block weights in float8 with a per-tensor
    ``.scale_weight``, everything else as is, and the ``marker`` key (``scaled_fp8``, top level or prefixed)."""
    state = {}
    for key, value in to_original_keys(source.state_dict()).items():
        if key.startswith("blocks.") and key.endswith(".weight") and value.ndim == 2:
            scale = value.abs().amax() / 448.0
            state[f"model.diffusion_model.{key}"] = (value / scale).to(torch.float8_e4m3fn)
            state[f"model.diffusion_model.{key[: -len('.weight')]}.scale_weight"] = scale.reshape(1)
        else:
            state[f"model.diffusion_model.{key}"] = value
    state[marker] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(path))
    return path
