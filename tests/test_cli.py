"""`sdvg inspect / generate / encode-prompts` on tiny real checkpoint files."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sdvg_engine.cli import main
from sdvg_engine.text_encoder import load_prompt_embeddings
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, write_checkpoint_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt"))


def test_inspect_prints_format_and_architecture(files, capsys):
    assert main(["inspect", str(files / "drafter.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "format:         diffusers" in out and "context scheme: global_cache" in out and "custom Wan2.1" in out
    assert main(["inspect", "--json", str(files / "target.safetensors")]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["num_layers"] == 2


def test_inspect_missing_file_is_an_error(files, capsys):
    assert main(["inspect", str(files / "nope.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_embeddings_file_round_trip(files):
    pairs = load_prompt_embeddings(files / "embeds.safetensors")
    assert [p for p, _ in pairs] == ["a red ball", "a blue cube"]
    assert torch.equal(pairs[1][1], prompt_embeds(2))


@pytest.mark.parametrize("mode", ["sdvg", "target_only", "random"])
def test_generate_writes_videos_masks_and_report(files, tmp_path, mode, capsys):
    out = tmp_path / "out"
    code = main(["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
                 "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"), "--mode", mode,
                 "--reward", str(files / "ImageReward.safetensors"), "--tau", "-1.5",
                 "--frames", "21", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
                 "--format", "webp", "--out", str(out)])
    assert code == 0
    assert (out / "video_000.webp").stat().st_size > 0 and (out / "video_001.webp").exists()
    reports = json.loads((out / "report.json").read_text())
    assert len(reports) == 2 and reports[0]["settings"]["mode"] == mode and reports[0]["num_blocks"] == 2
    for i, report in enumerate(reports):
        # The mask strip recomputed from the report: 6 px per frame, green for kept drafts, grey for target frames.
        with Image.open(out / f"mask_{i:03d}.png") as im:
            strip = np.asarray(im.convert("RGB"))
        expected = np.zeros((24, 21 * 6, 3), dtype=np.uint8)
        for block in report["blocks"]:
            first, end = block["video_frames"]
            colour = (60, 200, 90) if block["source"] == "draft" else (110, 110, 110)
            expected[:, first * 6 : end * 6] = colour
        assert np.array_equal(strip, expected), i
        with Image.open(out / f"video_{i:03d}.webp") as im:
            assert (im.size, im.n_frames) == ((WIDTH, HEIGHT), 21)
    assert sorted(p.name for p in out.iterdir()) == [".sdvg-outputs.json", "mask_000.png", "mask_001.png", "report.json",
                                                     "video_000.webp", "video_001.webp"]  # no temporary files left
    manifest = json.loads((out / ".sdvg-outputs.json").read_text())  # what --overwrite may later remove
    assert manifest["files"] == ["mask_000.png", "mask_001.png", "report.json", "video_000.webp", "video_001.webp"]
    err = capsys.readouterr().err
    assert "block 2/2" in err
    if mode == "sdvg":
        assert "vs tau -1.50" in err and reports[0]["settings"]["tau"] == -1.5


def test_generate_sdvg_without_reward_is_refused(files, tmp_path, capsys):
    assert main(["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
              "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"), "--frames", "21",
              "--width", str(WIDTH), "--height", str(HEIGHT), "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("sdvg generate: error: --reward: mode 'sdvg' needs --reward "
                                               "(an ImageReward.pt file); or pick another --mode")


def test_generate_rejects_bad_frame_count(files, tmp_path, capsys):
    code = main(["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
                 "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"), "--frames", "20",
                 "--mode", "target_only", "--device", "cpu", "--out", str(tmp_path)])
    assert code == 2 and "whole blocks" in capsys.readouterr().err


def test_generate_tau_minus_inf_keeps_every_draft(files, tmp_path):
    """``--tau -inf`` (no ``=``) parses and accepts every draft after the forced first block."""
    out = tmp_path / "out"
    code = main(["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
                 "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"), "--prompt", "a red ball",
                 "--reward", str(files / "ImageReward.safetensors"), "--tau", "-inf", "--frames", "33",
                 "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
                 "--format", "webp", "--out", str(out), "--report", str(tmp_path / "r.json")])
    assert code == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["decisions"] == ["target", "draft", "draft"] and report["settings"]["tau"] == "-inf"
    assert sorted(p.name for p in out.iterdir()) == [".sdvg-outputs.json", "mask_000.png", "video_000.webp"]


def test_inspect_validates_vae_and_reward_like_their_loaders(files, tmp_path, capsys):
    assert main(["inspect", str(files / "vae")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "kind:           Wan VAE (z_dim 16, base_dim 8)"
    assert main(["inspect", "--json", str(files / "ImageReward.safetensors")]) == 0
    assert json.loads(capsys.readouterr().out)["kind"].startswith("ImageReward reward model (")
    # A reward file the loader refuses: inspect refuses it too, with the loader's message.
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    state = load_file(str(files / "ImageReward.safetensors"))
    with safe_open(str(files / "ImageReward.safetensors"), framework="pt") as f:
        meta = f.metadata()
    del state["mlp.layers.0.weight"]
    save_file(state, str(tmp_path / "reward_missing.safetensors"), metadata=meta)
    assert main(["inspect", str(tmp_path / "reward_missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "reward_missing.safetensors: not an ImageReward-v1.0-compatible state dict" in err and "mlp.layers.0.weight" in err


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_inspect_accepts_the_single_file_vaes_generate_accepts(files, tmp_path, capsys, layout):
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    from node_fixtures import original_state_dict
    from sdvg_engine.vae import load_wan_vae

    vae = AutoencoderKLWan.from_pretrained(str(files / "vae"))
    state = original_state_dict(vae) if layout == "original" else vae.state_dict()
    path = tmp_path / f"wan_vae_{layout}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    load_wan_vae(path)  # what generate --vae does
    assert main(["inspect", str(path)]) == 0
    assert "Wan VAE (z_dim 16, base_dim 8)" in capsys.readouterr().out
    prefixed = tmp_path / f"wan_vae_{layout}_prefixed.safetensors"
    save_file({f"first_stage_model.{k}": v.contiguous() for k, v in state.items()}, str(prefixed))
    assert main(["inspect", str(prefixed)]) == 0


def test_a_prompts_file_with_a_bom_reads_the_first_prompt_as_typed(tmp_path):
    from types import SimpleNamespace

    from sdvg_engine.cli import _read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeffa red ball\r\na paper boat\n".encode("utf-8"))
    assert _read_prompts(SimpleNamespace(prompt=None, prompts_file=str(path))) == ["a red ball", "a paper boat"]
