"""``sdvg encode-prompts``: encode prompts with UMT5-XXL into an embeddings file."""

from __future__ import annotations

from pathlib import Path

from .common import UsageError, _print_err
from .outputs import check_output_file
from .prompts import _read_prompts


def cmd_encode_prompts(args) -> int:
    from ..loaders import parse_dtype
    from ..text_encoder import load_text_encoder, save_prompt_embeddings

    prompts = _read_prompts(args)
    if not prompts or not all(p.strip() for p in prompts):
        raise UsageError("--prompt/--prompts-file: no (non-empty) prompts; give --prompt TEXT or --prompts-file F")
    out = Path(args.out).expanduser()
    check_output_file(out, "--out", overwrite=args.overwrite)
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.device, dtype=parse_dtype(args.dtype))
    contexts = []
    for i, prompt in enumerate(prompts):
        contexts.append(encoder.encode(prompt))
        _print_err(f"encoded {i + 1}/{len(prompts)}: {prompt[:70]}")
    save_prompt_embeddings(out, prompts, contexts)  # temporary file + rename
    print(f"wrote {len(prompts)} prompt embeddings to {out}")
    return 0

