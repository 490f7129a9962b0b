"""Argument checks at the API boundary: one home for "is this value of the right type and range".

Each helper returns the value (converted where that is lossless) or raises ``ValueError`` naming the argument, the
value it got and what to pass instead. They run before any model loads; callers deeper in the engine then trust
their inputs. ``bool`` is not accepted where a number is due (``True`` is an ``int`` in Python, never a seed).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is checked: `sdvg --help` imports this module
    import torch


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(name: str, value, *, low: int | None = None, high: int | None = None, fix: str = "") -> int:
    """A whole number (a Python or NumPy int, never a bool, float or string) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number, got {_shown(value)} ({type(value).__name__})"
                         + (f"; {fix}" if fix else f"; pass e.g. {name}={int(low or 0)}"))
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else (f"<= {high}" if low is None else f"in {low}..{high}")
        raise ValueError(f"{name} must be a whole number {span}, got {value}" + (f"; {fix}" if fix else ""))
    return value


def check_optional_int(name: str, value, *, low: int | None = None, high: int | None = None,
                       fix: str = "") -> int | None:
    """``None`` or :func:`check_int`."""
    return None if value is None else check_int(name, value, low=low, high=high, fix=fix)


#: Seeds are what ``torch.Generator.manual_seed`` takes without wrapping: 0 .. 2**64 - 1.
SEED_MAX = 2**64 - 1


def check_seed(name: str, value) -> int:
    """A seed: a whole number in ``0 .. 2**64 - 1`` (torch's generator range; larger seeds would wrap or fail deep
    inside torch, and a negative one maps onto a large one)."""
    return check_int(name, value, low=0, high=SEED_MAX,
                     fix=f"pass a whole number from 0 to {SEED_MAX} (2**64 - 1), e.g. {name}=0")


def check_number(name: str, value, *, low: float | None = None, high: float | None = None, fix: str = "",
                 finite: bool = True) -> float:
    """A real number (int or float, never a bool or string), finite unless ``finite=False``, in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_shown(value)} ({type(value).__name__})"
                         + (f"; {fix}" if fix else ""))
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}" + (f"; {fix}" if fix else ""))
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low:g}" if high is None else (f"<= {high:g}" if low is None else f"in [{low:g}, {high:g}]")
        raise ValueError(f"{name} must be {span}, got {value}" + (f"; {fix}" if fix else ""))
    return value


def check_bool(name: str, value, *, fix: str = "") -> bool:
    """``True`` or ``False``, also as a NumPy bool or the whole numbers 0 and 1 (earlier releases ran with those); not
    a string such as ``'no'``, which Python would read as true, nor any other number."""
    if isinstance(value, bool):
        return value
    if (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")) or \
            (isinstance(value, numbers.Integral) and int(value) in (0, 1)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {_shown(value)} ({type(value).__name__})"
                     + (f"; {fix}" if fix else f"; pass {name}=True or {name}=False"))


def check_choice(name: str, value, choices) -> str:
    """One of ``choices`` (compared as given: no case folding)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {_shown(value)}")
    return value


def check_device(name: str, value) -> "torch.device":
    """A device this machine has: ``cpu``, ``cuda`` / ``cuda:N`` with CUDA present, ``mps`` where available.

    ``meta`` is accepted (the real-size dry run builds models there)."""
    import torch

    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:
            raise ValueError(f"{name}={value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    else:
        raise ValueError(f"{name} must be a device name such as 'cpu' or 'cuda', got {_shown(value)} "
                         f"({type(value).__name__})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={str(device)!r}, but this PyTorch sees no CUDA GPU; use 'cpu' (or install a CUDA "
                             "build of PyTorch on a machine with an NVIDIA GPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(device)!r}, but there are only {torch.cuda.device_count()} CUDA device(s); "
                             f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"{name}='mps', but MPS is not available here; use 'cpu'")
    elif device.type not in ("cpu", "meta"):
        raise ValueError(f"{name}={str(device)!r} is not supported; use 'cpu' or 'cuda'")
    return device


def check_path(name: str, value, what: str = "a checkpoint file") -> "str | os.PathLike":
    """``value`` is a path (``str`` or ``os.PathLike``); else a ValueError naming ``name``, the value and the fix."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise ValueError(f"{name} must be the path of {what} (a str or pathlib.Path), got {value!r}; "
                         f"pass e.g. {name}='models/{'drafter.safetensors' if 'checkpoint' in what else 'file'}'")
    return value


def check_exists(name: str, path) -> None:
    """``path`` exists (a file or a model folder); else ``FileNotFoundError`` naming the argument and the path.
    Nothing is ever downloaded, so a missing file is always the caller's to fix."""
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"{name}: no such file or folder: {os.fspath(path)!r} (nothing is downloaded: "
                                   "check the path)", os.fspath(path))
