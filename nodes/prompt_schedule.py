"""The work of SDVG Prompt Schedule and SDVG Prompt Switch: the prompts a video switches to while it is made.

The sampler's own ``positive`` and ``reward_prompt`` stay the opening prompt (frame 0); an ``SDVG_PROMPT_SCHEDULE``
(:class:`SDVGSchedule`) holds the later prompts, each with the video frame it starts at. Two nodes make one:

* SDVG Prompt Schedule: ``frame: prompt`` lines encoded with a CLIP (each line's text is also its reward prompt), and
  the switch settings (``target_after_switch``, ``switch_routing``);
* SDVG Prompt Switch: one switch from a CONDITIONING and its reward prompt; chained through ``schedule``.

The nodes check what they can without the video's length (the engine's
:func:`~sdvg_engine.prompt_schedule.parse_schedule` and :func:`~sdvg_engine.prompt_schedule.block_of_frame` rules,
assuming 3-latent-frame blocks); the sampler checks the frames against its ``length`` and the model's blocks
(:func:`engine_schedule`). Nothing here imports ComfyUI: the CLIP is used through the two calls CLIPTextEncode makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdvg_engine.checks import check_bool, check_choice
from sdvg_engine.choices import SWITCH_ROUTING
from sdvg_engine.prompt_schedule import block_of_frame, block_start_frame, parse_schedule

from . import schema

__all__ = ["SDVGSchedule", "Switch", "encode_text", "engine_schedule", "schedule_node", "start_frame_problem",
           "switch_node"]

#: blocks of 3 latent frames: what every supported checkpoint uses (the sampler re-checks with the model's own)
FRAMES_PER_BLOCK = 3


@dataclass(frozen=True, eq=False)
class Switch:
    """One prompt switch: from video frame ``frame`` on, the video follows ``conditioning`` and is scored against
    ``reward_prompt``. ``source``: where it was made, for error messages."""

    frame: int
    conditioning: Any
    reward_prompt: str
    source: str


@dataclass(frozen=True, eq=False)
class SDVGSchedule:
    """An ``SDVG_PROMPT_SCHEDULE``: the switches after the opening prompt, in frame order, and the switch settings an
    SDVG Prompt Schedule node set (``None``: not set here, the engine's defaults apply). Never modified."""

    switches: tuple[Switch, ...]
    target_after_switch: bool | None = None
    switch_routing: str | None = None
    #: the node that set the settings (for the message when two try to)
    settings_from: str = field(default="")

    @property
    def frames(self) -> tuple[int, ...]:
        return tuple(s.frame for s in self.switches)

    def options(self) -> dict:
        """The SDVGOptions fields this schedule sets."""
        out = {}
        if self.target_after_switch is not None:
            out["target_after_switch"] = self.target_after_switch
        if self.switch_routing is not None:
            out["switch_routing"] = self.switch_routing
        return out


# ------------------------------------------------------------------------------------------------------- checks
def _shortest_length(frame: int) -> int:
    """The shortest valid video length (12n - 3) with a block after the one holding ``frame``."""
    step = 4 * FRAMES_PER_BLOCK
    return step * ((frame + 3) // step + 1) - 3


def _covering_length(frame: int) -> int:
    """What the nodes check a start frame against before the sampler's length is known: the shortest length holding
    it, at least 81 (so a message lists a few block starts, not 84), at most the longest video."""
    return min(schema.MAX_LENGTH, max(81, _shortest_length(frame)))


def start_frame_problem(start_frame) -> str | None:
    """Why SDVG Prompt Switch's ``start_frame`` cannot start a switch (``None`` when it can; a link passes)."""
    if start_frame is None:
        return None
    if isinstance(start_frame, bool) or not isinstance(start_frame, int):
        return f"start_frame must be a whole number, got {start_frame!r}"
    if start_frame < 0 or start_frame >= schema.MAX_LENGTH:
        return (f"start_frame {start_frame} is outside every video (frames 0..{schema.MAX_LENGTH - 1}); use the video "
                f"frame where the prompt starts, e.g. {block_start_frame(3)}")
    if start_frame == 0:
        return ("start_frame 0 is the opening prompt's (the sampler's positive and reward_prompt): a switch starts "
                f"at a later block, e.g. {block_start_frame(1)}, {block_start_frame(2)} or {block_start_frame(3)}")
    try:
        block_of_frame(start_frame, _covering_length(start_frame), FRAMES_PER_BLOCK, where="start_frame")
    except ValueError as e:
        return str(e)
    return None


def _check_previous(schedule, where: str) -> SDVGSchedule | None:
    if schedule is None:
        return None
    if not isinstance(schedule, SDVGSchedule):
        raise ValueError(f"{where}: expected the output of SDVG Prompt Schedule or SDVG Prompt Switch, got "
                         f"{type(schedule).__name__}; connect one of those nodes or leave the input empty")
    return schedule


def _merge(previous: SDVGSchedule | None, added: list[Switch], **settings) -> SDVGSchedule:
    """``previous``'s switches and ``added`` in frame order (a frame used twice is refused), with the settings."""
    switches = list(previous.switches if previous is not None else ()) + added
    switches.sort(key=lambda s: s.frame)
    for a, b in zip(switches, switches[1:]):
        if a.frame == b.frame:
            raise ValueError(f"two prompt switches start at frame {a.frame} ({a.source} and {b.source}); one prompt "
                             "per start frame: move or remove one")
    return SDVGSchedule(tuple(switches), **settings)


# -------------------------------------------------------------------------------------------------------- nodes
def encode_text(clip, text: str):
    """The CONDITIONING CLIPTextEncode makes of ``text`` with ``clip`` (ComfyUI's CLIP object)."""
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def schedule_node(text: str, target_after_switch: bool, switch_routing: str, clip=None,
                  schedule: SDVGSchedule | None = None) -> SDVGSchedule:
    """The work of SDVG Prompt Schedule: ``frame: prompt`` lines (only the switches: the sampler holds the opening
    prompt) encoded with ``clip``, added to ``schedule``'s switches, with the switch settings."""
    where = "SDVG Prompt Schedule"
    target_after_switch = check_bool("target_after_switch", target_after_switch)
    switch_routing = check_choice("switch_routing", switch_routing, SWITCH_ROUTING)
    previous = _check_previous(schedule, f"{where} schedule")
    if previous is not None and previous.settings_from:
        raise ValueError(f"{where}: the connected schedule comes from another SDVG Prompt Schedule node, which sets "
                         "target_after_switch and switch_routing already; put all lines in one SDVG Prompt Schedule, "
                         "or chain SDVG Prompt Switch nodes into its schedule input")
    if not isinstance(text, str):
        raise ValueError(f"{where} text: expected `frame: prompt` lines, got {type(text).__name__}")
    added = []
    if text.strip():
        if clip is None:
            raise ValueError(f"{where}: connect a clip (CLIPLoader with type 'wan') to encode the text's lines, or "
                             "leave the text empty and chain SDVG Prompt Switch nodes into the schedule input")
        # the lines hold only switches; frames are checked against the longest video here, against length at the sampler
        lines = parse_schedule(text, schema.MAX_LENGTH, FRAMES_PER_BLOCK, source=f"{where} text", opening=False)
        for block, prompt, reward in lines:
            frame = block_start_frame(block, FRAMES_PER_BLOCK)
            added.append(Switch(frame, encode_text(clip, prompt), reward, f"{where} line `{frame}: {prompt[:40]}`"))
    elif previous is None:
        raise ValueError(f"{where}: holds no switches; write `frame: prompt` lines (e.g. `45: the fox stops and looks "
                         "back`; the sampler's positive prompt opens the video) or chain SDVG Prompt Switch nodes into "
                         "the schedule input")
    return _merge(previous, added, target_after_switch=target_after_switch, switch_routing=switch_routing,
                  settings_from=where)


def switch_node(conditioning, start_frame: int, reward_prompt: str,
                schedule: SDVGSchedule | None = None) -> SDVGSchedule:
    """The work of SDVG Prompt Switch: one switch to ``conditioning`` at ``start_frame``, added to ``schedule``'s."""
    where = f"SDVG Prompt Switch at start_frame {start_frame}"
    problem = start_frame_problem(start_frame)
    if problem:
        raise ValueError(f"SDVG Prompt Switch: {problem}")
    if not isinstance(reward_prompt, str):
        raise ValueError(f"{where}: reward_prompt must be text, got {type(reward_prompt).__name__}")
    if conditioning is None:
        raise ValueError(f"{where}: connect the conditioning of the prompt the video switches to (CLIPTextEncode)")
    previous = _check_previous(schedule, f"{where}: schedule")
    settings = ({} if previous is None else
                dict(target_after_switch=previous.target_after_switch, switch_routing=previous.switch_routing,
                     settings_from=previous.settings_from))
    return _merge(previous, [Switch(int(start_frame), conditioning, reward_prompt.strip(), where)], **settings)


# ------------------------------------------------------------------------------------------------------ sampler
def engine_schedule(schedule: SDVGSchedule, opening, opening_prompt: str, *, length: int, frames_per_block: int,
                    text_dim: int, needs_prompt: bool, mode: str) -> list[tuple]:
    """The engine's ``prompt_schedule`` (``[(first_block, context, reward_prompt), ...]``) of a sampler run: the opening
    prompt at block 0, then ``schedule``'s switches, each checked against the run (errors name the sampler's
    ``prompt_schedule`` input, the switch and the fix)."""
    from .loaders import context_from_conditioning

    if not isinstance(schedule, SDVGSchedule):
        raise ValueError(f"prompt_schedule: expected the output of SDVG Prompt Schedule or SDVG Prompt Switch, got "
                         f"{type(schedule).__name__}; connect one of those nodes or leave the input empty")
    entries = [(0, opening, opening_prompt)]
    for switch in schedule.switches:
        where = f"prompt_schedule ({switch.source})"
        try:
            block = block_of_frame(switch.frame, length, frames_per_block, where=where)
        except ValueError as e:
            fix = (f"; raise the sampler's length to at least {_shortest_length(switch.frame)} or move the switch "
                   "earlier" if switch.frame >= length else "")
            raise ValueError(f"{e}{fix}") from None
        context = context_from_conditioning(switch.conditioning, text_dim=text_dim, name=where)
        if needs_prompt and not switch.reward_prompt.strip():
            raise ValueError(f"{where}: the reward prompt is empty, and mode {mode!r} scores drafts against it; type "
                             "the text the switch's conditioning was made from into its reward_prompt")
        entries.append((block, context, switch.reward_prompt))
    return entries
