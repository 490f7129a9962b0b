"""The prompts of a run (``--prompt``, ``--prompts-file``, ``--context-file``), read and checked without a model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .arg_checks import options_of
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



def plan_prompts(args) -> tuple[list[str], list[tuple[str, torch.Tensor]] | None]:
    """The prompts of the run, read without loading a model: ``(prompts, pairs from --context-file or None)``.

    Refuses (before anything loads) an empty prompt list, prompts missing from the context file, a
    text-encoder-less run, and an empty prompt when drafts are scored (``sdvg``, ``schedule`` with its veto): it
    would score against nothing.
    """
    from ..text_encoder import load_prompt_embeddings

    pairs = None
    if args.context_file:
        pairs = load_prompt_embeddings(args.context_file)
        wanted = _read_prompts(args)
        if wanted:
            by_prompt = dict(pairs)
            missing = [p for p in wanted if p not in by_prompt]
            if missing:
                raise UsageError(f"--context-file {args.context_file}: has no embeddings for {missing[:3]}; encode them "
                                 "with `sdvg encode-prompts` or drop --prompt/--prompts-file")
            pairs = [(p, by_prompt[p]) for p in wanted]
        prompts = [p for p, _ in pairs]
    else:
        prompts = _read_prompts(args)
        if not prompts:
            raise UsageError("--prompt/--prompts-file/--context-file: no prompts; give one of them")
        if not args.text_encoder:
            raise UsageError("--text-encoder: prompts need a text encoder (with --tokenizer for a single file), "
                             "or give --context-file")
    if options_of(args).scores_drafts:
        empty = [i for i, p in enumerate(prompts) if not p.strip()]
        if empty:
            where = f"--context-file {args.context_file}" if args.context_file else "--prompt"
            mode = getattr(args, "mode", "sdvg")
            how = f"--mode {mode}" + (" with --schedule-veto" if mode == "schedule" else "")
            raise UsageError(f"{where}: prompt {empty[0]} is empty; {how} scores drafts against the prompt "
                             "(ImageReward), so give a non-empty prompt or use another --mode")
    return prompts, pairs


def _contexts(args, plan=None) -> list[tuple[str, torch.Tensor]]:
    from ..loaders import parse_dtype
    from ..text_encoder import load_text_encoder

    prompts, pairs = plan or plan_prompts(args)
    if pairs is not None:
        return pairs
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.aux_device or args.device,
                                dtype=parse_dtype(args.dtype))
    return [(p, encoder.encode(p)) for p in prompts]

