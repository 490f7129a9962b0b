"""``sdvg``'s entry point: parse, check, run one command; failures in one line, Ctrl-C at any moment exit status 130.

Nothing heavy is imported at module level here or in the parser: torch, diffusers and the models are imported by the
command that runs, inside :func:`main`'s Ctrl-C handling, so an interrupt while they import (the first seconds) is
one line, not a traceback.
"""

from __future__ import annotations

import signal
import sys
import threading

from .arg_checks import join_negative_values, validate_args
from .args import build_parser
from .common import CTRL_C, _print_err, raise_if_interrupted, raise_interrupt

#: Failures that are the user's input or environment: reported in one line, exit status 2 (plus the
#: pipeline's NonFiniteOutputError and torch's out-of-memory error, see :func:`main`).
EXPECTED_ERRORS = (ValueError, OSError)

COMMANDS = ("inspect", "encode-prompts", "export-comfy", "generate", "bench")
#: exit status after Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130


def _expected_errors() -> tuple:
    """:data:`EXPECTED_ERRORS` and the pipeline's refusal of a NaN/inf block (a light import: sdvg_engine.options)."""
    from ..options import NonFiniteOutputError

    return EXPECTED_ERRORS + (NonFiniteOutputError,)


def _out_of_memory_error() -> type:
    """torch's OutOfMemoryError when torch is loaded (nothing else can raise it); never imports torch for an error."""
    torch = sys.modules.get("torch")
    return getattr(torch, "OutOfMemoryError", _NeverRaised) if torch is not None else _NeverRaised


class _NeverRaised(Exception):
    pass


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename and str(err.filename) not in str(err.args[-1] if err.args else ""):
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) or type(err).__name__
    if isinstance(err, KeyError):  # str(KeyError) is the quoted key alone
        text = f"missing key {text}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _catch_sigint():
    """Make Ctrl-C raise KeyboardInterrupt (caught by :func:`main`) from now on; returns the handler to restore, or
    None where signals cannot be set (not the main thread). A SIGINT the caller chose to ignore stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    CTRL_C.clear()
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, raise_interrupt)
    return previous


def main(argv=None) -> int:
    """Run one command; returns the exit status (0, 2 for any failure, 130 after Ctrl-C)."""
    previous = _catch_sigint()  # first of all: before any heavy import a command may make
    command = "sdvg"
    debug = False

    def report(message: str) -> None:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(message)

    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        command = " ".join(["sdvg", *[a for a in argv if a in COMMANDS][:1]])  # named even before parsing ends
        debug = "--debug" in argv
        argv = join_negative_values([a for a in argv if a != "--debug"])
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # argparse: --help (0) or a one-line usage error (2)
            return exit_.code if isinstance(exit_.code, int) else 2
        command = f"sdvg {args.command}"
        try:
            validate_args(args)
            status = args.func(args)
            raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt a library swallowed is still a Ctrl-C
            return status
        except _out_of_memory_error() as err:
            report(f"{command}: error: out of memory ({_one_line(err)[:200]}); lower --width/--height/--length, use "
                   "--fp8-target or --vram-gb, or put the drafter/VAE on another device (--drafter-device/--aux-device)")
            return 2
        except _expected_errors() as err:
            report(f"{command}: error: {_one_line(err)}")
            return 2
    except KeyboardInterrupt:
        if previous is not None:  # a second Ctrl-C while this line is printed must not become a traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        report(f"{command}: interrupted (Ctrl-C); no output was left half-written")
        return INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
