"""The one checkpoint reader for the DiTs, the Wan VAE, ImageReward, text encoders and embeddings files.

Every failure is a :class:`CheckpointError` (a ``ValueError``) whose message names the file, what is
wrong and what to do, e.g. ``x.safetensors: the file is truncated or corrupt (...); copy or download
it again``. Nothing here executes pickled code (``torch.load(weights_only=True)``) or touches the network.

* :func:`read_tensor_file` reads a ``.safetensors`` file or a torch pickle into ``{key: tensor}`` plus
  the safetensors metadata, sniffing the content (a renamed file still reads) and unwrapping training
  checkpoints (``{"generator_ema": {...}}`` ...);
* :func:`check_tensors` refuses empty files and non-tensor entries;
* :func:`check_float_weights` refuses integer / bool weights (a quantized or corrupted export would
  otherwise load and produce garbage);
* :func:`check_finite` refuses NaN / inf values by tensor key;
* :func:`json_metadata` parses a JSON metadata entry, naming the file and key when it is broken.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

__all__ = ["CheckpointError", "missing_reason", "read_tensor_file", "check_tensors", "check_float_weights", "check_finite",
           "json_metadata", "sniff_format", "PICKLE_SUFFIXES"]

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
#: Training checkpoints keep the weights one level down; the first entry found wins (EMA before raw).
DEFAULT_ENTRIES = ("generator_ema", "generator", "state_dict", "model", "module")
_RECOPY = "copy or download it again"


class CheckpointError(ValueError):
    """A file that cannot be used; the message names the file, the key (when one is at fault) and the fix."""


def missing_reason(path: Path) -> str:
    """Why ``path`` does not exist as far as this process can tell: ``"not found"``, or a folder on the way
    that cannot be searched (``is_file()`` is then False for a file that is really there)."""
    probe = Path(os.path.abspath(path)).parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.is_dir() and not os.access(probe, os.X_OK):
        return f"cannot be reached: folder {probe} is not accessible (permission denied); fix its permissions"
    return "not found"


def _require_file(path: Path, what: str, hint: str) -> None:
    if not path.exists():
        reason = missing_reason(path)
        if reason != "not found":
            raise CheckpointError(f"{path}: {reason}")
        raise FileNotFoundError(f"{what} not found: {path}" + (f". {hint}" if hint else ""))
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder, expected a {what} file" + (f". {hint}" if hint else ""))
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file (a pipe, socket or device); save the {what} to a file first")
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except PermissionError as e:
        raise CheckpointError(f"{path}: cannot be read (permission denied); fix its permissions (chmod a+r)") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened ({e.strerror or e})") from e
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty (0 bytes): the copy or download did not finish; {_RECOPY}")


def sniff_format(path: Path) -> str:
    """``"safetensors"``, ``"pickle"`` or ``"unknown"`` from the first bytes (the suffix is only a tiebreak)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch zip archive / legacy pickle protocol 2+
        return "pickle"
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        return "safetensors"
    if suffix in PICKLE_SUFFIXES:
        return "pickle"
    return "unknown"


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - SafetensorError/OSError/ValueError/...: all re-raised with the file named
        raise CheckpointError(
            f"{path}: not a readable safetensors file, the file is truncated or corrupt "
            f"({type(e).__name__}: {e}); {_RECOPY}"
        ) from e
    return tensors, metadata


def _read_pickle(path: Path) -> object:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        pass  # mmap needs the zip format; old-style pickles load without it
    except Exception as e:  # noqa: BLE001 - UnpicklingError/EOFError/...: all re-raised with the file named
        raise _pickle_error(path, e) from e
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - as above
        raise _pickle_error(path, e) from e


def _pickle_error(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path}: cannot be read as a PyTorch checkpoint with weights_only=True ({type(e).__name__}: {_first_line(e)}); "
        f"the file may be truncated or corrupt ({_RECOPY}), or it holds Python objects (convert it to safetensors)"
    )


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # torch's weights_only failures wrap the culprit ("Unsupported operand 86", "Unsupported global: ...")
    # in generic paragraphs; keep the culprit line.
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [ln for ln in lines if not ln.startswith(("Weights only", "Please file", "Check the documentation"))] or lines
    return (lines[0] if lines else "")[:200]


def read_tensor_file(path: str | os.PathLike, *, what: str = "checkpoint", hint: str = "",
                     entries: Iterable[str] = DEFAULT_ENTRIES) -> tuple[dict, dict, str | None]:
    """Read ``path`` into ``(tensors, metadata, entry)``.

    ``entry`` is the wrapper key the weights came from (``"generator_ema"`` ...), else ``None``.
    Raises ``FileNotFoundError`` for a missing file, :class:`CheckpointError` for everything else.
    """
    path = Path(path).expanduser()
    _require_file(path, what, hint)
    kind = sniff_format(path)
    if kind == "unknown":
        raise CheckpointError(f"{path}: not a safetensors file or a PyTorch checkpoint (unknown content); "
                              f"give a .safetensors or .pt/.pth {what}")
    metadata: dict = {}
    entry = None
    if kind == "safetensors":
        state, metadata = _read_safetensors(path)
    else:
        obj = _read_pickle(path)
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{path}: expected a dict of tensors, found a {type(obj).__name__}")
        state = dict(obj)
        for name in entries:
            if isinstance(state.get(name), Mapping):
                state, entry = dict(state[name]), name
                break
    return state, metadata, entry


def check_tensors(state: Mapping, path, *, ignore: Callable[[str], bool] = lambda k: False) -> None:
    """Refuse a file with no tensors or with entries that are not tensors (listing their keys)."""
    if not state:
        raise CheckpointError(f"{path}: the file holds no tensors; {_RECOPY} or pick the right file")
    bad = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor) and not ignore(k))
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} entries are not tensors, e.g. {bad[:5]}; expected a plain state dict")


def check_float_weights(state: Mapping[str, torch.Tensor], path, *, allow: Callable[[str], bool] = lambda k: False) -> None:
    """Refuse integer or bool tensors among the weights (keys for which ``allow`` is true are exempt)."""
    bad = [(k, v.dtype) for k, v in state.items()
           if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()) and not allow(k)]
    if bad:
        key, dtype = bad[0]
        raise CheckpointError(
            f"{path}: tensor '{key}' is {str(dtype).replace('torch.', '')}, not floating point "
            f"({len(bad)} such tensors); model weights must be float32/bf16/fp16/fp8: this file is a quantized "
            "or corrupted export, use the original release"
        )


def check_finite(tensor: torch.Tensor, key: str, path, *, fix: str = "") -> None:
    """Refuse NaN / inf values in ``tensor`` (named ``key`` in ``path``)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int(torch.isinf(tensor).sum())
        raise CheckpointError(f"{path}: tensor '{key}' holds {n_nan} NaN and {n_inf} inf values"
                              + (f"; {fix}" if fix else "; regenerate the file"))


def json_metadata(raw: str, key: str, path) -> object:
    """Parse the JSON metadata entry ``key`` of ``path``."""
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: metadata '{key}' is not valid JSON ({e}); re-export the file or remove that entry") from e
