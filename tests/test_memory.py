"""Smaller state and the memory budget: fp8 KV cache, bf16 VAE, plan_memory (docs/memory.md states the numbers)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.models.kv_cache import CacheGeometry, KVCache, dequantize_rows, quantize_rows
from sdvg_engine.models.loading import _FP32_PATTERNS
from sdvg_engine.offload import (IMAGE_REWARD_PARAMS, LADDER, WAN_VAE_PARAMS, kv_cache_dtype, memory_components,
                                 plan_memory, resolve_memory_args, wan_param_counts)
from sdvg_engine.sampling import SeededNoise
from sdvg_engine.vae import StreamingWanVAE
from sdvg_fixtures import tiny_vae
from wan_fixtures import text_context, tiny_wan

H, W = 4, 6
#: stated in docs/memory.md: fp8 KV vs bf16 KV, relative RMS over 4 blocks (measured 0.5-0.7%)
FP8_KV_REL_RMS = 0.012
#: stated in docs/memory.md: bf16 VAE vs fp32, pixels in [-1, 1] (measured max 0.054-0.068, mean 0.004-0.009)
BF16_VAE_MAX, BF16_VAE_MEAN = 0.1, 0.015


def _as_loaded(model):
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if any(k in name for k in _FP32_PATTERNS) else torch.bfloat16)
    return model


def _latents(model, kv_dtype, scheme: str, blocks: int = 4) -> torch.Tensor:
    model.use_runtime(kv_cache_dtype=kv_dtype)
    context = GlobalCache(21) if scheme == "global" else RecomputeWindow(3, anchor_encoder=tiny_vae())
    gen = CausalGenerator(model, schedule="self_forcing", context=context)
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=blocks)
    noise, out = SeededNoise(7), []
    for b in range(blocks):
        lat = gen.generate_block(b, noise).latents
        px = torch.rand(1, 3, 9 if b == 0 else 12, 8 * H, 8 * W, generator=torch.Generator().manual_seed(b)) * 2 - 1
        gen.commit_block(b, lat, px)
        out.append(lat)
    if kv_dtype is not None:
        assert gen.kv_cache.keys.dtype == kv_dtype
    return torch.cat(out, 2).float()


def _rel_rms(a, b) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


# ---------------------------------------------------------------------------------------------------- fp8 KV cache
def test_quantize_rows_matches_a_float8_cast_of_the_scaled_rows():
    x = torch.randn(2, 3, 5, 128) * torch.logspace(-3, 2, 5).view(1, 1, 5, 1)
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3, 5, 1)
    torch.testing.assert_close(s, x.abs().amax(-1, keepdim=True) / 448.0)
    assert torch.equal(q.float(), (x / s).to(torch.float8_e4m3fn).float())
    back = dequantize_rows(q, s, torch.float32)
    assert ((back - x).abs() <= x.abs() * 2**-4 + s * 2**-9).all()  # e4m3: half an ulp, 3 mantissa bits


def test_fp8_cache_size_and_geometry_checks():
    g = CacheGeometry(2, 1, 4, 128, 10, 6, torch.float8_e4m3fn, torch.device("cpu"), torch.bfloat16)
    cache = KVCache(g)
    rows = 2 * 1 * 4 * 60
    assert cache.nbytes == g.nbytes == 2 * rows * 128 + 2 * rows * 4
    bf16 = CacheGeometry(2, 1, 4, 128, 10, 6, torch.bfloat16, torch.device("cpu"))
    assert g.nbytes / bf16.nbytes == pytest.approx((128 + 4) / 256)
    with pytest.raises(ValueError, match="needs compute_dtype"):
        CacheGeometry(2, 1, 4, 128, 10, 6, torch.float8_e4m3fn, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kv_dtype must be one of .*got 'int8'"):
        kv_cache_dtype("int8")


@pytest.mark.parametrize("scheme", ["global", "window"])
def test_fp8_kv_cache_error_against_bf16_is_within_the_stated_tolerance(scheme):
    model = _as_loaded(tiny_wan(seed=1, num_layers=4))
    reference = _latents(tiny_wan(seed=1, num_layers=4), None, scheme)  # fp32 weights and cache
    bf16 = _latents(model, None, scheme)
    fp8 = _latents(model, torch.float8_e4m3fn, scheme)
    # block 0 attends only to itself, whose rows are used unrounded: identical
    assert torch.equal(fp8[:, :, :3], bf16[:, :, :3])
    err = _rel_rms(fp8, bf16)
    assert 0 < err < FP8_KV_REL_RMS
    # the fp8 cache costs about what bf16 itself costs against fp32
    assert err < 2 * _rel_rms(bf16, reference)


# ------------------------------------------------------------------------------------------------------- bf16 VAE
def test_bf16_vae_decode_error_against_fp32_is_within_the_stated_tolerance():
    fp32 = tiny_vae(0)
    bf16 = StreamingWanVAE(copy.deepcopy(fp32.vae).to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    latents = torch.randn(1, 16, 9, 4, 6, generator=torch.Generator().manual_seed(0))
    a = torch.cat([fp32.decode_block(latents[:, :, 3 * i : 3 * i + 3]) for i in range(3)], 2)
    b = torch.cat([bf16.decode_block(latents[:, :, 3 * i : 3 * i + 3]) for i in range(3)], 2)
    assert b.dtype == torch.float32 and a.shape == b.shape == (1, 3, 33, 32, 48)
    diff = (a - b).abs()
    assert 0 < diff.max().item() < BF16_VAE_MAX and diff.mean().item() < BF16_VAE_MEAN


# ---------------------------------------------------------------------------------------------------- memory plan
@pytest.mark.parametrize("name", ["tiny", "Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B"])
def test_parameter_counts_match_the_real_architectures(name):
    cfg = wan_config(name)
    with torch.device("meta"):
        model = CausalWanTransformer3DModel(**cfg)
    counts = wan_param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["blocks"] == sum(p.numel() for p in model.blocks.parameters())
    assert counts["block_linear"] == sum(m.weight.numel() for b in model.blocks for m in b.modules()
                                         if isinstance(m, torch.nn.Linear))
    assert counts["fp32"] == sum(p.numel() for n, p in model.named_parameters() if any(k in n for k in _FP32_PATTERNS))


def test_vae_and_reward_parameter_constants():
    from diffusers import AutoencoderKLWan

    from sdvg_engine.reward import ImageRewardConfig, ImageRewardModel

    with torch.device("meta"):
        assert sum(p.numel() for p in AutoencoderKLWan().parameters()) == WAN_VAE_PARAMS
        assert sum(p.numel() for p in ImageRewardModel(ImageRewardConfig.v1()).parameters()) == IMAGE_REWARD_PARAMS


def test_component_sizes_at_832x480():
    resident = memory_components(**LADDER[0])
    # 14B bf16 (modulation/time/norm2 in fp32) and the 6-frame bf16 window: 40 layers x K,V x 9360 tokens x 5120 x 2 B
    assert resident["target weights (bf16)"] == pytest.approx((14_288_491_584 + 29_184_000) * 2 / 2**30)
    kv = resident["target KV (recompute window, 6 frames, bf16)"]
    assert kv == pytest.approx((40 * 2 * 6 * 1560 * 5120 * 2 + 40 * 2 * 512 * 5120 * 2) / 2**30)
    fp8 = memory_components(**LADDER[4])
    assert fp8["target KV (recompute window, 6 frames, fp8)"] == pytest.approx(
        (40 * 2 * 6 * 1560 * 40 * (128 + 4) + 40 * 2 * 512 * 5120 * 2) / 2**30)
    assert fp8["VAE decode cache (bf16)"] == pytest.approx(resident["VAE decode cache (fp32)"] / 2)


def test_plan_memory_picks_the_first_step_that_fits():
    totals = [sum(memory_components(**step).values()) for step in LADDER]
    assert totals == sorted(totals, reverse=True)  # every step saves memory
    assert plan_memory(200).offload == "none" and not plan_memory(200).fp8_target
    for gb in (48, 24, 16):
        plan = plan_memory(gb)
        i = next(i for i, t in enumerate(totals) if t <= gb)
        assert plan.fits and plan.total_gib == pytest.approx(totals[i]) and plan.total_gib <= gb
        assert {k: getattr(plan, k) for k in LADDER[i]} == LADDER[i]
    assert plan_memory(24).offload == "target" and plan_memory(16).offload == "both"
    # 12 GB: nothing fits once the rollback snapshot and the VAE decode's measured temporaries are counted
    # (each step's total is checked against the real-size dry run in tests/test_dry_run.py)
    assert not plan_memory(12).fits and 14.0 < plan_memory(12).total_gib < 14.5
    small = plan_memory(4)
    assert not small.fits and small.total_gib > 4 and small.offload == "both"
    assert plan_memory(16).flags == ("--fp8-target --offload both --kv-dtype fp8 --vae-dtype bf16 "
                                     "--drafter-context recompute_window")
    with pytest.raises(ValueError, match="vram_gb must be a positive number of GiB"):
        plan_memory(0)


def test_cost_model_slowdown():
    plan = plan_memory(24, tflops=50, pcie_gbs=24)
    compute, offloaded = plan.slowdown["target call s (resident -> offloaded)"]
    # fp8 target blocks over 24 GB/s take less than the call's compute: only the first block's copy shows
    assert offloaded > compute and plan.slowdown["target call"] < 1.05
    slow_bus = plan_memory(24, tflops=400, pcie_gbs=4)
    assert slow_bus.slowdown["target call"] > 2  # transfer-bound when compute is fast and the bus slow


def _args(**kw):
    base = dict(device="cuda", drafter_device=None, aux_device=None, width=832, height=480, frames=81,
                fp8_target=False, vae_dtype="fp32", drafter_context="auto", vram_gb=None, offload=None, kv_dtype=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_vram_gb_fills_the_flags_left_at_their_defaults(capsys):
    args = _args(vram_gb=16)
    assert resolve_memory_args(args) == ("both", "fp8")
    assert args.fp8_target and args.vae_dtype == "bf16" and args.drafter_context == "recompute_window"
    assert ("--vram-gb 16: --fp8-target --offload both --kv-dtype fp8 --vae-dtype bf16 --drafter-context "
            "recompute_window") in capsys.readouterr().err
    assert resolve_memory_args(_args(vram_gb=16, offload="target", kv_dtype="bf16")) == ("target", "bf16")
    assert resolve_memory_args(_args()) == ("none", "auto")
    with pytest.raises(ValueError, match="--vram-gb plans one CUDA card, but --device is 'cpu'"):
        resolve_memory_args(_args(vram_gb=24, device="cpu"))
    with pytest.raises(ValueError, match="cannot be combined with --drafter-device"):
        resolve_memory_args(_args(vram_gb=24, drafter_device="cuda:1"))
    with pytest.raises(ValueError, match=r"--vram-gb 4: even the smallest plan .* needs"):
        resolve_memory_args(_args(vram_gb=4))


def test_cli_parses_the_memory_flags():
    from sdvg_engine.cli import build_parser

    args = build_parser().parse_args(["generate", "--drafter", "d", "--target", "t", "--vae", "v", "--vram-gb", "24",
                                      "--offload", "both", "--kv-dtype", "fp8"])
    assert (args.vram_gb, args.offload, args.kv_dtype) == (24.0, "both", "fp8")


# ------------------------------------------------------------------------------------------------------ bench scripts
def _bench(script, *args):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, str(root / "bench" / script), *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_memory_plan_prints_the_single_card_rows():
    proc = _bench("memory_plan.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for gb in (24, 16, 12):
        plan = plan_memory(gb)
        assert f"| {gb} GB (" in out and f"`--vram-gb {gb}` = `{plan.flags}`" in out and f"| {plan.total_gib:.1f} |" in out
    assert "| 8 GB (RTX 4060 8GB, 12 TFLOP/s) | **no** |" in out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_real_size_offload_refuses_without_cuda():
    proc = _bench("real_size.py", "--offload", "target")
    assert proc.returncode == 2
    assert "--offload streams transformer blocks from CPU RAM to a CUDA GPU, and no CUDA device is visible; use --tiny" in proc.stderr


def test_fp8_cache_reads_equal_dequantize_rows():
    g = CacheGeometry(1, 1, 2, 128, 4, 3, torch.float8_e4m3fn, torch.device("cpu"), torch.bfloat16)
    cache = KVCache(g)
    k0, v0 = torch.randn(1, 2, 8, 128).bfloat16(), torch.randn(1, 2, 8, 128).bfloat16() * 5
    cache.write_and_read(0, 0, k0, v0)
    k1, v1 = torch.randn(1, 2, 4, 128).bfloat16(), torch.randn(1, 2, 4, 128).bfloat16()
    k, v = cache.write_and_read(0, 2, k1, v1)
    assert k.dtype == v.dtype == torch.bfloat16 and k.shape == (1, 2, 12, 128)
    for got, first, new in ((k, k0, k1), (v, v0, v1)):
        assert torch.equal(got[:, :, :8], dequantize_rows(*quantize_rows(first), torch.bfloat16))
        assert torch.equal(got[:, :, 8:], new)


def test_generate_with_offload_on_the_cpu_fails_with_the_explanation(tmp_path, capsys):
    from sdvg_engine.cli import main
    from sdvg_fixtures import write_checkpoint_files

    root = write_checkpoint_files(tmp_path)
    common = ["generate", "--drafter", str(root / "drafter.safetensors"), "--target", str(root / "target.safetensors"),
              "--vae", str(root / "vae"), "--context-file", str(root / "embeds.safetensors"), "--mode", "target_only",
              "--device", "cpu", "--dtype", "fp32", "--frames", "9", "--width", "48", "--height", "32",
              "--out", str(tmp_path / "out")]
    assert main(common + ["--offload", "both"]) == 2  # refused before any model loads
    assert ("--offload both: streams transformer blocks from CPU RAM to a CUDA GPU, but --device is cpu"
            in capsys.readouterr().err)
    assert main(common + ["--vram-gb", "24"]) == 2  # one line, exit 2, like every other CLI error
    err = capsys.readouterr().err
    assert "--vram-gb plans one CUDA card, but --device is 'cpu'" in err and "Traceback" not in err
