"""Per-block records, timings and the JSON report of one speculative run."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .router import COMPARED_QUANTITY, RouteDecision

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


# ---- the result of a run -----------------------------------------------------------------------------------------
@dataclass
class SDVGResult:
    """Output of :meth:`SpeculativePipeline.generate`.

    frames: ``[T, H, W, 3]`` float32 in 0..1 (CPU).
    latents: ``[B, C, T_lat, h, w]`` float32, the final latents in the DiT's normalized space.
    acceptance_mask: ``[T]`` float32, 1 where the frame comes from an accepted draft.
    blocks: one :class:`BlockRecord` per block.
    report: JSON-serialisable summary (see :func:`build_report`).
    """

    frames: torch.Tensor
    latents: torch.Tensor
    acceptance_mask: torch.Tensor
    blocks: list[BlockRecord]
    report: dict


def build_result(pipe, run, wall: float, *, recording, stored: bool) -> SDVGResult:
    """The :class:`SDVGResult` of a finished ``run`` (a :class:`sdvg_engine.run.Run`) of ``pipe``: its frames, latents,
    mask and the report with its settings, replay and schedule sections. ``recording``: what the run recorded (or
    ``None``), ``stored``: whether the memo kept it."""
    records = run.records
    report = build_report(
        settings=run_settings(pipe, run), blocks=records, wall_seconds=wall, timer=run.timer,
        calls={g.name: dict(g.calls) for g in (pipe.drafter, pipe.target)},
        model_seconds={g.name: {k: round(v, 6) for k, v in g.seconds.items()} for g in (pipe.drafter, pipe.target)},
        target_only_model_seconds=target_only_seconds(pipe.target, len(records)),
        memory={"drafter_kv_cache_bytes": pipe.drafter.kv_cache_bytes, "target_kv_cache_bytes": pipe.target.kv_cache_bytes},
        decode_hidden=run.workers.parallel and not run.workers.same_lane("target", "vae"),
    )
    report["free_tau_interval"] = free_tau_interval(records, run.options, pipe.router)
    report["tau_per_block"] = [None if b.decision is None or b.decision.tau is None else _json_number(b.decision.tau)
                               for b in records]
    report["replay"] = {
        "enabled": recording is not None,
        "replayed_blocks": run.first_block,
        "seconds_saved": round(run.replayed_seconds, 6),
        "kept_for_replay": stored,
        "recorded_blocks": len(recording.blocks) if stored else 0,
        "recording_bytes": recording.nbytes if stored else 0,
        "memo_bytes": pipe.memo.nbytes if pipe.memo is not None else 0,
    }
    report["schedule"] = {
        "worker_busy_seconds": run.workers.busy_seconds(),
        "critical_path_seconds": round(wall, 6),
        "speculative_target_blocks": run.workers.speculations,
        "dropped_speculative_blocks": run.workers.dropped,
        "dropped_speculative_seconds": round(run.workers.dropped_seconds, 6),
    }
    return SDVGResult(frames=torch.cat(run.frames), latents=torch.cat(run.latents, dim=2),
                      acceptance_mask=torch.cat(run.mask), blocks=records, report=report)


def run_settings(pipe, run) -> dict:
    """The report's ``settings``: the options, the inputs, the models' schedules and contexts, the workers, the router."""
    settings = {
        **asdict(run.options), "seed": run.seed, "num_frames": run.num_frames, "width": run.width, "height": run.height,
        "prompt": run.prompt, "preset": pipe.preset, "prompt_schedule": schedule_settings(run),
        "drafter_schedule": pipe.drafter.schedule.name, "target_schedule": pipe.target.schedule.name,
        "drafter_context": pipe.drafter.context.name, "target_context": pipe.target.context.name,
        "settings_source": {g.name: dict(g.settings_source) for g in (pipe.drafter, pipe.target)},
        "workers": {"lanes": dict(run.workers.lanes), "parallel": run.workers.parallel},
    }
    if pipe.router is not None:
        router_settings = pipe.router.settings()
        tau = router_settings.get("tau", pipe.router.tau)
        router_settings["tau"] = tau if not isinstance(tau, float) or math.isfinite(tau) else str(tau)
        settings.update(router_settings)
    return settings


def schedule_settings(run) -> list[dict]:
    """The report's ``prompt_schedule``: per segment its first block and video frame and its reward prompt (one entry
    for a one-prompt run). The score plot marks the switches from it."""
    from .prompt_schedule import block_start_frame

    segments = run.schedule.segments if run.schedule is not None else ()
    return [{"first_block": seg.first_block, "first_frame": block_start_frame(seg.first_block, run.frames_per_block),
             "prompt": seg.prompt} for seg in segments]


def target_only_seconds(target, num_blocks: int) -> float | None:
    """What the target's model calls of an all-target video would cost, from this run's per-call times.

    All-target = every block's full schedule + one context pass (commit or recompute) before each
    later block. Per-call times, not per-block totals: a run's target total also holds deferred
    commits of accepted drafts, dropped speculative work and, with hybrid regeneration, partial schedules.
    """
    calls, seconds = target.calls, target.seconds
    if not calls.get("denoise"):
        return None
    per_denoise = seconds["denoise"] / calls["denoise"]
    context_kinds = [k for k in ("commit", "recompute") if calls.get(k)]
    # A t=0 context pass has the shape of a denoising call; use that when none was measured.
    per_context = sum(seconds[k] for k in context_kinds) / sum(calls[k] for k in context_kinds) if context_kinds else per_denoise
    passes_per_context = 1 if target.context.name == "global_cache" else getattr(target.context, "context_frames", 3) // max(1, target.frames_per_block) or 1
    return per_denoise * target.schedule.num_steps * num_blocks + per_context * passes_per_context * (num_blocks - 1)


def free_tau_interval(records: list[BlockRecord], options, router) -> dict | None:
    """The range of tau that changes no decision of this run, in the space tau is compared in: above the highest
    rejected value, up to the lowest accepted one (``None`` ends: unbounded; a draft is kept when value >= tau).

    ``fixed``: the value is the draft's block score. The reference modes (``relative``, ``anchor``, ``baseline``): the
    margin ``block_score - reference_score`` (tau is a margin there); a replay re-decides each recorded draft against
    its recorded reference, which stays the same while no earlier decision changes, so the margins are exactly what a
    replay compares. Each drafted block flips when tau crosses its own value (``flip_tau_per_block``), so moving tau
    inside the interval replays the whole run for free (see :mod:`sdvg_engine.memo`).

    Keys: ``above``, ``up_to``, ``flip_tau_per_block``, ``exact`` (False with cascade scoring, whose early decisions
    saw only some frames); in the reference modes also ``compared`` (what the values are, e.g. ``"score - last
    committed block"``) and ``tau_mode``. ``None`` when no router decided (other modes) or tau adapts
    (``accept_rate``: its thresholds move with the scores)."""
    mode = getattr(router, "tau_mode", "fixed")
    reference_mode = bool(getattr(router, "uses_reference", False))
    if not options.scores_drafts or router is None or (mode != "fixed" and not reference_mode):
        return None

    def compared(d):  # the value the router compared with tau (RouteDecision.comparison, its one home)
        if d is None or (reference_mode and d.reference_score is None):
            return None
        value = d.comparison().value
        return value if math.isfinite(value) else None

    values = [compared(r.decision) for r in records]
    rejected = [v for r, v in zip(records, values) if v is not None and not r.decision.accept]
    accepted = [v for r, v in zip(records, values) if v is not None and r.decision.accept]
    interval = {"above": max(rejected) if rejected else None, "up_to": min(accepted) if accepted else None,
                "flip_tau_per_block": values, "exact": not options.cascade}
    if reference_mode:
        interval.update(compared=COMPARED_QUANTITY.get(mode, "score - reference"), tau_mode=mode)
    return interval


def _json_number(x: float):
    return float(x) if math.isfinite(x) else str(x)
