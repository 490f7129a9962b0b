"""Tests for sdvg_engine.vae: streaming Wan2.1 decode with snapshot/restore, offline loading, encode.

Everything runs on tiny random VAEs (`AutoencoderKLWan(base_dim=8)`, 0.9M params) on CPU; no weights are downloaded.
"""

from __future__ import annotations

import re
import socket

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import load_file, save_file

from wan_fixtures import vae_key_to_original
from sdvg_engine.vae import StreamingWanVAE, VAEDecodeState, load_wan21_vae_config, load_wan_vae


LATENT_H, LATENT_W = 2, 4  # small and non-square, so a transposed H/W would be caught


def _tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16).eval()
    # The RMS-norm gains start at exactly 1; perturb them so a wrongly mapped gamma changes the output.
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.mul_(1 + 0.1 * torch.randn_like(p))
    return vae


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return _tiny_vae()


@pytest.fixture
def stream(vae) -> StreamingWanVAE:
    return StreamingWanVAE(vae)


def _latents(frames: int, seed: int, batch: int = 1, h: int = LATENT_H, w: int = LATENT_W) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, frames, h, w, generator=g)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# ----------------------------------------------------------------------------------------------- streaming decode
def test_streaming_blocks_equal_full_decode(vae):
    stream = StreamingWanVAE(vae)
    z = _latents(7, seed=1, h=8, w=8)
    blocks = [z[:, :, 0:1], z[:, :, 1:4], z[:, :, 4:7]]
    outs = [stream.decode_block(b) for b in blocks]

    assert [o.shape[2] for o in outs] == [1, 12, 12]
    assert all(o.dtype == torch.float32 and o.shape[-2:] == (64, 64) for o in outs)
    assert stream.latent_frames_decoded == 7

    with torch.no_grad():
        reference = vae.decode(stream.denormalize(z)).sample
    streamed = torch.cat(outs, dim=2)
    assert streamed.shape == reference.shape == (1, 3, 25, 64, 64)
    assert torch.equal(streamed, reference)
    assert streamed.abs().max() <= 1.0


def test_first_block_frame_count_and_shapes(stream):
    out = stream.decode_block(_latents(3, seed=2, batch=2))
    assert out.shape == (2, 3, 9, 8 * LATENT_H, 8 * LATENT_W)
    assert stream.decode_block(_latents(2, seed=3, batch=2)).shape[2] == 8
    assert stream.decode_cache_bytes() > 0


def test_snapshot_restore_discards_draft(vae):
    block_a, block_b = _latents(3, seed=10), _latents(3, seed=11)
    draft = 50.0 * _latents(3, seed=12)  # garbage, so a leak into the cache would be visible

    fresh = StreamingWanVAE(vae)
    expected_a = fresh.decode_block(block_a)
    expected_b = fresh.decode_block(block_b)

    stream = StreamingWanVAE(vae)
    assert torch.equal(stream.decode_block(block_a), expected_a)
    state = stream.snapshot()
    cache_bytes = stream.decode_cache_bytes()
    # Deep copy of what the snapshot references, to prove that later decoding never writes into those tensors
    # (which is what makes the shallow snapshot valid).
    frozen = [t.clone() if isinstance(t, torch.Tensor) else t for t in state.feat_cache]

    draft_pixels = stream.decode_block(draft)
    assert not torch.equal(draft_pixels, expected_b)
    assert stream.latent_frames_decoded == 6
    for before, now in zip(frozen, state.feat_cache):
        if isinstance(before, torch.Tensor):
            assert torch.equal(before, now)
        else:
            assert before == now

    stream.restore(state)
    assert stream.latent_frames_decoded == 3
    assert stream.decode_cache_bytes() == cache_bytes
    assert torch.equal(stream.decode_block(block_b), expected_b)

    # The same state can be restored again (e.g. a second rejected draft).
    stream.restore(state)
    stream.decode_block(draft)
    stream.restore(state)
    assert torch.equal(stream.decode_block(block_b), expected_b)


def test_any_block_split_gives_identical_pixels(vae):
    # The pixels must be a pure function of the latent sequence, bit for bit, however it is cut into blocks.
    z = _latents(7, seed=5)
    results = []
    for split in [(7,), (2, 1, 4), (4, 3), (1,) * 7]:
        stream = StreamingWanVAE(vae)
        bounds = [0, *torch.tensor(split).cumsum(0).tolist()]
        outs = [stream.decode_block(z[:, :, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        assert [o.shape[2] for o in outs] == [1 + 4 * (split[0] - 1), *(4 * n for n in split[1:])]
        results.append(torch.cat(outs, dim=2))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    # diffusers applies post_quant_conv to all 7 frames at once; on these tiny shapes the CPU kernel can differ
    # in the last bit (exact equality is tested at 8x8 above).
    with torch.no_grad():
        torch.testing.assert_close(results[0], vae.decode(StreamingWanVAE(vae).denormalize(z)).sample)


def test_invalid_blocks_leave_the_stream_untouched(stream):
    stream.decode_block(_latents(3, seed=20))
    state = stream.snapshot()
    with pytest.raises(ValueError, match="reset"):
        stream.decode_block(_latents(3, seed=21, h=LATENT_H + 2))  # different video size mid-stream
    with pytest.raises(ValueError, match="reset"):
        stream.decode_block(_latents(3, seed=21, batch=2))  # different batch mid-stream
    with pytest.raises(ValueError):
        stream.decode_block(torch.zeros(1, 8, 3, LATENT_H, LATENT_W))  # wrong channel count
    with pytest.raises(ValueError):
        stream.decode_block(torch.zeros(1, 16, 0, LATENT_H, LATENT_W))  # empty block
    assert stream.latent_frames_decoded == state.latent_frames
    assert all(a is b for a, b in zip(stream.snapshot().feat_cache, state.feat_cache))


def test_decode_is_atomic_when_the_decoder_fails(vae, monkeypatch):
    block_a, block_b = _latents(3, seed=22), _latents(3, seed=23)
    fresh = StreamingWanVAE(vae)
    fresh.decode_block(block_a)
    expected_b = fresh.decode_block(block_b)

    stream = StreamingWanVAE(vae)
    stream.decode_block(block_a)
    real_forward, calls = vae.decoder.forward, []

    def failing_forward(*args, **kwargs):  # fails on the 2nd latent frame, after the 1st updated the cache
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated out of memory")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(vae.decoder, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated"):
        stream.decode_block(block_b)
    monkeypatch.undo()
    assert stream.latent_frames_decoded == 3
    assert torch.equal(stream.decode_block(block_b), expected_b)


def test_reset_starts_a_new_video(vae):
    block_a, block_b = _latents(3, seed=30), _latents(3, seed=31)
    expected = StreamingWanVAE(vae).decode_block(block_a)

    stream = StreamingWanVAE(vae)
    stream.decode_block(block_b)
    second = stream.decode_block(block_a)
    assert second.shape[2] == 12
    stream.reset()
    assert stream.latent_frames_decoded == 0 and stream.decode_cache_bytes() == 0
    again = stream.decode_block(block_a)
    assert again.shape[2] == 9
    assert torch.equal(again, expected)
    # After reset, a different spatial size is allowed.
    stream.reset()
    assert stream.decode_block(_latents(1, seed=32, h=2, w=2)).shape == (1, 3, 1, 16, 16)


def test_restore_rejects_foreign_state(stream):
    with pytest.raises(TypeError):
        stream.restore([None] * 33)
    with pytest.raises(ValueError, match="slots"):
        stream.restore(VAEDecodeState(feat_cache=(None,), latent_frames=0, stream_key=None))


# ------------------------------------------------------------------------------------------- encode / normalise
def test_normalize_denormalize(stream, vae):
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    z = _latents(2, seed=40)
    torch.testing.assert_close(stream.denormalize(z), z * std + mean)
    torch.testing.assert_close(stream.normalize(z), (z - mean) / std)
    torch.testing.assert_close(stream.normalize(stream.denormalize(z)), z)
    torch.testing.assert_close(stream.denormalize(torch.zeros(1, 16, 1, 1, 1)), mean)
    # Bit-identical to the form used by diffusers' Wan pipelines (`latents / (1 / std) + mean`).
    assert torch.equal(stream.denormalize(z), z / (1.0 / std) + mean)


def test_encode_frame_and_video_leave_decode_cache_untouched(vae):
    block_a, block_b = _latents(3, seed=50), _latents(3, seed=51)
    fresh = StreamingWanVAE(vae)
    fresh.decode_block(block_a)
    expected_b = fresh.decode_block(block_b)

    stream = StreamingWanVAE(vae)
    pixels_a = stream.decode_block(block_a)
    latent = stream.encode_frame(pixels_a[:, :, -1])
    assert latent.shape == (1, 16, 1, LATENT_H, LATENT_W) and latent.dtype == torch.float32
    video_latents = stream.encode_video(pixels_a[:, :, :5])
    assert video_latents.shape == (1, 16, 2, LATENT_H, LATENT_W)
    # diffusers' own decode/clear_cache in between must not touch the stream either (it owns its cache list).
    with torch.no_grad():
        vae.decode(stream.denormalize(block_b))
    assert torch.equal(stream.decode_block(block_b), expected_b)

    # encode_frame = posterior mean of diffusers' encode, normalised.
    with torch.no_grad():
        raw = vae.encode(pixels_a[:, :, -1:]).latent_dist.mode()
    assert torch.equal(latent, stream.normalize(raw))
    assert not torch.equal(latent, raw)

    with pytest.raises(ValueError, match="1 \\+ 4k"):
        stream.encode_video(pixels_a[:, :, :4])
    with pytest.raises(ValueError):
        stream.encode_frame(pixels_a[:, :, 0, :12])  # height not a multiple of 8


def test_metadata(stream, vae):
    assert (stream.latent_channels, stream.spatial_scale, stream.temporal_scale) == (16, 8, 4)
    assert stream.vae is vae
    assert stream.device == torch.device("cpu") and stream.dtype == torch.float32


def test_rejects_wan22_vae():
    with pytest.raises(ValueError, match="Wan2.1"):
        StreamingWanVAE(AutoencoderKLWan(base_dim=8, z_dim=48))
    with pytest.raises(TypeError):
        StreamingWanVAE(torch.nn.Linear(2, 2))


def test_shipped_config_is_the_real_wan21_vae():
    config = load_wan21_vae_config()
    assert config["_class_name"] == "AutoencoderKLWan"
    assert (config["base_dim"], config["z_dim"], config["dim_mult"], config["num_res_blocks"]) == (96, 16, [1, 2, 4, 4], 2)
    assert config["temperal_downsample"] == [False, True, True] and config["attn_scales"] == []
    assert config["latents_mean"][:3] == [-0.7571, -0.7089, -0.9113] and config["latents_mean"][-1] == -0.2921
    assert config["latents_std"][:3] == [2.8184, 1.4541, 2.3275] and config["latents_std"][-1] == 1.916
    assert len(config["latents_mean"]) == len(config["latents_std"]) == 16


# ---------------------------------------------------------------------------------------------------- loading
def _original_state_dict(vae: AutoencoderKLWan) -> dict[str, torch.Tensor]:
    state = vae.state_dict()
    original = {vae_key_to_original(k): v.clone() for k, v in state.items()}
    # The test's inverse must be exactly undone by diffusers' converter, or the loading tests prove nothing.
    assert len(original) == len(state)
    back = convert_wan_vae_to_diffusers(original)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    return original


@pytest.fixture(scope="module")
def original_sd(vae):
    sd = _original_state_dict(vae)
    assert "decoder.middle.0.residual.0.gamma" in sd and "decoder.upsamples.4.shortcut.weight" in sd
    return sd


def _assert_same_model(loaded: StreamingWanVAE, source: AutoencoderKLWan):
    assert isinstance(loaded, StreamingWanVAE)
    assert loaded.vae.config.base_dim == source.config.base_dim == 8
    src = source.state_dict()
    got = loaded.vae.state_dict()
    assert set(got) == set(src)
    assert all(torch.equal(got[k], src[k]) for k in src)
    assert not any(p.requires_grad for p in loaded.vae.parameters()) and not loaded.vae.training
    z = _latents(2, seed=60, h=2, w=2)
    assert torch.equal(loaded.decode_block(z), StreamingWanVAE(source).decode_block(z))


def test_load_original_pth(tmp_path, vae, original_sd, no_network):
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save(original_sd, path)
    _assert_same_model(load_wan_vae(path), vae)


def test_load_comfyui_safetensors_with_prefix(tmp_path, vae, original_sd, no_network):
    for prefix in ("", "vae.", "first_stage_model."):
        path = tmp_path / f"wan_2.1_vae_{prefix or 'plain'}.safetensors"
        sd = {prefix + k: v.contiguous() for k, v in original_sd.items()}
        if prefix == "first_stage_model.":  # a combined checkpoint: other components are ignored
            sd["model.diffusion_model.head.modulation"] = torch.zeros(1, 2, 4)
        save_file(sd, str(path))
        _assert_same_model(load_wan_vae(path), vae)


def test_load_diffusers_folder_and_file(tmp_path, vae, no_network):
    folder = tmp_path / "pipeline" / "vae"
    vae.save_pretrained(folder)
    _assert_same_model(load_wan_vae(folder), vae)
    _assert_same_model(load_wan_vae(folder.parent), vae)  # pipeline root with a vae/ subfolder
    _assert_same_model(load_wan_vae(folder / "diffusion_pytorch_model.safetensors"), vae)


def test_load_casts_dtype(tmp_path, original_sd):
    path = tmp_path / "vae.safetensors"
    save_file({k: v.contiguous() for k, v in original_sd.items()}, str(path))
    loaded = load_wan_vae(path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.vae.parameters())


def test_missing_and_unexpected_keys_are_reported(tmp_path, original_sd):
    # Original layout: the missing tensor is reported under its diffusers name.
    dropped = "decoder.upsamples.4.shortcut.weight"
    sd = {k: v for k, v in original_sd.items() if k != dropped}
    sd["decoder.extra_layer.weight"] = torch.zeros(1)
    path = tmp_path / "broken_vae.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError) as err:
        load_wan_vae(path)
    message = str(err.value)
    assert "broken_vae.pth" in message
    assert "decoder.up_blocks.1.resnets.0.conv_shortcut.weight" in message
    assert "decoder.extra_layer.weight" in message and "1 missing" in message and "1 unexpected" in message

    # Diffusers layout: names are reported as they are in the file; the marker key itself may be the missing one.
    diffusers_sd = {k: v for k, v in AutoencoderKLWan(base_dim=8).state_dict().items()}
    for dropped in ("decoder.mid_block.resnets.0.norm1.gamma", "encoder.down_blocks.2.resample.1.bias"):
        path = tmp_path / "diffusers_missing.safetensors"
        save_file({k: v.contiguous() for k, v in diffusers_sd.items() if k != dropped}, str(path))
        with pytest.raises(ValueError, match=re.escape(dropped)) as err:
            load_wan_vae(path)
        assert "diffusers_missing.safetensors" in str(err.value)

    # Original marker key missing: still recognised as a Wan VAE, the key is reported.
    sd = {k: v for k, v in original_sd.items() if k != "decoder.middle.0.residual.0.gamma"}
    path = tmp_path / "no_marker.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError, match=re.escape("decoder.mid_block.resnets.0.norm1.gamma")):
        load_wan_vae(path)


def test_wrong_shapes_and_wan22_are_rejected(tmp_path, original_sd):
    sd = dict(original_sd)
    sd["decoder.head.0.gamma"] = torch.ones(5, 1, 1, 1)
    path = tmp_path / "bad_shape.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError, match="bad_shape.pth"):
        load_wan_vae(path)

    sd = dict(original_sd)
    sd["decoder.conv1.weight"] = torch.zeros(32, 48, 3, 3, 3)  # Wan2.2 latent width
    path = tmp_path / "wan2.2_vae.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError, match="Wan2.2") as err:
        load_wan_vae(path)
    assert "wan2.2_vae.pth" in str(err.value)

    folder = tmp_path / "wan22"
    AutoencoderKLWan(base_dim=8, z_dim=48).save_pretrained(folder)
    with pytest.raises(ValueError, match="Wan2.1"):
        load_wan_vae(folder)


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist.pth"):
        load_wan_vae(tmp_path / "does_not_exist.pth")

    for name in ("garbage.safetensors", "garbage.pth"):
        path = tmp_path / name
        path.write_bytes(b"this is not a checkpoint" * 10)
        with pytest.raises(ValueError, match=re.escape(name)):
            load_wan_vae(path)

    truncated = tmp_path / "truncated.safetensors"
    save_file({"decoder.conv_in.weight": torch.zeros(4, 16, 3, 3, 3)}, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated.safetensors"):
        load_wan_vae(truncated)

    other = tmp_path / "not_a_vae.safetensors"
    save_file({"blocks.0.weight": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a Wan VAE"):
        load_wan_vae(other)

    empty_folder = tmp_path / "folder_without_config"
    empty_folder.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_wan_vae(empty_folder)
