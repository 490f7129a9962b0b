"""The toy world's clips: which prompts (the showcase prompts, the fixed design / report split), how a clip runs
(the toy pipeline) and what its parts cost (per-block seconds, the DiTs' per-call costs).

The bottom of the toy's tools: the tree tool (``tree.py``), the baseline table (``baselines.py``), the routing report
and the demo build on it, in that order, and nothing here imports them.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..loaders import LoadedDiT
from ..loaders import build_pipeline as build
from ..pipeline import SDVGOptions, SpeculativePipeline, video_frames_to_latent_frames
from ..router import RewardRouter
from .text import embed_caption
from .world import SIZE, all_scenes, clip_metrics

NUM_FRAMES = 81  # 21 latent frames = 7 blocks of 3, like the real models
SHOWCASE_PROMPTS = (
    "a red ball moving right on black",
    "a blue square moving down on white",
    "a green triangle moving left on gray",
    "a yellow ball moving up on gray",
    "a blue triangle moving right on black",
    "a red square moving left on white",
)

# The held-out split (issue 24), indices into prompts_for(REPORT_PROMPTS[1]) (showcase prompts first): every
# earlier figure (and every default: taus, rates, the reward's training checks) used prompts 0-47; prompts 48-87 were
# used by nothing before the split. Choose settings on DESIGN only; quote REPORT.
DESIGN_PROMPTS = (0, 48)
REPORT_PROMPTS = (48, 88)
SPLITS = {"design": DESIGN_PROMPTS, "report": REPORT_PROMPTS}


def prompts_for(n: int) -> list[str]:
    """The showcase prompts first, then a fixed spread over the rest of the world."""
    out = list(SHOWCASE_PROMPTS[:n])
    rest = [s.caption for s in all_scenes() if s.caption not in out]
    rng = np.random.default_rng(2024)
    for i in rng.permutation(len(rest)):
        if len(out) >= n:
            break
        out.append(rest[i])
    return out


#: what the toy checkpoints were trained with (a preset's "checkpoint" choice): Self-Forcing's global cache, 4 calls
TOY_CONTEXT, TOY_SCHEDULE = "global_cache", "self_forcing"


def build_pipeline(models, tau: float = 0.0, preset: str = "native", workers: int | str = 1) -> SpeculativePipeline:
    """The toy pipeline (:func:`sdvg_engine.loaders.build_pipeline`). ``native`` (the toy default): both tiny DiTs as
    they were trained, on a global cache with 4 calls. ``reference``: the paper's configuration (both on the recompute
    window with the 5-call list), which the toy models were not trained for; it is here to compare decisions and
    quality under the two presets."""
    dits = [LoadedDiT(m, TOY_CONTEXT, TOY_SCHEDULE) for m in (models.drafter, models.target)]
    router = RewardRouter(models.scorer, tau=tau, aggregation="min")
    return build(dits[0], dits[1], models.vae, router, preset=preset, workers=workers)


def run_clip(pipe, caption, seed, options, num_frames=NUM_FRAMES):
    """One clip on ``pipe``: its result and its quality metrics (:func:`world.clip_metrics`)."""
    result = pipe.generate(embed_caption(caption), prompt=caption, num_frames=num_frames, width=SIZE, height=SIZE,
                           seed=seed, options=options)
    metrics = clip_metrics(result.frames.numpy(), caption)
    return result, metrics


def clip_list(clips: int, seeds: int = 1, skip: int = 0) -> list[tuple[str, int]]:
    """``clips`` prompts (:func:`prompts_for`: the showcase prompts first, then a fixed spread) less the first
    ``skip`` of them, x seeds ``0 .. seeds-1``."""
    return [(p, s) for s in range(seeds) for p in prompts_for(clips)[skip:]]


def split_clips(split: str, seeds: int = 1) -> list[tuple[str, int]]:
    """The clips of a fixed split (:data:`SPLITS`): ``design`` = prompts 0-47, ``report`` = prompts 48-87 of
    :func:`prompts_for`, x seeds ``0 .. seeds-1``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    lo, hi = SPLITS[split]
    return clip_list(hi, seeds, lo)


def weights_hash(weights: Path) -> str:
    """A short hash of a weights folder's MANIFEST.json (the files' sha256, checked when the models load)."""
    manifest = json.loads((Path(weights) / "MANIFEST.json").read_text())
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]


def call_costs(calls: dict, call_seconds: dict, num_blocks: int) -> dict:
    """Each model's call structure and seconds per DiT call, from a target-only and a draft-only run:
    ``calls`` / ``call_seconds`` ``{"target": report["model_calls"]["target"] of the target-only run, "drafter": the
    draft-only run's}`` (the pipeline's per-kind call counts and seconds). Returns ``{model: {"steps", "context",
    "per_call"}}``: denoising calls per block, ``global_cache`` (commit passes) or ``recompute_window``, and the mean
    seconds of one call (a t=0 context pass has the shape of a denoising call)."""
    out = {}
    for model in ("drafter", "target"):
        c, sec = calls[model], call_seconds[model]
        if not c.get("denoise") or c["denoise"] % num_blocks:
            raise ValueError(f"{model}: {c.get('denoise')} denoising calls is not a whole schedule per block over "
                             f"{num_blocks} blocks (expected the calls of an all-{model} run)")
        out[model] = {"steps": c["denoise"] // num_blocks,
                      "context": "recompute_window" if c.get("recompute") else "global_cache",
                      "per_call": sum(sec.values()) / sum(c.values())}
    return out


def measure_block_seconds(models, *, preset: str = "native", num_frames: int = NUM_FRAMES,
                          caption: str = "a red ball moving right on black", repeats: int = 2) -> dict:
    """Seconds per block of each component, measured on ``models`` with the pipeline's own timers (one worker;
    the fastest of ``repeats`` after a warm-up): drafter and target (their context passes included) from
    draft_only / target_only runs, decode from both, reward from scoring one 12-frame block."""
    pipe = build_pipeline(models, preset=preset, workers=1)
    fpb = pipe.target.frames_per_block
    B = video_frames_to_latent_frames(num_frames, fpb) // fpb
    embeds = embed_caption(caption)
    runs = {}
    for mode in ("target_only", "draft_only"):
        best = None
        for _ in range(repeats + 1):  # the first is a warm-up
            report = pipe.generate(embeds, prompt=caption, num_frames=num_frames, width=SIZE, height=SIZE, seed=0,
                                   options=SDVGOptions(mode=mode)).report
            best = report if best is None or report["seconds"]["wall"] < best["seconds"]["wall"] else best
        runs[mode] = best
    frames = torch.rand(4 * fpb, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    prompt = pipe.router.scorer.encode_prompt(caption)
    times = []
    for _ in range(repeats + 3):
        t = time.perf_counter()
        pipe.router.score_frames(frames, prompt)
        times.append(time.perf_counter() - t)
    seconds = {mode: r["seconds"] for mode, r in runs.items()}
    return {"drafter": seconds["draft_only"]["drafter"] / B, "target": seconds["target_only"]["target"] / B,
            "decode": (seconds["draft_only"]["vae"] + seconds["target_only"]["vae"]) / (2 * B), "score": min(times[1:]),
            "calls": call_costs({"target": runs["target_only"]["model_calls"]["target"],
                                 "drafter": runs["draft_only"]["model_calls"]["drafter"]},
                                {"target": runs["target_only"]["model_call_seconds"]["target"],
                                 "drafter": runs["draft_only"]["model_call_seconds"]["drafter"]}, B),
            "threads": torch.get_num_threads()}
