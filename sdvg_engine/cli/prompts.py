"""The prompts of a run (``--prompt``, ``--prompts-file``, ``--context-file``, ``--prompt-schedule``), read and checked
without a model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .arg_checks import REFERENCE_MODES, options_of
from .common import UsageError

if TYPE_CHECKING:
    import torch


def _read_prompts(args) -> list[str]:
    prompts = []
    if getattr(args, "prompt", None) is not None:
        prompts.append(args.prompt)
    if getattr(args, "prompts_file", None):
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts-file {path}: not found or not a file")
        try:
            text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first prompt
        except UnicodeDecodeError:
            raise UsageError(f"--prompts-file {path}: not a UTF-8 text file (one prompt per line)") from None
        from_file = [line.strip() for line in text.splitlines() if line.strip()]
        if not from_file:
            # Never "no prompts, so all of --context-file": an empty list is a mistake to report.
            raise UsageError(f"--prompts-file {path}: holds no prompts (one per line); add prompts or drop the flag")
        prompts += from_file
    return prompts



#: latent frames per block of the CLI's models (Wan2.1 causal DiTs: 3, as :func:`cmd_generate` counts blocks)
FRAMES_PER_BLOCK = 3


def read_prompt_schedule(args) -> list[tuple[int, str, str]] | None:
    """``--prompt-schedule FILE`` read and checked without a model: ``[(first_block, prompt, reward_prompt), ...]``
    (:func:`sdvg_engine.prompt_schedule.parse_schedule`, whose errors name the file and the line or entry), or
    ``None`` without the flag. Refuses a missing or unreadable file, and what the run could not follow."""
    given = getattr(args, "prompt_schedule", None)
    if given is None:
        return None
    flag = f"--prompt-schedule {given}"
    path = Path(given).expanduser()
    if not path.exists():
        raise UsageError(f"{flag}: not found; check the path (a text file of `frame: prompt` lines or JSON)")
    if not path.is_file():
        raise UsageError(f"{flag}: is not a file; give a text file of `frame: prompt` lines or JSON")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first line
    except UnicodeDecodeError:
        raise UsageError(f"{flag}: not a UTF-8 text file; write `frame: prompt` lines or JSON") from None
    except OSError as err:
        raise UsageError(f"{flag}: cannot be read ({err.strerror or err}); check its permissions") from None
    from ..prompt_schedule import parse_schedule

    try:
        schedule = parse_schedule(text, args.frames, FRAMES_PER_BLOCK, source=flag)
    except ValueError as err:
        raise UsageError(str(err)) from None
    options = options_of(args)
    if options.scores_drafts:
        empty = [i for i, (_, _, reward) in enumerate(schedule) if not reward.strip()]
        if empty:  # only JSON can say so ("reward_prompt": ""); a line's reward prompt is its prompt
            raise UsageError(f"{flag} entry {empty[0] + 1}: the reward_prompt is empty, and {_scoring_mode(args)} "
                             "scores drafts against it (ImageReward); give it text or leave it out (it defaults to "
                             "the prompt)")
        if (len(schedule) > 1 and getattr(args, "tau_mode", None) in REFERENCE_MODES
                and options.switch_routing == "reset" and not options.target_after_switch):
            raise UsageError(f"--no-target-after-switch: with --tau-mode {args.tau_mode} and --switch-routing reset "
                             f"each draft is compared with the blocks made since the last prompt switch of {flag}, and "
                             "the first block after a switch has none; drop --no-target-after-switch, or use "
                             "--switch-routing carry or --tau-mode fixed")
    return schedule


def _scoring_mode(args) -> str:
    mode = getattr(args, "mode", "sdvg")
    return f"--mode {mode}" + (" with --schedule-veto" if mode == "schedule" else "")


def plan_prompts(args, schedule=None) -> tuple[list[str], list[tuple[str, torch.Tensor]] | None]:
    """The prompts of the run, read without loading a model: ``(prompts, pairs from --context-file or None)``.
    With ``--prompt-schedule`` (``schedule``: what :func:`read_prompt_schedule` returned, read here if not given)
    the prompts are the schedule's distinct prompts, in order (each is encoded once).

    Refuses (before anything loads) an empty prompt list, prompts missing from the context file, a
    text-encoder-less run, and an empty prompt when drafts are scored (``sdvg``, ``schedule`` with its veto): it
    would score against nothing.
    """
    from ..text_encoder import load_prompt_embeddings

    if schedule is None:
        schedule = read_prompt_schedule(args)
    scheduled = schedule is not None
    pairs = None
    if args.context_file:
        pairs = load_prompt_embeddings(args.context_file)
        wanted = _schedule_prompts(schedule) if scheduled else _read_prompts(args)
        if wanted:
            by_prompt = dict(pairs)
            missing = [p for p in wanted if p not in by_prompt]
            if missing:
                if scheduled:
                    raise UsageError(f"--context-file {args.context_file}: has no embeddings for the prompts "
                                     f"{missing[:3]} of --prompt-schedule {args.prompt_schedule}; encode them with "
                                     "`sdvg encode-prompts` (or give --text-encoder instead of --context-file)")
                raise UsageError(f"--context-file {args.context_file}: has no embeddings for {missing[:3]}; encode them "
                                 "with `sdvg encode-prompts` or drop --prompt/--prompts-file")
            pairs = [(p, by_prompt[p]) for p in wanted]
        prompts = [p for p, _ in pairs]
    else:
        prompts = _schedule_prompts(schedule) if scheduled else _read_prompts(args)
        if not prompts:
            raise UsageError("--prompt/--prompts-file/--context-file: no prompts; give one of them")
        if not args.text_encoder:
            raise UsageError("--text-encoder: prompts need a text encoder (with --tokenizer for a single file), "
                             "or give --context-file")
    if options_of(args).scores_drafts:
        empty = [i for i, p in enumerate(prompts) if not p.strip()]
        if empty:
            where = f"--context-file {args.context_file}" if args.context_file else "--prompt"
            raise UsageError(f"{where}: prompt {empty[0]} is empty; {_scoring_mode(args)} scores drafts against the "
                             "prompt (ImageReward), so give a non-empty prompt or use another --mode")
    return prompts, pairs


def _schedule_prompts(schedule) -> list[str]:
    """The distinct prompts of a schedule, in order of first use: what is encoded (once each) or looked up."""
    return list(dict.fromkeys(prompt for _, prompt, _ in schedule))


def schedule_entries(schedule, contexts) -> list[tuple[int, torch.Tensor, str]]:
    """The pipeline's ``prompt_schedule``: ``[(first_block, embeddings, reward_prompt), ...]`` from
    :func:`read_prompt_schedule`'s entries and the ``(prompt, embeddings)`` pairs of :func:`_contexts`."""
    by_prompt = dict(contexts)
    return [(block, by_prompt[prompt], reward) for block, prompt, reward in schedule]


def _contexts(args, plan=None) -> list[tuple[str, torch.Tensor]]:
    from ..loaders import parse_dtype
    from ..text_encoder import load_text_encoder

    prompts, pairs = plan or plan_prompts(args)
    if pairs is not None:
        return pairs
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.aux_device or args.device,
                                dtype=parse_dtype(args.dtype))
    return [(p, encoder.encode(p)) for p in prompts]

