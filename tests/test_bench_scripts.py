"""The benchmark scripts run end to end in their small modes, so they cannot rot."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_real_size_tiny_prints_both_tables(tmp_path):
    out = tmp_path / "numbers.json"
    proc = subprocess.run([sys.executable, str(BENCH / "real_size.py"), "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| target: denoise (5 calls) |" in proc.stdout
    assert "| VAE decode (3 latent -> 12 frames) |" in proc.stdout
    for label in ("target-only", "draft-only", "SDVG 0/2 accepted", "SDVG 2/2 accepted (100.0%)"):
        assert f"| {label}" in proc.stdout
    assert out.stat().st_size > 0
