"""The replay key: what must be equal for a run to reuse the blocks of an earlier one (see :mod:`sdvg_engine.memo`).

Every input that can change an output is part of the key; the router's tau settings and the workers are not (a replay
re-decides the recorded scores under the new tau, and every worker layout gives bit-identical outputs).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import torch

__all__ = ["replay_key", "model_identity", "weights_fingerprint"]


def replay_key(pipe, prompt_embeds, prompt, num_frames, width, height, seed, opts, devices) -> tuple:
    """The memo key of a run of ``pipe`` (a :class:`SpeculativePipeline`): every input of a run except the router's tau settings (tau, tau mode, target rate, prior) and the
    workers, which do not change outputs."""
    text = prompt_embeds.detach().float().cpu().contiguous()
    options = asdict(opts)
    models = tuple(model_identity(g) for g in (pipe.drafter, pipe.target))
    router = None
    if pipe.router is not None:
        router = tuple(sorted((k, str(v)) for k, v in pipe.router.settings().items()
                              if k not in ("tau", "tau_mode", "accept_rate", "prior_mean", "prior_std", "prior_count")))
        # Relative recordings hold the scores of committed target blocks, which other modes never compute.
        router += (id(pipe.router.scorer), pipe.router.tau_mode == "relative")
    vae = (id(pipe.vae.vae) if hasattr(pipe.vae, "vae") else id(pipe.vae), str(getattr(pipe.vae, "dtype", "")))
    return (hashlib.sha256(text.numpy().tobytes()).hexdigest(), tuple(text.shape), prompt, num_frames, width, height,
            seed, tuple(sorted(options.items())), models, router, vae, tuple(sorted((k, str(v)) for k, v in devices.items())))



def model_identity(gen) -> tuple:
    """Which weights, schedule and context a generator runs.

    The weights are identified by content (:func:`weights_fingerprint`), not by storage: ComfyUI loads models under
    ``torch.inference_mode()`` (inference tensors have no version counter) and moves them between devices between
    queues (new storage, same weights)."""
    weights = weights_fingerprint(gen.model)
    context = tuple(sorted((k, str(v)) for k, v in vars(gen.context).items() if isinstance(v, (int, float, str, type(None)))
                           and k in ("max_frames", "context_frames", "attention_bias")))
    kv_dtype = str(getattr(gen.model, "kv_cache_dtype", None) or getattr(gen.model, "compute_dtype", ""))
    return (id(gen.model), weights, gen.schedule.timesteps, gen.schedule.shift, kv_dtype, gen.context.name, context,
            gen.frames_per_block)


def weights_fingerprint(model: torch.nn.Module, samples: int = 512) -> tuple:
    """Shape, dtype and a hash of ``samples`` evenly strided values of the first, middle and last parameter: the same
    for the same weights on any device (and under inference mode), different after a reload of other weights or an
    in-place change of those tensors. Costs three small device-to-host copies."""
    params = list(model.parameters())
    if not params:
        return ()
    picked = {0: params[0], len(params) // 2: params[len(params) // 2], len(params) - 1: params[-1]}
    out = []
    for i, p in sorted(picked.items()):
        flat = p.data.reshape(-1)  # .data: no version counter involved, whatever mode made the tensor
        if flat.is_meta:
            digest = "meta"
        else:
            values = flat[:: max(1, flat.numel() // samples)][:samples].float().cpu()
            digest = hashlib.sha1(values.numpy().tobytes()).hexdigest()
        out.append((i, tuple(p.shape), str(p.dtype), digest))
    return tuple(out)
