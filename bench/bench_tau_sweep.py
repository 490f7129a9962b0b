"""Interactive tau on the toy world: a 4-tau sweep with replay against four independent runs, side by side.

    python bench/bench_tau_sweep.py [--prompts 4 --repeats 3 --taus -2 -1.5 -1 0]

For each prompt, the taus are run in the order given, once with a replay memo (each run reuses the blocks before
its first changed decision) and once without; the outputs are checked equal, and the median over repeats of the
summed wall times is printed with their ratio, the replayed share of blocks, and the same for a sweep that goes
back and forth (the order a user moving a slider produces). Run it alone: it is a timing benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.toy.demo import DEFAULT_TAUS, NUM_FRAMES, build_pipeline, prompts_for
from sdvg_engine.toy.models import load_toy_models
from sdvg_engine.toy.text import embed_caption
from sdvg_engine.toy.world import SIZE


def sweep(pipe, prompts, taus, memo: bool):
    """Wall seconds of the sweep, the results, and the replayed blocks."""
    wall, results, replayed, blocks = 0.0, [], 0, 0
    for caption in prompts:
        pipe.memo = ReplayMemo() if memo else None
        for tau in taus:
            pipe.router.tau = tau
            started = time.perf_counter()
            result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=NUM_FRAMES, width=SIZE, height=SIZE,
                                   seed=0, options=SDVGOptions())
            wall += time.perf_counter() - started
            results.append(result)
            replayed += result.report["replay"]["replayed_blocks"]
            blocks += result.report["num_blocks"]
    return wall, results, replayed / blocks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--taus", type=float, nargs="+", default=list(DEFAULT_TAUS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pipe = build_pipeline(load_toy_models())
    prompts = prompts_for(args.prompts)
    orders = {"sweep": list(args.taus), "back and forth": list(args.taus) + list(reversed(args.taus))[1:]}
    sweep(pipe, prompts[:1], args.taus[:1], False)  # warm-up
    print(f"toy world, {len(prompts)} prompts x {NUM_FRAMES} frames, median of {args.repeats} repeats, 1 thread\n")
    print("| order | runs per prompt | independent s | with replay s | ratio | blocks replayed |")
    print("|---|---|---|---|---|---|")
    for name, taus in orders.items():
        plain, memo, share = [], [], 0.0
        for _ in range(args.repeats):
            w0, r0, _ = sweep(pipe, prompts, taus, False)
            w1, r1, share = sweep(pipe, prompts, taus, True)
            for a, b in zip(r0, r1):
                assert torch.equal(a.frames, b.frames) and torch.equal(a.latents, b.latents), "replay changed an output"
            plain.append(w0)
            memo.append(w1)
        p, m = statistics.median(plain), statistics.median(memo)
        print(f"| {name} ({', '.join(f'{t:g}' for t in taus)}) | {len(taus)} | {p:.2f} | {m:.2f} | {p / m:.2f}x | {share:.0%} |")


if __name__ == "__main__":
    main()
