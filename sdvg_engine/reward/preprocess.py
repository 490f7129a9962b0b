"""Frame preprocessing for the reward ViT, in torch on the model's device (no torchvision/PIL).

``center`` reproduces ImageReward's ``Resize(S, BICUBIC) -> CenterCrop(S) -> Normalize(CLIP)``:
the shorter side becomes S, so on a 832x480 Wan frame 42 % of the width is never seen.
``full`` squashes the whole frame to SxS so that nothing is cut off (aspect ratio changes).

Torch bicubic with ``antialias=True`` differs from PIL by <= 0.059 (mean 0.004) in normalised
units; results are clamped to [0, 1] before normalising, as PIL's uint8 output would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CLIP_MEAN", "CLIP_STD", "CROP_MODES", "preprocess_frames"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CROP_MODES = ("center", "full")


def _resize(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    if (x.shape[-2], x.shape[-1]) == (h, w):
        return x
    # Bicubic + antialias (the antialias matters when downscaling 480p frames to 224).
    return F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)


def preprocess_frames(
    frames: torch.Tensor,
    size: int,
    *,
    crop: str = "center",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Turn video frames into ViT input.

    Args:
        frames: [N, 3, H, W], float in 0..1 (uint8 0..255 is also accepted), any H, W.
        size: ViT input side S (224 for ImageReward-v1.0).
        crop: "center" (reference ImageReward preprocessing) or "full" (squash whole frame).
        device, dtype: where/what the result should be (the model's device and dtype).

    Returns:
        [N, 3, S, S] normalised with the CLIP mean/std, on ``device`` in ``dtype``.
    """
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"frames must be a torch.Tensor, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[1] != 3:
        hint = ""
        if frames.ndim == 4 and frames.shape[-1] == 3:
            hint = " (this looks like channels-last [N, H, W, 3]; use frames.permute(0, 3, 1, 2))"
        raise ValueError(f"frames must be [N, 3, H, W], got shape {tuple(frames.shape)}{hint}")
    if frames.shape[0] == 0:
        raise ValueError("frames is empty (N == 0)")
    if frames.dtype == torch.uint8:
        x = frames.to(device=device).float() / 255.0
    elif frames.is_floating_point():
        # Resample in fp32 at least: bicubic in fp16 is less accurate and not on every backend.
        x = frames.to(device=device, dtype=torch.float32)
    else:
        raise TypeError(f"frames must be float (0..1) or uint8, got {frames.dtype}")

    h, w = x.shape[-2:]
    if crop == "full":
        x = _resize(x, size, size)
    else:
        # torchvision Resize(int): shorter side -> size, longer side -> int(size * long / short).
        if h <= w:
            nh, nw = size, int(size * w / h)
        else:
            nh, nw = int(size * h / w), size
        x = _resize(x, nh, nw)
        # torchvision CenterCrop offsets: int(round((dim - size) / 2)).
        top = int(round((nh - size) / 2.0))
        left = int(round((nw - size) / 2.0))
        x = x[..., top : top + size, left : left + size]
    # Out of place: x may still be a view of the caller's tensor.
    x = x.clamp(0.0, 1.0)
    mean = torch.tensor(CLIP_MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return ((x - mean) / std).to(dtype)
