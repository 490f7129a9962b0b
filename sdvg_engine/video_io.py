"""Writing frames ``[T, H, W, 3]`` (float 0..1) to MP4 (PyAV), animated WebP or PNG frames (Pillow): the project's one
video writer (the CLI, the toy demo)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
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


@contextmanager
def atomic_output(path: str | os.PathLike, *, overwrite: bool = True):
    """Yield a temporary path next to ``path`` (same suffix); on success it is renamed onto ``path``.

    An interrupted or failed write leaves ``path`` as it was (the temporary is removed). With
    ``overwrite=False`` an existing ``path`` is refused (``FileExistsError``) before anything is written.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass --overwrite (overwrite=True) to replace it or choose another name")
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():  # PNG-frame folders: os.replace cannot replace a non-empty folder
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_video(frames: torch.Tensor, path: str | os.PathLike, fps: int = FPS, *, overwrite: bool = True,
                scale: int = 1, lossless: bool = False) -> Path:
    """Write ``frames`` to ``path``; the suffix picks the format (``.mp4``, ``.webp``, or a folder for PNGs).

    ``scale``: enlarge each pixel to ``scale x scale`` (nearest neighbour; the toy world's 32-pixel frames);
    ``lossless``: a lossless WebP (else quality 90).

    An ``.mp4`` request without PyAV installed raises (``pip install av``) rather than silently
    writing something else; callers that want a fallback choose it with :func:`default_video_suffix`.
    The video is written to a temporary name and renamed at the end (:func:`atomic_output`), so a
    failed write never leaves a torn file; ``overwrite=False`` refuses an existing ``path``.
    """
    path = Path(path)
    if path.suffix not in (".mp4", ".webp", ""):
        raise ValueError(f"unknown video format '{path.suffix}' for {path}: use .mp4, .webp or a folder name")
    if path.suffix == ".mp4" and not have_pyav():
        raise RuntimeError(f"writing {path} needs PyAV (pip install av); or ask for .webp")
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a whole number >= 1, got {scale!r}")
    pixels = to_uint8(frames)
    if scale > 1:
        pixels = pixels.repeat(scale, axis=1).repeat(scale, axis=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, overwrite=overwrite) as tmp:
        _write_pixels(pixels, path.suffix, tmp, fps, lossless=lossless)
    return path


def _write_pixels(pixels: np.ndarray, suffix: str, path: Path, fps: int, *, lossless: bool = False) -> None:
    if suffix == ".mp4":
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
        return
    from PIL import Image

    images = [Image.fromarray(f) for f in pixels]
    if suffix == ".webp":
        images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0,
                       lossless=lossless, quality=90, format="WEBP")
        return
    path.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        image.save(path / f"frame_{i:05d}.png")


def default_video_suffix() -> str:
    return ".mp4" if have_pyav() else ".webp"


def mask_strip(mask: torch.Tensor, height: int = 24, width_per_frame: int = 6) -> np.ndarray:
    """An image ``[height, T*w, 3]``: green where the frame came from an accepted draft, grey for the target."""
    colours = np.where(mask.cpu().numpy()[:, None] > 0.5, np.array([[60, 200, 90]]), np.array([[110, 110, 110]]))
    strip = np.repeat(colours.astype(np.uint8), width_per_frame, axis=0)
    return np.repeat(strip[None], height, axis=0)
