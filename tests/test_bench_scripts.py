"""The benchmark scripts run end to end in their small modes, so they cannot rot."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
def test_gpu_check_tiny_writes_its_json_and_table(tmp_path):
    """`make gpu-check`'s CPU mode: the CUDA-only test selection (all skipped here) and every real_size configuration
    (resident, fp8, offload + fp8 KV, 2 lanes), one JSON and one markdown table. (It runs bench/real_size.py --tiny four
    times, which is what keeps that script from rotting; a separate run of it here cost another minute of CI.)"""
    import json

    script = BENCH.parent / "scripts" / "gpu_check.py"
    # a budget no loaded CI machine runs out of: a configuration skipped for time would not be checked
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path), "--budget-s", "1500"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["ok"] and report["tests"]["counts"].get("skipped", 0) >= 3
    assert report["tests"]["counts"].get("passed", 0) == 0  # nothing but the CUDA-only tests was selected
    assert [row["config"] for row in report["bench"]] == ["resident bf16 (+ one video with a prompt switch)", "fp8 target",
                                                          "fp8 target + offload + fp8 KV (one consumer GPU)",
                                                          "2 lanes on one GPU"]
    assert all(row["returncode"] == 0 for row in report["bench"])
    assert [len(row["result"]["runs"]) for row in report["bench"]] == [5, 4, 4, 4]
    switched = report["bench"][0]["result"]["runs"][-1]["report"]
    assert [s["first_block"] for s in switched["settings"]["prompt_schedule"]] == [0, 1]
    assert switched["model_calls"]["drafter"]["text"] == 1  # the switch re-encoded the drafter's text
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| 2 lanes on one GPU | SDVG 1/1 accepted (100.0%) |" in table
