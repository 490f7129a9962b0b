"""`sdvg generate --taus` (one video per tau, replaying shared prefixes) and the preset / adaptive-tau / worker flags."""

import json
import math

import pytest

from sdvg_engine.cli import main
from sdvg_fixtures import HEIGHT, WIDTH, write_checkpoint_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt_sweep"))


def generate(files, out, *extra):
    return main(["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
                 "--vae", str(files / "vae"), "--reward", str(files / "ImageReward.safetensors"), "--prompt", "a red ball",
                 "--context-file", str(files / "embeds.safetensors"), "--frames", "45", "--width", str(WIDTH),
                 "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu", "--format", "webp", "--out", str(out),
                 *extra])


def test_taus_sweep_replays_and_equals_separate_runs(files, tmp_path, capsys):
    assert generate(files, tmp_path / "sweep", "--taus=-inf,inf,-inf") == 0
    out = capsys.readouterr().out
    assert "tau sweep -inf,inf,-inf" in out and "with replay" in out
    reports = json.loads((tmp_path / "sweep" / "report.json").read_text())
    assert [r["settings"]["tau"] for r in reports] == ["-inf", "inf", "-inf"]
    assert [r["replay"]["replayed_blocks"] for r in reports] == [0, 1, 4]  # block 0 is shared; the third repeats the first
    assert reports[0]["decisions"] == reports[2]["decisions"] == ["target", "draft", "draft", "draft"]
    for tau, report in ((-math.inf, reports[0]), (math.inf, reports[1])):
        assert generate(files, tmp_path / f"single{tau}", "--tau", str(tau)) == 0
        single = json.loads((tmp_path / f"single{tau}" / "report.json").read_text())
        assert single["decisions"] == report["decisions"] and single["draft_scores"] == report["draft_scores"]
    assert (tmp_path / "sweep" / "video_002.webp").read_bytes() == (tmp_path / "sweep" / "video_000.webp").read_bytes()


def test_preset_tau_mode_preprocess_and_workers_reach_the_run(files, tmp_path):
    assert generate(files, tmp_path / "a", "--preset", "native", "--tau-mode", "accept_rate", "--accept-rate", "0.5",
                    "--reward-preprocess", "torch", "--workers", "2") == 0
    settings = json.loads((tmp_path / "a" / "report.json").read_text())["settings"]
    assert settings["preset"] == "native" and settings["drafter_context"] == "global_cache"
    assert settings["tau_mode"] == "accept_rate" and settings["accept_rate"] == 0.5 and settings["preprocess"] == "torch"
    assert settings["workers"]["parallel"]
    assert generate(files, tmp_path / "b") == 0
    settings = json.loads((tmp_path / "b" / "report.json").read_text())["settings"]
    assert settings["preset"] == "reference" and settings["drafter_context"] == settings["target_context"] == "recompute_window"
    assert settings["drafter_schedule"] == settings["target_schedule"] == "krea"


def test_bad_accept_rate_is_refused_before_loading(files, tmp_path, capsys):
    assert generate(files, tmp_path / "c", "--tau-mode", "accept_rate", "--accept-rate", "1.5") == 2
    assert "--accept-rate 1.5" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
