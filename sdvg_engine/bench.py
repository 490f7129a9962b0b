"""``sdvg bench``: prompts x tau values x modes -> resumable JSONL, a summary table and a Pareto plot.

One JSON line per video: prompt, seed, mode, tau, decisions, draft scores, per-component seconds,
wall time, and evaluation scores of the final video (mean / min ImageReward over its frames and a
temporal proxy: mean cosine similarity of consecutive frames' ViT features). Evaluation runs after
the timed generation and is not counted in its time.

Under ``torchrun --nproc_per_node N`` each rank takes every N-th prompt (``torch.distributed``, gloo on
CPU, nccl on GPUs), writes ``OUT.rank<r>.jsonl``, and rank 0 merges them into ``OUT`` once all ranks are
done. Without torchrun the same command runs in one process. A rerun skips lines already written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .options import SDVGOptions


def run_key(prompt: str, seed: int, mode: str, tau: float | None) -> str:
    return json.dumps([prompt, seed, mode, None if tau is None else float(tau)])


def runs_for(prompts: list[str], taus: list[float], modes: list[str], seed: int) -> list[dict]:
    """Every (prompt, mode, tau) to run; tau matters only for ``sdvg`` mode (modes and taus checked first)."""
    check_runs(modes, taus)
    runs = []
    for i, prompt in enumerate(prompts):
        for mode in modes:
            for tau in (taus if SDVGOptions(mode=mode).scores_drafts else [None]):
                runs.append({"prompt_index": i, "prompt": prompt, "seed": seed + i, "mode": mode, "tau": tau})
    return runs


def shard(runs: list[dict], rank: int, world: int) -> list[dict]:
    """Rank r takes the runs of prompts r, r + world, ... (so one prompt's runs share a rank)."""
    return [r for r in runs if r["prompt_index"] % world == rank]


_ROW_KEYS = ("prompt", "seed", "mode", "tau")


def read_rows(path: Path, *, log=print) -> list[dict]:
    """The rows of a results file. A torn last line (a run killed mid-write) is dropped with a warning
    naming the file and line, and cut from the file so that appended rows stay valid JSONL; any
    other broken line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise ValueError(f"{path}: is not a file; give a .jsonl results file name")
        return []
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a JSONL results file (binary content); give a new --out name") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            is_last = all(not rest.strip() for rest in lines[number:])
            if is_last and not text.endswith("\n"):
                log(f"warning: {path}:{number}: dropping a torn last line ({len(line)} characters, {e}); "
                    "that run will be redone")
                keep = len("\n".join(lines[: number - 1]).encode("utf-8"))
                with path.open("r+b") as f:
                    f.truncate(keep + (1 if number > 1 else 0))
                break
            raise ValueError(f"{path}:{number}: not a JSON results line ({e}); fix or delete that line") from None
        if not isinstance(row, dict) or any(k not in row for k in _ROW_KEYS):
            raise ValueError(f"{path}:{number}: a results line needs the keys {list(_ROW_KEYS)}; fix or delete that line")
        rows.append(row)
    return rows


def read_done(paths: list[Path], *, log=print) -> set[str]:
    done = set()
    for path in paths:
        for row in read_rows(path, log=log):
            done.add(run_key(row["prompt"], row["seed"], row["mode"], row["tau"]))
    return done


def check_runs(modes: list[str], taus: list[float]) -> None:
    """Refuse unknown modes and NaN taus before any run starts (not after the other modes ran)."""
    from .pipeline import MODES

    if not modes:
        raise ValueError(f"no modes given; choose from {MODES}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    if "sdvg" in modes and not taus:
        raise ValueError("mode 'sdvg' needs at least one tau")
    bad = [t for t in taus if isinstance(t, float) and math.isnan(t)]
    if bad:
        raise ValueError("tau must not be NaN (use -inf to accept all, inf to reject all)")


def evaluate(scorer, frames: torch.Tensor, prompt: str) -> dict:
    """Quality of a finished video ``[T, H, W, 3]``: ImageReward mean/min over frames + temporal proxy."""
    from .router import temporal_consistency

    scores = scorer.score_frames(frames.permute(0, 3, 1, 2), prompt)
    return {"reward_mean": float(scores.scores.mean()), "reward_min": float(scores.scores.min()),
            "temporal": temporal_consistency(scores.image_features)}


def bench_rows(pipe, scorer, contexts: dict, runs: list[dict], *, num_frames: int, width: int, height: int, out_file: Path,
               done: set[str], router_factory, log=print) -> int:
    """Run every run not in ``done``, appending one JSON line each to ``out_file``; returns how many ran."""

    ran = 0
    for run in runs:
        key = run_key(run["prompt"], run["seed"], run["mode"], run["tau"])
        if key in done:
            continue
        pipe.router = router_factory(run["tau"] if run["tau"] is not None else -math.inf)
        result = pipe.generate(contexts[run["prompt"]], prompt=run["prompt"], num_frames=num_frames, width=width,
                               height=height, seed=run["seed"], options=SDVGOptions(mode=run["mode"]))
        rep = result.report
        row = {
            "prompt": run["prompt"], "seed": run["seed"], "mode": run["mode"], "tau": run["tau"],
            "decisions": rep["decisions"], "draft_scores": rep["draft_scores"],
            "acceptance": rep["acceptance"]["rate_after_first_block"], "seconds": rep["seconds"],
            "wall": rep["seconds"]["wall"], "speedup_estimate": rep["speedup_vs_target"],
            **evaluate(scorer, result.frames, run["prompt"]),
        }
        with out_file.open("a") as f:  # one write per line: a kill leaves at most a torn last line
            f.write(json.dumps(row) + "\n")
        ran += 1
        log(f"{run['mode']:>16} tau={run['tau']!s:>6} wall={row['wall']:.2f}s reward_min={row['reward_min']:+.3f} :: {run['prompt'][:50]}")
    return ran


def summarize(rows: list[dict]) -> list[dict]:
    """Mean per (mode, tau), with wall-time ratio against target_only when present."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["tau"]), []).append(row)
    base = groups.get(("target_only", None))
    base_wall = sum(r["wall"] for r in base) / len(base) if base else None
    base_q = sum(r["reward_mean"] for r in base) / len(base) if base else None
    out = []
    for (mode, tau), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] if kv[0][1] is not None else 0)):
        n = len(group)
        wall = sum(r["wall"] for r in group) / n
        acc = [r["acceptance"] for r in group if r["acceptance"] is not None]
        temporal = [r["temporal"] for r in group if r["temporal"] is not None]
        out.append({
            "mode": mode, "tau": tau, "videos": n, "wall": wall,
            "speedup": base_wall / wall if base_wall else None,
            "reward_mean": sum(r["reward_mean"] for r in group) / n,
            "reward_min": sum(r["reward_min"] for r in group) / n,
            "temporal": sum(temporal) / len(temporal) if temporal else None,
            "acceptance": sum(acc) / len(acc) if acc else None,
            "quality_vs_target": (sum(r["reward_mean"] for r in group) / n) / base_q if base_q else None,
        })
    return out


def format_table(summary: list[dict]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = ["| mode | tau | videos | wall s | speedup | IR mean | IR min | temporal | acceptance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['mode']} | {f(s['tau'], '+.2f')} | {s['videos']} | {s['wall']:.3f} | {f(s['speedup'], '.2f')}x | "
                     f"{s['reward_mean']:+.3f} | {s['reward_min']:+.3f} | {f(s['temporal'], '.3f')} | {f(s['acceptance'], '.0%')} |")
    return "\n".join(lines)


def pareto_plot(summary: list[dict], path: Path, *, quality_key: str = "reward_mean", size=(720, 480)) -> Path:
    """Quality vs wall time, one point per (mode, tau), drawn with Pillow (no matplotlib dependency)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = 70, 30, size[0] - 20, size[1] - 50
    xs = [s["wall"] for s in summary]
    ys = [s[quality_key] for s in summary]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad_x, pad_y = (x1 - x0) * 0.1 or 1.0, (y1 - y0) * 0.1 or 1.0
    x0, x1, y0, y1 = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y

    def to_px(x, y):
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text((left, bottom + 20), f"wall time per video (s): {x0:.2f} .. {x1:.2f}", fill="black")
    draw.text((5, 5), f"{quality_key}: {y0:+.3f} .. {y1:+.3f}", fill="black")
    colours = {"sdvg": (30, 110, 220), "target_only": (200, 40, 40), "draft_only": (40, 160, 60),
               "first_block_only": (200, 130, 20), "random": (130, 60, 170), "schedule": (60, 150, 150)}
    sdvg = sorted((s for s in summary if s["mode"] == "sdvg"), key=lambda s: s["wall"])
    if len(sdvg) > 1:
        draw.line([to_px(s["wall"], s[quality_key]) for s in sdvg], fill=colours["sdvg"], width=2)
    for s in summary:
        x, y = to_px(s["wall"], s[quality_key])
        c = colours.get(s["mode"], (0, 0, 0))
        draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill=c)
        label = s["mode"] if s["tau"] is None else f"tau {s['tau']:+.2f}"
        draw.text((x + 7, y - 6), label, fill=c)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path


def distributed_context():
    """``(rank, world)`` from torchrun's environment (initialising the process group), else ``(0, 1)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def merge_shards(out_file: Path, world: int) -> list[dict]:
    """Fold rank shard files into ``out_file`` (deduplicated) and return all rows."""
    rows, seen = [], set()
    paths = [out_file] + ([shard_path(out_file, r) for r in range(world)] if world > 1 else [])
    for path in paths:
        for row in read_rows(path):
            key = run_key(row["prompt"], row["seed"], row["mode"], row["tau"])
            if key not in seen:
                seen.add(key)
                rows.append(row)
    if world > 1:
        tmp = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, out_file)  # the merged file appears whole or not at all
        for r in range(world):
            shard_path(out_file, r).unlink(missing_ok=True)
    return rows


def shard_path(out_file: Path, rank: int) -> Path:
    return out_file.with_name(f"{out_file.stem}.rank{rank}{out_file.suffix}")
