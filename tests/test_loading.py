"""Every checkpoint format round-trips through the loader; bad files fail naming the file and keys."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.models.loading import CheckpointError, inspect_checkpoint, load_causal_wan, save_checkpoint, _infer_config
from wan_fixtures import text_context, tiny_wan, to_original_keys, write_checkpoint as _write, write_scaled_fp8


@pytest.fixture(scope="module")
def source():
    return tiny_wan(seed=4)


@pytest.fixture(scope="module")
def reference_output(source):
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    text_kv = source.encode_text(text_context())
    return x, source.forward_block(x, torch.full((1, 3), 833.3333333333334), text_kv)


def _output(model, x):
    return model.forward_block(x, torch.full((1, 3), 833.3333333333334), model.encode_text(text_context()))




def test_original_key_map_round_trips(source):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers(to_original_keys(source.state_dict()))
    assert set(converted) == set(source.state_dict())


@pytest.mark.parametrize("fmt", ["self_forcing", "krea", "comfyui", "wan_original", "diffusers_folder", "diffusers"])
def test_format_round_trip(fmt, source, reference_output, tmp_path):
    path = _write(fmt, source, tmp_path)
    model, info = load_causal_wan(path, dtype=torch.float32)
    assert info.format == fmt
    assert info.config["num_layers"] == 2 and info.config["num_attention_heads"] == 2
    if fmt == "self_forcing":
        assert info.source_entry == "generator_ema"  # EMA weights, not the raw generator
    x, expected = reference_output
    assert torch.equal(_output(model, x), expected)


def test_safetensors_with_config_metadata(source, reference_output, tmp_path):
    path = tmp_path / "toy.safetensors"
    save_checkpoint(source, path, context_scheme="recompute_window")
    model, info = load_causal_wan(path, dtype=torch.float32)
    assert info.context_scheme == "recompute_window"
    x, expected = reference_output
    assert torch.equal(_output(model, x), expected)


def test_bf16_and_fp8_load(source, reference_output, tmp_path):
    path = _write("krea", source, tmp_path)
    x, expected = reference_output
    bf16, _ = load_causal_wan(path, dtype=torch.bfloat16)
    assert bf16.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert bf16.blocks[0].scale_shift_table.dtype == torch.float32  # modulation stays fp32
    err_bf16 = (_output(bf16, x) - expected).abs().max().item()
    fp8, info = load_causal_wan(path, dtype=torch.float32, fp8=True)
    assert fp8.blocks[0].attn1.to_q.weight_fp8.dtype == torch.float8_e4m3fn
    assert any("float8" in n for n in info.notes)
    err_fp8 = (_output(fp8, x) - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert 0 < err_bf16 < 0.05 * scale and 0 < err_fp8 < 0.1 * scale


def test_the_file_loaders_fp8_target_runs_under_cudas_rules(source, tmp_path):
    """The pack's own fp8 weights (``fp8=True``, bf16 compute as on a GPU) under CUDA's fp8 matmul checks
    (``tests/cuda_rules.py``): they dequantise per call into a plain bf16 matmul, so no ``_scaled_mm`` is made and
    nothing is refused; the time MLP keeps the reference implementations' float32."""
    from cuda_rules import cuda_scaled_mm

    model, _ = load_causal_wan(_write("krea", source, tmp_path), dtype=torch.bfloat16, fp8=True)
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    with cuda_scaled_mm() as log:
        flow = _output(model, x)
    assert (log.calls, log.refused) == ([], []) and flow.isfinite().all()
    assert not model.ops_in_host_dtypes


def test_missing_key_names_file_and_key(source, tmp_path):
    state = to_original_keys(source.state_dict())
    del state["blocks.1.cross_attn.k.weight"]
    path = tmp_path / "broken.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as err:
        load_causal_wan(path)
    assert "broken.safetensors" in str(err.value) and "blocks.1.attn2.to_k.weight" in str(err.value)


def test_unexpected_key_and_wrong_shape(source, tmp_path):
    state = dict(source.state_dict())
    state["blocks.0.extra.weight"] = torch.zeros(3)
    path = tmp_path / "extra.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*blocks\.0\.extra\.weight"):
        load_causal_wan(path)
    state = dict(source.state_dict())
    state["blocks.0.attn1.to_v.bias"] = torch.zeros(7)
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn1\.to_v\.bias.*shape"):
        load_causal_wan(path)


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt.safetensors"):
        load_causal_wan(bad)
    bad_pt = tmp_path / "corrupt.pt"
    bad_pt.write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="corrupt.pt"):
        load_causal_wan(bad_pt)
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        load_causal_wan(tmp_path / "nowhere.safetensors")
    other = tmp_path / "unet.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 4, 3, 3)}, str(other))
    with pytest.raises(CheckpointError, match="not a Wan2.1 transformer"):
        load_causal_wan(other)


def test_pickle_with_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_causal_wan(path)


@pytest.mark.parametrize("name,heads,scheme", [("Wan2.1-T2V-1.3B", 12, "global_cache"), ("Wan2.1-T2V-14B", 40, "recompute_window")])
def test_real_architectures_detected_from_shapes(name, heads, scheme, tmp_path):
    with torch.device("meta"):
        model = CausalWanTransformer3DModel(**wan_config(name))
    config = _infer_config(model.state_dict(), tmp_path, None)
    assert config == {k: v for k, v in wan_config(name).items()}
    assert config["num_attention_heads"] == heads
    n = sum(p.numel() for p in model.parameters())
    assert (n / 1e9) == pytest.approx(1.42 if heads == 12 else 14.29, abs=0.05)


def test_inspect_describes_file(source, tmp_path):
    info = inspect_checkpoint(_write("self_forcing", source, tmp_path))
    text = info.describe()
    assert "self_forcing" in text and "generator_ema" in text and "global_cache" in text
    json.dumps(info.to_dict())


def test_fused_and_fp8_load(source, reference_output, tmp_path):
    path = _write("comfyui", source, tmp_path)
    x, expected = reference_output
    fused, _ = load_causal_wan(path, dtype=torch.float32, fuse_qkv=True)
    assert (_output(fused, x) - expected).abs().max().item() <= 1e-5
    both, _ = load_causal_wan(path, dtype=torch.float32, fuse_qkv=True, fp8=True)
    assert both.blocks[0].attn1.to_qkv.weight_fp8.dtype == torch.float8_e4m3fn
    assert (_output(both, x) - expected).abs().max().item() < 0.1 * expected.abs().max().item()


def test_config_in_metadata_is_used_for_widths_shapes_cannot_tell(tmp_path):
    """A 96-wide model with 3 heads of 32: shapes alone cannot give the heads; the file's config does."""
    model = tiny_wan(seed=6, num_attention_heads=3, attention_head_dim=32, ffn_dim=128)
    path = tmp_path / "narrow.safetensors"
    save_checkpoint(model, path)
    loaded, info = load_causal_wan(path, dtype=torch.float32)
    assert info.config["num_attention_heads"] == 3 and info.config["attention_head_dim"] == 32
    x = torch.randn(1, 16, 3, 4, 6)
    assert torch.equal(_output(loaded, x), _output(model, x))
    from safetensors.torch import load_file

    save_file(load_file(str(path)), str(tmp_path / "bare.safetensors"))  # same tensors, no metadata
    with pytest.raises(CheckpointError, match="cannot infer the number of heads for width 96"):
        load_causal_wan(tmp_path / "bare.safetensors")


def test_comfyui_fp8_scaled_file_is_dequantized_per_tensor(source, reference_output, tmp_path):
    """``*_fp8_scaled`` files: float8 weights + ``.scale_weight``; loaded close to the source."""
    path = write_scaled_fp8(source, tmp_path / "causal_fp8_scaled.safetensors")
    model, info = load_causal_wan(path, dtype=torch.float32)
    assert info.format == "comfyui" and "float8_e4m3fn" in info.stored_dtype
    assert "fp8_scales" not in info.to_dict()
    x, expected = reference_output
    err = (_output(model, x) - expected).abs().max().item()
    assert 0 < err < 0.1 * expected.abs().max().item()


def test_inspect_fails_exactly_when_a_load_fails(source, tmp_path):
    """``inspect_checkpoint`` (what ``sdvg inspect`` runs) and ``load_causal_wan`` share one reader and one set of checks."""
    state = {k: v.clone() for k, v in source.state_dict().items()}
    meta = {"sdvg.config": json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in source.config.items()})}
    cases = {
        "ok": (state, meta),
        "missing": ({k: v for k, v in state.items() if k != "proj_out.bias"}, meta),
        "shape": ({**state, "proj_out.bias": torch.zeros(3)}, meta),
        "ints": ({**state, "proj_out.bias": state["proj_out.bias"].to(torch.int16)}, meta),
        "meta": (state, {"sdvg.config": "[1, 2"}),
        "heads": (state, {"sdvg.config": json.dumps({**json.loads(meta["sdvg.config"]), "num_attention_heads": 0})}),
        "scheme": (state, {**meta, "sdvg.context_scheme": "sliding"}),
    }
    for name, (tensors, metadata) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        outcomes = []
        for fn in (inspect_checkpoint, lambda p: load_causal_wan(p, dtype=torch.float32)):
            try:
                fn(path)
                outcomes.append(None)
            except CheckpointError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], name
        assert (outcomes[0] is None) == (name == "ok"), (name, outcomes[0])
        if name != "ok":
            assert outcomes[0].startswith(f"{path}: "), outcomes[0]
