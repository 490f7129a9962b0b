"""What a prompt switch costs, measured on the toy world: one clip with and without a switch, side by side.

    python bench/bench_prompt_switch.py [--repeats 5 --switch-block 3]

Per repeat (interleaved, one thread): the same toy caption and seed made draft_only (the Self-Forcing-style drafter on
its global cache, where a switch re-runs the commit passes of the blocks before it) and target_only, each once with one
prompt and once with the caption changed at ``--switch-block`` (a prompt schedule). Prints the median seconds of each
run, the switch's extra seconds and share, and the extra model calls by kind (the re-cache's commit passes, the text
encode), which the real-size price in ``bench/cost_model.py`` multiplies by per-call seconds. Run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdvg_engine.pipeline import SDVGOptions  # noqa: E402
from sdvg_engine.toy.clips import NUM_FRAMES, build_pipeline  # noqa: E402
from sdvg_engine.toy.models import load_toy_models  # noqa: E402
from sdvg_engine.toy.text import embed_caption  # noqa: E402
from sdvg_engine.toy.world import SIZE  # noqa: E402

BEFORE, AFTER = "a red ball moving left on black", "a red ball moving right on black"


def one_run(pipe, mode: str, switch_block: int | None) -> tuple[float, dict]:
    if switch_block is None:
        prompts = {"prompt_embeds": embed_caption(BEFORE), "prompt": BEFORE}
    else:
        prompts = {"prompt_schedule": [(0, embed_caption(BEFORE), BEFORE), (switch_block, embed_caption(AFTER), AFTER)]}
    started = time.perf_counter()
    result = pipe.generate(**prompts, num_frames=NUM_FRAMES, width=SIZE, height=SIZE, seed=0,
                           options=SDVGOptions(mode=mode))
    return time.perf_counter() - started, result.report["model_calls"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--switch-block", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pipe = build_pipeline(load_toy_models())
    rows = {}
    for mode in ("draft_only", "target_only"):
        one_run(pipe, mode, None)  # warm-up
        seconds = {"one prompt": [], "switch": []}
        calls = {}
        for _ in range(args.repeats):
            for label, block in (("one prompt", None), ("switch", args.switch_block)):
                s, calls[label] = one_run(pipe, mode, block)
                seconds[label].append(s)
        med = {k: statistics.median(v) for k, v in seconds.items()}
        rows[mode] = {"median_s": med, "extra_s": med["switch"] - med["one prompt"],
                      "extra_share": med["switch"] / med["one prompt"] - 1, "calls": calls}
    print(f"## A prompt switch at block {args.switch_block} on the toy world ({NUM_FRAMES} frames, one thread, median "
          f"of {args.repeats})\n")
    print("| mode | one prompt s | with a switch s | extra | model calls, one prompt -> with a switch |")
    print("|---|---|---|---|---|")
    for mode, r in rows.items():
        model = "drafter" if mode == "draft_only" else "target"
        print(f"| {mode} | {r['median_s']['one prompt']:.3f} | {r['median_s']['switch']:.3f} | "
              f"{r['extra_s'] * 1000:+.0f} ms ({r['extra_share']:+.1%}) | {r['calls']['one prompt'][model]} -> "
              f"{r['calls']['switch'][model]} |")
    return rows


if __name__ == "__main__":
    main()
