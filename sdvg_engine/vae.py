"""Wan2.1 causal VAE, driven one latent frame at a time with a restorable decode cache.

Speculative decoding needs to decode a *draft* block, score its pixels, and, when the draft is rejected, decode the
target's block instead as if the draft had never been decoded. The Wan2.1 VAE decoder is causal in time: every
`WanCausalConv3d` (temporal kernel 3) keeps the last two time steps it has seen in a cache slot, and the temporal
upsamplers keep a marker (`"Rep"`) that makes the very first latent frame decode to a single pixel frame. diffusers'
public `AutoencoderKLWan.decode()` clears that cache before and after every call, so it cannot stream. This module
runs diffusers' own decoder (`vae.decoder`) frame by frame, exactly like `AutoencoderKLWan._decode`, but keeps the
cache between calls in a list owned by [`StreamingWanVAE`] (not in `vae._feat_map`, which `vae.encode()` /
`vae.decode()` / `vae.clear_cache()` overwrite).

Why a snapshot is a shallow copy: in diffusers 0.42 every cache update is a slot *assignment*
(`feat_cache[idx] = x[:, :, -2:].clone()` or a `torch.cat`), never an in-place write into a cached tensor. A snapshot
therefore only has to remember which tensor objects were in the slots (a tuple of references) plus the frame
counter; decoding more frames replaces slots but never changes the tensors the snapshot points to. The test-suite
checks this invariant. If you ever decode with in-place kernels (CUDA graphs with static buffers, custom fused
convolutions), snapshots must deep-copy instead.

Latent normalisation: the diffusion model works on `z_norm = (z - mean) / std` per channel. [`StreamingWanVAE`] is the
only place that converts (see `normalize` / `denormalize`), using the reciprocal form of Wan and diffusers
(`z_norm / (1 / std) + mean`) so that results are bit-identical to their pipelines.

This module must never import ComfyUI.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from diffusers.utils import is_accelerate_available


__all__ = ["StreamingWanVAE", "VAEDecodeState", "load_wan_vae", "load_wan21_vae_config"]

# Keys that identify a Wan VAE in the original (Wan / ComfyUI) layout and in the diffusers layout. diffusers'
# single-file loader recognises a Wan VAE by the first original key; the others make detection survive a file
# that lacks that one key (it is then reported as missing instead of "not a Wan VAE").
_ORIGINAL_MARKER_KEYS = ("decoder.middle.0.residual.0.gamma", "decoder.conv1.weight", "decoder.head.2.weight")
_DIFFUSERS_MARKER_KEYS = ("decoder.mid_block.resnets.0.norm1.gamma", "decoder.conv_in.weight", "decoder.conv_out.weight")

_WAN21_Z_DIM = 16
_MAX_KEYS_IN_ERROR = 10

_UNSUPPORTED_VAE_HINT = (
    "Only the Wan2.1 VAE (z_dim=16; files 'Wan2.1_VAE.pth' or ComfyUI's 'wan_2.1_vae.safetensors') is supported: the "
    "Self-Forcing and Krea models generate Wan2.1 latents. The Wan2.2 VAE (z_dim=48) is not supported; use the Wan2.1 VAE."
)


def load_wan21_vae_config() -> dict[str, Any]:
    """The diffusers config of the real Wan2.1 VAE, shipped with the package so that loading never goes online."""
    text = resources.files("sdvg_engine").joinpath("configs", "wan2.1_vae", "config.json").read_text(encoding="utf-8")
    return json.loads(text)


def _check_wan21_config(config: Mapping[str, Any], where: str) -> None:
    """Raise a clear error for VAE configs this module cannot stream (Wan2.2: z_dim 48, residual blocks, patching)."""
    z_dim = config.get("z_dim", _WAN21_Z_DIM)
    is_residual = bool(config.get("is_residual", False))
    patch_size = config.get("patch_size", None)
    if z_dim != _WAN21_Z_DIM or is_residual or patch_size not in (None, 1):
        raise ValueError(
            f"{where}: unsupported VAE (z_dim={z_dim}, is_residual={is_residual}, patch_size={patch_size}); this looks "
            f"like a Wan2.2 VAE. {_UNSUPPORTED_VAE_HINT}"
        )


@dataclass(frozen=True)
class VAEDecodeState:
    """An immutable snapshot of a [`StreamingWanVAE`] decode stream (see [`StreamingWanVAE.snapshot`]).

    Attributes:
        feat_cache (`tuple`):
            One entry per `WanCausalConv3d` of the decoder: `None` (not used yet), the string `"Rep"` (temporal
            upsampler after the first latent frame) or a tensor `[B, C, <=2, h', w']` with the last time steps.
            The tensors are shared with the live stream, never copied: they are never written in place.
        latent_frames (`int`): latent frames decoded since the last `reset()`.
        stream_key (`tuple` or `None`): `(batch, height, width, dtype)` of the stream; `None` before the first block.
    """

    feat_cache: tuple
    latent_frames: int
    stream_key: tuple | None


class StreamingWanVAE:
    """Wan2.1 causal VAE driven one latent frame at a time, with a restorable decode cache.

    Decoding follows the official Wan2.1 / diffusers semantics: the first latent frame after [`reset`] decodes to one
    pixel frame and every later latent frame to `temporal_scale` (4) pixel frames, so 21 latent frames give
    1 + 4 * 20 = 81 pixel frames however they are split into blocks. (Self-Forcing's demo instead starts from a
    zero cache and drops 3 frames; that variant is deliberately not reproduced.)

    Args:
        vae ([`~diffusers.AutoencoderKLWan`]):
            A Wan2.1 VAE (z_dim 16). It is used as is: move it with `vae.to(...)` (e.g. by ComfyUI's memory
            management); the stream follows the module's current device and dtype. Device moves in the middle of a
            stream are fine (diffusers moves cached tensors to the input's device); dtype changes require `reset()`.
    """

    def __init__(self, vae: AutoencoderKLWan):
        if not isinstance(vae, AutoencoderKLWan):
            raise TypeError(f"StreamingWanVAE wraps a diffusers AutoencoderKLWan, got {type(vae).__name__}")
        _check_wan21_config(vae.config, where="StreamingWanVAE")
        self.vae = vae

        config = vae.config
        self.latent_channels: int = int(config.z_dim)
        # Each non-final stage of the decoder doubles H and W; each `temperal_downsample` stage doubles time.
        self.spatial_scale: int = 2 ** (len(config.dim_mult) - 1)
        self.temporal_scale: int = 2 ** sum(bool(t) for t in config.temperal_downsample)

        # Kept in float32 and cast on use, exactly like diffusers' Wan pipelines do (tensor(list) -> .to(dtype)).
        self._latents_mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self._latents_std = torch.tensor(config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        if self._latents_mean.shape[1] != self.latent_channels or self._latents_std.shape[1] != self.latent_channels:
            raise ValueError("latents_mean / latents_std in the VAE config must have z_dim entries")

        # One slot per causal conv, as diffusers' `clear_cache()` does (the 1x1x1 shortcut conv is counted but
        # never uses its slot).
        self._num_cache_slots = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        # `vae.encode` keeps its causal cache on the shared diffusers module: two workers re-encoding anchors
        # (drafter and target on the recompute window) must take turns.
        self._encode_lock = threading.Lock()
        self.reset()

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.vae.post_quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.post_quant_conv.weight.dtype

    @property
    def latent_frames_decoded(self) -> int:
        """Latent frames decoded since the last [`reset`] (or as of the restored snapshot)."""
        return self._latent_frames

    def __repr__(self) -> str:
        return (
            f"StreamingWanVAE(device={self.device}, dtype={self.dtype}, latent_frames_decoded={self._latent_frames}, "
            f"decode_cache_bytes={self.decode_cache_bytes()})"
        )

    # ------------------------------------------------------------------------------------------- normalisation
    def normalize(self, raw_latents: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents `[B, 16, T, h, w]` -> the diffusion model's space: `(z - mean) / std` per channel.

        Computed in `raw_latents.dtype` as `(z - mean) * (1 / std)`, the form used by Wan and diffusers.
        """
        mean = self._latents_mean.to(raw_latents.device, raw_latents.dtype)
        inv_std = 1.0 / self._latents_std.to(raw_latents.device, raw_latents.dtype)
        return (raw_latents - mean) * inv_std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents `[B, 16, T, h, w]` -> raw VAE latents: `z_norm * std + mean` per channel.

        Computed in `latents.dtype` as `z_norm / (1 / std) + mean`, bit-identical to diffusers' Wan pipelines.
        """
        mean = self._latents_mean.to(latents.device, latents.dtype)
        inv_std = 1.0 / self._latents_std.to(latents.device, latents.dtype)
        return latents / inv_std + mean

    # --------------------------------------------------------------------------------------------------- decode
    def reset(self) -> None:
        """Forget the decode cache: the next [`decode_block`] starts a new video (its first latent -> 1 frame)."""
        self._feat_cache: list = [None] * self._num_cache_slots
        self._latent_frames = 0
        self._stream_key: tuple | None = None

    @torch.no_grad()
    def decode_block(self, block_latents: torch.Tensor) -> torch.Tensor:
        """Decode the next block of a video and advance the decode cache.

        Args:
            block_latents (`torch.Tensor` of shape `[B, 16, n, h, w]`):
                *Normalized* latents, as produced by the diffusion model (any float dtype / device; they are moved
                to the VAE's device and dtype).

        Returns:
            `torch.Tensor` of shape `[B, 3, T, 8h, 8w]`, float32, clamped to [-1, 1], with `T = 1 + 4 (n - 1)` for
            the first block after [`reset`] and `T = 4 n` afterwards.
        """
        if block_latents.ndim != 5 or block_latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"decode_block expects latents [B, {self.latent_channels}, n, h, w], got {tuple(block_latents.shape)}"
            )
        batch, _, num_frames, height, width = block_latents.shape
        if num_frames == 0:
            raise ValueError("decode_block got an empty block (n = 0 latent frames)")
        stream_key = (batch, height, width, self.dtype)
        if self._stream_key is not None and stream_key != self._stream_key:
            raise ValueError(
                f"decode_block: (batch, h, w, dtype) = {stream_key} differs from this stream's {self._stream_key}; "
                "call reset() before decoding a different video"
            )

        self._run_offload_hook()
        z = self.denormalize(block_latents.to(device=self.device, dtype=self.dtype))

        # Work on a copy of the slot list and commit at the end: an exception half-way (e.g. out of memory) then
        # leaves the stream exactly as it was.
        feat_cache = list(self._feat_cache)
        latent_frames = self._latent_frames
        frames = []
        for i in range(num_frames):
            # `post_quant_conv` is 1x1x1, so `_decode` applies it to the whole video at once. We apply it per latent
            # frame: every frame then goes through the same ops on the same shapes whatever the block split, which
            # makes the pixels a pure function of the latent sequence (bit-exact across splits). The CPU backend
            # may pick a different kernel for a different T on tiny inputs, so on e.g. 2x4 latents this can differ
            # from `decode()` in the last bit; at 8x8 and real sizes it is identical.
            x = self.vae.post_quant_conv(z[:, :, i : i + 1])
            # The slot counter restarts for every latent frame: slot k always belongs to the k-th causal conv.
            feat_idx = [0]
            # `first_chunk` mirrors `_decode` (True only for frame 0 of a video). The Wan2.1 decoder ignores it; the
            # one-frame first output comes from the temporal upsamplers seeing an empty ("None") slot.
            frames.append(self.vae.decoder(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=latent_frames == 0))
            latent_frames += 1

        self._feat_cache = feat_cache
        self._latent_frames = latent_frames
        self._stream_key = stream_key
        return torch.clamp(torch.cat(frames, dim=2), min=-1.0, max=1.0).float()

    def snapshot(self) -> VAEDecodeState:
        """Remember the current decode state. O(number of cache slots): the cached tensors are shared, not copied."""
        return VAEDecodeState(
            feat_cache=tuple(self._feat_cache), latent_frames=self._latent_frames, stream_key=self._stream_key
        )

    def restore(self, state: VAEDecodeState) -> None:
        """Return to `state`: decoding continues as if the blocks decoded since [`snapshot`] never happened.

        A state may be restored any number of times.
        """
        if not isinstance(state, VAEDecodeState):
            raise TypeError(f"restore expects a VAEDecodeState, got {type(state).__name__}")
        if len(state.feat_cache) != self._num_cache_slots:
            raise ValueError(
                f"restore: the state has {len(state.feat_cache)} cache slots, this decoder has {self._num_cache_slots} "
                "(snapshot of a different VAE architecture)"
            )
        self._feat_cache = list(state.feat_cache)
        self._latent_frames = state.latent_frames
        self._stream_key = state.stream_key

    def decode_cache_bytes(self) -> int:
        """Bytes held by the current decode cache (tensors shared with snapshots are counted once here)."""
        return sum(t.numel() * t.element_size() for t in self._feat_cache if isinstance(t, torch.Tensor))

    # --------------------------------------------------------------------------------------------------- encode
    @torch.no_grad()
    def encode_frame(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode single images as the first chunk of a video (the anchor re-encode of Krea-style recompute).

        Uses the encoder's own cache, so the decode stream is not disturbed.

        Args:
            pixels (`torch.Tensor` of shape `[B, 3, H, W]`): values in [-1, 1]; H and W multiples of 8.

        Returns:
            `torch.Tensor` of shape `[B, 16, 1, H/8, W/8]`: normalized latents (float32), the posterior mean.
        """
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"encode_frame expects pixels [B, 3, H, W], got {tuple(pixels.shape)}")
        return self.encode_video(pixels.unsqueeze(2))

    @torch.no_grad()
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode a whole video.

        Args:
            pixels (`torch.Tensor` of shape `[B, 3, T, H, W]`): values in [-1, 1]; `T = 1 + 4k`; H, W multiples of 8.

        Returns:
            `torch.Tensor` of shape `[B, 16, 1 + k, H/8, W/8]`: normalized latents (float32), the posterior mean.
        """
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise ValueError(f"encode_video expects pixels [B, 3, T, H, W], got {tuple(pixels.shape)}")
        _, _, num_frames, height, width = pixels.shape
        if num_frames < 1 or (num_frames - 1) % self.temporal_scale != 0:
            raise ValueError(
                f"encode_video needs T = 1 + {self.temporal_scale}k frames, got T = {num_frames} "
                "(diffusers would silently drop the extra frames)"
            )
        if height % self.spatial_scale or width % self.spatial_scale:
            raise ValueError(f"encode_video needs H and W divisible by {self.spatial_scale}, got {height}x{width}")
        # `vae.encode` clears only the VAE's own caches (`vae._feat_map`, `vae._enc_feat_map`); the decode stream lives
        # in `self._feat_cache` and is untouched. It also triggers accelerate offload hooks itself.
        with self._encode_lock:
            posterior = self.vae.encode(pixels.to(device=self.device, dtype=self.dtype)).latent_dist
        return self.normalize(posterior.mode().float())

    # ------------------------------------------------------------------------------------------------- helpers
    def _run_offload_hook(self) -> None:
        # What diffusers' `@apply_forward_hook` does for `decode()`: with accelerate CPU offload, this moves the
        # VAE to its execution device before we call its submodules directly.
        hook = getattr(self.vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self.vae)


# ======================================================================================================== loading
def load_wan_vae(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> StreamingWanVAE:
    """Load a Wan2.1 VAE from local files only (never downloads) and wrap it in a [`StreamingWanVAE`].

    Accepted inputs:
        - `Wan2.1_VAE.pth`: a torch pickle of a plain state dict with the original Wan keys (loaded with
          `weights_only=True`);
        - ComfyUI's `wan_2.1_vae.safetensors` (original keys, optionally behind a prefix such as `vae.` or
          `first_stage_model.`, which is stripped; other components of a combined checkpoint are ignored);
        - a diffusers folder (`config.json` + weights), or a pipeline folder with a `vae/` subfolder;
        - a single diffusers-keyed `.safetensors` file.

    Single files are built from the shipped Wan2.1 config, with `base_dim` / `z_dim` read from the tensor shapes
    (so small test VAEs load through the same path), on the meta device so the weights are allocated once, and
    loaded strictly.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: unreadable / corrupt file, not a Wan VAE, a Wan2.2 VAE, or missing / unexpected / mis-shaped keys.
            The message names the file.
    """
    from .checks import check_path

    path = Path(check_path("path", path, "a Wan2.1 VAE file or folder")).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Wan2.1 VAE not found: '{path}'. load_wan_vae only reads local files and never downloads; pass the path "
            "of Wan2.1_VAE.pth, ComfyUI's wan_2.1_vae.safetensors, or a diffusers VAE folder."
        )
    if path.is_dir():
        vae = _load_diffusers_folder(path, dtype=dtype)
    else:
        vae = _load_single_file(path, device=device, dtype=dtype)
    # Both loaders already produce `dtype` (single files are cast tensor by tensor, folders use `torch_dtype`), so
    # only the device moves here; diffusers' `ModelMixin.to(dtype=...)` would also log a spurious fp32 warning.
    vae = vae.to(device=device)
    vae.eval()
    vae.requires_grad_(False)
    return StreamingWanVAE(vae)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file or a torch pickle into a flat `{name: tensor}` dict (on CPU), through the shared
    checkpoint reader (`sdvg_engine.checkpoint_io`): unreadable, truncated, empty or integer-weight files are
    refused with a `CheckpointError` (a `ValueError`) naming the file."""
    from .checkpoint_io import read_tensor_file

    state_dict, _, _ = read_tensor_file(
        path, what="Wan VAE checkpoint", hint="pass Wan2.1_VAE.pth, wan_2.1_vae.safetensors or a diffusers VAE folder",
        entries=("state_dict", "model", "module"),
    )
    return {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _select_vae_keys(state_dict: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """Find the VAE inside `state_dict` and strip its prefix. Returns `(state_dict, is_original_layout)`."""
    for markers, is_original in ((_ORIGINAL_MARKER_KEYS, True), (_DIFFUSERS_MARKER_KEYS, False)):
        # A prefix is empty or ends with a dot ('vae.', 'first_stage_model.'); prefer the shortest.
        prefixes = [k[: -len(m)] for m in markers for k in state_dict if k.endswith(m)]
        prefixes = [p for p in prefixes if p == "" or p.endswith(".")]
        if not prefixes:
            continue
        prefix = min(prefixes, key=len)
        if prefix:
            state_dict = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        return state_dict, is_original
    sample = ", ".join(sorted(state_dict)[:5]) or "<no tensors>"
    raise ValueError(
        f"'{path}' is not a Wan VAE checkpoint: none of {_ORIGINAL_MARKER_KEYS} (original Wan/ComfyUI keys) or "
        f"{_DIFFUSERS_MARKER_KEYS} (diffusers keys) was found. First keys: {sample}. "
        "Pass Wan2.1_VAE.pth, wan_2.1_vae.safetensors or a diffusers VAE folder"
    )


def _format_key_error(path: Path, missing: list[str], unexpected: list[str], what: str, note: str = "") -> str:
    lines = [f"'{path}' does not match {what}{note}:"]
    if missing:
        shown = ", ".join(missing[:_MAX_KEYS_IN_ERROR])
        more = f" (and {len(missing) - _MAX_KEYS_IN_ERROR} more)" if len(missing) > _MAX_KEYS_IN_ERROR else ""
        lines.append(f"  {len(missing)} missing key(s): {shown}{more}")
    if unexpected:
        shown = ", ".join(unexpected[:_MAX_KEYS_IN_ERROR])
        more = f" (and {len(unexpected) - _MAX_KEYS_IN_ERROR} more)" if len(unexpected) > _MAX_KEYS_IN_ERROR else ""
        lines.append(f"  {len(unexpected)} unexpected key(s): {shown}{more}")
    return "\n".join(lines)


def _load_single_file(path: Path, *, device: str | torch.device, dtype: torch.dtype) -> AutoencoderKLWan:
    return wan_vae_from_state_dict(_read_state_dict(path), device=device, dtype=dtype, source=str(path))


def wan_vae_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str = "<state dict>",
    copy: bool = False,
) -> AutoencoderKLWan:
    """Build the diffusers Wan2.1 VAE from a state dict in the original Wan layout (optionally behind a prefix,
    as in `Wan2.1_VAE.pth`, ComfyUI files, or `comfy.sd.VAE.first_stage_model.state_dict()`) or in diffusers'.

    `base_dim` / `z_dim` are read from the tensor shapes. With `copy=True` the tensors are copied, so the
    caller's module (e.g. ComfyUI's own VAE) is never aliased. Errors name `source`.
    """
    path = Path(source)
    state_dict = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    state_dict, is_original = _select_vae_keys(state_dict, path)
    from .checkpoint_io import check_float_weights

    check_float_weights(state_dict, path)  # integer weights would load and decode garbage
    # diffusers name -> name in the file, to report unexpected keys under the names the user sees.
    file_names = {k: k for k in state_dict}
    if is_original:
        # diffusers' own key map (original Wan -> diffusers). It only renames keys and passes values through, so
        # converting {name: name} yields the rename table itself. Unknown keys keep their name and are reported
        # as unexpected below.
        file_names = convert_wan_vae_to_diffusers({k: k for k in state_dict})
        state_dict = {new: state_dict[old] for new, old in file_names.items()}

    config = load_wan21_vae_config()
    dim_mult = config["dim_mult"]
    # Read the widths from the tensors: decoder.conv_in is [base_dim * dim_mult[-1], z_dim, 3, 3, 3] and
    # encoder.conv_in is [base_dim, 3, 3, 3, 3]. Missing tensors keep the shipped values and are reported below.
    decoder_in = state_dict.get("decoder.conv_in.weight")
    encoder_in = state_dict.get("encoder.conv_in.weight")
    decoder_in = decoder_in if decoder_in is not None and decoder_in.ndim == 5 else None
    encoder_in = encoder_in if encoder_in is not None and encoder_in.ndim == 5 else None
    if decoder_in is not None:
        config["z_dim"] = int(decoder_in.shape[1])
        _check_wan21_config(config, where=f"'{path}'")
    decoder_base_dim = int(decoder_in.shape[0]) // dim_mult[-1] if decoder_in is not None else None
    encoder_base_dim = int(encoder_in.shape[0]) if encoder_in is not None else None
    config["base_dim"] = encoder_base_dim or decoder_base_dim or config["base_dim"]
    if decoder_base_dim is not None and decoder_base_dim != config["base_dim"]:
        config["decoder_base_dim"] = decoder_base_dim  # a decoder narrower/wider than the encoder

    # Build on the meta device (no memory), then adopt the checkpoint's tensors with `assign=True`.
    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(config)
    expected = vae.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    what = f"a Wan2.1 VAE (base_dim={config['base_dim']}, z_dim={config['z_dim']})"
    if missing or unexpected:
        note = " (original Wan layout; missing keys are given by their diffusers names)" if is_original else ""
        unexpected = sorted(file_names[k] for k in unexpected)
        raise ValueError(_format_key_error(path, missing, unexpected, what, note))

    state_dict = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=copy)
        for k, v in state_dict.items()
    }
    try:
        vae.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"'{path}' does not match {what}: {e}") from e
    leftover = [n for n, t in (*vae.named_parameters(), *vae.named_buffers()) if t.is_meta]
    if leftover:  # would mean diffusers added a tensor that is not in the state dict
        raise RuntimeError(f"'{path}': tensors left uninitialised after loading: {leftover[:_MAX_KEYS_IN_ERROR]}")
    return vae



def _load_diffusers_folder(folder: Path, *, dtype: torch.dtype) -> AutoencoderKLWan:
    # Accept a pipeline root as well as its `vae/` subfolder.
    if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"'{folder}' is a folder without config.json; expected a diffusers AutoencoderKLWan folder "
            "(config.json + diffusion_pytorch_model.safetensors) or a single checkpoint file"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not read '{config_file}': {e}") from e
    class_name = config.get("_class_name", "AutoencoderKLWan")
    if class_name != "AutoencoderKLWan":
        raise ValueError(f"'{config_file}' describes a {class_name}, not an AutoencoderKLWan")
    _check_wan21_config(config, where=f"'{config_file}'")

    try:
        vae, info = AutoencoderKLWan.from_pretrained(
            folder,
            local_files_only=True,
            torch_dtype=dtype,
            output_loading_info=True,
            # Without accelerate diffusers falls back to a double allocation anyway; saying so explicitly avoids
            # its "install accelerate" warning on every load.
            low_cpu_mem_usage=is_accelerate_available(),
        )
    except Exception as e:
        raise ValueError(f"Could not load the diffusers Wan VAE in '{folder}': {type(e).__name__}: {e}") from e
    missing, unexpected = sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", []))
    what = f"a Wan2.1 VAE (base_dim={config.get('base_dim')}, z_dim={config.get('z_dim')})"
    if missing or unexpected:
        raise ValueError(_format_key_error(folder, missing, unexpected, what))
    if info.get("mismatched_keys"):
        raise ValueError(f"'{folder}' has tensors of the wrong shape: {info['mismatched_keys'][:_MAX_KEYS_IN_ERROR]}")
    return vae
