"""Writing frames ``[T, H, W, 3]`` (float 0..1) to MP4 (PyAV), animated WebP or PNG frames (Pillow)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

FPS = 16  # Wan2.1


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3], got {tuple(frames.shape)}")
    return (frames.detach().float().clamp(0, 1).cpu().numpy() * 255.0 + 0.5).astype(np.uint8)


def have_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def write_video(frames: torch.Tensor, path: str | os.PathLike, fps: int = FPS) -> Path:
    """Write ``frames`` to ``path``; the suffix picks the format (``.mp4``, ``.webp``, or a folder for PNGs).

    An ``.mp4`` request without PyAV installed raises (``pip install av``) rather than silently
    writing something else; callers that want a fallback choose it with :func:`default_video_suffix`.
    """
    path = Path(path)
    pixels = to_uint8(frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".mp4":
        if not have_pyav():
            raise RuntimeError(f"writing {path} needs PyAV (pip install av); or ask for .webp")
        import av

        height, width = pixels.shape[1:3]
        with av.open(str(path), mode="w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height = width - width % 2, height - height % 2
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"}
            for frame in pixels:
                packet = stream.encode(av.VideoFrame.from_ndarray(frame[: stream.height, : stream.width], format="rgb24"))
                container.mux(packet)
            container.mux(stream.encode())
        return path
    from PIL import Image

    images = [Image.fromarray(f) for f in pixels]
    if path.suffix == ".webp":
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0, lossless=False, quality=90)
        return path
    if path.suffix == "":
        path.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(images):
            image.save(path / f"frame_{i:05d}.png")
        return path
    raise ValueError(f"unknown video format '{path.suffix}' for {path}: use .mp4, .webp or a folder name")


def default_video_suffix() -> str:
    return ".mp4" if have_pyav() else ".webp"


def mask_strip(mask: torch.Tensor, height: int = 24, width_per_frame: int = 6) -> np.ndarray:
    """An image ``[height, T*w, 3]``: green where the frame came from an accepted draft, grey for the target."""
    colours = np.where(mask.cpu().numpy()[:, None] > 0.5, np.array([[60, 200, 90]]), np.array([[110, 110, 110]]))
    strip = np.repeat(colours.astype(np.uint8), width_per_frame, axis=0)
    return np.repeat(strip[None], height, axis=0)
