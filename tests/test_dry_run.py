"""The whole loop at 832x480x81 with the real 1.3B, 14B, Wan VAE and ImageReward architectures, on the meta device
(sdvg_engine/dry_run.py): bytes per category against closed forms and bench/memory_plan.py, the replay recording
against the memo's cap, and replay replaying. A representative subset of bench/dry_run.py's matrix (both presets,
1 and 2 workers, every mode, fp8 KV, fp8 target, offload, replay), about a minute on 2 CPU cores."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import pytest
import torch

from sdvg_engine.dry_run import (DEFAULT_SCORES, FIRST_TAU, REPLAY_TAU, DryRunConfig, LiveBytes, check_recording_fits,
                                 dry_run, forced_decisions, replayed_drafts, tensor_bytes)
from sdvg_engine.memo import DEFAULT_MAX_BYTES, recording_bytes
from sdvg_engine.models.causal_wan import wan_config
from sdvg_engine.offload import IMAGE_REWARD_PARAMS, WAN_VAE_PARAMS, _weights_bytes, memory_components
from sdvg_engine.router import DEFAULT_ROUTER_OPTIONS

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
TOKENS_PER_FRAME = (480 // 16) * (832 // 16)  # 30 * 52 latent patches of one latent frame
ROPE_TABLES = 2 * 1024 * 128 * 4  # diffusers' WanRotaryPosEmbed buffers (cos, sin) kept by the loader, float32
D13 = dict(layers=30, dim=1536, heads=12)  # Wan2.1-T2V-1.3B
D14 = dict(layers=40, dim=5120, heads=40)  # Wan2.1-T2V-14B

CONFIGS = [
    DryRunConfig(preset="reference", mode="sdvg", workers=1, replay=True),
    DryRunConfig(preset="native", mode="sdvg", workers=2, replay=True),
    DryRunConfig(preset="reference", mode="target_only", workers=2),
    DryRunConfig(preset="native", mode="draft_only", workers=1),
    DryRunConfig(preset="reference", mode="first_block_only", workers=2),
    DryRunConfig(preset="native", mode="random", workers=2),
    DryRunConfig(preset="reference", mode="schedule", workers=1),
    DryRunConfig(preset="native", mode="sdvg", workers=2, kv_dtype="fp8", fp8_target=True, offload="target"),
    DryRunConfig(preset="reference", mode="sdvg", workers=1),  # one run, measured afresh: what_ran's figures
]


def _bench(name):
    import sys

    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results():
    torch.set_num_threads(1)
    return {c: dry_run(c, remeasure=c is CONFIGS[8]) for c in CONFIGS}


def kv_bytes(model: dict, frames: int, kv_dtype: str = "auto") -> int:
    """Self-attention K and V of ``frames`` latent frames for every layer, plus the prompt's 512 cross-attention rows
    (bf16). fp8: one byte per value and a float32 scale per row of one head (128 values)."""
    rows = model["layers"] * 2 * frames * TOKENS_PER_FRAME * model["heads"]
    per_row = 128 + 4 if kv_dtype == "fp8" else 128 * 2
    return rows * per_row + model["layers"] * 2 * 512 * model["dim"] * 2


@pytest.mark.slow
def test_kv_caches_weights_and_vae_are_exact(results):
    for config, r in results.items():
        drafter_frames = 21 if config.preset == "native" else 6  # global cache: the whole video; window: 3 + 3
        if config.mode != "target_only":
            assert r.device["KV cache: drafter"] == kv_bytes(D13, drafter_frames, config.kv_dtype), config.label
        else:
            assert "KV cache: drafter" not in r.device
        if config.mode != "draft_only":
            assert r.device["KV cache: target"] == kv_bytes(D14, 6, config.kv_dtype), config.label
        else:
            assert "KV cache: target" not in r.device
        target, outside = _weights_bytes(wan_config("Wan2.1-T2V-14B"), config.fp8_target)
        if config.offload in ("target", "both"):
            # resident part + the two blocks the streamer holds at once (the one in use and the prefetched one)
            target = outside + ROPE_TABLES + 2 * (target - outside) // 40 + (2 * 10 * 4 if config.fp8_target else 0)
        else:
            target += ROPE_TABLES + (40 * 10 * 4 if config.fp8_target else 0)  # fp8: one float32 scale per Linear
        assert r.device["weights: target"] == target, config.label
        assert r.device["weights: drafter"] == _weights_bytes(wan_config("Wan2.1-T2V-1.3B"), False)[0] + ROPE_TABLES
        assert r.device["weights: vae"] == WAN_VAE_PARAMS * 4
        assert r.device["weights: reward"] == IMAGE_REWARD_PARAMS * 2 + 512 * 8  # + BERT's position ids (int64)
    # 14B: 40 layers x 2 x 6 frames x 1560 tokens x 5120 x bf16 + 512 text rows = 7.53 GiB
    assert kv_bytes(D14, 6) == 40 * 2 * 6 * 1560 * 5120 * 2 + 40 * 2 * 512 * 5120 * 2 == 8_087_142_400


def test_figures_match_the_memory_plan(results):
    """bench/dry_run.py's rules (plan_problems: what exits 1) hold for every configuration, and the first table of
    bench/memory_plan.py has the dry run's exact rows."""
    dry = _bench("dry_run")
    items, extras = _bench("memory_plan").plan_table()
    for config, r in results.items():
        compared = dry.compare(r)
        assert dry.plan_problems(r, rows=compared) == [], config.label
        rows = {row: (measured, plan) for row, measured, plan in compared}
        activations = rows["activations (largest per-call transient, per lane, summed)"]
        if config.workers == 2:  # the target's lane adds its own transient (0.63 GiB for the 14B) beside the VAE's
            assert activations[0] > activations[1], config.label
        # and a plan 1% smaller is refused, naming the configuration and the row
        tight = dry.plan_problems(r, plan_scale=0.99, rows=compared)
        assert any(p.startswith(f"{config.label}: KV cache: target: dry run ") for p in tight) == (
            config.mode != "draft_only"), tight
    r = results[CONFIGS[1]]  # native: the drafter on its global cache, as the table assumes
    assert r.device["KV cache: drafter"] == items["drafter KV cache (global, 21 frames)"]
    assert r.device["KV cache: target"] == items["target KV cache (recompute window, 6 frames)"]
    assert r.device["weights: vae"] == items["VAE weights (fp32)"]
    assert any("replay memo" in k for k in extras) and any("one replay recording" in k for k in extras)


def test_the_plans_transient_matches_a_real_decode_measured_apart_from_the_dry_run():
    """The plan's activation row is the Wan VAE decode's transient, a per-pixel constant once read off the dry run.
    Checked here against a figure the dry run does not produce: the real VAE architecture decoding two 3-latent-frame
    blocks with real values on the CPU (no meta device, no pipeline, no replayed calls) at 64x64 pixels; the largest
    transient of the two, new cache slots excluded, scaled by the frame area."""
    from diffusers import AutoencoderKLWan

    from sdvg_engine.vae import StreamingWanVAE, load_wan21_vae_config

    torch.manual_seed(0)
    vae = StreamingWanVAE(AutoencoderKLWan.from_config(load_wan21_vae_config()).eval().requires_grad_(False))
    peaks = []
    for _ in range(2):
        old = list(vae._feat_cache)
        with torch.no_grad(), LiveBytes() as live:
            vae.decode_block(torch.randn(1, 16, 3, 8, 8))
        peaks.append(live.peak - tensor_bytes([n for n, o in zip(vae._feat_cache, old) if n is not o]))
    measured_per_pixel = max(peaks) / (64 * 64)
    plan = memory_components(offload="none", kv_dtype="auto", vae_dtype="fp32", fp8_target=False,
                             drafter_context="auto")
    planned = next(v for k, v in plan.items() if k.startswith("largest transient")) * 2**30
    # at 64x64 the borders cost 1.3% more per pixel than at 832x480: the plan must sit just under the small figure
    measured = measured_per_pixel * 832 * 480
    assert 0.97 * measured <= planned <= measured, (planned, measured)
    # bf16 halves it
    bf16 = memory_components(offload="none", kv_dtype="auto", vae_dtype="bf16", fp8_target=False, drafter_context="auto")
    assert next(v for k, v in bf16.items() if k.startswith("largest transient")) * 2**30 == pytest.approx(planned / 2)


def test_a_rollback_snapshot_lives_only_until_the_verdict(results):
    """A draft the router may reject keeps the VAE state before its decode until the verdict, then lets it go: at most
    one older cache beside the current one (3.5 GiB at 832x480 fp32). Modes that keep every draft keep no snapshot.
    (Before: the snapshot lived until the block was finished, two older caches, 7.0 GiB, in every mode that drafts.)"""
    for config, r in results.items():
        cache = r.device["VAE decode cache"]
        older = r.device["VAE decode cache: older states kept by snapshots"]
        if config.mode == "sdvg":
            assert older == cache, config.label
        else:  # target_only drafts nothing; draft_only, first_block_only, random, schedule never roll back
            assert older == 0, config.label


def test_replay_replays_at_real_size_and_the_recording_fits_the_default_cap(results):
    for config in (CONFIGS[0], CONFIGS[1]):
        r = results[config]
        replay = r.report["replay"]
        assert replay["replayed_blocks"] == 1 + replayed_drafts(DEFAULT_SCORES, FIRST_TAU, REPLAY_TAU) == 5
        assert replay["kept_for_replay"] and replay["recorded_blocks"] == 7
        # the closed form counts one seam feature vector per block; a last block by the target has none (no next draft)
        closed = recording_bytes(832, 480, 81)
        assert closed - 1024 * 4 <= replay["recording_bytes"] <= closed
        assert replay["recording_bytes"] == r.host["recording (one run)"]
        assert replay["recording_bytes"] < DEFAULT_MAX_BYTES
        check_recording_fits(r)  # passes at the default cap
        # the second run (margin -0.25 -> 0): blocks 0-4 replayed; block 5 (0.2 against block 4's 0.3) now rejected,
        # block 6 (-0.4 against the target's block 5) too
        assert r.report["decisions"] == ["target", "draft", "draft", "target", "draft", "target", "target"]
        assert [b["replayed"] for b in r.report["blocks"]] == [True] * 5 + [False] * 2
    for config in CONFIGS[2:]:
        check_recording_fits(results[config])  # no recording: nothing to check


def test_the_dry_run_runs_the_shipped_default_router(results):
    """Relative routing with margin -0.25 (router.DEFAULT_ROUTER_OPTIONS): block 3 (0.1, 0.5 below block 2) is
    rejected, which a fixed threshold of -0.25 would keep."""
    assert DEFAULT_ROUTER_OPTIONS == {"tau_mode": "relative", "tau": FIRST_TAU}
    assert forced_decisions(DEFAULT_SCORES, FIRST_TAU) == [True, True, False, True, True, False]
    assert forced_decisions(DEFAULT_SCORES, FIRST_TAU, tau_mode="fixed") == [True, True, True, True, True, False]
    single = results[CONFIGS[8]]
    assert single.report["decisions"] == ["target", "draft", "draft", "target", "draft", "draft", "target"]
    assert single.report["acceptance"]["accepted_blocks"] == 4


def test_real_and_replayed_calls_are_counted(results):
    """What runs the real forward on meta and what replays a measured shape, per component (the module docstring's
    figures), for one run measured afresh: reference sdvg w1 (7 blocks, drafts 3 and 6 rejected). The VAE decodes the
    7 kept blocks and the 2 rejected drafts, 2 of them for real (block 0's 9 frames, one 12-frame block); the
    recompute windows' anchor re-encodes (7) always run for real; ImageReward
    scores 6 drafts, the 2 target blocks a later draft compares with (blocks 0 and 3) and 2 seam frames (after blocks
    0 and 3): 3 shapes (9, 12 and 1 frame)."""
    r = results[CONFIGS[8]]
    assert r.calls["vae decode"] == 9 and r.real_calls["vae decode"] == 2 and r.replayed_calls["vae decode"] == 7
    assert r.calls["reward"] == 10 and r.real_calls["reward"] == 3 and r.replayed_calls["reward"] == 7
    assert r.calls["vae encode"] == r.real_calls["vae encode"] == 7  # never replayed
    assert (r.calls["drafter"], r.real_calls["drafter"]) == (37, 3)
    assert (r.calls["target"], r.real_calls["target"]) == (18, 3)
    # measured afresh: each shape ran once (the anchor re-encodes have one shape and always run)
    assert r.shapes == {**{c: r.real_calls[c] for c in r.calls}, "vae encode": 1}
    assert "vae decode: 9 calls, 2 real, 7 replayed (2 shapes)" in r.what_ran()
    # sharing one stack, a later configuration replays the shapes an earlier one measured
    again = dry_run(CONFIGS[8])
    assert again.real_calls.get("reward", 0) == 0 and again.shapes["reward"] == 3 and again.calls == r.calls


def test_the_cap_check_fails_when_a_recording_would_not_fit(results):
    r = results[CONFIGS[0]]
    with pytest.raises(AssertionError, match="does not fit the memo's cap"):
        check_recording_fits(r, max_bytes=r.report["replay"]["recording_bytes"] - 1)
    # a cap of half a whole recording: the memo keeps the prefix that fits, blocks 0-2 (9 + 12 + 12 of the 81 frames,
    # 41%; a fourth block would make 56%), the second run replays those 3, and the check says it does not fit
    small = dry_run(dataclasses.replace(CONFIGS[0], workers=2), max_bytes=recording_bytes(832, 480, 81) // 2)
    assert small.report["replay"]["kept_for_replay"] is True
    assert small.report["replay"]["recorded_blocks"] == small.report["replay"]["replayed_blocks"] == 3
    with pytest.raises(AssertionError, match="does not fit the memo's cap"):
        check_recording_fits(small)


@pytest.mark.slow
def test_bench_dry_run_exits_1_when_a_figure_leaves_the_plan():
    """bench/dry_run.py with every plan figure made 1% smaller (--plan-scale 0.99) must fail, naming the rows."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "dry_run.py"), "--config", "native draft_only w1",
                           "--plan-scale", "0.99"], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.path.abspath(root)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED (a figure left the plan" in proc.stdout
    assert re.search(r"^native draft_only w1: KV cache: drafter: dry run 5\.712 GiB, plan 5\.65\d GiB \(must be equal",
                     proc.stdout, re.M), proc.stdout[-2000:]
