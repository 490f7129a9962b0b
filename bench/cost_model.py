"""Real-size roofline cost model of SDVG schedules (832x480, Wan2.1 1.3B drafter + 14B target).

1. FLOPs and bytes moved per component, counted on the REAL architectures built on the meta device (no weights,
   no GPU): one DiT call over a 3-latent-frame block (4680 query tokens) attending to its KV context, with the
   recompute window (Krea: anchor + last 2 latent frames, rebuilt by a t=0 pass) and with the global cache
   (Self-Forcing: growing by 3 frames per block); the t=0 context passes; the Wan VAE decode of one block
   (3 latent -> 12 video frames) and the anchor re-encode; ImageReward (BLIP ViT-L/16 @ 224 + BERT
   cross-attention) on 12 frames. FLOPs come from ``torch.utils.flop_counter.FlopCounterMode``; bytes from an
   unfused per-op count (every non-view ATen op reads its inputs and writes its outputs; attention counted as one
   fused flash kernel: q, k, v, out). :func:`dit_flops` is the closed form, checked against FlopCounterMode in
   tests/test_cost_model.py.
2. A roofline per call, ``max(flops / (peak * mfu), bytes / (bandwidth * bw_eff))``, on named GPUs (peak dense
   bf16 tensor TFLOPs, memory bandwidth) with a stated efficiency per component class (:data:`EFFICIENCY`).
3. :func:`simulate_schedule`: expected video time and speedup vs target-only on the same workers for the
   reference's schedule, this project's sequential one and the overlapped two-GPU one, with or without hybrid
   k=3, as an event simulation over Bernoulli accept sequences (fixed seed). It takes per-component per-block
   times (:func:`block_times` builds them from the roofline; the lead can feed measured toy timings instead).

    python bench/cost_model.py            # tables (markdown), ~15 s on a CPU
    python bench/cost_model.py --json     # the same numbers as JSON
    python bench/cost_model.py --mfu dit=0.4 --gpus H200   # other efficiency assumptions / GPUs

Acceptance rates: the paper counts acceptance over all 9 blocks with block 0 (always the target's) as a reject, so
a table rate ``a`` means ``9a`` accepted of 8 drafted blocks, i.e. a per-drafted-block probability
``p = 9a/8`` (:func:`drafted_accept_prob`): 73.1 / 78.0 / 83.4 / 87.5 % -> 82.2 / 87.8 / 93.8 / 98.4 %.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config  # noqa: E402
from sdvg_engine.dry_run import MetaBytes  # noqa: E402
from sdvg_engine.offload import dit_flops  # noqa: E402,F401  (the one DiT FLOP formula; checked in tests/test_cost_model.py)

# ------------------------------------------------------------------------------------------------ hardware
@dataclass(frozen=True)
class GPU:
    """Peak dense bf16 tensor throughput (FP32 accumulate, no sparsity) and memory bandwidth, from the datasheets."""

    name: str
    bf16_tflops: float
    mem_gbps: float


GPUS = {
    # H200 SXM: 989.4 TFLOPS bf16 dense (1979 with sparsity), 4.8 TB/s HBM3e.
    "H200": GPU("NVIDIA H200 SXM", 989.4, 4800.0),
    # RTX A6000: 309.7 TFLOPS tensor with sparsity -> 154.8 dense, 768 GB/s GDDR6.
    "A6000": GPU("NVIDIA RTX A6000", 154.8, 768.0),
    # RTX 4090: 165.2 TFLOPS bf16 with FP32 accumulate (330.3 with FP16 accumulate), 1008 GB/s GDDR6X.
    "RTX 4090": GPU("NVIDIA GeForce RTX 4090", 165.2, 1008.0),
}


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak reached by one component class: ``mfu`` of the tensor FLOPs, ``bw`` of the bandwidth."""

    mfu: float
    bw: float


#: Stated assumptions, not fitted: eager bf16 with flash attention. DiT calls are big GEMMs (4680 tokens x
#: dim 1536/5120) plus attention over 4.7k-42k keys; the VAE is conv3d + GroupNorm/SiLU at up to 480x832x96
#: per frame; ImageReward is a batch of 12 ViT-L images (197 tokens) and a 35-token BERT.
EFFICIENCY = {"dit": Efficiency(0.45, 0.8), "vae": Efficiency(0.30, 0.7), "reward": Efficiency(0.25, 0.7)}


def roofline_seconds(flops: float, nbytes: float, gpu: GPU, eff: Efficiency) -> float:
    """One call: compute time or memory time, whichever is larger."""
    return max(flops / (gpu.bf16_tflops * 1e12 * eff.mfu), nbytes / (gpu.mem_gbps * 1e9 * eff.bw))


# ------------------------------------------------------------------------------------------------ counting
class _SDPAAsFused(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` as one fused kernel (reads q, k, v, mask; writes out)."""

    def __init__(self, bytes_counter: "ByteCounter"):
        super().__init__()
        self.counter = bytes_counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.counter.depth += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.counter.depth -= 1
            self.counter.add_moved(list(args) + list(kwargs.values()) + [out])
            return out
        return func(*args, **kwargs)


class ByteCounter(MetaBytes):
    """Bytes moved by eager execution without fusion: inputs + outputs of every non-view ATen op (the project's one
    meta byte counter, :class:`sdvg_engine.dry_run.MetaBytes`, counting moved bytes only).

    An upper bound for one kernel per op (caches absorb some re-reads); weights are read once per use.
    Use with :func:`count_cost`, which also makes attention count as one fused kernel.
    """

    def __init__(self):
        super().__init__(live=False, moved=True)


@dataclass
class Cost:
    flops: float
    bytes: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def scale(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.bytes * k)


def count_cost(fn: Callable[[], object]) -> Cost:
    """FLOPs (FlopCounterMode) and unfused bytes (:class:`ByteCounter`) of ``fn()``; works on meta tensors."""
    bytes_counter = ByteCounter()
    with FlopCounterMode(display=False) as flops, bytes_counter, _SDPAAsFused(bytes_counter):
        fn()
    return Cost(float(flops.get_total_flops()), float(bytes_counter.bytes))


# ---------------------------------------------------------------------------------------- real architectures
WIDTH, HEIGHT, FRAMES_PER_BLOCK = 832, 480, 3
DRAFTER, TARGET = "Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B"


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            t.data = t.data.to(dtype)  # per tensor: ModelMixin.to(dtype) warns about fp32-kept modules
    return module.eval().requires_grad_(False)


@functools.lru_cache(maxsize=None)
def _meta_dit(name: str, num_layers: int | None = None):
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    with torch.device("meta"):
        model = _cast(CausalWanTransformer3DModel(**wan_config(name, **overrides)), torch.bfloat16)
        text_kv = model.encode_text(torch.zeros(1, 512, 4096))
    return model, text_kv


def dit_call_cost(name: str, context_frames: int, *, width: int = WIDTH, height: int = HEIGHT,
                  frames: int = FRAMES_PER_BLOCK) -> Cost:
    """One DiT call over a block of ``frames`` latent frames after ``context_frames`` cached frames (bf16, meta).

    Counted on 1- and 2-layer copies of the architecture and extrapolated to all layers (every layer runs the
    same ops on the same shapes, so this is exact and ~20x faster than counting the 40-layer model).
    """
    layers = wan_config(name)["num_layers"]
    one = _dit_call_cost(name, 1, context_frames, width, height, frames)
    two = _dit_call_cost(name, 2, context_frames, width, height, frames)
    return one + (two + one.scale(-1)).scale(layers - 1)


@functools.lru_cache(maxsize=None)
def _dit_call_cost(name, num_layers, context_frames, width, height, frames) -> Cost:
    model, text_kv = _meta_dit(name, num_layers)
    h, w = height // 8, width // 8
    with torch.device("meta"):
        cache = model.new_kv_cache(1, h, w, context_frames + frames)
        x = torch.zeros(1, 16, frames, h, w)
        t = torch.zeros(1, frames)
    return count_cost(lambda: model.forward_block(x, t, text_kv, cache, context_frames))


@functools.lru_cache(maxsize=None)
def _meta_vae():
    from diffusers import AutoencoderKLWan

    from sdvg_engine.vae import StreamingWanVAE

    with torch.device("meta"):
        return StreamingWanVAE(_cast(AutoencoderKLWan(), torch.bfloat16))


def vae_decode_cost(*, first: bool = False, width: int = WIDTH, height: int = HEIGHT,
                    latent_frames: int = FRAMES_PER_BLOCK) -> Cost:
    """Streaming decode of one block (bf16): the first block of a video (3 latents -> 9 frames) or a later one (-> 12)."""
    return _vae_decode_cost(first, width, height, latent_frames)


@functools.lru_cache(maxsize=None)
def _vae_decode_cost(first, width, height, latent_frames) -> Cost:
    vae = _meta_vae()
    vae.reset()
    shape = (1, 16, latent_frames, height // 8, width // 8)
    if not first:
        vae.decode_block(torch.zeros(shape, device="meta"))
    cost = count_cost(lambda: vae.decode_block(torch.zeros(shape, device="meta")))
    vae.reset()
    return cost


@functools.lru_cache(maxsize=None)
def vae_encode_frame_cost(width: int = WIDTH, height: int = HEIGHT) -> Cost:
    """The recompute window's anchor: one pixel frame re-encoded by the VAE (blocks >= 2)."""
    vae = _meta_vae()
    return count_cost(lambda: vae.encode_frame(torch.zeros(1, 3, height, width, device="meta")))


@functools.lru_cache(maxsize=None)
def reward_cost(frames: int = 12) -> Cost:
    """ImageReward-v1.0 (fp16) on ``frames`` 224x224 crops, batched, with a 35-token prompt."""
    from sdvg_engine.reward import ImageRewardConfig, ImageRewardModel

    with torch.device("meta"):
        model = _cast(ImageRewardModel(ImageRewardConfig.v1()), torch.float16)
        ids = torch.zeros(1, 35, dtype=torch.long)
        mask = torch.ones(1, 35, dtype=torch.long)
        pixels = torch.zeros(frames, 3, 224, 224, dtype=torch.float16)
    return count_cost(lambda: model(pixels, ids, mask))


# ------------------------------------------------------------------------------------------ per-block times
CONTEXTS = ("recompute_window", "global_cache")


def _dit_block_calls(name: str, context: str, blocks: int) -> dict[str, list[Cost]]:
    """Per block b: one denoising call, and the context work paid before denoising b (zero for b = 0).

    recompute_window: denoise over 3 context + 3 block frames; before b >= 1 a t=0 pass over the 3 context frames
    (block-causal from position 0), plus from b = 2 on the anchor re-encode (VAE, counted here as DiT-side work).
    global_cache: denoise block b over the 3b cached frames + itself; before b >= 1 the commit pass of block b-1
    (a t=0 call at its own position over the 3(b-1) frames before it).
    """
    fpb = FRAMES_PER_BLOCK
    zero = Cost(0.0, 0.0)
    if context == "recompute_window":
        denoise = [dit_call_cost(name, 0)] + [dit_call_cost(name, fpb)] * (blocks - 1)
        ctx = [zero] + [dit_call_cost(name, 0)] * (blocks - 1)
    elif context == "global_cache":
        denoise = [dit_call_cost(name, fpb * b) for b in range(blocks)]
        ctx = [zero] + [dit_call_cost(name, fpb * (b - 1)) for b in range(1, blocks)]
    else:
        raise ValueError(f"unknown context scheme {context!r}; choose one of {CONTEXTS}")
    return {"call": denoise, "context": ctx}


def component_costs(blocks: int = 9) -> dict[str, Cost]:
    """The per-component table (one call each) at 832x480."""
    fpb = FRAMES_PER_BLOCK
    rows = {}
    for label, name in (("drafter 1.3B", DRAFTER), ("target 14B", TARGET)):
        rows[f"{label}: denoise, recompute window (3 ctx + 3 frames)"] = dit_call_cost(name, fpb)
        rows[f"{label}: t=0 recompute pass (3 frames)"] = dit_call_cost(name, 0)
        rows[f"{label}: denoise, global cache, block 1 (6 frames)"] = dit_call_cost(name, fpb)
        rows[f"{label}: denoise, global cache, block 6 (21 frames)"] = dit_call_cost(name, 6 * fpb)
        if blocks > 7:
            rows[f"{label}: denoise, global cache, block {blocks - 1} ({fpb * blocks} frames)"] = dit_call_cost(name, fpb * (blocks - 1))
    rows["VAE decode, block 0 (3 latents -> 9 frames)"] = vae_decode_cost(first=True)
    rows["VAE decode, later block (3 latents -> 12 frames)"] = vae_decode_cost()
    rows["VAE encode, anchor frame (recompute window, b >= 2)"] = vae_encode_frame_cost()
    rows["ImageReward, 12 frames batched"] = reward_cost(12)
    return rows


CLASS_OF = {"draft_call": "dit", "draft_context": "dit", "target_call": "dit", "target_context": "dit",
            "decode": "vae", "score": "reward"}


def block_times(gpu: GPU, *, blocks: int = 9, drafter_context: str = "global_cache",
                target_context: str = "recompute_window", efficiency: dict[str, Efficiency] | None = None,
                score_frames: int = 12) -> dict[str, list[float]]:
    """Per-component per-block seconds on ``gpu`` (lists indexed by block), the input of :func:`simulate_schedule`.

    Keys: ``draft_call`` / ``target_call`` (one denoising call), ``draft_context`` / ``target_context`` (context
    work before that model generates block b: recompute pass + anchor encode, or commit pass), ``decode`` (block
    0 decodes 9 frames, later blocks 12), ``score`` (ImageReward on the block's frames).
    """
    eff = {**EFFICIENCY, **(efficiency or {})}

    def sec(cost: Cost, cls: str) -> float:
        return roofline_seconds(cost.flops, cost.bytes, gpu, eff[cls])

    anchor = sec(vae_encode_frame_cost(), "vae")
    out = {}
    for prefix, name, context in (("draft", DRAFTER, drafter_context), ("target", TARGET, target_context)):
        calls = _dit_block_calls(name, context, blocks)
        out[f"{prefix}_call"] = [sec(c, "dit") for c in calls["call"]]
        ctx = [sec(c, "dit") if c.flops else 0.0 for c in calls["context"]]
        if context == "recompute_window":
            ctx = [s + (anchor if b >= 2 else 0.0) for b, s in enumerate(ctx)]
        out[f"{prefix}_context"] = ctx
    out["decode"] = [sec(vae_decode_cost(first=True), "vae")] + [sec(vae_decode_cost(), "vae")] * (blocks - 1)
    out["score"] = [sec(reward_cost(9), "reward")] + [sec(reward_cost(score_frames), "reward")] * (blocks - 1)
    return out


@functools.lru_cache(maxsize=None)
def text_encode_cost(name: str) -> Cost:
    """One prompt's cross-attention K/V (the text MLP and every layer's K/V projections over 512 rows): what a model
    pays at a prompt schedule's switch (:meth:`sdvg_engine.generator.CausalGenerator.use_prompt_of`)."""
    layers = wan_config(name)["num_layers"]
    one, two = (_text_encode_cost(_meta_dit(name, n)[0]) for n in (1, 2))  # built outside the count
    return one + (two + one.scale(-1)).scale(layers - 1)


def _text_encode_cost(model) -> Cost:
    return count_cost(lambda: model.encode_text(torch.zeros(1, 512, 4096, device="meta")))


def switch_seconds(gpu: GPU, switch_block: int, *, drafter_context: str = "global_cache",
                   target_context: str = "recompute_window", efficiency: dict[str, Efficiency] | None = None) -> dict:
    """What a prompt switch at ``switch_block`` adds to a video on ``gpu``, per model: its text encode, and the
    re-cache of the committed frames under the new prompt. A recompute window rebuilds its context before every block
    anyway (nothing extra); a global cache re-runs the commit pass of every block before the switch, of which one
    (block ``switch_block - 1``'s) it pays anyway. The target-made block after the switch (``target_after_switch``)
    is priced by the schedule, like block 0."""
    eff = {**EFFICIENCY, **(efficiency or {})}
    out = {}
    for prefix, name, context in (("drafter", DRAFTER, drafter_context), ("target", TARGET, target_context)):
        text = roofline_seconds(*asdict(text_encode_cost(name)).values(), gpu, eff["dit"])
        recache = 0.0
        if context == "global_cache":
            recache = sum(roofline_seconds(*asdict(dit_call_cost(name, FRAMES_PER_BLOCK * b)).values(), gpu, eff["dit"])
                          for b in range(switch_block - 1))
        out[prefix] = {"text_encode_s": text, "recache_s": recache, "extra_calls": max(0, switch_block - 1)
                       if context == "global_cache" else 0}
    return out


# ------------------------------------------------------------------------------------------------ schedules
SCHEDULES = ("reference", "sequential", "overlapped")
PAPER_RATES = (0.731, 0.780, 0.834, 0.875)
PAPER_SPEEDUPS = {"sdvg": (1.59, 1.69, 1.88, 2.05), "hybrid+cascade": (1.88, 1.96, 2.01, 2.11)}


def drafted_accept_prob(paper_rate: float, blocks: int = 9) -> float:
    """The paper's acceptance (over all blocks, block 0 a reject) -> probability per drafted block (b >= 1)."""
    return min(1.0, paper_rate * blocks / (blocks - 1))


def _at(value, b: int) -> float:
    return float(value[b]) if isinstance(value, (list, tuple)) else float(value)


@dataclass
class ScheduleOptions:
    """What a schedule runs. ``draft_steps``/``target_steps``: denoising calls per block (engine: 4 / 5; the reference:
    5 / 5). ``hybrid_k``: on reject the target continues from the drafter's state after k steps, so it runs
    ``target_steps - k`` calls. ``placement`` (overlapped only): component -> worker; the target needs its own.
    ``verify=False`` (sequential only): the decisions come before drafting (mode ``schedule``, ``random``), so a
    target block costs the target alone and a kept draft is drafted and decoded, never scored."""

    blocks: int = 9
    draft_steps: int = 4
    target_steps: int = 5
    hybrid_k: int | None = None
    placement: dict[str, str] = field(default_factory=lambda: {"target": "gpu0", "draft": "gpu1", "decode": "gpu1", "score": "gpu1"})
    speculate_draft: bool = True
    target_speculates: bool = True
    verify: bool = True

    def target_calls_on_reject(self) -> int:
        if self.hybrid_k is None:
            return self.target_steps
        if not 0 < self.hybrid_k < min(self.draft_steps, self.target_steps):
            raise ValueError(f"hybrid_k={self.hybrid_k} must lie in 1..{min(self.draft_steps, self.target_steps) - 1}")
        return self.target_steps - self.hybrid_k


def _check_times(times: dict, blocks: int) -> None:
    missing = [k for k in CLASS_OF if k not in times]
    if missing:
        raise ValueError(f"times is missing {missing}; expected keys {sorted(CLASS_OF)} (seconds, a number or a per-block list)")
    for k in CLASS_OF:
        v = times[k]
        if isinstance(v, (list, tuple)) and len(v) < blocks:
            raise ValueError(f"times[{k!r}] has {len(v)} entries, need one per block ({blocks})")


def sequential_time(times: dict, accepts: Sequence[bool], opts: ScheduleOptions, *, reference: bool = False) -> float:
    """One video on one worker, everything in order. ``accepts[b]`` for b >= 1 (``accepts[0]`` is ignored).

    reference=True is the reference's loop: drafts, decodes and scores block 0 too (then the target redoes it),
    and rebuilds both models' contexts before every block b >= 1. Otherwise this project's: block 0 by the target
    only, the drafter's context updated before each draft, the target's rebuilt only when it must generate.
    """
    t = 0.0
    for b in range(opts.blocks):
        dc, tc = _at(times["draft_call"], b), _at(times["target_call"], b)
        decode, score = _at(times["decode"], b), _at(times["score"], b)
        if b == 0:
            if reference:
                t += opts.draft_steps * dc + decode + score
            t += opts.target_steps * tc + decode
            continue
        if not opts.verify and not reference:  # decided before drafting: one model per block, nothing scored
            if accepts[b]:
                t += _at(times["draft_context"], b) + opts.draft_steps * dc + decode
            else:
                t += _at(times["target_context"], b) + opts.target_steps * tc + decode
            continue
        t += _at(times["draft_context"], b) + opts.draft_steps * dc + decode + score
        if reference:
            t += _at(times["target_context"], b)
        if not accepts[b]:
            t += (0.0 if reference else _at(times["target_context"], b)) + opts.target_calls_on_reject() * tc + decode
    return t


def target_only_time(times: dict, opts: ScheduleOptions, *, workers: int = 1) -> float:
    """Target-only video: one worker in order, or two (fair baseline: block b's decode overlaps block b+1)."""
    if workers not in (1, 2):
        raise ValueError(f"workers must be 1 or 2, got {workers}")
    gen_end = dec_end = 0.0
    total = 0.0
    for b in range(opts.blocks):
        work = (_at(times["target_context"], b) if b else 0.0) + opts.target_steps * _at(times["target_call"], b)
        decode = _at(times["decode"], b)
        if workers == 1:
            total += work + decode
        else:
            gen_end += work
            dec_end = max(dec_end, gen_end) + decode
            total = dec_end
    return total


class _Worker:
    """A serial resource: tasks run in the order they are issued. A task is a list of calls ``(ready, seconds)``;
    each call starts when it is ready and the worker is free."""

    def __init__(self):
        self.free = 0.0
        self.spans: list[tuple[float, float]] = []
        self._last: tuple[float, int] | None = None

    def run(self, calls: Sequence[tuple[float, float]]) -> tuple[float, float]:
        """Issue a task; returns (start of its first call, end of its last)."""
        before, first, t = self.free, len(self.spans), self.free
        for ready, seconds in calls:
            start = max(t, ready)
            t = start + seconds
            self.spans.append((start, t))
        self.free = t
        self._last = (before, first)
        return (self.spans[first][0], t) if calls else (before, before)

    def abort_last(self, at: float) -> float:
        """Drop the last issued task at time ``at``: a call under way finishes, later ones never start.

        Returns the seconds of its work that ran and were thrown away."""
        before, first = self._last
        ran = [(s, e) for s, e in self.spans[first:] if s < at]
        del self.spans[first + len(ran):]
        self.free = ran[-1][1] if ran else before
        self._last = None
        return sum(e - s for s, e in ran)

    def busy_until(self, end: float) -> float:
        """Seconds of work done before ``end`` (work still under way when the video is done is cut off)."""
        return sum(max(0.0, min(e, end) - s) for s, e in self.spans)


def overlapped_time(times: dict, accepts: Sequence[bool], opts: ScheduleOptions, *, detail: bool = False):
    """One video on separate workers (default: GPU0 = target, GPU1 = drafter + VAE + reward), as an event simulation.

    Per block b >= 1, once block b-1 is final (its latents committed at time C(b-1)):

    * the drafter updates its context and drafts b (unless it already drafted b speculatively right after draft
      b-1 and b-1 was accepted); the VAE decodes the previous block if the target made it, then the draft; the
      reward scores it; the decision is known at D(b);
    * the target rebuilds its context at C(b-1) and regenerates b at once (hybrid: its last ``target_steps - k``
      calls, once the drafter's state after k steps exists); on accept it stops at the first call boundary after
      D(b) and its work is dropped; on reject C(b) = max(D(b), target done), and the target's block is decoded next;
    * with ``speculate_draft`` the drafter issues block b+1 right after draft b on the draft's latents (dropped at
      D(b) on reject); on a worker shared with the VAE and reward it cannot start before D(b), so it is not
      speculative there.

    Block 0 is the target's; its decode runs on the VAE's worker. The video is done when the last committed block
    is decoded. Returns the seconds, and with ``detail`` also per-worker busy seconds (until the video is done) and
    the seconds of dropped speculative work.
    """
    place = opts.placement
    if any(place[k] == place["target"] for k in ("draft", "decode", "score")):
        raise ValueError(f"overlapped schedule: the target needs its own worker, got placement {place} "
                         "(use the sequential schedule for one worker)")
    workers = {name: _Worker() for name in sorted(set(place.values()))}
    W = {k: workers[place[k]] for k in ("target", "draft", "decode", "score")}
    nb, steps_d, steps_t = opts.blocks, opts.draft_steps, opts.target_steps
    t_calls = opts.target_calls_on_reject()
    dropped = 0.0

    def draft_task(b, ready):
        return [(ready, _at(times["draft_context"], b))] + [(ready, _at(times["draft_call"], b))] * steps_d

    # Block 0: the target alone.
    _, commit = W["target"].run([(0.0, _at(times["target_call"], 0))] * steps_t)
    pending = (commit, _at(times["decode"], 0))  # a committed target block still to decode: (ready, seconds)
    decoded = 0.0  # when the VAE stream has decoded everything committed so far
    spec = None  # (block, start, end) of a draft issued speculatively
    for b in range(1, nb):
        if spec is not None and spec[0] == b:
            d_start, d_end = spec[1], spec[2]
        else:
            d_start, d_end = W["draft"].run(draft_task(b, commit))
        spec = None
        if pending is not None:
            _, decoded = W["decode"].run([(max(pending[0], decoded), pending[1])])
            pending = None
        _, draft_decoded = W["decode"].run([(max(d_end, decoded), _at(times["decode"], b))])
        _, decided = W["score"].run([(draft_decoded, _at(times["score"], b))])
        if opts.speculate_draft and b + 1 < nb:
            spec = (b + 1, *W["draft"].run(draft_task(b + 1, d_end)))
        # The target: context rebuild once b-1 is final, then its calls (hybrid: from the drafter's state after k).
        target_end = None
        if opts.target_speculates or not accepts[b]:
            ready = commit if opts.target_speculates else max(commit, decided)
            steps_ready = ready
            if opts.hybrid_k is not None:
                state_at = d_start + _at(times["draft_context"], b) + opts.hybrid_k * _at(times["draft_call"], b)
                steps_ready = max(ready, state_at)
            calls = [(ready, _at(times["target_context"], b))] + [(steps_ready, _at(times["target_call"], b))] * t_calls
            _, target_end = W["target"].run(calls)
        if accepts[b]:
            if target_end is not None:
                dropped += W["target"].abort_last(decided)
            commit, decoded = decided, draft_decoded
        else:
            if spec is not None:
                dropped += W["draft"].abort_last(decided)
                spec = None
            commit = max(decided, target_end)
            decoded = draft_decoded  # the VAE cache is rolled back; the target's block is decoded next
            pending = (commit, _at(times["decode"], b))
    end = max(decoded, commit)  # an accepted last block is final when it is scored
    if pending is not None:
        _, end = W["decode"].run([(max(pending[0], decoded), pending[1])])
    if not detail:
        return end
    return end, {"busy": {n: w.busy_until(end) for n, w in workers.items()}, "dropped": dropped}


def accept_sequences(accept_rate: float, blocks: int, sequences: int, seed: int = 0) -> list[list[bool]]:
    """Bernoulli(accept_rate) decisions for drafted blocks 1..blocks-1 (entry 0, the target's block, is False)."""
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept_rate must be in [0, 1] (per drafted block), got {accept_rate}")
    rng = random.Random(seed)
    return [[False] + [rng.random() < accept_rate for _ in range(blocks - 1)] for _ in range(sequences)]


def simulate_schedule(times: dict, accept_rate: float, schedule: str, *, opts: ScheduleOptions | None = None,
                      sequences: int = 1000, seed: int = 0) -> dict:
    """Expected video seconds of ``schedule`` and its speedup over target-only on the same workers.

    Args:
        times: per-component seconds, each a number or a per-block list: ``draft_call``, ``draft_context``,
            ``target_call``, ``target_context``, ``decode``, ``score`` (see :func:`block_times`; measured toy
            timings work too).
        accept_rate: probability that a drafted block (b >= 1) is accepted (convert the paper's rates with
            :func:`drafted_accept_prob`).
        schedule: ``reference`` (sequential, drafts block 0, rebuilds both contexts every block), ``sequential``
            (this project's, one worker) or ``overlapped`` (two workers, see :func:`overlapped_time`).
        opts: steps, hybrid k, blocks, placement (:class:`ScheduleOptions`).
        sequences, seed: the Monte Carlo sample (common to every schedule for a given seed).

    Returns a dict: ``seconds`` (mean over sequences), ``target_only_seconds`` (one worker for the sequential
    schedules, two for the overlapped one, decode hidden), ``speedup`` (ratio of the two means, as the paper's
    table), ``workers``; overlapped also ``busy`` (mean seconds per worker) and ``dropped`` (mean seconds of
    speculative work thrown away).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    opts = opts or ScheduleOptions()
    _check_times(times, opts.blocks)
    runs = accept_sequences(accept_rate, opts.blocks, sequences, seed)
    out = {"schedule": schedule, "accept_rate": accept_rate, "hybrid_k": opts.hybrid_k, "blocks": opts.blocks}
    if schedule == "overlapped":
        total, busy, dropped = 0.0, {}, 0.0
        for accepts in runs:
            t, info = overlapped_time(times, accepts, opts, detail=True)
            total += t
            dropped += info["dropped"]
            for k, v in info["busy"].items():
                busy[k] = busy.get(k, 0.0) + v
        workers = len(set(opts.placement.values()))
        base = target_only_time(times, opts, workers=2)
        out.update(busy={k: v / len(runs) for k, v in busy.items()}, dropped=dropped / len(runs))
    else:
        total = sum(sequential_time(times, a, opts, reference=schedule == "reference") for a in runs)
        workers, base = 1, target_only_time(times, opts, workers=1)
    mean = total / len(runs)
    out.update(seconds=mean, target_only_seconds=base, speedup=base / mean, workers=workers)
    return out


# ------------------------------------------------------------------------------------------------ projection
def schedule_variants() -> list[tuple[str, str, str, ScheduleOptions]]:
    """(label, schedule, drafter context, options) for every row of the speedup tables."""
    rows = []
    for k in (None, 3):
        hy = "" if k is None else ", hybrid k=3"
        rows.append((f"(a) reference{hy}", "reference", "recompute_window", ScheduleOptions(draft_steps=5, hybrid_k=k)))
        for sched, tag in (("sequential", "(b) sequential"), ("overlapped", "(c) overlapped 2 GPUs")):
            for ctx, ctag in (("global_cache", "drafter global cache"), ("recompute_window", "drafter recompute window")):
                rows.append((f"{tag}, {ctag}{hy}", sched, ctx, ScheduleOptions(hybrid_k=k)))
    return rows


def project(gpu_names: Sequence[str], *, blocks: int = 9, efficiency: dict | None = None, sequences: int = 1000,
            seed: int = 0, rates: Sequence[float] = PAPER_RATES) -> dict:
    """Per-block component seconds and speedup tables for every named GPU (a JSON-serialisable dict)."""
    out = {}
    for name in gpu_names:
        gpu = GPUS[name]
        times = {ctx: block_times(gpu, blocks=blocks, drafter_context=ctx, efficiency=efficiency) for ctx in CONTEXTS}
        rows = []
        for label, sched, ctx, opts in schedule_variants():
            opts.blocks = blocks
            res = [simulate_schedule(times[ctx], drafted_accept_prob(r, blocks), sched, opts=opts,
                                     sequences=sequences, seed=seed) for r in rates]
            rows.append({"label": label, "schedule": sched, "drafter_context": ctx, "hybrid_k": opts.hybrid_k,
                         "draft_steps": opts.draft_steps, "target_steps": opts.target_steps, "results": res})
        out[name] = {"gpu": asdict(gpu), "block_times": times, "rows": rows}
    return out


def calibration(*, blocks: int = 9, efficiency: dict | None = None, sequences: int = 1000, seed: int = 0,
                measured_score_s: float | None = None) -> dict:
    """Schedule (a) on 2x A6000 next to the paper's measured speedups (and its derived per-block costs)."""
    gpu = GPUS["A6000"]
    times = block_times(gpu, blocks=blocks, drafter_context="recompute_window", efficiency=efficiency)
    if measured_score_s is not None:
        times = {**times, "score": [measured_score_s] * blocks}
    res = {}
    for key, k in (("sdvg", None), ("hybrid+cascade", 3)):
        opts = ScheduleOptions(blocks=blocks, draft_steps=5, hybrid_k=k)
        res[key] = [simulate_schedule(times, drafted_accept_prob(r, blocks), "reference", opts=opts,
                                      sequences=sequences, seed=seed) for r in PAPER_RATES]
    b = 1
    target_block = times["target_context"][b] + 5 * times["target_call"][b] + times["decode"][b]
    verify = times["draft_context"][b] + times["target_context"][b] + 5 * times["draft_call"][b] + times["decode"][b] + times["score"][b]
    opts = ScheduleOptions(blocks=blocks, draft_steps=5)
    return {
        "times": times, "results": res,
        "derived": {
            "target-only video s": (target_only_time(times, opts), 97.0),
            "target block s (recompute + 5 calls + decode)": (target_block, 10.8),
            "accepted block s (both recomputes + 5 drafter calls + decode + score)": (verify, (48.0 - 10.8 - 3.0) / 8),
            "draft + decode + score s": (times["draft_context"][b] + 5 * times["draft_call"][b] + times["decode"][b] + times["score"][b], 3.0),
            "score s": (times["score"][b], 0.5),
            "all accepted video s": (sequential_time(times, [False] + [True] * (blocks - 1), opts, reference=True), 48.0),
            "all rejected video s": (sequential_time(times, [False] * blocks, opts, reference=True), 124.0),
        },
    }


def fitted_dit_efficiency(calib: dict, efficiency: dict, target_block_s: float = 10.8) -> Efficiency:
    """The DiT MFU at which the projected A6000 target block (recompute + 5 calls + decode) takes ``target_block_s``
    (the paper's derived 10.8 s). DiT calls are compute-bound here, so their time scales as 1 / MFU."""
    t = calib["times"]
    dit = t["target_context"][1] + 5 * t["target_call"][1]
    mfu = efficiency["dit"].mfu * dit / (target_block_s - t["decode"][1])
    return Efficiency(round(mfu, 3), efficiency["dit"].bw)


# ------------------------------------------------------------------------------------------------ printing
def _fmt_rate(r: float) -> str:
    return f"{r:.1%} (p={drafted_accept_prob(r):.3f})"


def _print_speedups(rows: list[dict], rates: Sequence[float]) -> None:
    print("| schedule | " + " | ".join(f"{r:.1%}" for r in rates)
          + f" | video s at {rates[0]:.1%} | target-only s | GPU0 / GPU1 busy at {rates[0]:.1%} |")
    print("|---|" + "---|" * (len(rates) + 3))
    for row in rows:
        res = row["results"]
        busy = res[0].get("busy")
        busy = " / ".join(f"{v / res[0]['seconds']:.0%}" for v in busy.values()) if busy else "-"
        print(f"| {row['label']} | " + " | ".join(f"{x['speedup']:.2f}x" for x in res)
              + f" | {res[0]['seconds']:.1f} | {res[0]['target_only_seconds']:.1f} | {busy} |")


def print_tables(costs: dict[str, Cost], proj: dict, calib: dict, calib_measured: dict, efficiency: dict,
                 calib_fitted: dict, fitted: Efficiency) -> None:
    gpus = list(proj)
    print("## Per-component cost at 832x480 (one call; real architectures on the meta device)\n")
    eff = ", ".join(f"{k} MFU {v.mfu:.2f} / bandwidth {v.bw:.2f}" for k, v in efficiency.items())
    print(f"Roofline per call = max(FLOPs / (peak bf16 x MFU), bytes / (bandwidth x eff)); {eff}.\n")
    print("| component | TFLOP | GB moved (unfused) | " + " | ".join(f"{g} ms" for g in gpus) + " |")
    print("|---|---|---|" + "---|" * len(gpus))
    for label, c in costs.items():
        cls = "dit" if ("drafter" in label or "target" in label) else ("vae" if "VAE" in label else "reward")
        ms = [roofline_seconds(c.flops, c.bytes, GPUS[g], efficiency[cls]) * 1e3 for g in gpus]
        print(f"| {label} | {c.flops / 1e12:.2f} | {c.bytes / 1e9:.1f} | " + " | ".join(f"{m:.0f}" for m in ms) + " |")
    for g in gpus:
        t = proj[g]["block_times"]["global_cache"]
        tw = proj[g]["block_times"]["recompute_window"]
        b = 1
        target_block = t["target_context"][b] + 5 * t["target_call"][b]
        print(f"\n{g}, block 1: target 5 calls + recompute {target_block:.2f} s; drafter 4 calls + commit "
              f"{t['draft_context'][b] + 4 * t['draft_call'][b]:.3f} s (global cache; block {len(t['draft_call']) - 1}: "
              f"{t['draft_context'][-1] + 4 * t['draft_call'][-1]:.3f} s; recompute window: "
              f"{tw['draft_context'][b] + 4 * tw['draft_call'][b]:.3f} s); decode {t['decode'][b]:.3f} s; "
              f"score {t['score'][b]:.3f} s; target/drafter {target_block / (t['draft_context'][b] + 4 * t['draft_call'][b]):.1f}x, "
              f"decode+score = {(t['decode'][b] + t['score'][b]) / target_block:.0%} of a target block")
    rates = PAPER_RATES
    for g in gpus:
        print(f"\n## Projected speedup vs target-only on the same workers, {GPUS[g].name} ({proj[g]['rows'][0]['results'][0]['blocks']} blocks)\n")
        print("Paper acceptance (per drafted block p = 9a/8): " + " / ".join(_fmt_rate(r) for r in rates) + "\n")
        _print_speedups(proj[g]["rows"], rates)
    print("\n## Calibration: schedule (a) on 2x A6000 vs the paper (measured)\n")
    print("| | " + " | ".join(f"{r:.1%}" for r in rates) + " |\n|---|" + "---|" * len(rates))
    for key, label in (("sdvg", "SDVG"), ("hybrid+cascade", "hybrid k=3 (+ cascade in the paper)")):
        print(f"| paper, {label} | " + " | ".join(f"{x:.2f}x" for x in PAPER_SPEEDUPS[key]) + " |")
        print(f"| projected, {label} | " + " | ".join(f"{x['speedup']:.2f}x" for x in calib["results"][key]) + " |")
        print(f"| projected with the paper's 0.5 s scoring, {label} | "
              + " | ".join(f"{x['speedup']:.2f}x" for x in calib_measured["results"][key]) + " |")
        print(f"| ... and DiT MFU {fitted.mfu:.2f} (fitted to the 10.8 s target block), {label} | "
              + " | ".join(f"{x['speedup']:.2f}x" for x in calib_fitted["results"][key]) + " |")
    print(f"\n| per-block cost on A6000 | projected | fitted (DiT MFU {fitted.mfu:.2f}, 0.5 s scoring) | paper (derived) |"
          "\n|---|---|---|---|")
    for k, (proj_v, paper_v) in calib["derived"].items():
        print(f"| {k} | {proj_v:.2f} | {calib_fitted['derived'][k][0]:.2f} | {paper_v:.2f} |")


def _parse_mfu(items: Sequence[str]) -> dict[str, Efficiency]:
    out = {}
    for item in items:
        try:
            cls, value = item.split("=")
            mfu = float(value)
        except ValueError:
            raise SystemExit(f"--mfu expects CLASS=FRACTION (e.g. dit=0.4), got {item!r}") from None
        if cls not in EFFICIENCY or not 0 < mfu <= 1:
            raise SystemExit(f"--mfu {item!r}: class must be one of {sorted(EFFICIENCY)} and the fraction in (0, 1]")
        out[cls] = Efficiency(mfu, EFFICIENCY[cls].bw)
    return out


def project_times(times: dict, *, blocks: int, draft_steps: int = 4, target_steps: int = 5,
                  rates: Sequence[float] = PAPER_RATES, sequences: int = 1000, seed: int = 0,
                  paper_convention: bool = True) -> list[dict]:
    """Speedup rows for (b) sequential and (c) overlapped, with and without hybrid k=3, from given seconds.

    ``rates`` are in the paper's convention (block 0 counted as a reject) unless ``paper_convention=False``, in which
    case they are already per drafted block."""
    rows = []
    for k in (None, 3):
        for sched, tag in (("sequential", "(b) sequential"), ("overlapped", "(c) overlapped 2 workers")):
            opts = ScheduleOptions(blocks=blocks, draft_steps=draft_steps, target_steps=target_steps, hybrid_k=k)
            res = [simulate_schedule(times, drafted_accept_prob(r, blocks) if paper_convention else r, sched,
                                     opts=opts, sequences=sequences, seed=seed) for r in rates]
            rows.append({"label": tag + ("" if k is None else ", hybrid k=3"), "schedule": sched, "hybrid_k": k,
                         "results": res})
    return rows


def _project_measured(args) -> dict:
    path = Path(args.times)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--times {path}: cannot read a JSON object ({e})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"--times {path}: expected a JSON object with keys {sorted(CLASS_OF)}")
    steps = {k: int(data.pop(k)) for k in ("draft_steps", "target_steps") if k in data}
    try:
        rows = project_times(data, blocks=args.blocks, rates=args.rates, sequences=args.sequences, seed=args.seed,
                             paper_convention=not args.rates_per_drafted, **steps)
    except ValueError as e:
        raise SystemExit(f"--times {path}: {e}") from None
    result = {"times": data, **steps, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        conv = "per drafted block" if args.rates_per_drafted else f"paper convention, p = {args.blocks}a/{args.blocks - 1}"
        print(f"## Projected speedup vs target-only on the same workers, from {path} ({args.blocks} blocks; rates {conv})\n")
        _print_speedups(rows, args.rates)
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of markdown tables")
    p.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPUS))
    p.add_argument("--blocks", type=int, default=9, help="blocks of 3 latent frames (9 = the paper's 105 frames)")
    p.add_argument("--mfu", nargs="*", default=[], metavar="CLASS=F", help="override the MFU of dit / vae / reward")
    p.add_argument("--sequences", type=int, default=1000, help="Bernoulli accept sequences per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--times", default=None, metavar="FILE",
                   help="skip the roofline: project the schedules from a JSON of per-component seconds "
                        "(draft_call, draft_context, target_call, target_context, decode, score; each a number or a "
                        "per-block list; optional draft_steps, target_steps), e.g. measured on the toy world")
    p.add_argument("--rates", nargs="+", type=float, default=list(PAPER_RATES),
                   help="acceptance rates in the paper's convention (block 0 counted as a reject); only with --times")
    p.add_argument("--rates-per-drafted", action="store_true",
                   help="--rates are already per drafted block (as the engine's report counts them)")
    args = p.parse_args(argv)
    if args.times:
        return _project_measured(args)
    if args.blocks < 2:
        raise SystemExit(f"--blocks must be at least 2 (block 0 is the target's), got {args.blocks}")
    torch.set_num_threads(1)
    efficiency = {**EFFICIENCY, **_parse_mfu(args.mfu)}
    costs = component_costs(args.blocks)
    proj = project(args.gpus, blocks=args.blocks, efficiency=efficiency, sequences=args.sequences, seed=args.seed)
    calib = calibration(blocks=args.blocks, efficiency=efficiency, sequences=args.sequences, seed=args.seed)
    calib_measured = calibration(blocks=args.blocks, efficiency=efficiency, sequences=args.sequences, seed=args.seed,
                                 measured_score_s=0.5)
    fitted = fitted_dit_efficiency(calib, efficiency)
    calib_fitted = calibration(blocks=args.blocks, efficiency={**efficiency, "dit": fitted}, sequences=args.sequences,
                               seed=args.seed, measured_score_s=0.5)
    result = {"efficiency": {k: asdict(v) for k, v in efficiency.items()},
              "components": {k: asdict(v) for k, v in costs.items()},
              "projection": proj, "calibration": calib, "calibration_with_paper_scoring": calib_measured,
              "calibration_fitted": {"dit_efficiency": asdict(fitted), **calib_fitted}}
    result["prompt_switch"] = {gpu: {str(b): switch_seconds(GPUS[gpu], b, efficiency=efficiency)
                                     for b in range(1, args.blocks)} for gpu in args.gpus}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_tables(costs, proj, calib, calib_measured, efficiency, calib_fitted, fitted)
        _print_switch_price(result["prompt_switch"], args.blocks, efficiency)
    return result


def _print_switch_price(price: dict, blocks: int, efficiency: dict) -> None:
    """What a prompt switch adds (text encodes + the drafter's global-cache re-cache), beside one target block."""
    print("\n## A prompt switch (issue 39): extra seconds at 832x480, Self-Forcing drafter (global cache) + Krea "
          "target (recompute window)\n")
    print("| GPU | switch at block | drafter re-cache (extra t=0 passes) | text encodes (both) | share of one target block |")
    print("|---|---|---|---|---|")
    for gpu, rows in price.items():
        times = block_times(GPUS[gpu], blocks=blocks, efficiency=efficiency)
        target_block = 5 * times["target_call"][1] + times["target_context"][1]
        for b, row in rows.items():
            extra = row["drafter"]["recache_s"]
            text = row["drafter"]["text_encode_s"] + row["target"]["text_encode_s"]
            print(f"| {gpu} | {b} | {extra:.3f} s ({row['drafter']['extra_calls']}) | {text * 1000:.1f} ms | "
                  f"{(extra + text) / target_block:.1%} |")


if __name__ == "__main__":
    main()
