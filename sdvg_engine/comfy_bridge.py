"""Engine-side helpers for host applications such as ComfyUI (which this module never imports).

* :class:`ModuleHolder`: a plain ``nn.Module`` around a model, for memory managers that write a
  ``device`` attribute onto the module they manage (ComfyUI's ``ModelPatcher`` does; diffusers models
  have a read-only ``device`` property).

The VAE of a host (ComfyUI's ``WanVAE`` uses the original Wan key layout) becomes a streaming decoder
with :func:`sdvg_engine.vae.wan_vae_from_state_dict` (``copy=True``).
"""

from __future__ import annotations

import torch

__all__ = ["ModuleHolder"]


class ModuleHolder(torch.nn.Module):
    """Holds ``module`` as a submodule and has a writable ``device`` attribute.

    A memory manager may move the holder (``holder.to(device)`` moves the wrapped module) and record
    where it put it in ``holder.device``; code using the wrapped module keeps reading the module's
    own device from its parameters.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device | str | None = None):
        super().__init__()
        self.module = module
        first = next(iter(module.parameters()), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))

    def forward(self, *args, **kwargs):  # pragma: no cover - never called by the pipeline
        return self.module(*args, **kwargs)
