"""Per-block records, timings and the JSON report of one speculative run."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .router import RouteDecision

COMPONENTS = ("drafter", "target", "vae", "reward")


class Lap:
    """The duration of one measured call; on CUDA it is read back from its events only when asked for."""

    __slots__ = ("_seconds", "_events")

    def __init__(self, seconds: float = 0.0, events: tuple | None = None):
        self._seconds, self._events = seconds, events

    @property
    def seconds(self) -> float:
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            self._seconds, self._events = start.elapsed_time(end) / 1000.0, None
        return self._seconds


class ComponentTimer:
    """Seconds per label (component or call kind).

    CPU: ``perf_counter`` around each call. CUDA: a pair of timing events on the device's current stream
    around each call, read back only when :attr:`seconds` is read (at the end of a block), so timing adds no
    host synchronisation between the calls of a block on one GPU: the GPU keeps its queue full, as in an
    untimed run. Only when consecutive calls run on different devices does it wait for the previous one.
    """

    def __init__(self):
        self._laps: list[tuple[str, Lap]] = []
        self._seconds: Counter = Counter()
        self._last_device: torch.device | None = None
        self._lock = threading.Lock()  # several workers may time their calls at once
        #: wait for the previous GPU when the next call runs elsewhere (one worker); off when each device has a worker
        self.handover_sync = True

    @contextmanager
    def measure(self, label: str, device: torch.device | None = None):
        """Time the body as one call of ``label``; yields its :class:`Lap`."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        last, self._last_device = self._last_device, device
        if self.handover_sync and last is not None and last.type == "cuda" and last != device:
            # Handing over to another device: without this wait, work still queued on the previous GPU
            # (e.g. the drafter's, when the VAE sits on cuda:1 or on the CPU) would be timed as this call's.
            torch.cuda.synchronize(last)
        on_gpu = device.type == "cuda"
        if on_gpu:
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            lap = Lap(events=(start, end))
        else:
            lap, began = Lap(), time.perf_counter()
        try:
            yield lap
        finally:
            if on_gpu:
                end.record(stream)
            else:
                lap._seconds = time.perf_counter() - began
            with self._lock:
                self._laps.append((label, lap))

    @property
    def seconds(self) -> Counter:
        """Total seconds per label so far (waits for pending CUDA events)."""
        with self._lock:
            laps, self._laps = self._laps, []
            for label, lap in laps:
                self._seconds[label] += lap.seconds
            return Counter(self._seconds)

    def clear(self) -> None:
        with self._lock:
            self._laps.clear()
            self._seconds.clear()
            self._last_device = None


@dataclass
class BlockRecord:
    """What happened to one block, streamed to callbacks as soon as the block is final.

    Attributes:
        index: block number (0-based).
        source: ``"draft"`` if the drafter's block was kept, ``"target"`` otherwise.
        drafted: whether the drafter ran on this block at all.
        decision: the router's decision for a drafted block (``None`` when not drafted).
        latent_frames: ``(first, end)`` latent frame range of the block in the video.
        video_frames: ``(first, end)`` pixel frame range of the block in the video.
        frames: the block's decoded frames ``[T, H, W, 3]`` float 0..1 on CPU (for previews).
        seconds: time spent on this block per component.
        decode: the :class:`Lap` of the kept block's VAE decode (what an all-target run would also pay).
    """

    index: int
    source: str
    drafted: bool
    decision: RouteDecision | None
    latent_frames: tuple[int, int]
    video_frames: tuple[int, int]
    frames: torch.Tensor | None = None
    seconds: dict = field(default_factory=dict)
    decode: Lap = field(default_factory=Lap)
    replayed: bool = False  # taken from an earlier run with the same inputs (see sdvg_engine.memo)

    @property
    def decode_seconds(self) -> float:
        return self.decode.seconds

    def to_dict(self) -> dict:
        d = {
            "index": self.index, "source": self.source, "drafted": self.drafted,
            "latent_frames": list(self.latent_frames), "video_frames": list(self.video_frames),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()}, "replayed": self.replayed,
        }
        d["decision"] = None if self.decision is None else self.decision.to_dict()
        return d


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def build_report(*, settings: dict, blocks: list[BlockRecord], calls: dict, model_seconds: dict, timer: ComponentTimer,
                 wall_seconds: float, target_only_model_seconds: float | None, memory: dict,
                 decode_hidden: bool = False) -> dict:
    """The JSON-serialisable summary of a run.

    ``speedup_vs_target`` estimates what an all-target run would have cost from the per-call times
    measured in this run (``target_only_model_seconds``: the target's calls of an all-target video,
    plus the decode of every kept block), divided by this run's wall time. With ``decode_hidden`` (the VAE has a
    worker of its own) an all-target run would decode beside the target, so the longer of the two counts.
    """
    # Blocks given to the router: drafted ones, and random mode's target blocks (drawn before drafting, never drafted).
    drafted = [b for b in blocks if b.drafted or b.decision is not None]
    accepted = [b for b in drafted if b.source == "draft"]
    later = blocks[1:]
    decode_kept = sum(b.decode_seconds for b in blocks)
    if target_only_model_seconds is None:
        estimate = None
    elif decode_hidden:
        estimate = max(target_only_model_seconds, decode_kept)
    else:
        estimate = target_only_model_seconds + decode_kept
    seconds = {c: round(timer.seconds.get(c, 0.0), 6) for c in COMPONENTS}
    inside = sum(timer.seconds.get(c, 0.0) for c in COMPONENTS)
    return {
        "settings": settings,
        "num_blocks": len(blocks),
        "blocks": [b.to_dict() for b in blocks],
        "draft_scores": [_finite(b.decision.block_score) if b.decision else None for b in blocks],
        "decisions": [b.source for b in blocks],
        "acceptance": {
            "drafted_blocks": len(drafted),
            "accepted_blocks": len(accepted),
            "rate_of_drafted": len(accepted) / len(drafted) if drafted else None,
            # The reference counts over all blocks with block 0 as a reject; we report both.
            "rate_after_first_block": sum(b.source == "draft" for b in later) / len(later) if later else None,
            "rate_all_blocks": len(accepted) / len(blocks) if blocks else None,
        },
        "model_calls": calls,
        "model_call_seconds": model_seconds,
        "seconds": {**seconds, "wall": round(wall_seconds, 6), "outside_components": round(wall_seconds - inside, 6)},
        "loop_overhead_fraction": (wall_seconds - inside) / wall_seconds if wall_seconds > 0 else None,
        "estimated_target_only_seconds": None if estimate is None else round(estimate, 6),
        "speedup_vs_target": None if estimate is None or wall_seconds <= 0 else estimate / wall_seconds,
        "memory": memory,
    }
