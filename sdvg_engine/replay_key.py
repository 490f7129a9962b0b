"""The replay key: what must be equal for a run to reuse the blocks of an earlier one (see :mod:`sdvg_engine.memo`).

Every input that can change an output is part of the key; the router's tau settings and the workers are not (a replay
re-decides the recorded scores under the new tau, and every worker layout gives bit-identical outputs).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import torch

__all__ = ["replay_key", "model_identity", "scorer_identity", "weights_fingerprint"]


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
        router += (pipe.router.tau_mode if pipe.router.uses_reference else None, scorer_identity(pipe.router.scorer))
    vae_module = pipe.vae.vae if hasattr(pipe.vae, "vae") else pipe.vae
    # The VAE decodes every frame (and encodes a recompute window's anchor): its weights by content, like the models'.
    vae = (id(vae_module), str(getattr(pipe.vae, "dtype", "")),
           weights_fingerprint(vae_module) if isinstance(vae_module, torch.nn.Module) else None)
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
    # Both: an fp8 KV cache keeps its dtype when the compute dtype changes (and the weights' dtype may not be it).
    kv_dtype = (str(getattr(gen.model, "kv_cache_dtype", None)), str(getattr(gen.model, "compute_dtype", "")))
    # A host's model (a ComfyUI MODEL) may apply patches per call (LoRA on a low-VRAM load) that leave every
    # parameter as it was: it says itself what else decides its outputs.
    host = gen.model.sdvg_identity() if hasattr(gen.model, "sdvg_identity") else None
    return (id(gen.model), weights, gen.schedule.timesteps, gen.schedule.shift, kv_dtype, gen.context.name, context,
            gen.frames_per_block, host)


def scorer_identity(scorer) -> tuple:
    """Which reward model scores the drafts: the scorer object, its network's weights by content (an in-place change
    or a reload of other weights changes every score) and its batch size (another batching, other float sums)."""
    model = getattr(scorer, "model", None)
    weights = weights_fingerprint(model) if isinstance(model, torch.nn.Module) else None
    return (id(scorer), weights, getattr(scorer, "batch_size", None))


def weights_fingerprint(model: torch.nn.Module, samples: int = 64) -> tuple:
    """The number, shapes and dtypes of all parameters and a hash of ``samples`` evenly strided values (plus the last
    one) of *every* parameter: the same for the same weights on any device (and under inference mode), different
    after a reload of other weights or an in-place change of any parameter tensor (a merged LoRA, a patched layer;
    a change that leaves every sampled value as it was is not seen). One small device-to-host copy per device."""
    params = list(model.parameters())
    if not params:
        return ()
    layout = hashlib.sha1(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()).hexdigest()
    picked: dict = {}  # device -> [(parameter index, sampled values)]
    for i, p in enumerate(params):
        flat = p.data.reshape(-1)  # .data: no version counter involved, whatever mode made the tensor
        if flat.is_meta or flat.numel() == 0:
            continue
        step = max(1, flat.numel() // samples)
        picked.setdefault(flat.device, []).append((i, torch.cat([flat[::step][:samples], flat[-1:]]).float()))
    host = {}
    for device, items in picked.items():  # one copy per device, then back in parameter order (device-independent)
        copied = torch.cat([v for _, v in items]).cpu().split([v.numel() for _, v in items])
        host.update((i, v) for (i, _), v in zip(items, copied))
    digest = hashlib.sha1(torch.cat([host[i] for i in sorted(host)]).numpy().tobytes()).hexdigest() if host else None
    meta = sum(1 for p in params if p.is_meta)
    return (len(params), layout, meta, digest)
