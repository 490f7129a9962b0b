"""What every ``sdvg`` command shares: the usage error and stderr printing."""

from __future__ import annotations

import sys


def _print_err(*args):
    print(*args, file=sys.stderr, flush=True)


class UsageError(ValueError):
    """A bad command-line argument; the message starts with the flag and its value."""
