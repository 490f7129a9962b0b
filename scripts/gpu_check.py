"""`make gpu-check`: on a lent GPU, the CUDA-only tests and bench/real_size.py's configurations, within a time budget,
written to one JSON file and one markdown table. ``--tiny`` runs the same on the CPU with tiny configs (CI runs it, so
it cannot rot before a GPU is lent).

    python scripts/gpu_check.py --out outputs/gpu_check          # on the GPU machine, at most ~9 minutes
    python scripts/gpu_check.py --tiny --out /tmp/gpu_check      # CPU, tiny

With a ComfyUI checkout (``--comfyui`` or ``COMFYUI_PATH``; run with that ComfyUI's Python) it first runs the MODEL
path there (``scripts/gpu_model_path.py``: ComfyUI's loader with a scaled-fp8 target and a bf16 drafter, real fp8
matmuls on sm_89+ cards, against the pack's file loaders).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: bench/real_size.py configurations, in order of importance (a later one is skipped when the budget cannot fit it)
CONFIGS = [
    ("resident bf16 (+ one video with a prompt switch)", ["--prompt-switch"]),
    ("fp8 target", ["--fp8"]),
    ("fp8 target + offload + fp8 KV (one consumer GPU)", ["--fp8", "--offload", "target", "--kv-dtype", "fp8"]),
    ("2 lanes on one GPU", ["--workers", "2"]),
]


def run_tests(out: Path, tiny: bool, timeout: float) -> dict:
    env = dict(os.environ, SDVG_ONLY_CUDA_TESTS="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    (out / "cuda_tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", tail)}
    # exit 5 = nothing ran: on the CPU every CUDA test is deselected or skipped, which is what --tiny expects
    ok = proc.returncode == 0 or (proc.returncode == 5 and tiny)
    return {"returncode": proc.returncode, "ok": ok, "summary": tail, "counts": counts,
            "seconds": round(time.perf_counter() - started, 1)}


def run_bench(out: Path, tiny: bool, budget_s: float, started: float) -> list[dict]:
    rows, last = [], None
    for label, flags in CONFIGS:
        left = budget_s - (time.perf_counter() - started)
        if last is not None and left < 1.2 * last:
            rows.append({"config": label, "skipped": f"{left:.0f} s of the budget left, the last run took {last:.0f} s"})
            continue
        path = out / f"real_size_{len(rows)}.json"
        argv = [sys.executable, str(ROOT / "bench" / "real_size.py"), "--json", str(path), *flags]
        if tiny:
            argv.append("--tiny")
        else:
            argv += ["--repeats", "1"]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT / "bench", capture_output=True, text=True, timeout=max(60.0, left))
        last = time.perf_counter() - t0
        row = {"config": label, "flags": flags, "seconds": round(last, 1), "returncode": proc.returncode,
               "table": proc.stdout}
        if proc.returncode == 0:
            row["result"] = json.loads(path.read_text())
        else:
            row["error"] = proc.stderr[-3000:]
        rows.append(row)
    return rows


def run_model_path(out: Path, comfyui: str, tiny: bool, timeout: float) -> dict:
    """scripts/gpu_model_path.py on the ComfyUI checkout ``comfyui`` (its JSON, or the failure's tail)."""
    argv = [sys.executable, str(ROOT / "scripts" / "gpu_model_path.py"), "--comfyui", comfyui, "--out", str(out)]
    if tiny:
        argv += ["--tiny", "--repeats", "1"]
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": round(timeout, 1)}
    (out / "model_path.log").write_text(proc.stdout + proc.stderr)
    row = {"ok": proc.returncode == 0, "returncode": proc.returncode,
           "seconds": round(time.perf_counter() - started, 1)}
    if (out / "model_path.json").is_file():
        row["result"] = json.loads((out / "model_path.json").read_text())
    if proc.returncode != 0:
        row["error"] = proc.stderr[-3000:]
    return row


def markdown(report: dict) -> str:
    lines = [f"# GPU check, {report['date']} ({report['device']})", "",
             f"CUDA-only tests: {report['tests']['summary']} ({report['tests']['seconds']} s)", ""]
    model_path = report.get("model_path")
    if model_path is not None:
        r = model_path.get("result") or {}
        fp8 = r.get("fp8_matmuls", {})
        lines += [f"MODEL path ({r.get('comfyui', '?')}): {'ok' if model_path['ok'] else 'FAILED: see JSON'}; "
                  f"fp8 matmuls per target DiT call {fp8.get('per_dit_call')} (fp8 Linears: "
                  f"{fp8.get('fp8_linears_per_dit_call')}); MODEL path / file loaders: target_only "
                  f"{r.get('target_only', {}).get('model_path_over_file_loaders')}x, first_block_only "
                  f"{r.get('first_block_only', {}).get('model_path_over_file_loaders')}x", ""]
    lines += ["| configuration | run | wall s | vs target-only | peak GiB |", "|---|---|---|---|---|"]
    for row in report["bench"]:
        if "result" not in row:
            lines.append(f"| {row['config']} | {row.get('skipped') or 'failed: see JSON'} | | | |")
            continue
        runs = row["result"]["runs"]
        base = runs[0]["report"]["seconds"]["wall"]
        for r in runs:
            wall = r["report"]["seconds"]["wall"]
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            lines.append(f"| {row['config']} | {r['label']} | {wall:.2f} | {base / wall:.2f}x | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"))
    p.add_argument("--tiny", action="store_true", help="CPU, tiny configs (CI)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for everything (default 9 min)")
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH") or None,
                   help="a ComfyUI checkout: also check the MODEL path there (default: $COMFYUI_PATH)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device is visible: run this on the GPU machine, or pass --tiny")
    device = "CPU (tiny configs)" if args.tiny else torch.cuda.get_device_name(0)
    model_path = run_model_path(out, args.comfyui, args.tiny, args.budget_s / 4) if args.comfyui else None
    tests = run_tests(out, args.tiny, timeout=args.budget_s / 3)
    bench = run_bench(out, args.tiny, args.budget_s, started)
    report = {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
              "tests": tests, "bench": bench, "seconds": round(time.perf_counter() - started, 1)}
    if model_path is not None:
        report["model_path"] = model_path
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    failed = not tests["ok"] or any(r.get("returncode", 0) != 0 for r in bench) or (
        model_path is not None and not model_path["ok"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
