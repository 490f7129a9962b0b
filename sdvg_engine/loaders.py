"""One-call loaders that turn checkpoint files into the objects the pipeline takes."""

from __future__ import annotations

import os

import torch

from .context import ContextScheme, make_context_scheme
from .generator import CausalGenerator
from .models.loading import CONTEXT_SCHEMES, load_causal_wan

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: "str | torch.dtype") -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def load_generator(path: str | os.PathLike, *, name: str = "model", dtype="bfloat16", device="cpu",
                   context_scheme: str = "auto", schedule: str = "auto", fp8: bool = False,
                   num_heads: int | None = None, max_frames: int = 21, attention_bias: float | None = None,
                   anchor_encoder=None, fuse_qkv: bool = False, compile: bool = False,
                   offload: "bool | str" = "none", kv_dtype: str = "auto") -> CausalGenerator:
    """Load a causal Wan checkpoint and wrap it as a :class:`CausalGenerator`.

    ``context_scheme="auto"`` takes the scheme the checkpoint was trained with (14B Krea: recompute
    window; Self-Forcing 1.3B: global cache); ``schedule="auto"`` takes the schedule the weights were
    distilled for (``krea``'s 5 calls for the 14B, ``self_forcing``'s 4 otherwise). ``fuse_qkv``
    fuses the attention projections and ``compile`` wraps the block forward in ``torch.compile``
    (inference only; see ``bench/bench_speed.py`` for their effect). ``offload="blocks"`` (or ``True``)
    keeps the transformer blocks in CPU RAM and streams them to the CUDA ``device`` per call;
    ``kv_dtype="fp8"`` stores the KV cache in float8 (see ``sdvg_engine/offload.py``, ``docs/memory.md``).
    """
    from .offload import apply_memory_options, load_device_for

    model, info = load_causal_wan(path, dtype=parse_dtype(dtype), num_heads=num_heads, fp8=fp8, fuse_qkv=fuse_qkv,
                                  compile=compile, device=load_device_for(offload, device, name, compile, kv_dtype))
    apply_memory_options(model, device, offload=offload, kv_dtype=kv_dtype)
    scheme_name = info.context_scheme if context_scheme == "auto" else context_scheme
    if scheme_name not in CONTEXT_SCHEMES:
        raise ValueError(f"context_scheme must be 'auto' or one of {CONTEXT_SCHEMES}, got {context_scheme!r}")
    scheme: ContextScheme = make_context_scheme(scheme_name, max_frames=max_frames, attention_bias=attention_bias,
                                                anchor_encoder=anchor_encoder)
    if schedule == "auto":
        # The schedule belongs to the weights, not to the context scheme: Krea 14B was distilled for
        # 5 calls; Self-Forcing 1.3B for 4, also when it runs with a recompute window (long videos).
        schedule = "krea" if info.architecture == "Wan2.1-T2V-14B" else "self_forcing"
    gen = CausalGenerator(model, schedule=schedule, context=scheme, name=name)
    gen.info = info
    return gen
