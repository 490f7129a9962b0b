"""What one run is asked to do: the options of a run, the modes and what each needs, cancel and run errors.

One home for every "does this mode ..." rule: the pipeline, the CLI, the nodes, the workers and the tree tool ask an
:class:`SDVGOptions` (``uses_drafter``, ``uses_target``, ``scores_drafts``, ``keeps_every_draft``,
``target_makes_block``) instead of comparing mode names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import check_bool, check_choice, check_int, check_number, check_optional_int
from .choices import MODES, SCHEDULE_EVERY, SWITCH_ROUTING  # noqa: F401 (MODES is public here too)

if TYPE_CHECKING:
    from .router import RewardRouter


class GenerationCancelled(RuntimeError):
    """Raised between model calls when a run is cancelled; the pipeline stays usable."""


class NonFiniteOutputError(RuntimeError):
    """A model produced NaN/inf for a block: raised instead of saving a black video; the pipeline stays usable."""


class CancelToken:
    """Thread-safe enough cancel flag: ``cancel()`` from anywhere, checked before every model call."""

    def __init__(self):
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class SDVGOptions:
    """Routing options of one run (all JSON-serialisable; they go into the report).

    mode: ``sdvg`` | ``target_only`` | ``draft_only`` | ``first_block_only`` | ``random`` | ``schedule``.
    force_first_block: block 0 by the target (default on; ignored by ``draft_only``).
    random_accept_prob: acceptance probability ``p`` of ``random`` mode.
    refine_from_step: hybrid regeneration: on reject the target continues from the drafter's
        state after this many steps (the reference's best is 3); ``None`` = full regeneration.
    cascade: score ``cascade_frames`` evenly spaced frames first; with ``min`` aggregation a partial
        minimum below tau rejects exactly; accept early only above ``tau + cascade_margin``.
    schedule_every: ``schedule`` mode: the target generates block 0 and every ``k``-th block (``k, 2k, ...``),
        decided before drafting, so the drafter never runs on them and nothing is decoded twice or scored; the
        drafter's blocks are kept unscored. ``0``: only block 0 (as ``first_block_only``).
    schedule_veto: ``schedule`` mode: also score each drafted block and let the router reject it (the target
        regenerates it), e.g. a relative veto (``tau_mode="relative"``); needs a reward router.
    target_after_switch: with a prompt schedule, the first block of each later segment is the target's, as block 0 is
        (``draft_only`` ignores it); off (the default): the router decides it like any other block. Ignored without a
        schedule.
    switch_routing: with a prompt schedule, what the router's state does at a switch: ``carry`` (the default: scores
        under the old prompt are compared with scores under the new one as they are; for the relative router only the
        first draft after the switch reads one) or ``reset`` (each segment starts like a video: the reference modes
        read only the segment's committed blocks, accept_rate's pool restarts from its prior). ``reset`` with a
        reference mode needs ``target_after_switch``. Ignored without a schedule. Both defaults were chosen on the toy
        world's design clips (docs/dev/prompt_schedule.md): the target block after a switch bought no measurable
        quality there and cost 7% of the speed on both splits.

    ``random`` mode draws its decisions before drafting, so a block it gives the target is never drafted, decoded
    twice or scored (the draws are keyed by seed, prompt and block, so the decisions are those of a draft-first run).
    """

    mode: str = "sdvg"
    force_first_block: bool = True
    random_accept_prob: float = 0.73
    refine_from_step: int | None = None
    cascade: bool = False
    cascade_frames: int = 4
    cascade_margin: float = 0.5
    schedule_every: int = SCHEDULE_EVERY
    schedule_veto: bool = False
    target_after_switch: bool = False
    switch_routing: str = "carry"

    def __post_init__(self) -> None:
        # Types and ranges are checked here, once, when the options are made (``dataclasses.replace`` makes them
        # again): a string, a float where a whole number is due, ``True`` as a number or ``'no'`` as a switch is
        # refused with the field's name instead of failing (or, worse, passing) deep inside a run. Values are stored
        # normalised (NumPy numbers become Python ones, so the report stays JSON). What needs the router or the
        # drafter's schedule (refine_from_step's upper bound) is checked by :meth:`validate` and the pipeline.
        self.mode = check_choice("mode", self.mode, MODES)
        self.force_first_block = check_bool(
            "force_first_block", self.force_first_block,
            fix="True = block 0 by the target (the default), False = the drafter may make block 0 too")
        self.random_accept_prob = check_number(
            "random_accept_prob", self.random_accept_prob, low=0.0, high=1.0,
            fix="pass the share of blocks random mode gives the drafter as a number, e.g. random_accept_prob=0.73")
        self.refine_from_step = check_optional_int(
            "refine_from_step", self.refine_from_step,
            fix="pass the drafter step the target continues from as a whole number (3 = the reference's best), "
                "or None for full regeneration")
        self.cascade = check_bool("cascade", self.cascade)
        # The cascade's own settings are range-checked only when it is on (earlier releases ignored them otherwise).
        self.cascade_frames = check_int(
            "cascade_frames", self.cascade_frames, low=1 if self.cascade else None,
            fix="pass how many frames the cascade scores first, e.g. cascade_frames=4")
        self.cascade_margin = check_number(
            "cascade_margin", self.cascade_margin, low=0.0 if self.cascade else None,
            fix="pass a margin >= 0 above tau for an early accept, e.g. cascade_margin=0.5")
        self.schedule_every = check_int(
            "schedule_every", self.schedule_every, low=0,
            fix="pass k to give the target every k-th block, e.g. schedule_every=3 (0 = only block 0 by the target)")
        self.schedule_veto = check_bool("schedule_veto", self.schedule_veto)
        self.target_after_switch = check_bool(
            "target_after_switch", self.target_after_switch,
            fix="True = the first block after a prompt switch by the target, False = the router decides (the default)")
        self.switch_routing = check_choice("switch_routing", self.switch_routing, SWITCH_ROUTING)

    # ---- what the mode needs (the one home of these rules) ------------------------------------------
    @property
    def scores_drafts(self) -> bool:
        """Whether drafts are scored and routed by the reward router (``sdvg``, or ``schedule`` with its veto)."""
        return self.mode == "sdvg" or (self.mode == "schedule" and bool(self.schedule_veto))

    @property
    def uses_drafter(self) -> bool:
        """Whether the drafter runs at all (every mode but ``target_only``)."""
        return self.mode != "target_only"

    @property
    def uses_target(self) -> bool:
        """Whether the target runs at all (every mode but ``draft_only``)."""
        return self.mode != "draft_only"

    @property
    def target_first_block(self) -> bool:
        """Whether block 0 is the target's (``force_first_block``, which ``draft_only`` ignores)."""
        return self.force_first_block and self.mode != "draft_only"

    @property
    def keeps_every_draft(self) -> bool:
        """Whether every drafted block is kept (no router may reject one): no rollback snapshot, no speculation.
        ``random`` decides before drafting, so a block it drafts is kept too."""
        return not self.scores_drafts

    @property
    def draws_before_drafting(self) -> bool:
        """Whether each block's decision is drawn before any draft (``random``: a block given to the target is never
        drafted, decoded twice or scored)."""
        return self.mode == "random"

    @property
    def drafter_leads(self) -> bool:
        """Whether the drafter makes most of the output (``draft_only``, ``first_block_only``): with two lanes on one
        device it gets the lane of its own."""
        return self.mode in ("draft_only", "first_block_only")

    def target_makes_block(self, b: int, random_accept: bool | None = None, starts_segment: bool = False) -> bool:
        """Whether the target makes block ``b`` without a draft, decided before drafting. ``random_accept``: random
        mode's draw for the block (``RandomRouter.decide_block(b).accept``), which needs no draft either.
        ``starts_segment``: a prompt schedule switches at ``b``."""
        if b == 0 and self.target_first_block:
            return True
        if starts_segment and self.target_after_switch and self.mode != "draft_only":
            return True
        if self.mode == "schedule" and self.schedule_every > 0 and b > 0 and b % self.schedule_every == 0:
            return True
        if self.draws_before_drafting:
            if random_accept is None:
                raise ValueError("random mode decides each block with its draw: pass random_accept")
            return not random_accept
        return self.mode == "target_only"

    def validate(self, router: RewardRouter | None) -> None:
        """What depends on the router (its types and ranges are checked when the options are made). The field
        checks run again too, in case a field was assigned after construction."""
        self.__post_init__()
        if self.mode == "sdvg" and router is None:
            raise ValueError("mode 'sdvg' needs a reward router (ImageReward); use another mode without one")
        if self.scores_drafts and router is None:
            raise ValueError("schedule_veto scores each drafted block with the reward router (ImageReward), and there "
                             "is none; load a reward model or set schedule_veto=False")
        if self.cascade and self.scores_drafts:
            if router.aggregation != "min":
                raise ValueError("cascade scoring is exact only with 'min' aggregation; set aggregation='min' or cascade=False")
            if router.temporal_weight != 0.0:
                raise ValueError("cascade scoring does not combine with a temporal weight; set one of them off")
        if self.scores_drafts and router.uses_reference:
            if not self.force_first_block:
                raise ValueError(f"tau_mode {router.tau_mode!r} compares each draft with the blocks committed before "
                                 "it, and block 0 has none: keep force_first_block on (block 0 by the target) or use "
                                 "tau_mode 'fixed'")
            if self.cascade:
                raise ValueError(f"cascade scoring is not supported with tau_mode {router.tau_mode!r}; set "
                                 "cascade=False or use tau_mode 'fixed'")
