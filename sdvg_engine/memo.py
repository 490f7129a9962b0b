"""Replay: a run that differs from an earlier one only in tau reuses every block up to its first changed decision.

Why this is exact: a draft and its scores depend only on the blocks before it, never on tau. Two runs with the
same inputs therefore agree block for block until the first block whose decision differs, and from there on the
earlier run's state at that point (both models' contexts, the VAE decode cache, the seam features) is all the
new run needs. :class:`ReplayMemo` keeps, per finished run, each block's decision, latents and decoded pixels and
the state after it, in CPU RAM within a byte cap (oldest recordings dropped first); :func:`plan_replay` finds how
far a new tau can reuse a recording by re-deciding the recorded scores, exactly as a fresh run would decide them.

A model's context is restored as references plus a lazy rebuild (see :meth:`ContextScheme.restore`), the VAE from
its snapshot; both are bit-exact, so a replayed run equals a fresh run at the new tau bit for bit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .router import RouteDecision, TauState

DEFAULT_MAX_BYTES = 4 << 30


def _cpu(value):
    """A CPU copy of every tensor inside ``value`` (tuples, lists and dataclass-like VAE states kept as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cpu(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return type(value)(**{k: _cpu(getattr(value, k)) for k in value.__dataclass_fields__})
    return value


@dataclass(frozen=True)
class RecordedBlock:
    """One finished block and the state right after it (CPU tensors; never changed once recorded)."""

    index: int
    source: str
    drafted: bool
    decision: RouteDecision | None
    latents: torch.Tensor  # [B, C, F, h, w] float32
    pixels: torch.Tensor  # [B, 3, T, H, W] in [-1, 1], as decoded
    vae_after: object  # VAEDecodeState
    contexts_after: dict  # generator name -> ContextScheme.snapshot()
    previous_features_after: torch.Tensor | None
    seconds: float  # component seconds this block took (what a replay saves)
    reference_after: float | None = None  # relative routing: this block's score as committed (the next reference)


@dataclass
class Recording:
    key: tuple
    blocks: list[RecordedBlock] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return _unique_nbytes(self.blocks)


def _unique_nbytes(blocks) -> int:
    """Bytes held by ``blocks``; blocks shared between recordings (a replayed prefix) hold the same tensors, so each
    tensor counts once."""
    seen, total = set(), 0
    for block in blocks:
        for t in _tensors([block.latents, block.pixels, block.vae_after, block.contexts_after, block.previous_features_after]):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for k in value.__dataclass_fields__:
            yield from _tensors(getattr(value, k))


class ReplayMemo:
    """Recordings of finished runs, newest last, within ``max_bytes`` of CPU RAM (oldest dropped first).

    Thread-safe. A recording larger than the cap is not kept (the run still completes; its report says so).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._recordings: "OrderedDict[int, Recording]" = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes_locked()

    def _nbytes_locked(self) -> int:
        return _unique_nbytes(block for rec in self._recordings.values() for block in rec.blocks)

    def __len__(self) -> int:
        return len(self._recordings)

    def lookup(self, key: tuple) -> list[Recording]:
        """Recordings made with ``key``, newest first."""
        with self._lock:
            return [r for r in reversed(self._recordings.values()) if r.key == key]

    def store(self, recording: Recording) -> bool:
        """Keep ``recording`` as the newest; drop the oldest recordings beyond the cap (blocks a replayed run shares
        with its source recording are the same tensors and counted once)."""
        if recording.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._recordings[self._next] = recording
            self._next += 1
            while self._recordings and self._nbytes_locked() > self.max_bytes:
                self._recordings.popitem(last=False)
            return any(r is recording for r in self._recordings.values())

    def clear(self) -> None:
        with self._lock:
            self._recordings.clear()


def redecide(router, options, recorded: RouteDecision, num_frames: int, tau: float) -> RouteDecision | None:
    """The decision a fresh run would make at ``tau`` from a recorded draft's scores, or ``None`` when the recorded
    scores cannot tell (cascade scoring that stopped early and would now have to score the rest; relative routing
    with a recording that holds no reference score).

    Relative mode (``tau_mode="relative"``): the draft is compared with the recorded reference (the score of the
    committed block before it). Replay keeps every block up to the first changed decision, so that reference is the
    one a fresh run would have too."""
    if router.tau_mode == "relative":
        if recorded.reference_score is None:
            return None
        return router.decide(recorded.frame_scores, recorded.temporal_score, tau=tau, reference=recorded.reference_score)
    if not options.cascade or num_frames <= options.cascade_frames:
        return router.decide(recorded.frame_scores, recorded.temporal_score, tau=tau)
    first = torch.linspace(0, num_frames - 1, options.cascade_frames).round().long().unique().tolist()
    scores = list(recorded.frame_scores)
    partial = [scores[i] for i in first] if recorded.frames_scored == num_frames else scores
    if len(partial) != len(first):
        return None
    partial_min = router.aggregate(torch.tensor(partial, dtype=torch.float32))
    if partial_min < tau or partial_min >= tau + options.cascade_margin:
        return router.decide(partial, tau=tau)
    if recorded.frames_scored != num_frames:
        return None
    return router.decide(scores, tau=tau)


@dataclass
class ReplayPlan:
    """How much of ``recording`` a run can reuse: blocks ``0 .. reuse - 1``, with their decisions at the new tau."""

    recording: Recording
    reuse: int
    decisions: list[RouteDecision | None]


def plan_replay(recordings: list[Recording], router, options, tau_state: TauState | None) -> ReplayPlan | None:
    """The recording that lets this run reuse the most blocks (``None`` if none reuses any)."""
    best = None
    for rec in recordings:
        state = tau_state.copy() if tau_state is not None else None
        decisions = []
        for block in rec.blocks:
            decision = block.decision
            if block.drafted and options.mode == "sdvg":
                tau = router.block_tau(state)
                decision = redecide(router, options, block.decision, block.pixels.shape[2], tau)
                if decision is None or decision.accept != block.decision.accept:
                    break
                state.observe(decision.block_score)
            decisions.append(decision)
        if decisions and (best is None or len(decisions) > best.reuse):
            best = ReplayPlan(rec, len(decisions), decisions)
    return best
