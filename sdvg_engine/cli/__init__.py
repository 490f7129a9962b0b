"""``sdvg``: inspect checkpoints, encode prompts, generate videos (headless, batch-friendly).

    sdvg inspect PATH
    sdvg encode-prompts --text-encoder PATH [--tokenizer DIR] --prompts-file F --out embeds.safetensors
    sdvg generate --drafter D --target T --vae V [--reward R] (--prompt P | --prompts-file F) ...

Failures are one line on stderr naming the argument or file, what is wrong and the fix, with exit
status 2 (130 after Ctrl-C); ``--debug`` adds the traceback. Every argument and output path is checked
(the table :data:`ARG_CHECKS`, then :func:`plan_generate_outputs`) before any model is loaded, outputs
are written to a temporary name and renamed, and nothing existing is replaced without ``--overwrite``.

One module per command (``inspect``, ``encode_prompts``, ``generate``, ``bench``); ``args`` holds the parser,
``arg_checks`` the argument types and the validation table, ``outputs`` the output paths, manifest and atomic
writes, ``prompts`` the prompt reading, ``entry`` :func:`main`.
"""

from .arg_checks import (ARG_CHECKS, ArgCheck, arg_check, finite_float, join_negative_values, options_of, parse_taus,
                         peek_context_scheme, tau_value, validate_args)
from .args import BENCH_TAUS, build_parser, resolve_device, resolve_router_defaults
from .bench import cmd_bench
from .common import UsageError
from .encode_prompts import cmd_encode_prompts
from .entry import EXPECTED_ERRORS, main
from .generate import block_verdict, build_pipeline, cmd_generate, generator_kwargs, router_kwargs
from .inspect import cmd_inspect
from .outputs import (MANIFEST, check_manifest, check_output_file, plan_generate_outputs, write_manifest,
                      write_text_atomic, written_by_earlier_run)
from .prompts import _contexts, _read_prompts, plan_prompts  # noqa: F401 - imported from here by tests

__all__ = ["ARG_CHECKS", "ArgCheck", "BENCH_TAUS", "EXPECTED_ERRORS", "MANIFEST", "UsageError", "arg_check",
           "block_verdict", "build_parser", "build_pipeline", "check_manifest", "check_output_file", "cmd_bench", "cmd_encode_prompts", "cmd_generate",
           "cmd_inspect", "finite_float", "generator_kwargs", "join_negative_values", "main", "options_of", "parse_taus",
           "peek_context_scheme", "plan_generate_outputs", "plan_prompts", "resolve_device", "resolve_router_defaults", "router_kwargs",
           "tau_value", "validate_args", "write_manifest", "write_text_atomic", "written_by_earlier_run"]
