"""`sdvg bench`: resumable JSONL, summary and plot; two-rank sharding under torchrun (gloo, CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdvg_engine import bench
from sdvg_engine.cli import main
from sdvg_fixtures import HEIGHT, WIDTH, write_checkpoint_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("bench"))


def _args(files, out):
    return ["bench", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(files / "vae"), "--reward", str(files / "ImageReward.safetensors"),
            "--context-file", str(files / "embeds.safetensors"), "--taus=-1.0,0.5", "--modes", "sdvg,target_only",
            "--frames", "21", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
            "--out", str(out)]


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_bench_writes_lines_summary_and_plot_then_resumes(files, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert main(_args(files, out)) == 0
    rows = _rows(out)
    assert len(rows) == 2 * (2 + 1)  # 2 prompts x (2 taus of sdvg + target_only)
    assert {(r["mode"], r["tau"]) for r in rows} == {("sdvg", -1.0), ("sdvg", 0.5), ("target_only", None)}
    for r in rows:
        assert set(r) >= {"prompt", "seed", "decisions", "draft_scores", "seconds", "reward_mean", "reward_min", "temporal"}
    printed = capsys.readouterr()
    assert "| sdvg | -1.00 | 2 |" in printed.out and "| target_only | - | 2 |" in printed.out
    assert out.with_suffix(".png").stat().st_size > 0

    assert main(_args(files, out)) == 0  # a rerun skips every finished line
    assert "ran 0 videos, skipped 6" in capsys.readouterr().err
    assert len(_rows(out)) == 6

    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:37])  # killed while writing the 5th line
    assert main(_args(files, out)) == 0
    err = capsys.readouterr().err
    assert f"warning: {out}:5: dropping a torn last line (37 characters" in err
    assert "ran 2 videos, skipped 4" in err
    def content(rows):  # everything but the timings is deterministic
        return sorted(json.dumps([r["prompt"], r["mode"], r["tau"], r["decisions"], r["draft_scores"], r["reward_mean"]])
                      for r in rows)

    assert content(_rows(out)) == content(json.loads(line) for line in lines)


def test_shard_covers_every_run_once():
    runs = bench.runs_for([f"p{i}" for i in range(5)], [-0.7, -1.0], ["sdvg", "target_only"], seed=0)
    shards = [bench.shard(runs, r, 3) for r in range(3)]
    keys = [bench.run_key(r["prompt"], r["seed"], r["mode"], r["tau"]) for s in shards for r in s]
    assert sorted(keys) == sorted(bench.run_key(r["prompt"], r["seed"], r["mode"], r["tau"]) for r in runs)
    assert len(set(keys)) == len(keys) == 15


@pytest.mark.slow
def test_two_ranks_under_torchrun(files, tmp_path):
    out = tmp_path / "dist.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", "29517", "-m", "sdvg_engine.cli"] + _args(files, out)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == 6
    assert len({bench.run_key(r["prompt"], r["seed"], r["mode"], r["tau"]) for r in rows}) == 6
    assert "rank 0/2: ran 3 videos" in proc.stderr and "rank 1/2: ran 3 videos" in proc.stderr
    assert not list(tmp_path.glob("dist.rank*.jsonl"))  # shards merged and removed


def test_read_rows_torn_and_broken_lines(tmp_path):
    good = [{"prompt": "a", "seed": 1, "mode": "sdvg", "tau": -0.7}, {"prompt": "b", "seed": 2, "mode": "random", "tau": None}]
    path = tmp_path / "r.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in good)
    path.write_text(text + '{"prompt": "c", "se')
    warnings = []
    assert bench.read_rows(path, log=warnings.append) == good
    assert warnings == [f"warning: {path}:3: dropping a torn last line (19 characters, Unterminated string starting at: "
                        "line 1 column 17 (char 16)); that run will be redone"]
    assert path.read_text() == text  # cut, so that appended lines stay valid JSONL
    path.write_text(json.dumps(good[0]) + "\n{oops\n" + json.dumps(good[1]) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON results line"):
        bench.read_rows(path)
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: a results line needs the keys"):
        bench.read_rows(path)


def test_unknown_mode_is_refused_before_any_run():
    with pytest.raises(ValueError, match="unknown mode 'sdvgg'"):
        bench.runs_for(["p"], [-0.7], ["target_only", "sdvgg"], seed=0)
    with pytest.raises(ValueError, match="NaN"):
        bench.runs_for(["p"], [float("nan")], ["sdvg"], seed=0)
