"""`sdvg inspect / generate / encode-prompts` on tiny real checkpoint files."""

import json
import re
from pathlib import Path

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


# ---- models loaded only when the mode needs them --------------------------------------------------------------
def _spy_loads(monkeypatch):
    """Record every checkpoint the run loads (the real loaders still run)."""
    import sdvg_engine.loaders as loaders
    import sdvg_engine.reward as reward

    opened = []
    real_dit, real_reward = loaders.load_dit, reward.load_image_reward

    def load_dit(path, **kw):
        opened.append(("dit", str(path)))
        return real_dit(path, **kw)

    def load_image_reward(path, **kw):
        opened.append(("reward", str(path)))
        return real_reward(path, **kw)

    monkeypatch.setattr(loaders, "load_dit", load_dit)
    monkeypatch.setattr(reward, "load_image_reward", load_image_reward)
    return opened


@pytest.mark.parametrize("mode,given,loaded", [
    ("draft_only", ["--drafter"], ["drafter"]),                      # no --target at all
    ("draft_only", ["--drafter", "--target", "--reward"], ["drafter"]),  # given, never opened
    ("target_only", ["--target"], ["target"]),
    ("sdvg", ["--drafter", "--target", "--reward"], ["ImageReward", "drafter", "target"]),  # the reward first
])
def test_only_the_models_the_mode_uses_are_loaded(files, tmp_path, monkeypatch, mode, given, loaded):
    opened = _spy_loads(monkeypatch)
    paths = {"--drafter": files / "drafter.safetensors", "--target": files / "target.safetensors",
             "--reward": files / "ImageReward.safetensors"}
    out = tmp_path / "out"
    argv = ["generate", "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"),
            "--prompt", "a red ball", "--mode", mode, "--length", "21", "--width", str(WIDTH), "--height", str(HEIGHT),
            "--dtype", "fp32", "--device", "cpu", "--format", "webp", "--out", str(out)]
    for flag in given:
        argv += [flag, str(paths[flag])]
    assert main(argv) == 0
    assert [Path(p).stem for _, p in opened] == loaded
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["mode"] == mode and report["num_blocks"] == 2
    for role in ("drafter", "target"):
        used = role in loaded
        assert (report["settings"][f"{role}_context"] is not None) == used
        assert (role in report["settings"]["settings_source"]) == used
        assert (sum(report["model_calls"][role].values()) > 0) == used


def test_draft_only_without_target_writes_the_drafters_video(files, tmp_path):
    """The draft_only video without --target equals the one made with --target given (which it never runs)."""
    common = ["generate", "--drafter", str(files / "drafter.safetensors"), "--vae", str(files / "vae"),
              "--context-file", str(files / "embeds.safetensors"), "--prompt", "a red ball", "--mode", "draft_only",
              "--frames", "21", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
              "--format", "webp"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--target", str(files / "target.safetensors"), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "video_000.webp").read_bytes() == (tmp_path / "b" / "video_000.webp").read_bytes()


@pytest.mark.parametrize("mode,missing", [("sdvg", "--target"), ("random", "--target"), ("sdvg", "--drafter"),
                                          ("first_block_only", "--drafter")])
def test_a_mode_that_runs_a_model_requires_it(files, tmp_path, capsys, mode, missing):
    argv = ["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(files / "vae"), "--reward", str(files / "ImageReward.safetensors"), "--mode", mode,
            "--context-file", str(files / "embeds.safetensors"), "--device", "cpu", "--out", str(tmp_path / "o")]
    i = argv.index(missing)
    del argv[i: i + 2]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sdvg generate: error: {missing}: missing: --mode {mode} ") and "checkpoint" in err
    assert not (tmp_path / "o").exists()


# ---- the progress line prints what was compared with tau -------------------------------------------------------
PROGRESS = re.compile(r"block (\d+)/\d+: (?:margin|draft score) ([-+]\d+\.\d+) .*?vs (?:tau|running-quantile "
                      r"threshold) ([-+]\d+\.\d+) -> (accepted|rejected)")


@pytest.mark.parametrize("tau_mode,tau", [("relative", "-0.05"), ("anchor", "0.0"), ("accept_rate", None),
                                          ("fixed", "-1.5")])
def test_progress_line_shows_the_compared_quantity_and_threshold(files, tmp_path, capsys, tau_mode, tau):
    out = tmp_path / "out"
    argv = ["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(files / "vae"), "--reward", str(files / "ImageReward.safetensors"),
            "--context-file", str(files / "embeds.safetensors"), "--prompt", "a red ball", "--tau-mode", tau_mode,
            "--length", "57", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
            "--format", "webp", "--out", str(out)] + (["--tau", tau] if tau else [])
    assert main(argv) == 0
    lines = {int(m[1]) - 1: m.groups()[1:] for m in PROGRESS.finditer(capsys.readouterr().err)}
    blocks = json.loads((out / "report.json").read_text())["blocks"]
    judged = [b for b in blocks if b.get("decision")]
    assert judged and sorted(lines) == [b["index"] for b in judged]
    for block in judged:
        d = block["decision"]
        reference = d.get("reference_score")
        value = d["block_score"] - reference if tau_mode in ("relative", "anchor") else d["block_score"]
        printed_value, printed_threshold, verdict = lines[block["index"]]
        assert float(printed_value) == pytest.approx(value, abs=5e-4)
        assert float(printed_threshold) == pytest.approx(float(d["tau"]), abs=5e-4)
        assert (verdict == "accepted") == d["accept"] == (value >= float(d["tau"]))
