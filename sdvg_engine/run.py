"""What one generation holds while it runs, and how it starts.

:class:`Run` is the whole state of one call of :meth:`SpeculativePipeline.stream`: the pipeline object itself holds
no half-run state. Each field says who writes it and when. Four kinds of field:

* **set once** by :func:`start_run` on the caller's thread, before any block; read-only afterwards;
* **the loop's state**, written only on the main thread by the loop, in block order (:meth:`Run.advance` is the
  one writer of the routing state a later draft reads; a replay restores it through the same method);
* **the output**, appended on the main thread when a block is final (:meth:`Run.append_block`);
* **replay**: the plan and the recording, made by :func:`start_run`, then added to on the main thread
  (:meth:`Run.record`).

Worker threads never assign a field of a :class:`Run`: what a task needs is handed to it when it is submitted.
(Two objects a run holds are shared on purpose: the timer, which has a lock, and the adaptive threshold's
:class:`TauState`, observed by the reward lane in block order.)
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .checks import check_int
from .memo import RecordedBlock, Recording, ReplayPlan, plan_replay
from .options import CancelToken, GenerationCancelled, SDVGOptions
from .prompt_schedule import PromptSchedule, check_text_context
from .replay_key import replay_key
from .report import BlockRecord, ComponentTimer, Lap
from .router import RandomRouter, RouteDecision, TauState
from .sampling import NoiseSource, SeededNoise
from .workers import COMPONENTS, StoppedByOtherWorker, Workers, plan_lanes

if TYPE_CHECKING:  # pragma: no cover
    from .generator import CausalGenerator
    from .pipeline import SpeculativePipeline

TEXT_LEN = 512
SEED_RANGE = (0, 2**64 - 1)  # SeededNoise takes no negative seed; 2**64 - 1 is the largest a ComfyUI seed widget gives


@dataclass(eq=False)
class Run:
    """The state of one generation (see the module docstring for the three kinds of field)."""

    # ---- set once by start_run (caller's thread), read-only afterwards -------------------------------------------
    options: SDVGOptions
    num_blocks: int
    noise: NoiseSource
    prompt: str
    seed: int
    width: int
    height: int
    num_frames: int
    frames_per_block: int
    workers: Workers
    cancel: CancelToken | None = None
    before_call: Callable[[str, str], None] | None = None
    #: the generators this mode runs (their contexts take every committed block)
    active: list[CausalGenerator] = field(default_factory=list)
    #: seconds per component of this run (its laps are written by whichever thread makes the call; it has a lock)
    timer: ComponentTimer = field(default_factory=ComponentTimer)
    #: the reward's prompt features, when the mode scores drafts
    prompt_features: torch.Tensor | None = None
    #: the adaptive threshold's running scores (the caller's, if carried); observed on the reward lane per draft
    #: (the drafts are scored in block order) and on the main thread by a replay
    tau_state: TauState | None = None
    #: random mode's draws (decided before drafting)
    random_router: RandomRouter | None = None
    #: the prompt of every block (one segment without a prompt schedule; :mod:`sdvg_engine.prompt_schedule`)
    schedule: PromptSchedule | None = None
    #: the reward's prompt features per segment of the schedule, when the mode scores drafts
    segment_features: list = field(default_factory=list)

    # ---- the loop's routing state: written on the main thread by advance(), in block order ---------------------------
    #: the reward's ViT features of the last committed frame (a tensor, a Future of one, or None): the next draft's
    #: seam term
    previous_features: object = None
    #: reference modes: each committed block's score (a float, a Future of one, or None where no reference reads it)
    committed_scores: list = field(default_factory=list)

    # ---- the output: appended on the main thread when a block is final (append_block) -------------------------------
    records: list[BlockRecord] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)  # per block [T, H, W, 3] float32 0..1 (CPU)
    latents: list[torch.Tensor] = field(default_factory=list)  # per block [B, C, F, h, w] float32 (CPU)
    mask: list[torch.Tensor] = field(default_factory=list)  # per block [T]: 1 where the frames are a kept draft's
    video_frames: int = 0  # frames appended so far
    #: the timer's totals when the last block was final (take_block_seconds() reads the difference)
    block_seconds: dict = field(default_factory=dict)

    # ---- replay: set by start_run, then written on the main thread -------------------------------------------------
    #: what a later run may replay (with a memo); blocks are added in order as they are final; released by the result
    recording: Recording | None = None
    #: the recording reached the memo's cap: later blocks are not recorded (and nothing more crosses to the host)
    recording_full: bool = False
    #: which blocks of an earlier run this one reuses (start_run; released by the result)
    replay_plan: ReplayPlan | None = None
    first_block: int = 0  # the first block this run generates (= the blocks replayed)
    replayed_seconds: float = 0.0  # component seconds the replayed blocks took in the run that made them

    # ---- what tasks call -------------------------------------------------------------------------------------------
    def submit(self, component: str, fn, *args):
        return self.workers.submit(component, fn, *args)

    def check_cancel(self, component: str, kind: str) -> None:
        """The cancel point before every model, VAE and reward call (any thread)."""
        if self.cancel is not None and self.cancel.cancelled:
            raise GenerationCancelled(f"generation cancelled before a {component} {kind}")
        if self.workers.failed.is_set():
            raise StoppedByOtherWorker(f"stopped before a {component} {kind}: another worker of this run failed "
                                       f"({self.workers.first_error!r})")
        if self.before_call is not None:
            self.before_call(component, kind)

    @property
    def host_copies(self) -> dict | None:
        """The recording's table of host copies while it still records (``None`` past the memo's cap or without a
        memo): read on the main thread when a task is submitted, never later on a worker."""
        return self.recording.host_copies if self.recording is not None and not self.recording_full else None

    # ---- the loop's state ------------------------------------------------------------------------------------------
    def advance(self, previous_features, committed_scores) -> None:
        """The routing state after a committed (or replayed) block: the one place it is written."""
        self.previous_features = previous_features
        self.committed_scores = list(committed_scores)

    def decided_before_drafting(self, b: int) -> RouteDecision | None:
        """The decision of a block made before any draft: random mode's draw (``None`` in the other modes and for a
        block the target makes anyway: block 0, the first block after a prompt switch)."""
        # Asked with a draw that gives the drafter the block: True only where the target makes it whatever the draw.
        if self.random_router is None or self.options.target_makes_block(b, True, self.starts_segment(b)):
            return None
        return self.random_router.decide_block(b)

    def target_makes(self, b: int) -> bool:
        """Whether the target makes block ``b`` without a draft (:meth:`SDVGOptions.target_makes_block`)."""
        draw = self.decided_before_drafting(b)
        return self.options.target_makes_block(b, None if draw is None else draw.accept, self.starts_segment(b))

    # ---- the prompt schedule ---------------------------------------------------------------------------------------
    def starts_segment(self, b: int) -> bool:
        """Whether the prompt switches at block ``b``."""
        return self.schedule is not None and self.schedule.starts_segment(b)

    def features_of(self, b: int):
        """The reward's prompt features block ``b`` is scored against (its segment's)."""
        return self.segment_features[self.schedule.segment_index(b)] if self.segment_features else None

    def resets_routing_at(self, b: int) -> bool:
        """Whether the routing state restarts at block ``b`` (a switch with ``switch_routing="reset"``)."""
        return self.options.switch_routing == "reset" and self.starts_segment(b)

    def routing_index(self, b: int) -> int:
        """Block ``b``'s index as the router's references count blocks: from its segment's start under ``reset``
        (an anchor is then the segment's first block), from block 0 otherwise."""
        if self.options.switch_routing != "reset" or self.schedule is None:
            return b
        return b - self.schedule.segment_of(b).first_block

    def enter_block(self, b: int, router) -> None:
        """Before block ``b`` is made: at a switch under ``switch_routing="reset"`` the router's state restarts as at
        the start of a video (the committed scores its references read, accept_rate's pool)."""
        if self.resets_routing_at(b):
            self.committed_scores = []
            if self.tau_state is not None:
                self.tau_state = router.new_tau_state()

    # ---- the recording (main thread, block order) ---------------------------------------------------------------
    def record(self, block: RecordedBlock, max_bytes: int) -> None:
        """Add a final block to the recording while it fits the memo's cap (``max_bytes``): a recording too large to
        keep whole keeps its longest prefix that fits (a later run still replays every block up to there)."""
        if self.recording_full:
            return
        self.recording.blocks.append(block)
        if self.recording.nbytes > max_bytes:
            self.recording.blocks.pop()
            self.recording_full = True

    # ---- the output ------------------------------------------------------------------------------------------------
    def append_block(self, index: int, source: str, drafted: bool, decision: RouteDecision | None,
                     latents: torch.Tensor, frames: torch.Tensor, **record_fields) -> BlockRecord:
        """Add a final block's frames ``[T, H, W, 3]``, latents (CPU float32) and mask, and its :class:`BlockRecord`."""
        f0 = self.video_frames
        self.video_frames += frames.shape[0]
        self.latents.append(latents)
        self.mask.append(torch.full((frames.shape[0],), 1.0 if source == "draft" else 0.0))
        self.frames.append(frames)
        fpb = self.frames_per_block
        record = BlockRecord(index=index, source=source, drafted=drafted, decision=decision,
                             latent_frames=(index * fpb, (index + 1) * fpb), video_frames=(f0, self.video_frames),
                             frames=frames, **record_fields)
        self.records.append(record)
        return record

    def take_block_seconds(self) -> dict:
        """Component seconds since the previous block was final: what this block took (its own calls, and work of a
        later block that overlapped it)."""
        now = self.timer.seconds
        spent = {k: v - self.block_seconds.get(k, 0.0) for k, v in now.items() if v - self.block_seconds.get(k, 0.0) > 0}
        self.block_seconds = dict(now)
        return spent


def video_frames_to_latent_frames(num_frames: int, frames_per_block: int = 3) -> int:
    """Wan's 1 + 4k rule, with whole blocks: valid lengths are 12n - 3 (9, 21, ..., 81) for 3-frame blocks."""
    num_frames = check_int("num_frames", num_frames, fix="pass a whole number of video frames such as 81")
    latent = (num_frames - 1) // 4 + 1
    if num_frames < 1 or (num_frames - 1) % 4 or latent % frames_per_block:
        step = 4 * frames_per_block
        lower = max(step - 3, ((num_frames + 3) // step) * step - 3)
        raise ValueError(
            f"num_frames={num_frames} does not fill whole blocks of {frames_per_block} latent frames; "
            f"use {lower} or {lower + step} (valid: 1 + 4*(3n) - 4 = {step - 3}, {2 * step - 3}, ..., 81)"
        )
    return latent


def pad_text(prompt_embeds: torch.Tensor) -> torch.Tensor:
    """Text context ``[1, L, D]`` with zero rows appended up to ``TEXT_LEN``, as the reference pads UMT5's output."""
    if prompt_embeds.shape[1] >= TEXT_LEN:
        return prompt_embeds
    return torch.nn.functional.pad(prompt_embeds, (0, 0, 0, TEXT_LEN - prompt_embeds.shape[1]))


def check_parts(drafter, target, vae, router) -> None:
    """The parts of a :class:`SpeculativePipeline`: their types (a clear error instead of an AttributeError mid-run),
    then whether the two models and the VAE fit together."""
    from .generator import CausalGenerator

    for name, gen in (("drafter", drafter), ("target", target)):
        if not isinstance(gen, CausalGenerator):
            raise ValueError(f"{name} must be a CausalGenerator, got {type(gen).__name__}; build it with "
                             "sdvg_engine.load_generator(...)")
    missing = [m for m in ("reset", "decode_block", "snapshot", "restore") if not callable(getattr(vae, m, None))]
    if missing:
        raise ValueError(f"vae must be a StreamingWanVAE (with reset, decode_block, snapshot, restore), got "
                         f"{type(vae).__name__} (missing {', '.join(missing)}); load it with sdvg_engine.load_wan_vae(...)")
    if router is not None and not all(callable(getattr(router, m, None)) for m in ("judge", "block_tau", "decide")):
        raise ValueError(f"router must be a RewardRouter (or None outside sdvg mode), got {type(router).__name__}; wrap "
                         "a scorer as RewardRouter(scorer, tau=...)")
    d, t = drafter.model.config, target.model.config

    def same(a, b):
        return (tuple(a) if isinstance(a, (list, tuple)) else a) == (tuple(b) if isinstance(b, (list, tuple)) else b)

    for key, what in (("in_channels", "latent channels"), ("out_channels", "output channels"),
                      ("patch_size", "patch size"), ("text_dim", "text width")):
        if not same(d[key], t[key]):
            raise ValueError(
                f"drafter and target are not compatible: the drafter has {what} {d[key]}, the target {t[key]}. "
                "Both must be Wan2.1 text-to-video models sharing the VAE and text encoder."
            )
    if drafter.frames_per_block != target.frames_per_block:
        raise ValueError(
            f"drafter generates {drafter.frames_per_block} latent frames per block, "
            f"the target {target.frames_per_block}; they must match"
        )
    z = getattr(vae, "latent_channels", d["in_channels"])
    if z != d["in_channels"]:
        raise ValueError(f"the VAE has {z} latent channels but the models use {d['in_channels']}; use the Wan2.1 VAE")


def check_run_inputs(pipe: SpeculativePipeline, prompt_embeds, prompt, num_frames, width, height, seed, options,
                     noise, scheduled: bool = False) -> SDVGOptions:
    """Refuse bad arguments of :meth:`SpeculativePipeline.stream` / ``generate`` with a ValueError naming the argument,
    its value and the fix, before any model runs. Returns the options to use. ``scheduled``: a prompt schedule holds
    the prompts (checked by :func:`plan_schedule`)."""
    if options is None:
        options = SDVGOptions()
    elif not isinstance(options, SDVGOptions):
        raise ValueError(f"options must be an SDVGOptions, got {type(options).__name__} {str(options)[:80]}; pass "
                         f"options=SDVGOptions(**your_dict) (from sdvg_engine import SDVGOptions)")
    options.validate(pipe.router)
    for name, value in (("width", width), ("height", height)):
        check_int(name, value, fix=f"pass a positive multiple of 16 such as {name}={832 if name == 'width' else 480}")
    if width % 16 or height % 16 or width <= 0 or height <= 0:
        raise ValueError(f"width and height must be positive multiples of 16, got {width}x{height}; use e.g. "
                         f"{max(16, width - width % 16)}x{max(16, height - height % 16)}")
    check_int("seed", seed, low=SEED_RANGE[0], high=SEED_RANGE[1],
              fix=f"pass a whole number in {SEED_RANGE[0]}..{SEED_RANGE[1]} (2**64 - 1), e.g. seed=42")
    if scheduled:
        return options
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string (the text the embeddings were made from; '' when no reward "
                         f"scores drafts), got {type(prompt).__name__} {prompt!r}")
    check_text_context(prompt_embeds, pipe.target.model.config.text_dim)
    if options.scores_drafts and not prompt.strip():
        raise ValueError(f"mode {options.mode!r}{' with schedule_veto' if options.mode == 'schedule' else ''} scores "
                         "drafts against the prompt text, but prompt is empty; pass prompt=... (the text the "
                         "embeddings were made from)")
    return options


def check_run_hooks(*, noise=None, cancel=None, before_call=None, on_block=None, tau_state=None) -> None:
    """Refuse a hook of the wrong kind before any model runs (it would fail deep inside the run otherwise)."""
    from .router import TauState

    if noise is not None and not all(callable(getattr(noise, m, None)) for m in ("initial", "step")):
        raise ValueError(f"noise must be a noise source with initial() and step() (e.g. sdvg_engine.SeededNoise(42) "
                         f"or TensorNoise), got {type(noise).__name__} {str(noise)[:60]}; or leave it None to use seed")
    if cancel is not None and not hasattr(cancel, "cancelled"):
        raise ValueError(f"cancel must be a CancelToken (from sdvg_engine import CancelToken), got "
                         f"{type(cancel).__name__} {str(cancel)[:60]}")
    for name, hook in (("before_call", before_call), ("on_block", on_block)):
        if hook is not None and not callable(hook):
            raise ValueError(f"{name} must be a function (or None), got {type(hook).__name__} {str(hook)[:60]}")
    if tau_state is not None and not isinstance(tau_state, TauState):
        raise ValueError(f"tau_state must be a TauState (router.new_tau_state()), got {type(tau_state).__name__}")


def plan_schedule(pipe: SpeculativePipeline, prompt_embeds, prompt, prompt_schedule, opts: SDVGOptions,
                  num_blocks: int) -> PromptSchedule:
    """The run's :class:`PromptSchedule`: ``prompt_schedule`` checked, or one segment of ``prompt_embeds`` and
    ``prompt`` (checked by :func:`check_run_inputs`); every segment's text padded to ``TEXT_LEN`` rows."""
    if prompt_schedule is None:
        schedule = PromptSchedule.single(prompt_embeds, prompt)
    else:
        if prompt_embeds is not None or prompt:
            raise ValueError("pass either prompt_embeds and prompt (one prompt) or prompt_schedule (its entries hold "
                             "each segment's embeddings and reward prompt), not both")
        schedule = PromptSchedule.of(prompt_schedule)
        schedule.check(num_blocks, pipe.target.model.config.text_dim, needs_prompt=opts.scores_drafts, mode=opts.mode)
        router = pipe.router
        if (len(schedule) > 1 and opts.scores_drafts and router.uses_reference and opts.switch_routing == "reset"
                and not opts.target_after_switch):
            raise ValueError(f"tau_mode {router.tau_mode!r} with switch_routing='reset' compares each draft with the "
                             "blocks committed since the last prompt switch, and the first block after a switch has "
                             "none: keep target_after_switch on, use switch_routing='carry' or tau_mode 'fixed'")
    return PromptSchedule([dataclasses.replace(seg, embeds=pad_text(seg.embeds)) for seg in schedule])


def start_run(pipe: SpeculativePipeline, prompt_embeds, prompt, num_frames, width, height, seed, options, noise, cancel,
              before_call, tau_state, workers, prompt_schedule=None) -> Run:
    """Check the inputs, plan the workers and the replay, and start the models on a new video: the :class:`Run`."""
    previous = getattr(pipe, "_run", None)
    if previous is not None:  # a stream left unfinished must not keep working on the models this run resets
        previous.workers.abandon()
    opts = check_run_inputs(pipe, prompt_embeds, prompt, num_frames, width, height, seed, options, noise,
                            scheduled=prompt_schedule is not None)
    check_run_hooks(noise=noise, cancel=cancel, before_call=before_call, tau_state=tau_state)
    fpb = pipe.target.frames_per_block
    num_blocks = video_frames_to_latent_frames(num_frames, fpb) // fpb
    schedule = plan_schedule(pipe, prompt_embeds, prompt, prompt_schedule, opts, num_blocks)
    prompt_embeds, prompt = schedule.first.embeds, schedule.first.prompt
    if opts.refine_from_step is not None:
        steps = pipe.drafter.schedule.num_steps
        if not 1 <= opts.refine_from_step < steps:
            raise ValueError(f"refine_from_step must be in 1..{steps - 1} for the drafter's {steps}-step schedule")
        pipe.target.step_index(pipe.drafter.schedule.timesteps[opts.refine_from_step])
    devices = {c: pipe._device(c) for c in COMPONENTS}
    memo_key = None
    if pipe.memo is not None and noise is None:  # an explicit noise source is not part of the key: never replayed
        memo_key = replay_key(pipe, prompt_embeds, prompt, num_frames, width, height, seed, opts, devices)
    run = Run(options=opts, num_blocks=num_blocks, noise=noise or SeededNoise(seed), prompt=prompt, seed=seed,
              width=width, height=height, num_frames=num_frames, frames_per_block=fpb, cancel=cancel,
              before_call=before_call, workers=Workers(plan_lanes(opts, devices, workers)), schedule=schedule)
    run.timer.handover_sync = not run.workers.parallel
    run.active = [g for g, used in ((pipe.drafter, opts.uses_drafter), (pipe.target, opts.uses_target)) if used]
    try:
        for gen in (pipe.drafter, pipe.target):
            gen.before_call = run.check_cancel
            gen.calls.clear()  # a model this mode does not use must not report a previous run's calls
            gen.timer.clear()
        switches = tuple((seg.first_block, seg.embeds) for seg in schedule.segments[1:])
        for gen in run.active:
            gen.start(prompt_embeds, latent_height=height // 8, latent_width=width // 8, num_blocks=num_blocks,
                      switches=switches)
        pipe.vae.reset()
        if opts.scores_drafts:
            run.segment_features = [pipe.router.scorer.encode_prompt(seg.prompt) for seg in schedule]
            run.prompt_features = run.segment_features[0]
            run.tau_state = tau_state if tau_state is not None else pipe.router.new_tau_state()
        if opts.draws_before_drafting:
            run.random_router = RandomRouter(opts.random_accept_prob, seed, key=prompt)
        if memo_key is not None:
            digests = schedule.block_digests(num_blocks)
            run.recording = Recording(memo_key, prompts=digests)
            resets = {b for b in range(num_blocks) if run.resets_routing_at(b)}
            run.replay_plan = plan_replay(pipe.memo.lookup(memo_key), pipe.router, opts, run.tau_state,
                                          prompts=digests, resets=resets)
            run.first_block = run.replay_plan.reuse if run.replay_plan is not None else 0
    except BaseException:
        run.workers.__exit__(*sys.exc_info())
        raise
    pipe._run = run
    return run


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN/inf. A meta tensor (the real-size dry run, :mod:`sdvg_engine.dry_run`) has no values
    to check: True."""
    return t.is_meta or bool(torch.isfinite(t).all())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, where a run's results live; a meta tensor (the dry run) stays on meta, with no values to copy."""
    return t if t.is_meta else t.cpu()


def compact(t):
    """A tensor holding only its own bytes: the seam features are the last row of a block's ``[N, 1024]`` features,
    and a view would keep all N rows in the recording (``memo.recording_bytes`` counts one row per block)."""
    if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


__all__ = ["Run", "start_run", "check_run_inputs", "video_frames_to_latent_frames", "pad_text", "TEXT_LEN", "Lap"]
