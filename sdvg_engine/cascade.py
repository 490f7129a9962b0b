"""Cascade scoring's rule, in one place (the pipeline scores by it, a replay re-decides by it).

A draft of more than ``cascade_frames`` frames is first scored on ``cascade_frames`` evenly spaced frames. With
``min`` aggregation a partial minimum below tau rejects exactly (the full minimum can only be lower); one at or above
``tau + cascade_margin`` accepts early; in between, the remaining frames are scored too and the full minimum decides.
"""

from __future__ import annotations

import torch


def cascades(options, num_frames: int) -> bool:
    """Whether a draft of ``num_frames`` frames is scored in two stages under ``options``."""
    return bool(options.cascade) and num_frames > options.cascade_frames


def first_frames(num_frames: int, cascade_frames: int) -> list[int]:
    """The frames scored first: ``cascade_frames`` evenly spaced indices (first and last included), in order."""
    return torch.linspace(0, num_frames - 1, cascade_frames).round().long().unique().tolist()


def settled_by_first_frames(partial_min: float, tau: float, margin: float) -> bool:
    """Whether the first frames' minimum decides alone: below tau (an exact reject) or at least ``tau + margin``."""
    return partial_min < tau or partial_min >= tau + margin
