"""What every ``sdvg`` command shares: the usage error and stderr printing."""

from __future__ import annotations

import sys
import threading

#: set by the CLI's SIGINT handler (:func:`raise_interrupt`) and kept: a library's broad ``except`` around code that
#: runs while torch and diffusers import may swallow the KeyboardInterrupt, never this flag
CTRL_C = threading.Event()


def raise_interrupt(signum, frame):
    """The CLI's SIGINT handler: remember the Ctrl-C, then raise KeyboardInterrupt as Python's own handler does."""
    CTRL_C.set()
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came and its KeyboardInterrupt was swallowed on the way."""
    if CTRL_C.is_set():
        raise KeyboardInterrupt


def _print_err(*args):
    print(*args, file=sys.stderr, flush=True)


class UsageError(ValueError):
    """A bad command-line argument; the message starts with the flag and its value."""
