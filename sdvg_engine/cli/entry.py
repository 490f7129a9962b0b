"""``sdvg``'s entry point: parse, check, run one command; failures in one line."""

from __future__ import annotations

import sys

import torch

from .arg_checks import join_negative_values, validate_args
from .args import build_parser
from .common import _print_err


#: Failures that are the user's input or environment: reported in one line, exit status 2 (plus the
#: pipeline's NonFiniteOutputError, see :func:`_expected_errors`).
EXPECTED_ERRORS = (ValueError, OSError)


def _expected_errors() -> tuple:
    """:data:`EXPECTED_ERRORS` and the pipeline's refusal of a NaN/inf block (imported only when something failed)."""
    from .. import pipeline

    extra = getattr(pipeline, "NonFiniteOutputError", None)
    return EXPECTED_ERRORS + ((extra,) if extra is not None else ())


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename and str(err.filename) not in str(err.args[-1] if err.args else ""):
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) or type(err).__name__
    if isinstance(err, KeyError):  # str(KeyError) is the quoted key alone
        text = f"missing key {text}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv=None) -> int:
    """Run one command; returns the exit status (0, 2 for any failure, 130 after Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = join_negative_values([a for a in argv if a != "--debug"])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a one-line usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        validate_args(args)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: interrupted (Ctrl-C); no output was left half-written")
        return 130
    except torch.OutOfMemoryError as err:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: error: out of memory ({_one_line(err)[:200]}); lower --width/--height/--frames, "
                   "use --fp8-target, or put the drafter/VAE on another device (--drafter-device/--aux-device)")
        return 2
    except _expected_errors() as err:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: error: {_one_line(err)}")
        return 2

