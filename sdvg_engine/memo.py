"""Replay: a run that differs from an earlier one only in tau reuses every block up to its first changed decision.

Why this is exact: a draft and its scores depend only on the blocks before it, never on tau. Two runs with the
same inputs therefore agree block for block until the first block whose decision differs, and from there on the
earlier run's state at that point (both models' contexts, the VAE decode cache, the seam features) is all the
new run needs. :class:`ReplayMemo` keeps, per finished run, each block's decision, latents and decoded pixels and
the state after it, in CPU RAM within a byte cap (oldest recordings dropped first); :func:`plan_replay` finds how
far a new tau can reuse a recording by re-deciding the recorded scores, exactly as a fresh run would decide them.

A model's context is restored as references plus a lazy rebuild (see :meth:`ContextScheme.restore`). The VAE's
causal decode cache is not stored at all (3.5 GiB a block at 832x480 in fp32): it is a pure function of the latents
decoded since ``reset()``, so a run that goes on after the replayed prefix decodes the reused latents again, which
rebuilds it bit for bit (one decode per reused block). A run replayed whole needs no VAE state and takes the recorded
frames. Both are bit-exact, so a replayed run equals a fresh run at the new tau bit for bit. A recording holds per
block the latents (1.2 MB at 832x480), the decoded frames (57 MB; a recompute-window model's context snapshots
reference the same frames) and the seam features: 397 MB for an 81-frame video at 832x480, where it was 25 GiB.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .cascade import cascades, first_frames, settled_by_first_frames
from .router import RouteDecision, TauState

DEFAULT_MAX_BYTES = 4 << 30


def _on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is already where a recording lives (the CPU): such a tensor is recorded as it is."""
    return t.device.type == "cpu"


def _cpu(value, copies: dict | None = None):
    """A CPU copy of every tensor inside ``value`` (tuples, lists and dataclass-like states kept as they are).

    ``copies`` (one dict per recording) makes each device *storage* cross to the host once, whole, and every tensor
    that views it becomes the same view of that one host copy: every block's context snapshot references earlier
    frames and latents again (a recompute window holds per-frame views of a block's decoded pixels), and copied view
    by view they would stop sharing storage with the recorded frames (~1.8x a recording's size, +300 MB at
    832x480x81). The views recorded are of block-sized storages (a block's latents, its decoded frames), never of a
    larger buffer. An entry lives as long as its source storage (a finalizer drops it, so a freed address that is
    reused is never mistaken for the old storage, and the copy of a rejected draft's frames goes with them); the source
    itself is not kept."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":  # a dry run at real size: nothing to copy, and views stay views
            return value
        if copies is None or _on_host(value):
            return value.detach().cpu()
        storage = value.untyped_storage()
        key = (str(value.device), storage.data_ptr())
        host = copies.get(key)
        if host is None:
            host = copies[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
            weakref.finalize(storage, copies.pop, key, None)
        return torch.empty(0, dtype=value.dtype).set_(host, value.storage_offset(), tuple(value.shape), value.stride())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cpu(v, copies) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v, copies) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return type(value)(**{k: _cpu(getattr(value, k), copies) for k in value.__dataclass_fields__})
    return value


def recording_bytes(width: int = 832, height: int = 480, num_frames: int = 81, *, latent_channels: int = 16,
                    frames_per_block: int = 3, feature_dim: int = 1024) -> int:
    """Host bytes of one recording of a ``num_frames`` video (closed form; ``tests/test_replay_real_size.py`` checks
    it against a recording built by the real code at that size): per block its float32 latents, its decoded float32
    frames and one seam feature vector (BLIP ViT-L: 1024)."""
    latent_frames = (num_frames - 1) // 4 + 1
    blocks = latent_frames // frames_per_block
    latents = latent_channels * latent_frames * (height // 8) * (width // 8) * 4
    return latents + num_frames * 3 * height * width * 4 + blocks * feature_dim * 4


@dataclass(frozen=True)
class RecordedBlock:
    """One finished block and the state right after it (CPU tensors; never changed once recorded)."""

    index: int
    source: str
    drafted: bool
    decision: RouteDecision | None
    latents: torch.Tensor  # [B, C, F, h, w] float32: what a replay decodes again (frames and VAE state)
    num_frames: int  # video frames of the block (T of its decoded pixels)
    contexts_after: dict  # generator name -> ContextScheme.snapshot()
    previous_features_after: torch.Tensor | None
    seconds: float  # component seconds this block took (what a replay saves)
    reference_after: tuple = ()  # reference modes: the scores of the committed blocks up to this one (None: unscored)
    pixels: torch.Tensor | None = None  # [B, 3, T, H, W] in [-1, 1] as decoded: a run replayed whole needs no decode


@dataclass
class Recording:
    key: tuple
    blocks: list[RecordedBlock] = field(default_factory=list)
    #: per block, the digest of the prompt-schedule segment it was made under (:meth:`PromptSchedule.block_digests`):
    #: the key holds the first prompt; a run whose later prompts differ reuses the blocks before the first difference
    prompts: tuple = ()
    #: device tensor -> its host copy, while the run records (see :func:`_cpu`); emptied when the run ends
    host_copies: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return _unique_nbytes(self.blocks)

    def decisions(self) -> list[tuple]:
        """Per block: where it came from and, for a scored draft, its block score (what a replay plan reads)."""
        return [(b.source, b.drafted, None if b.decision is None else b.decision.block_score,
                 self.prompts[b.index] if b.index < len(self.prompts) else None) for b in self.blocks]


def _unique_nbytes(blocks) -> int:
    """Bytes held by ``blocks``; blocks shared between recordings (a replayed prefix) hold the same tensors, so each
    tensor counts once."""
    seen, total = set(), 0
    for block in blocks:
        for t in _tensors([block.latents, block.pixels, block.contexts_after, block.previous_features_after]):
            # By storage: a context snapshot that holds a view of the block's latents holds no more bytes. Meta
            # tensors (a dry run at real size) have no storage: their base tensor stands for it.
            if t.device.type == "meta":
                base = t if t._base is None else t._base
                key, size = ("meta", id(base)), base.numel() * base.element_size()
            else:
                key, size = (t.device.type, t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
            if key not in seen:
                seen.add(key)
                total += size
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
        if recording.nbytes > self.max_bytes or not recording.blocks:
            return False
        with self._lock:
            # A run that replayed a recording and made the same decisions adds nothing: drop such older copies (their
            # tensors are shared, so they cost no bytes and the cap alone would never evict them).
            pattern = recording.decisions()
            for k in [k for k, r in self._recordings.items() if r.key == recording.key
                      and pattern[:len(r.blocks)] == r.decisions()]:
                del self._recordings[k]
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

    The reference modes (relative, anchor, baseline): the draft is compared with the recorded reference (built from the
    committed blocks before it). Replay keeps every block up to the first changed decision, so that reference is the
    one a fresh run would have too."""
    if router.uses_reference:
        if recorded.reference_score is None:
            return None
        return router.decide(recorded.frame_scores, recorded.temporal_score, tau=tau, reference=recorded.reference_score)
    if not cascades(options, num_frames):
        return router.decide(recorded.frame_scores, recorded.temporal_score, tau=tau)
    first = first_frames(num_frames, options.cascade_frames)
    scores = list(recorded.frame_scores)
    partial = [scores[i] for i in first] if recorded.frames_scored == num_frames else scores
    if len(partial) != len(first):
        return None
    partial_min = router.aggregate(torch.tensor(partial, dtype=torch.float32))
    if settled_by_first_frames(partial_min, tau, options.cascade_margin):
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


def plan_replay(recordings: list[Recording], router, options, tau_state: TauState | None, *, prompts: tuple = (),
                resets: set = frozenset()) -> ReplayPlan | None:
    """The recording that lets this run reuse the most blocks (``None`` if none reuses any).

    ``prompts``: this run's per-block segment digests (a recording is reused up to the first block made under another
    prompt); ``resets``: the blocks where the routing state restarts (a prompt switch under ``switch_routing="reset"``),
    where accept_rate's pool restarts as in the run."""
    best = None
    for rec in recordings:
        state = tau_state.copy() if tau_state is not None else None
        decisions = []
        for block in rec.blocks:
            if prompts and rec.prompts and rec.prompts[block.index] != prompts[block.index]:
                break
            if block.index in resets and state is not None:
                state = router.new_tau_state()
            decision = block.decision
            if block.drafted and options.scores_drafts:
                tau = router.block_tau(state)
                decision = redecide(router, options, block.decision, block.num_frames, tau)
                if decision is None or decision.accept != block.decision.accept:
                    break
                state.observe(decision.block_score)
            decisions.append(decision)
        if decisions and (best is None or len(decisions) > best.reuse):
            best = ReplayPlan(rec, len(decisions), decisions)
    return best
