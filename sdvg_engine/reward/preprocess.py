"""Frame preprocessing for the reward ViT.

Two paths (``preprocess=``):

``"pil"`` (default): exactly what the reference SDVG server (yuezhouhu/spec-video-gen,
``release_server.py``) and the ``image-reward`` package do to each decoded frame:

1. 8-bit conversion as the reference does it: ``frame.float().clamp(0, 1)``, then
   ``* 255`` and **truncation** to uint8 (torchvision ``to_pil_image`` on a float tensor runs
   ``pic.mul(255).byte()``; the reference computes ``(x + 1) * 0.5`` and clamps first, which is
   what :func:`sdvg_engine.pipeline.unit_frames` gives). uint8 input skips this step.
2. ImageReward's ``Resize(S, BICUBIC)``: PIL ``Image.resize(BICUBIC)`` with the shorter side
   set to S and the longer one to ``int(S * long / short)`` (torchvision ``Resize(int)``).
3. ``CenterCrop(S)``: offsets ``int(round((dim - S) / 2.0))`` (Python round: half to even).
4. ``ToTensor`` (``/ 255`` in float32) and ``Normalize`` with the CLIP mean/std.

The resize runs on the CPU (PIL), so each call moves the frames to the host as uint8
(a quarter of the float32 bytes); the 224x224 crops go back to the model's device.
``crop="full"`` in this path resizes the whole 8-bit frame to SxS with PIL bicubic (aspect
ratio not kept, nothing cut off) and skips the crop. The path is not differentiable (8-bit step, PIL);
use ``"torch"`` where gradients must flow to the frames.

``"torch"``: the fast path, all on the model's device: torch antialiased bicubic on the float
frames (no 8-bit step), the same geometry, clamp to [0, 1], normalise. Error against the PIL path
(``bench/bench_reward.py``, docs/dev/reward_preprocessing.md; 12 frames of 480x832): max |pixel
difference| 0.027 (smooth frames) to 0.083 (noise) in CLIP-normalised units, mean 0.0075 (mostly
the reference's 8-bit truncation, -0.5/255 on average); on real photographs the resampler alone
was measured up to 0.15. Scores moved by up to 1.3e-2 on a random test model (resampler alone:
2e-3 to 6e-3), so a fixed tau tuned on one path should be re-checked on the other.

A frame with any NaN/inf value gets NaN pixels in either path, so its score is NaN and the
router rejects the block (a uint8 cast of NaN would otherwise give an arbitrary finite image).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "CROP_MODES",
    "PREPROCESS_MODES",
    "frames_to_uint8",
    "pil_resize_crop",
    "preprocess_frames",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CROP_MODES = ("center", "full")
PREPROCESS_MODES = ("pil", "torch")
_MAX_PIL_THREADS = 8


def _check_mode(preprocess: str) -> None:
    if preprocess not in PREPROCESS_MODES:
        raise ValueError(
            f"preprocess must be one of {PREPROCESS_MODES}, got {preprocess!r} "
            f"('pil' = ImageReward-exact 8-bit PIL path, 'torch' = fast on-device approximation)"
        )


def _check_frames(frames) -> None:
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"frames must be a torch.Tensor, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[1] != 3:
        hint = ""
        if frames.ndim == 4 and frames.shape[-1] == 3:
            hint = " (this looks like channels-last [N, H, W, 3]; use frames.permute(0, 3, 1, 2))"
        raise ValueError(f"frames must be [N, 3, H, W], got shape {tuple(frames.shape)}{hint}")
    if frames.shape[0] == 0:
        raise ValueError("frames is empty (N == 0)")
    if frames.dtype != torch.uint8 and not frames.is_floating_point():
        raise TypeError(f"frames must be float (0..1) or uint8, got {frames.dtype}")


def _resized_size(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision ``Resize(int)``: shorter side -> size, longer -> int(size * long / short)."""
    if w <= h:
        return int(size * h / w), size
    return size, int(size * w / h)


def _crop_offsets(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision ``CenterCrop``: int(round((dim - size) / 2.0)), Python's half-to-even round."""
    return int(round((h - size) / 2.0)), int(round((w - size) / 2.0))


def frames_to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Float frames (0..1) -> uint8 exactly as the reference server makes its PIL images.

    ``frames.float().clamp(0, 1).mul(255)`` then truncation toward zero (``.byte()``), on the
    frames' own device. uint8 input is returned unchanged. NaN values give unspecified bytes
    (:func:`preprocess_frames` marks such frames NaN afterwards).
    """
    if frames.dtype == torch.uint8:
        return frames
    x = frames.float().clamp(0.0, 1.0)  # a new tensor: the in-place multiply below never touches the input
    return x.mul_(255.0).to(torch.uint8)


def pil_resize_crop(image: np.ndarray, size: int, *, crop: str = "center") -> np.ndarray:
    """One 8-bit RGB frame ``[H, W, 3]`` -> ``[S, S, 3]`` uint8 with ImageReward's PIL geometry
    (``crop="center"``: Resize(S, BICUBIC) + CenterCrop(S); ``"full"``: bicubic to SxS)."""
    img = Image.fromarray(np.ascontiguousarray(image))
    w, h = img.size
    if crop == "full":
        return np.asarray(img.resize((size, size), Image.Resampling.BICUBIC))
    nh, nw = _resized_size(h, w, size)
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    top, left = _crop_offsets(nh, nw, size)
    return np.asarray(img.crop((left, top, left + size, top + size)))


def _normalize(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CLIP_MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def _nonfinite_frames(frames: torch.Tensor) -> torch.Tensor | None:
    if frames.dtype == torch.uint8:
        return None
    bad = ~torch.isfinite(frames).flatten(1).all(dim=1)
    return bad if bool(bad.any()) else None


def _preprocess_pil(frames, size, crop, device) -> torch.Tensor:
    u8 = frames_to_uint8(frames).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # [N, H, W, 3]
    workers = min(len(u8), os.cpu_count() or 1, _MAX_PIL_THREADS)
    if workers > 1:
        # PIL releases the GIL while resampling: frames resize in parallel, results in order.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            crops = np.stack(list(pool.map(lambda f: pil_resize_crop(f, size, crop=crop), u8)))
    else:
        crops = np.stack([pil_resize_crop(f, size, crop=crop) for f in u8])  # [N, S, S, 3] uint8
    # torchvision ToTensor: HWC -> CHW, float32 / 255; then Normalize.
    x = torch.from_numpy(crops).to(device=device).permute(0, 3, 1, 2).to(torch.float32).div(255.0)
    return _normalize(x)


def _resize(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    if (x.shape[-2], x.shape[-1]) == (h, w):
        return x
    # Bicubic + antialias (the antialias matters when downscaling 480p frames to 224).
    return F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)


def _preprocess_torch(frames, size, crop, device) -> torch.Tensor:
    if frames.dtype == torch.uint8:
        x = frames.to(device=device).float() / 255.0
    else:
        # Resample in fp32 at least: bicubic in fp16 is less accurate and not on every backend.
        x = frames.to(device=device, dtype=torch.float32)
    h, w = x.shape[-2:]
    if crop == "full":
        x = _resize(x, size, size)
    else:
        nh, nw = _resized_size(h, w, size)
        x = _resize(x, nh, nw)
        top, left = _crop_offsets(nh, nw, size)
        x = x[..., top : top + size, left : left + size]
    # Out of place: x may still be a view of the caller's tensor. PIL's uint8 output is clipped too.
    return _normalize(x.clamp(0.0, 1.0))


def preprocess_frames(
    frames: torch.Tensor,
    size: int,
    *,
    crop: str = "center",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    preprocess: str = "pil",
) -> torch.Tensor:
    """Turn video frames into ViT input.

    Args:
        frames: [N, 3, H, W], float in 0..1 or uint8 0..255, any H, W.
        size: ViT input side S (224 for ImageReward-v1.0).
        crop: "center" (ImageReward's resize + center crop) or "full" (whole frame squashed to SxS).
        device, dtype: where/what the result should be (the model's device and dtype);
            ``device=None`` keeps the frames' device.
        preprocess: "pil" (ImageReward-exact, see the module docstring) or "torch" (fast approximation).

    Returns:
        [N, 3, S, S] normalised with the CLIP mean/std, on ``device`` in ``dtype``.
    """
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
    _check_mode(preprocess)
    _check_frames(frames)
    if device is None:
        device = frames.device
    bad = _nonfinite_frames(frames)
    if preprocess == "pil":
        x = _preprocess_pil(frames, size, crop, device)
    else:
        x = _preprocess_torch(frames, size, crop, device)
    if bad is not None:
        x = x.masked_fill(bad.to(x.device).view(-1, 1, 1, 1), float("nan"))
    return x.to(dtype)
