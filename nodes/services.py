"""What the node logic needs from its host, as one object: devices, the memory manager, progress, the interrupt flag
and the model folders (:class:`Services`), with the checks of what a node input may name (model files, devices).

The default :class:`Services` is plain PyTorch on the CPU (or wherever models are asked to go), so the tests and
scripts run the exact code the nodes run; ``comfy_nodes.ComfyServices`` is ComfyUI's.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

import torch

from . import schema

__all__ = ["Services", "check_model_name", "combo_options", "resolve_devices"]


class _PlainPatcher:
    """Stand-in for ComfyUI's ModelPatcher outside ComfyUI: ``load()`` moves the module to its device."""

    def __init__(self, holder: torch.nn.Module, load_device: torch.device, offload_device: torch.device):
        self.model, self.load_device, self.offload_device = holder, load_device, offload_device

    def load(self) -> None:
        self.model.to(self.load_device)
        self.model.device = self.load_device


class Services:
    """What the node logic needs from its host. This default is plain PyTorch (tests, scripts).

    Args:
        folders: model folder name -> directories, for :meth:`list_files` / :meth:`resolve`.
        device: the main compute device (``auto``).
    """

    def __init__(self, folders: dict[str, list[str]] | None = None, device: str | torch.device = "cpu"):
        self.folders = {k: [str(p) for p in v] for k, v in (folders or {}).items()}
        self._device = torch.device(device)

    # devices
    def main_device(self) -> torch.device:
        return self._device

    def offload_device(self) -> torch.device:
        return torch.device("cpu")

    def intermediate_device(self) -> torch.device:
        return torch.device("cpu")

    def cuda_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    # memory management
    def wrap(self, holder: torch.nn.Module, load_device: torch.device, offload_device: torch.device):
        """A memory-manager handle for ``holder`` (ComfyUI: a ModelPatcher)."""
        return _PlainPatcher(holder, load_device, offload_device)

    def load(self, patchers: list) -> None:
        """Put the models on their compute devices before sampling."""
        for p in patchers:
            p.load()

    def load_run(self, patchers: list, memory_required: int = 0) -> None:
        """Load every model of one run at once, reserving ``memory_required`` bytes beside the weights for what the
        memory manager cannot see (KV caches, activations: :func:`run_memory_required`). Default: :meth:`load`
        (hosts without a memory budget; subclasses that override only :meth:`load` keep working)."""
        self.load(patchers)

    # run control
    def check_interrupt(self) -> None:
        """Raise to stop the run (called before every model call)."""

    def progress(self, value: int, total: int, preview=None) -> None:
        """Report ``value`` of ``total`` blocks done, with a PIL preview of the newest frame."""

    def activity(self, text: str) -> None:
        """Say what the running node is doing now ("drafting block 2/7"); may be called from worker threads."""

    # model files
    def list_files(self, folders: Iterable[str]) -> list[str]:
        names: list[str] = []
        for folder in folders:
            for root in self.folders.get(folder, []):
                if os.path.isdir(root):
                    for dirpath, _, files in os.walk(root):
                        for f in files:
                            names.append(os.path.relpath(os.path.join(dirpath, f), root))
        return sorted(dict.fromkeys(names))

    def resolve(self, folders: Iterable[str], name: str) -> str:
        folders = list(folders)
        check_model_name(name, folders)
        for folder in folders:
            for root in self.folders.get(folder, []):
                path = os.path.join(root, name)
                # By name only: symlinked model files (common for large weights) stay usable.
                if not _inside(path, root):
                    raise ValueError(f"model file {name!r} resolves outside the {folder!r} folder {root}; "
                                     "pick a file inside ComfyUI's model folders")
                if os.path.isfile(path) or os.path.isdir(path):
                    return path
        raise FileNotFoundError(f"model file {name!r} not found in the folders {folders}")


def _inside(path: str, root: str) -> bool:
    root = os.path.abspath(root)
    return os.path.commonpath([os.path.abspath(path), root]) == root


def check_model_name(name: str, folders: Iterable[str] = ()) -> str:
    """Refuse a model file name that could leave ComfyUI's model folders (absolute, ``..``, empty).

    Node inputs are names relative to a models/ folder (``sub/dir/file.safetensors``); anything else
    would let a workflow read arbitrary files.
    """
    where = f" in {list(folders)}" if folders else ""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model file name is empty; pick a file{where} (ComfyUI models/ folders)")
    if "\x00" in name:
        raise ValueError(f"model file name {name!r} contains a NUL byte; pick a file{where}")
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ValueError(f"model file {name!r} is an absolute path; give a name relative to the model folders{where} "
                         "(put the file in ComfyUI/models/... or list its folder in extra_model_paths.yaml)")
    if ".." in parts:
        raise ValueError(f"model file {name!r} contains '..'; give a name inside the model folders{where} "
                         "(put the file in ComfyUI/models/... or list its folder in extra_model_paths.yaml)")
    return name


def combo_options(spec: schema.InputSpec, services: Services) -> list:
    """The values a combo input offers now (static options, model files or devices)."""
    if spec.options:
        return list(spec.options)
    if spec.options_from and spec.options_from[0] == "files":
        return services.list_files(spec.options_from[1:])
    if spec.options_from == (schema.DEVICES,):
        return schema.device_options(services.cuda_count())
    raise ValueError(f"input {spec.name!r} has no options")


def resolve_devices(device: str, services: Services) -> tuple[torch.device, torch.device]:
    """``(load_device, offload_device)`` for a loader's device choice: ``auto`` or one of the devices the node's
    combo lists here (``cpu``, ``cuda:N`` for each visible GPU); anything else is refused by name."""
    if device == "auto":
        load = services.main_device()
    else:
        options = schema.device_options(services.cuda_count())
        if not isinstance(device, str) or device not in options:
            if isinstance(device, str) and re.fullmatch(r"cuda:\d+", device):
                raise ValueError(f"device {device!r} does not exist: {services.cuda_count()} CUDA device(s) visible; "
                                 f"pick one of {options}")
            raise ValueError(f"device must be one of {options} on this machine, got {device!r}; pick 'auto' (ComfyUI's "
                             "main device) or one listed")
        load = torch.device(device)
    offload = torch.device("cpu") if load.type == "cpu" else services.offload_device()
    return load, offload
