"""Decision trees with what a block verifier could look at (issue 38): the tree, the frames every node scored, and the
drafter's latents at every denoising step.

    python -m sdvg_engine.toy.signal_trees --split design --cache outputs/verifier_cache
    python -m sdvg_engine.toy.signal_trees --split report --cache outputs/verifier_cache
    python -m sdvg_engine.toy.signal_trees --extra 16 --cache outputs/verifier_cache     # training clips (below)

Each clip is built once by the tree tool's own :class:`~sdvg_engine.toy.tree.TreeBuilder` (so the tree and its frames
are what ``python -m sdvg_engine.toy.tree --keep-frames --cache DIR`` writes, in the same layout: the tree tool and
``bench/bench_routing.py --cache DIR`` read them), with two generators watched while it runs:

* the drafter: the ``x0`` it predicts at every denoising step of every drafted node (``draft_x0[node, step]``; the
  last step is the block it outputs), for the "does the drafter agree with itself" signals;
* the target: its block at every node (``target``), for the latent distance of draft to target (a diagnostic: a
  router that had the target's block would not need the draft).

Nodes are in ``(b, h)`` order, as :func:`sdvg_engine.toy.tree_frames.node_values`: node index ``2**(b-1) - 1 + h``.
Saved as ``<clip>.signals.pt`` beside the tree. Resumable: a clip whose three files exist is read, not rebuilt; run
it in chunks with ``--limit N`` (clips built per call).

``--extra N``: training clips for a learned verifier whose captions are in neither split's report set: the first N
scenes after the report split (prompts 88 .. 88 + N - 1 of :func:`~sdvg_engine.toy.clips.prompts_for`), seed 1.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from .clips import REPORT_PROMPTS, prompts_for, split_clips, weights_hash
from .models import WEIGHTS, load_toy_models
from .tree import ClipTree, TreeBuilder, tree_path
from .tree_frames import ScoredFrames, frames_path

SIGNALS_SUFFIX = ".signals.pt"
EXTRA_SEED = 1


def signals_path(tree_file: Path) -> Path:
    return Path(tree_file).with_suffix(SIGNALS_SUFFIX)


def node_index(b: int, h: int) -> int:
    """Flat index of drafted node (block ``b`` >= 1, history ``h``) in ``(b, h)`` order."""
    return 2 ** (b - 1) - 1 + h


def dfs_nodes(n: int) -> list[tuple[int, int]]:
    """The order in which :meth:`TreeBuilder.build` drafts its nodes: depth first, "accept" before "reject"."""
    out = []

    def visit(b, h):
        if b > n:
            return
        out.append((b, h))
        visit(b + 1, h | (1 << (b - 1)))
        visit(b + 1, h)

    visit(1, 0)
    return out


class _Watch:
    """Records, per ``generate_block`` call of ``gen``, the x0 predicted at each denoising step."""

    def __init__(self, gen):
        self.gen, self.blocks = gen, []
        self._run, self._generate = gen.run_model, gen.generate_block
        sigmas, timesteps = gen.schedule.sigmas, gen.schedule.timesteps
        current: list = []

        def run_model(kind, latents, timestep, start_frame, cache_bias=None):
            flow = self._run(kind, latents, timestep, start_frame, cache_bias)
            if kind == "denoise":
                k = min(range(len(timesteps)), key=lambda i: abs(timesteps[i] - timestep))
                current.append((latents.float() - sigmas[k] * flow.float()).detach().cpu())
            return flow

        def generate_block(*args, **kw):
            current.clear()
            sample = self._generate(*args, **kw)
            self.blocks.append(torch.stack([x[0] for x in current]))  # [steps, C, F, h, w]
            return sample

        gen.run_model, gen.generate_block = run_model, generate_block

    def close(self):
        self.gen.run_model, self.gen.generate_block = self._run, self._generate


def build_clip(builder: TreeBuilder, cache: Path, caption: str, seed: int, log=print) -> bool:
    """Build (or find) the tree, frames and signals of one clip under ``cache``; True if it was built now."""
    key = builder.key(caption, seed)
    path = tree_path(cache, key)
    if path.exists() and frames_path(path).exists() and signals_path(path).exists():
        return False
    n = builder.num_blocks - 1
    scored = ScoredFrames.empty(n)
    watches = [_Watch(builder.pipe.drafter), _Watch(builder.pipe.target)]
    try:
        tree = builder.build(caption, seed, scored=scored)
    finally:
        for w in watches:
            w.close()
    drafts, targets = watches[0].blocks, watches[1].blocks
    order = dfs_nodes(n)
    nodes = len(order)
    if len(drafts) < nodes or len(targets) < nodes + 1:
        raise RuntimeError(f"{caption!r}: recorded {len(drafts)} drafter / {len(targets)} target blocks, expected "
                           f">= {nodes} / {nodes + 1}")
    draft_x0 = [None] * nodes
    target = [None] * nodes
    for i, (b, h) in enumerate(order):  # the first `nodes` drafter calls are the tree's; then the draft-only run
        draft_x0[node_index(b, h)] = drafts[i]
        target[node_index(b, h)] = targets[i + 1][-1]  # the target's call 0 is block 0
    data = {"draft_x0": torch.stack(draft_x0).half(), "target": torch.stack(target).half(),
            "block0": targets[0][-1].half(), "key": key}
    scored.save(frames_path(path))
    tmp = signals_path(path).with_suffix(f".tmp{os.getpid()}")
    torch.save(data, tmp)
    tmp.replace(signals_path(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(tree.to_json()))
    tmp.replace(path)
    log(f"  {caption!r} seed {seed}: {tree.build_seconds:.1f} s")
    return True


def load_clip(cache: Path, key: dict):
    """(tree, ScoredFrames, signals dict) of a clip built by :func:`build_clip`, or None if not all three exist."""
    path = tree_path(cache, key)
    if not (path.exists() and frames_path(path).exists() and signals_path(path).exists()):
        return None
    tree = ClipTree.from_json(json.loads(path.read_text()), where=str(path))
    if tree.key != key:
        raise ValueError(f"{path}: made for {tree.key}, expected {key}; delete it to rebuild")
    return tree, ScoredFrames.load(frames_path(path), tree.num_decisions), torch.load(signals_path(path), weights_only=True)


def extra_clips(n: int) -> list[tuple[str, int]]:
    """Training clips outside the report split: scenes 88 .. 88 + n - 1 of :func:`prompts_for`, seed 1."""
    hi = REPORT_PROMPTS[1]
    return [(p, EXTRA_SEED) for p in prompts_for(hi + n)[hi:]]


def clips_of(split: str, extra: int = 0) -> list[tuple[str, int]]:
    return extra_clips(extra) if split == "extra" else split_clips(split)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("design", "report", "extra"), default="design")
    ap.add_argument("--extra", type=int, default=0, help="with --split extra: how many training clips")
    ap.add_argument("--cache", type=Path, default=Path("outputs/verifier_cache"))
    ap.add_argument("--weights", type=Path, default=WEIGHTS)
    ap.add_argument("--limit", type=int, default=0, help="build at most N clips in this call (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clips = clips_of("extra" if args.extra else args.split, args.extra)
    builder = TreeBuilder(load_toy_models(weights=args.weights), weights_id=weights_hash(args.weights))
    built, began = 0, time.perf_counter()
    for caption, seed in clips:
        if args.limit and built >= args.limit:
            break
        built += build_clip(builder, args.cache, caption, seed)
    todo = sum(load_clip(args.cache, builder.key(c, s)) is None for c, s in clips)
    print(f"built {built} clips in {time.perf_counter() - began:.0f} s; {len(clips) - todo}/{len(clips)} ready")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
