"""Switches that used to crash or go inert: a KV cache dtype other than fp8 or the model's, changing the KV dtype of a
loaded pipeline, and the replay key's coverage of the schedule shift, the KV dtype and moved weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sdvg_engine.memo import ReplayMemo
from sdvg_engine.offload import apply_memory_options
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline
from test_workers import assert_same

PROMPT = "a red ball rolling on grass"
FRAMES = 33  # 3 blocks


def generate(pipe, seed=5, **kw):
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed, **kw)


@pytest.mark.parametrize("kv_dtype, atol", [("fp16", 2e-2), ("bf16", 6e-2), ("fp32", 0.0)])
def test_a_kv_cache_in_another_float_dtype_runs(kv_dtype, atol):
    """The models compute in fp32 here; an fp16/bf16 cache crashed at the first cached attention ("Expected query,
    key, and value to have the same dtype"). Reads now come back in the compute dtype."""
    reference = generate(tiny_pipeline(tau=-math.inf))
    pipe = tiny_pipeline(tau=-math.inf)
    for gen in (pipe.drafter, pipe.target):
        apply_memory_options(gen.model, "cpu", kv_dtype=kv_dtype)
    try:
        result = generate(pipe)
        assert pipe.target.kv_cache.keys.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[kv_dtype]
        assert (result.latents - reference.latents).abs().max() <= atol
        assert torch.isfinite(result.frames).all()
    finally:
        for gen in (pipe.drafter, pipe.target):
            apply_memory_options(gen.model, "cpu", kv_dtype="auto")  # the fixture's models are shared


def test_changing_the_kv_dtype_of_a_loaded_pipeline_takes_effect():
    pipe = tiny_pipeline(tau=-math.inf)
    generate(pipe)
    assert pipe.target.kv_cache.keys.dtype == torch.float32
    try:
        apply_memory_options(pipe.target.model, "cpu", kv_dtype="fp8")
        generate(pipe)
        assert pipe.target.kv_cache.keys.dtype == torch.float8_e4m3fn  # the old fp32 cache was reused before
    finally:
        apply_memory_options(pipe.target.model, "cpu", kv_dtype="auto")


def test_replay_key_covers_the_shift_and_the_kv_dtype_and_survives_moved_weights():
    pipe = tiny_pipeline(tau=-math.inf)
    pipe.memo = ReplayMemo()
    generate(pipe)
    assert generate(pipe).report["replay"]["replayed_blocks"] == 3
    # Another shift: other sigmas for the same timesteps, so another video (it used to replay the old one).
    original = pipe.target.schedule
    pipe.target.schedule = dataclasses.replace(original, shift=original.shift + 1.0)
    shifted = generate(pipe)
    assert shifted.report["replay"]["replayed_blocks"] == 0
    fresh = tiny_pipeline(tau=-math.inf)
    fresh.target.schedule = pipe.target.schedule
    assert_same(shifted, generate(fresh))
    pipe.target.schedule = original
    # Another KV dtype: other numerics (fp32 blocks used to be replayed into an fp8 run).
    try:
        apply_memory_options(pipe.target.model, "cpu", kv_dtype="fp8")
        assert generate(pipe).report["replay"]["replayed_blocks"] == 0
    finally:
        apply_memory_options(pipe.target.model, "cpu", kv_dtype="auto")
    # The same weights in new storage (ComfyUI moved the model off the GPU and back): still a replay.
    with torch.no_grad():
        for model in (pipe.drafter.model, pipe.target.model):
            model._apply(lambda t: t.clone())
    assert generate(pipe).report["replay"]["replayed_blocks"] == 3
    # In-place changed weights (a LoRA merged into the first parameter): never a replay.
    with torch.no_grad():
        first = next(pipe.target.model.parameters())
        saved = first.clone()
        first.add_(1e-3)
    try:
        assert generate(pipe).report["replay"]["replayed_blocks"] == 0
    finally:
        with torch.no_grad():
            first.copy_(saved)
