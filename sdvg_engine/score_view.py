"""The score plot: per block, the quantity the router compared with its threshold, and that threshold.

What is compared depends on the tau mode (``RouteDecision.comparison``): the draft's score in ``fixed`` and
``accept_rate`` modes, its margin over a reference score in ``relative`` / ``anchor`` / ``baseline`` modes, the
random draw ``u`` in ``random`` mode. Plotting the raw score against ``tau`` in the margin modes draws kept drafts
below the line and rejected ones above it; this module plots the compared quantity instead, draws each block's own
threshold (it moves per block in ``accept_rate`` mode), names the quantity on the y axis and shades the free-tau band
(the threshold values that change no decision) wherever the report defines it. A run with a prompt schedule has a
vertical line at each prompt switch (``settings.prompt_schedule``), labelled with the new prompt's first frame.

Reads only the report dict (``report.json``); no ComfyUI, no torch. :func:`draw_score_plot` returns an
``[height, width, 3]`` uint8 array (numpy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Colours of the plot's marks (tests find them by exact value).
KEPT = (30, 160, 60)
REJECTED = (210, 40, 40)
NOT_SCORED = (150, 150, 150)
THRESHOLD = (40, 90, 220)
BAND = (222, 236, 255)
SWITCH = (150, 70, 200)
WIDTH, HEIGHT = 640, 360
#: the plot box inside the image (left, right, top, bottom)
BOX = (72, WIDTH - 16, 28, HEIGHT - 36)

#: y-axis names per mode (the router's own labels where the report carries them)
QUANTITY = {
    "fixed": "draft score",
    "accept_rate": "draft score (threshold: running quantile)",
    "relative": "score - last committed block",
    "anchor": "score - block 0",
    "baseline": "score - mean of committed blocks",
    "random": "random draw u (keep if u < p)",
}


@dataclass(frozen=True)
class BlockPoint:
    """One block of the plot. ``value`` / ``threshold``: what was compared (None: not scored / no threshold)."""

    index: int
    value: float | None
    threshold: float | None
    kept: bool
    keep_if: str = ">="


@dataclass(frozen=True)
class ScoreView:
    mode: str
    quantity: str
    points: tuple[BlockPoint, ...]
    #: the free-tau band in the plotted quantity's units, (above, up_to); None ends are unbounded
    band: tuple[float | None, float | None] | None
    keep_if: str = ">="
    #: the prompt switches: ``(first block, first video frame)`` of every prompt after the opening one
    switches: tuple[tuple[int, int], ...] = ()


def _number(x) -> float | None:
    """A finite or infinite float from a report value ("inf"/"-inf" strings included); None otherwise."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return None if math.isnan(x) else float(x)
    if isinstance(x, str) and x.strip().lower() in ("inf", "+inf", "-inf", "infinity", "-infinity"):
        return float(x)
    return None


def _finite(x) -> float | None:
    v = _number(x)
    return v if v is not None and math.isfinite(v) else None


def compared(decision: dict, settings: dict) -> tuple[float | None, float | None, str, str, str]:
    """``(value, threshold, quantity, keep_if, mode)`` of one decision dict of a report: its ``compared`` entry
    where the router wrote one, else derived as the router compares (margin = block_score - reference_score)."""
    entry = decision.get("compared")
    if isinstance(entry, dict) and "value" in entry:
        mode = entry.get("mode") or settings.get("tau_mode") or "fixed"
        return (_finite(entry.get("value")), _number(entry.get("threshold")),
                entry.get("quantity") or QUANTITY.get(mode, "compared value"), entry.get("keep_if") or ">=", mode)
    score = _finite(decision.get("block_score"))
    if settings.get("mode") == "random" or decision.get("accept_prob") is not None:
        p = _number(decision.get("accept_prob", settings.get("random_accept_prob")))
        return score, p, QUANTITY["random"], "<", "random"
    mode = settings.get("tau_mode") or "fixed"
    threshold = _number(decision.get("tau", settings.get("tau")))
    reference = _finite(decision.get("reference_score"))
    if reference is not None:
        mode = mode if mode in ("relative", "anchor", "baseline") else "relative"
        return (None if score is None else score - reference), threshold, QUANTITY[mode], ">=", mode
    return score, threshold, QUANTITY.get(mode, "draft score"), ">=", mode


def score_view(report: dict) -> ScoreView:
    """The plot's content, from a report: one point per block and the band."""
    settings = report.get("settings", {}) or {}
    mode = "random" if settings.get("mode") == "random" else (settings.get("tau_mode") or "fixed")
    quantity, keep_if = QUANTITY.get(mode, "draft score"), "<" if mode == "random" else ">="
    points = []
    for b in report.get("blocks", []):
        decision = b.get("decision")
        kept = b.get("source") == "draft"
        if not decision:
            points.append(BlockPoint(b["index"], None, None, kept))
            continue
        value, threshold, q, k, m = compared(decision, settings)
        quantity, keep_if, mode = q, k, m
        points.append(BlockPoint(b["index"], value, threshold, kept, k))
    free = report.get("free_tau_interval")
    band = None
    if isinstance(free, dict) and mode not in ("accept_rate", "random"):
        # The band is in tau's units, which are the plotted quantity's in fixed and the margin modes.
        band = (_finite(free.get("above")), _finite(free.get("up_to")))
    return ScoreView(mode=mode, quantity=quantity, points=tuple(points), band=band, keep_if=keep_if,
                     switches=switches_of(settings))


def switches_of(settings: dict) -> tuple[tuple[int, int], ...]:
    """``(first block, first frame)`` of each prompt after the opening one, from a report's ``settings``."""
    schedule = settings.get("prompt_schedule")
    if not isinstance(schedule, list):
        return ()
    out = []
    for entry in schedule[1:]:
        block, frame = (entry.get("first_block"), entry.get("first_frame")) if isinstance(entry, dict) else (None, None)
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:
            out.append((block, frame if isinstance(frame, int) and not isinstance(frame, bool) else block))
    return tuple(out)


def draw_score_plot(report: dict, width: int = WIDTH, height: int = HEIGHT):
    """The score plot of ``report`` as an ``[height, width, 3]`` uint8 numpy array.

    Green dot: kept draft; red cross: rejected (the target regenerated it); grey square on the axis: not scored
    (not drafted, or kept without scoring). The blue segment over each block is that block's threshold; the shaded
    band the free-tau interval; a purple vertical line: a prompt switch (the block right of it is the new prompt's
    first), labelled with the prompt's number and first video frame."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    view = score_view(report)
    left, right, top, bottom = 72, width - 16, 28, height - 36
    values = [v for p in view.points for v in (p.value, p.threshold) if v is not None and math.isfinite(v)]
    if view.band is not None:
        values += [v for v in view.band if v is not None]
    lo, hi = (min(values), max(values)) if values else (-1.0, 1.0)
    if hi - lo < 1e-6:
        lo, hi = lo - 1.0, hi + 1.0
    pad = 0.1 * (hi - lo)
    lo, hi = lo - pad, hi + pad

    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    n = max(len(view.points), 1)
    column = (right - left) / n

    def x_of(i: int) -> float:
        return left + (i + 0.5) * column

    def y_of(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    if view.band is not None:
        above, up_to = view.band
        y_hi = y_of(up_to) if up_to is not None else top
        y_lo = y_of(above) if above is not None else bottom
        draw.rectangle([left + 1, max(top + 1, min(y_hi, y_lo)), right - 1, min(bottom - 1, max(y_hi, y_lo))], fill=BAND)
        text = f"free tau: ({'-inf' if above is None else f'{above:.2f}'}, {'inf' if up_to is None else f'{up_to:.2f}'}]"
        draw.text((left + 4, top + 2), text, fill=THRESHOLD, font=font)
    for k in range(5):  # y grid and labels
        v = lo + k * (hi - lo) / 4
        y = y_of(v)
        draw.line([left + 1, y, right - 1, y], fill=(225, 225, 225))
        draw.text((left - 40, y - 6), f"{v:.2f}", fill=(0, 0, 0), font=font)
    # The y axis names what was compared with tau, rotated along the axis.
    label = Image.new("RGB", (bottom - top, 12), (255, 255, 255))
    ImageDraw.Draw(label).text((2, 0), view.quantity, fill=(0, 0, 0), font=font)
    img.paste(label.rotate(90, expand=True), (4, top))
    draw = ImageDraw.Draw(img)

    thresholds = [p.threshold for p in view.points if p.threshold is not None and math.isfinite(p.threshold)]
    for p in view.points:  # each block's threshold, across its column (a line where it does not move)
        if p.threshold is not None and math.isfinite(p.threshold):
            y = y_of(p.threshold)
            draw.line([left + p.index * column, y, left + (p.index + 1) * column, y], fill=THRESHOLD, width=2)
    if thresholds:
        name = "p" if view.mode == "random" else "tau"
        moving = max(thresholds) - min(thresholds) > 1e-9
        text = f"{name} per block" if moving else f"{name} = {thresholds[0]:.2f}"
        # in the header, right-aligned: over the plot it would cover a marker's value
        draw.text((right - 8 - draw.textlength(text, font=font), top - 12), text, fill=THRESHOLD, font=font)
    for k, (block, frame) in enumerate(view.switches):  # prompt switches: between the old prompt's last block and this
        x = round(left + block * column)
        draw.line([x, top + 1, x, bottom - 1], fill=SWITCH, width=2)
        draw.text((x + 4, top + 14), f"prompt {k + 2} @ frame {frame}", fill=SWITCH, font=font)
    for p in view.points:
        x = x_of(p.index)
        draw.text((x - 3, bottom + 4), str(p.index), fill=(0, 0, 0), font=font)
        if p.value is None:
            draw.rectangle([x - 4, bottom - 8, x + 4, bottom - 1], fill=NOT_SCORED)
            continue
        y = y_of(p.value)
        draw.text((x + 8, y - 6), f"{p.value:.2f}", fill=(90, 90, 90), font=font)
        if p.kept:
            draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=KEPT)
        else:
            draw.line([x - 5, y - 5, x + 5, y + 5], fill=REJECTED, width=3)
            draw.line([x - 5, y + 5, x + 5, y - 5], fill=REJECTED, width=3)
    acc = report.get("acceptance", {}) or {}
    rule = "keep if below" if view.keep_if == "<" else "keep if on or above"
    title = (f"SDVG {report.get('settings', {}).get('mode', 'sdvg')} ({view.mode}): kept "
             f"{acc.get('accepted_blocks', 0)}/{acc.get('drafted_blocks', 0)} drafted blocks; {rule} the blue line")
    draw.text((left, 4), title, fill=(0, 0, 0), font=font)
    draw.text((left, height - 16), "block  (green = kept draft, red = regenerated, grey = not scored)",
              fill=(80, 80, 80), font=font)
    return np.asarray(img, dtype=np.uint8).copy()


__all__ = ["BlockPoint", "ScoreView", "QUANTITY", "SWITCH", "compared", "draw_score_plot", "score_view", "switches_of"]
