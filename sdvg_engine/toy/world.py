"""A procedural video world with captions and a ground-truth quality metric.

Scenes: one object (``SHAPES``) of one colour (``COLOURS``) moving in a straight line (``MOTIONS``)
at ``SPEED`` px/frame over a flat background (``BACKGROUNDS``), rendered at ``SIZE x SIZE`` px with
analytic anti-aliasing (numpy only, deterministic). Caption: ``"a red ball moving left on gray"``.
A scene's start position is fixed by its motion up to a small seeded jitter (+-``JITTER`` px), so a
caption nearly determines its clip: the few-step x0 sampler the engine uses cannot represent a wide
multi-modal start distribution, and this keeps the toy task one of rendering + motion, not of mode choice.

Ground-truth metric (uses only the caption and the pixels, never the renderer's hidden state):

* per frame, ``adherence in [0, 1]``:
    - ``mask``: pixels within RGB distance ``COLOUR_TOL`` of the caption's colour;
      fewer than ``MIN_PIXELS`` -> adherence 0 (object missing / wrong colour);
    - ``iou``: IoU of the mask with the caption's shape template placed at the mask's centroid;
    - ``shape_ok``: 1 if the caption's shape has the highest template IoU of all shapes, else 0.5;
    - ``bg``: fraction of pixels outside the (dilated) template within ``BG_TOL`` of the caption's background;
    - ``adherence = iou * shape_ok * bg``.
* per clip, ``temporal in [0, 1]``: with mask centroids ``c_t`` and the caption's velocity ``v``,
  ``mean_t exp(-|c_t - c_{t-L} - L v|^2 / 2)`` over ``t >= L`` with lag ``L = 8`` frames (frames without an
  object count 0): is the object where the motion says, without jumps or stalls (a stalled object is
  ``8 * SPEED = 1.76`` px behind after 8 frames and scores 0.21).
* ``quality = 0.75 * mean_t adherence + 0.25 * temporal``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIZE = 32
RADIUS = 5.0
SPEED = 0.22
JITTER = 1.5
COLOURS = {"red": (0.9, 0.15, 0.15), "green": (0.15, 0.8, 0.2), "blue": (0.2, 0.3, 0.95), "yellow": (0.95, 0.85, 0.1)}
SHAPES = ("ball", "square", "triangle")
MOTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
BACKGROUNDS = {"black": (0.05, 0.05, 0.05), "gray": (0.5, 0.5, 0.5), "white": (0.95, 0.95, 0.95)}
COLOUR_TOL = 0.3
BG_TOL = 0.25
MIN_PIXELS = 6
LAG = 8  # frames between the centroids the temporal term compares
VOCAB = ("a", *COLOURS, *SHAPES, "moving", *MOTIONS, "on", *BACKGROUNDS)


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    motion: str
    background: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.motion} on {self.background}"

    @classmethod
    def parse(cls, caption: str) -> "Scene":
        words = caption.strip().lower().split()
        if len(words) != 7 or words[0] != "a" or words[3] != "moving" or words[5] != "on":
            raise ValueError(f"caption {caption!r} is not 'a <colour> <shape> moving <motion> on <background>'")
        scene = cls(words[1], words[2], words[4], words[6])
        for value, allowed in ((scene.colour, COLOURS), (scene.shape, SHAPES), (scene.motion, MOTIONS), (scene.background, BACKGROUNDS)):
            if value not in allowed:
                raise ValueError(f"{value!r} is not in the toy vocabulary {sorted(allowed)}")
        return scene


def all_scenes() -> list[Scene]:
    return [Scene(c, s, m, b) for c in COLOURS for s in SHAPES for m in MOTIONS for b in BACKGROUNDS]


def _coverage(shape: str, cx: np.ndarray, cy: np.ndarray, radius: float = RADIUS) -> np.ndarray:
    """Anti-aliased coverage [..., SIZE, SIZE] of ``shape`` centred at (cx, cy) (arrays broadcast over leading dims)."""
    grid = np.arange(SIZE, dtype=np.float64) + 0.5
    dx = grid[None, :] - np.asarray(cx, dtype=np.float64)[..., None, None]
    dy = grid[:, None] - np.asarray(cy, dtype=np.float64)[..., None, None]
    if shape == "ball":
        d = np.sqrt(dx * dx + dy * dy) - radius
    elif shape == "square":
        d = np.maximum(np.abs(dx), np.abs(dy)) - radius * 0.9
    elif shape == "triangle":  # pointing up, apex at -R, base at +0.8R
        base = dy - 0.8 * radius
        side = (2.0 * np.abs(dx) - (dy + radius)) / np.sqrt(5.0)
        d = np.maximum(base, side)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return np.clip(0.5 - d, 0.0, 1.0)


def trajectory(scene: Scene, num_frames: int, seed: int) -> np.ndarray:
    """Object centres ``[T, 2]`` (x, y) in pixels."""
    rng = np.random.default_rng([seed, 7])
    jitter = rng.uniform(-JITTER, JITTER, size=2)
    vx, vy = MOTIONS[scene.motion]
    travel = SPEED * (num_frames - 1)
    start = np.array([SIZE / 2 - vx * travel / 2, SIZE / 2 - vy * travel / 2]) + jitter
    t = np.arange(num_frames, dtype=np.float64)[:, None]
    return start[None] + SPEED * t * np.array([vx, vy])[None]


def render(scene: Scene, num_frames: int = 81, seed: int = 0) -> np.ndarray:
    """The clip ``[T, SIZE, SIZE, 3]`` float32 in 0..1."""
    centres = trajectory(scene, num_frames, seed)
    cov = _coverage(scene.shape, centres[:, 0], centres[:, 1])[..., None]
    bg = np.array(BACKGROUNDS[scene.background])
    fg = np.array(COLOURS[scene.colour])
    return (bg * (1 - cov) + fg * cov).astype(np.float32)


def _centroid(mask: np.ndarray) -> tuple[float, float]:
    ys, xs = np.nonzero(mask)
    return float(xs.mean()) + 0.5, float(ys.mean()) + 0.5


def _template(shape: str, cx: float, cy: float) -> np.ndarray:
    """Template mask of ``shape`` whose own centroid is at (cx, cy)."""
    t = _coverage(shape, cx, cy) > 0.5
    if t.any():
        tx, ty = _centroid(t)
        t = _coverage(shape, 2 * cx - tx, 2 * cy - ty) > 0.5
    return t


def frame_adherence(frame: np.ndarray, scene: Scene, *, details: bool = False):
    """Adherence in [0, 1] of one frame ``[SIZE, SIZE, 3]`` (0..1) to ``scene``'s caption (see module doc)."""
    frame = np.asarray(frame, dtype=np.float64)
    colour = np.array(COLOURS[scene.colour])
    mask = np.linalg.norm(frame - colour, axis=-1) < COLOUR_TOL
    if mask.sum() < MIN_PIXELS:
        return (0.0, None) if details else 0.0
    cx, cy = _centroid(mask)
    ious = {}
    for shape in SHAPES:
        t = _template(shape, cx, cy)
        ious[shape] = float((t & mask).sum() / max((t | mask).sum(), 1))
    shape_ok = 1.0 if max(ious, key=ious.get) == scene.shape else 0.5
    dilated = _coverage(scene.shape, cx, cy, RADIUS + 2.0) > 0
    outside = ~dilated
    bg_close = np.linalg.norm(frame - np.array(BACKGROUNDS[scene.background]), axis=-1) < BG_TOL
    bg = float((bg_close & outside).sum() / max(outside.sum(), 1))
    value = ious[scene.shape] * shape_ok * bg
    return (value, (cx, cy)) if details else value


def clip_metrics(frames: np.ndarray, scene: "Scene | str") -> dict:
    """Ground-truth metrics of a clip ``[T, SIZE, SIZE, 3]`` (0..1) against a scene or caption."""
    if isinstance(scene, str):
        scene = Scene.parse(scene)
    frames = np.asarray(frames)
    per_frame, centres = [], []
    for f in frames:
        a, c = frame_adherence(f, scene, details=True)
        per_frame.append(a)
        centres.append(c)
    v = SPEED * np.array(MOTIONS[scene.motion])
    temporal_terms = []
    for t in range(LAG, len(frames)):
        if centres[t] is None or centres[t - LAG] is None:
            temporal_terms.append(0.0)
            continue
        err = np.array(centres[t]) - np.array(centres[t - LAG]) - LAG * v
        temporal_terms.append(float(np.exp(-0.5 * float(err @ err))))
    temporal = float(np.mean(temporal_terms)) if temporal_terms else 1.0
    adherence = float(np.mean(per_frame))
    return {"quality": 0.75 * adherence + 0.25 * temporal, "adherence": adherence, "temporal": temporal,
            "per_frame": [float(a) for a in per_frame]}


# ---- corruptions (for training the reward model and for tests) ------------------------------------------
CORRUPTIONS = ("wrong_colour", "wrong_shape", "wrong_background", "blur", "noise", "fade", "missing", "smear", "double")


def corrupt(frames: np.ndarray, scene: Scene, kind: str, rng: np.random.Generator, num_frames: int | None = None,
            seed: int = 0) -> np.ndarray:
    """A corrupted version of a rendered clip ``frames`` of ``scene`` (same shape, 0..1)."""
    T = frames.shape[0]
    if kind == "wrong_colour":
        other = Scene(rng.choice([c for c in COLOURS if c != scene.colour]), scene.shape, scene.motion, scene.background)
        return render(other, T, seed)
    if kind == "wrong_shape":
        other = Scene(scene.colour, rng.choice([s for s in SHAPES if s != scene.shape]), scene.motion, scene.background)
        return render(other, T, seed)
    if kind == "wrong_background":
        other = Scene(scene.colour, scene.shape, scene.motion, rng.choice([b for b in BACKGROUNDS if b != scene.background]))
        return render(other, T, seed)
    if kind == "blur":
        k = int(rng.integers(1, 4))
        out = frames.copy()
        for axis in (1, 2):
            out = sum(np.roll(out, s, axis=axis) for s in range(-k, k + 1)) / (2 * k + 1)
        return out.astype(np.float32)
    if kind == "noise":
        return np.clip(frames + rng.normal(0, rng.uniform(0.05, 0.3), frames.shape), 0, 1).astype(np.float32)
    if kind == "fade":
        bg = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
        a = rng.uniform(0.55, 0.9)
        return (frames * (1 - a) + bg * a).astype(np.float32)
    if kind == "missing":
        bg = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
        return np.broadcast_to(bg, frames.shape).copy()
    if kind == "smear":
        dx, dy = rng.integers(3, 6, size=2) * rng.choice([-1, 1], size=2)
        return (0.5 * frames + 0.5 * np.roll(frames, (int(dy), int(dx)), axis=(1, 2))).astype(np.float32)
    if kind == "double":
        dx, dy = rng.integers(8, 14) * rng.choice([-1, 1]), rng.integers(-3, 4)
        shifted = np.roll(frames, (int(dy), int(dx)), axis=(1, 2))
        bg = np.array(BACKGROUNDS[scene.background], dtype=np.float32)
        fg_mask = (np.abs(shifted - bg).sum(-1, keepdims=True) > 0.1)
        return np.where(fg_mask, shifted, frames).astype(np.float32)
    raise ValueError(f"unknown corruption {kind!r}")
