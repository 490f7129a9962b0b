"""``sdvg``: inspect checkpoints, encode prompts, generate videos (headless, batch-friendly).

    sdvg inspect PATH
    sdvg encode-prompts --text-encoder PATH [--tokenizer DIR] --prompts-file F --out embeds.safetensors
    sdvg generate --drafter D --target T --vae V [--reward R] (--prompt P | --prompts-file F | --prompt-schedule F) ...

Failures are one line on stderr naming the argument or file, what is wrong and the fix, with exit
status 2 (130 after Ctrl-C); ``--debug`` adds the traceback. Every argument and output path is checked
(the table :data:`ARG_CHECKS`, then :func:`plan_generate_outputs`) before any model is loaded, outputs
are written to a temporary name and renamed, and nothing existing is replaced without ``--overwrite``.

One module per command (``inspect``, ``encode_prompts``, ``generate``, ``bench``); ``args`` holds the parser,
``arg_checks`` the argument types and the validation table, ``outputs`` the output paths, manifest and atomic
writes, ``prompts`` the prompt reading, ``entry`` :func:`main`.

This package imports its names on first use (PEP 562): the ``sdvg`` script's ``from sdvg_engine.cli import main``
imports nothing else, so a Ctrl-C in the first moments is caught by :func:`main` as one line, not a traceback.
"""

import sys
from importlib import import_module

#: public name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(("ARG_CHECKS", "ArgCheck", "arg_check", "finite_float", "join_negative_values", "options_of",
                     "parse_taus", "peek_context_scheme", "tau_value", "validate_args"), ".arg_checks"),
    **dict.fromkeys(("BENCH_TAUS", "build_parser", "resolve_device", "resolve_router_defaults"), ".args"),
    "cmd_bench": ".bench",
    "UsageError": ".common",
    "cmd_encode_prompts": ".encode_prompts",
    "EXPECTED_ERRORS": ".entry",
    **dict.fromkeys(("block_verdict", "build_pipeline", "cmd_generate", "generator_kwargs", "router_kwargs"),
                    ".generate"),
    "cmd_inspect": ".inspect",
    "cmd_export_comfy": ".export_comfy",
    **dict.fromkeys(("MANIFEST", "check_manifest", "check_output_file", "plan_generate_outputs", "write_manifest",
                     "write_text_atomic", "written_by_earlier_run"), ".outputs"),
    **dict.fromkeys(("_contexts", "_read_prompts", "plan_prompts", "read_prompt_schedule"), ".prompts"),  # tests
}

__all__ = sorted(["main", *(n for n in _EXPORTS if not n.startswith("_"))])


def main(argv=None) -> int:
    """Run one ``sdvg`` command (see :func:`sdvg_engine.cli.entry.main`); a Ctrl-C while the CLI itself is still
    importing exits 130 with one line too."""
    try:
        from .entry import main as run
    except KeyboardInterrupt:
        print("sdvg: interrupted (Ctrl-C); no output was left half-written", file=sys.stderr, flush=True)
        return 130
    return run(argv)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
