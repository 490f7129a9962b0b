"""Real-size dry run: the whole SDVG loop at 832x480x81 with the real architectures, on the meta device, in seconds.

The Wan2.1 1.3B drafter, the 14B target, the Wan VAE and ImageReward-v1.0 are built with their real configs on
``torch.device("meta")``: every tensor has its real shape and dtype and no values, so nothing is computed and
nothing is allocated. :func:`dry_run` then runs :meth:`SpeculativePipeline.generate` unchanged, through the real
context schemes of a preset, the real worker layouts, fp8 KV caches, fp8 target weights, block streaming
(the real :class:`~sdvg_engine.offload.BlockStreamer` schedule) and replay, and reports the bytes each category holds:

* **weights** (per component): the modules' parameters and buffers, each storage once. A streamed model counts its
  resident part plus the most blocks the streamer held at once (measured from ``BlockStreamer.loaded``).
* **KV caches**: the self-attention cache (+ fp8 scales) and the prompt's cross-attention K/V of each model that ran.
* **VAE decode cache**: the largest, over the run, of the causal decode cache plus the snapshots still alive (a
  draft keeps the state from before its decode until it is judged), each tensor once.
* **recording / memo** (host RAM): what a run keeps for replay (``report["replay"]``); checked against the cap.
* **activations**: per model call, the peak live bytes of the tensors the call itself created (a
  :class:`TorchDispatchMode` sees every op's outputs; a weakref finalizer per output tells when its storage dies;
  views and in-place results count once, by storage). Limits: only tensors created *inside* a DiT, VAE or reward
  call are counted (the loop's own small tensors between calls are not); the allocator's rounding and
  fragmentation, CUDA workspaces and kernels that allocate internally (e.g. attention backends) are not seen.

Values are never read: decisions come from :class:`ForcedScoreRouter`, which runs the real ImageReward forward on
the meta frames (so its activations count; with ``preprocess="torch"``, as the default "pil" path needs the pixel
values on the host) and returns forced block scores, so a tau change flips a chosen block (that is how replay is
exercised). The finite checks of the loop say "nothing to check" for meta tensors, and attention on meta returns what
a fused kernel allocates (``causal_wan._attention``), not the math fallback's score matrix.

Speed: a meta op costs the same as long as its shapes are the same, and a DiT call's output, its transient bytes
and its effect (in-place writes to the KV cache, no values) are functions of its input shapes and the cache
geometry. So the first call of each shape signature runs the real forward (every layer), and repeats replay its
measured result (calling the streamer's hooks per layer, as the forward does). The VAE and ImageReward always run.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKLWan
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .loaders import LoadedDiT, build_pipeline, checkpoint_schedule
from .memo import DEFAULT_MAX_BYTES, ReplayMemo
from .memo import _tensors as state_tensors
from .models import causal_wan
from .models.causal_wan import CausalWanTransformer3DModel, TextKV, wan_config
from .models.loading import build_model, quantize_blocks_fp8
from .pipeline import MODES, SDVGOptions, SpeculativePipeline
from .reward import FrameScores, ImageRewardConfig, ImageRewardModel, ImageRewardScorer
from .reward.tokenizer import BlipTokenizer
from .router import RewardRouter
from .vae import StreamingWanVAE, load_wan21_vae_config

META = torch.device("meta")
GiB = 2**30
#: block scores of the drafted blocks 1..6 (tau 0: accept, accept, reject, accept, accept, reject = 4/6). A second
#: run at ``REPLAY_TAU`` flips only block 5 (score 0.3), so it replays blocks 0..4.
DEFAULT_SCORES = (0.9, 0.5, -0.5, 0.8, 0.3, -0.2)
REPLAY_TAU = 0.4


# ================================================================================================ byte accounting
class LiveBytes(TorchDispatchMode):
    """Peak live bytes of the tensors created by the ops run under this mode (in this thread).

    Each op output whose storage is new is counted once (views and in-place results of tracked storages add a
    reference, outputs aliasing an input that was made elsewhere are not counted); a weakref finalizer on every
    output releases the storage's bytes when its last tracked tensor dies.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [live tensors, nbytes]
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        with self._lock:
            entry = self._refs.get(key)
            if entry is None:
                if key in inputs:  # in place on (or a view of) a tensor made before this call
                    return
                entry = self._refs[key] = [0, storage.nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._refs.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._refs[key]
                    self.live -= entry[1]


def tensor_bytes(*values) -> int:
    """Bytes of every tensor inside ``values`` (nested tuples/lists/dicts/dataclasses), each storage once."""
    seen, total = set(), 0
    for t in _tensors(values):
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _tensors(value):
    """The tensors of a module (parameters and buffers) or inside a nested value (:func:`sdvg_engine.memo._tensors`)."""
    if isinstance(value, torch.nn.Module):
        yield from value.parameters()
        yield from value.buffers()
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    else:
        yield from state_tensors(value)


class _Probe:
    """Per-component measurements of one dry run: the largest per-call transient and how many calls ran."""

    def __init__(self):
        self.transient: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.real_calls: dict[str, int] = {}  # calls that ran the forward (the rest replayed a measured signature)

    def note(self, component: str, peak: int, real: bool) -> None:
        self.transient[component] = max(self.transient.get(component, 0), peak)
        self.calls[component] = self.calls.get(component, 0) + 1
        if real:
            self.real_calls[component] = self.real_calls.get(component, 0) + 1


def _measured(probe_of, component: str, fn, *args, **kwargs):
    """Run ``fn`` under a fresh :class:`LiveBytes` and note its peak on the current probe."""
    with LiveBytes() as live:
        out = fn(*args, **kwargs)
    probe = probe_of()
    if probe is not None:
        probe.note(component, live.peak, real=True)
    return out, live.peak


# ================================================================================================ the stack
class MetaStack:
    """The four real architectures on the meta device, with measuring wrappers around their calls.

    Args:
        fp8_target: store the target's block Linear weights in float8 (``quantize_blocks_fp8``).
        offload: ``"none"`` | ``"target"`` | ``"both"``: stream those models' blocks (:meth:`_stream`).
        kv_dtype: ``"auto"`` | ``"fp8"``: both models' KV cache dtype.
    """

    def __init__(self, *, fp8_target: bool = False, offload: str = "none", kv_dtype: str = "auto"):
        from .offload import kv_cache_dtype

        self.probe: _Probe | None = None
        self._signatures: dict = {}
        self.drafter = self._dit("Wan2.1-T2V-1.3B", fp8=False)
        self.target = self._dit("Wan2.1-T2V-14B", fp8=fp8_target)
        self.streamed = {"drafter": offload == "both", "target": offload in ("target", "both")}
        self.max_loaded_blocks = {"drafter": 0, "target": 0}
        for name, model in (("drafter", self.drafter), ("target", self.target)):
            model.kv_cache_dtype = kv_cache_dtype(kv_dtype)
            if self.streamed[name]:
                self._stream(name, model)
            self._wrap_dit(name, model)
        with META:
            vae = AutoencoderKLWan.from_config(load_wan21_vae_config())
        self.vae = StreamingWanVAE(vae.eval().requires_grad_(False))
        self._wrap_vae()
        with META:
            reward = ImageRewardModel(ImageRewardConfig.v1())
        reward = reward.to(torch.float16).eval().requires_grad_(False)
        self.scorer = ImageRewardScorer(reward, BlipTokenizer())

    # ---- models
    @staticmethod
    def _dit(name: str, fp8: bool) -> CausalWanTransformer3DModel:
        """Through the loader's own path (``build_model``: bf16, modulation / time embedding / norms float32)."""
        config = wan_config(name)
        with META:
            state = CausalWanTransformer3DModel(**config).state_dict()
        model = build_model(config, dict(state), dtype=torch.bfloat16, device=META)
        if fp8:
            quantize_blocks_fp8(model)
        return model

    def _stream(self, name: str, model) -> None:
        """The project's :class:`BlockStreamer` drives the blocks, as with ``--offload``; its groups are stand-ins
        (diffusers' ``ModuleGroup`` needs a real device to copy to, and there is nothing to copy on meta). What is
        measured is how many blocks the streamer holds at once."""
        from .offload import BlockStreamer

        class Group:  # diffusers' ModuleGroup, without the copies
            def onload_(self):
                pass

            def offload_(self):
                pass

        streamer = model.block_hooks = BlockStreamer([Group() for _ in model.blocks])
        before = streamer.before

        def counted(layer, _before=before):
            _before(layer)
            self.max_loaded_blocks[name] = max(self.max_loaded_blocks[name], len(streamer.loaded))

        streamer.before = counted

    def _wrap_dit(self, name: str, model) -> None:
        forward, encode = model.forward_block, model.encode_text
        probe_of = lambda: self.probe  # noqa: E731

        def forward_block(block_latents, timesteps, text_kv, kv_cache=None, start_frame=0, *, attn_mask=None,
                          cache_bias=None):
            key = (name, tuple(block_latents.shape), tuple(timesteps.shape), start_frame, cache_bias, attn_mask is None,
                   None if kv_cache is None else kv_cache.geometry, tuple(text_kv.keys[0].shape))
            known = self._signatures.get(key)
            if known is None:
                out, peak = _measured(probe_of, name, forward, block_latents, timesteps, text_kv, kv_cache, start_frame,
                                      attn_mask=attn_mask, cache_bias=cache_bias)
                self._signatures[key] = (tuple(out.shape), out.dtype, peak)
                return out
            shape, dtype, peak = known
            if kv_cache is not None:
                kv_cache.check_fits(start_frame, block_latents.shape[2])
            hooks = model.block_hooks
            for layer in range(len(model.blocks)):  # what the forward does around each block
                if hooks is not None:
                    hooks.before(layer)
                    hooks.after(layer)
            if self.probe is not None:
                self.probe.note(name, peak, real=False)
            return torch.empty(shape, dtype=dtype, device=META)

        def encode_text(prompt_embeds):
            key = (name, "text", tuple(prompt_embeds.shape))
            if key not in self._signatures:
                text_kv, peak = _measured(probe_of, name, encode, prompt_embeds)
                self._signatures[key] = ([(tuple(k.shape), k.dtype) for k in text_kv.keys], peak)
                return text_kv
            shapes, peak = self._signatures[key]
            if self.probe is not None:
                self.probe.note(name, peak, real=False)
            return TextKV([torch.empty(s, dtype=d, device=META) for s, d in shapes],
                          [torch.empty(s, dtype=d, device=META) for s, d in shapes])

        model.forward_block, model.encode_text = forward_block, encode_text

    def _wrap_vae(self) -> None:
        vae, decode, encode, snapshot = self.vae, self.vae.decode_block, self.vae.encode_frame, self.vae.snapshot
        self._snapshots: "weakref.WeakSet" = weakref.WeakSet()  # VAEDecodeState objects still referenced
        self.vae_cache_peak = self.vae_held_peak = 0  # the cache alone; the cache and the snapshots still alive
        probe_of = lambda: self.probe  # noqa: E731

        def slots(cache):
            return tuple(s if not isinstance(s, torch.Tensor) else (tuple(s.shape), s.dtype) for s in cache)

        def decode_block(latents):
            key = ("vae", tuple(latents.shape), latents.dtype, vae.latent_frames_decoded == 0, slots(vae._feat_cache))
            known = self._signatures.get(key)
            if known is None:
                old = list(vae._feat_cache)
                with LiveBytes() as live:
                    pixels = decode(latents)
                new = vae._feat_cache
                replaced = tuple(n is not o for n, o in zip(new, old))
                # The new cache slots were made by this call but outlive it: the VAE cache's bytes, not a transient.
                peak = live.peak - tensor_bytes([n for n, r in zip(new, replaced) if r])
                self._signatures[key] = (tuple(pixels.shape), slots(new), replaced, peak)
                real = True
            else:  # the same shapes again: the decode's effect on meta, replayed (see the module docstring)
                shape, after, replaced, peak = known
                vae._feat_cache = [torch.empty(a[0], dtype=a[1], device=META) if r and isinstance(a, tuple)
                                   else (a if r else o) for a, r, o in zip(after, replaced, vae._feat_cache)]
                vae._latent_frames += latents.shape[2]
                vae._stream_key = (latents.shape[0], latents.shape[3], latents.shape[4], vae.dtype)
                pixels, real = torch.empty(shape, device=META), False
            if self.probe is not None:
                self.probe.note("vae", peak, real=real)
            self.vae_cache_peak = max(self.vae_cache_peak, tensor_bytes(vae._feat_cache))
            held = tensor_bytes(vae._feat_cache, [s.feat_cache for s in list(self._snapshots)])
            self.vae_held_peak = max(self.vae_held_peak, held)
            return pixels

        def take_snapshot():
            state = snapshot()
            self._snapshots.add(state)
            return state

        vae.decode_block, vae.snapshot = decode_block, take_snapshot
        vae.encode_frame = lambda pixels: _measured(probe_of, "vae", encode, pixels)[0]

    # ---- weights
    def weight_bytes(self) -> dict[str, int]:
        out = {}
        for name, model in (("drafter", self.drafter), ("target", self.target)):
            if self.streamed[name]:
                resident = tensor_bytes([t for n, t in list(model.named_parameters()) + list(model.named_buffers())
                                         if not n.startswith("blocks.")])
                per_block = tensor_bytes(model.blocks[0])
                out[name] = resident + self.max_loaded_blocks[name] * per_block
            else:
                out[name] = tensor_bytes(model)
        out["vae"] = tensor_bytes(self.vae.vae)
        out["reward"] = tensor_bytes(self.scorer.model)
        return out


class ForcedScoreRouter(RewardRouter):
    """Runs the real ImageReward forward on the (meta) frames, then reports forced scores.

    The ``n``-th scored draft of a run gets ``scores[n]`` as every frame's score (so ``tau`` decides as usual, and a
    tau change flips exactly the blocks it crosses); seam-feature calls (one frame) get a constant. Features are
    ones on the CPU, as the real scorer hands them back (``[N, 1024]`` float32).
    """

    def __init__(self, scorer, scores=DEFAULT_SCORES, *, tau: float = 0.0, **kw):
        super().__init__(scorer, tau=tau, preprocess="torch", **kw)
        self.scores, self.drafts = list(scores), 0

    def score_frames(self, frames, prompt_features):
        from .reward.preprocess import _preprocess_torch

        scorer = self.scorer
        feats = scorer.encode_prompt(prompt_features) if isinstance(prompt_features, str) else prompt_features
        pixels = _preprocess_torch(frames, scorer.config.image_size, self.crop, scorer.device).to(scorer.dtype)
        ids, mask = feats.input_ids.to(scorer.device), feats.attention_mask.to(scorer.device)
        stack = scorer._dry_stack
        key = ("reward", tuple(pixels.shape), tuple(ids.shape))
        if key not in stack._signatures:
            stack._signatures[key] = _measured(lambda: stack.probe, "reward", scorer.model, pixels, ids, mask)[1]
        else:
            stack.probe.note("reward", stack._signatures[key], real=False)
        n = frames.shape[0]
        if n > 1:
            value = self.scores[self.drafts % len(self.scores)] if self.scores else 0.0
            self.drafts += 1
        else:
            value = 0.0
        return FrameScores(torch.full((n,), float(value)), torch.ones(n, scorer.config.vision_width))


# ================================================================================================ the run
@dataclass(frozen=True)
class DryRunConfig:
    """One configuration of the matrix (see :func:`configurations`)."""

    preset: str = "reference"  # reference: both models on the recompute window; native: drafter on its global cache
    mode: str = "sdvg"
    workers: int = 1
    kv_dtype: str = "auto"
    fp8_target: bool = False
    offload: str = "none"
    replay: bool = False  # run twice (tau 0, then REPLAY_TAU) with a ReplayMemo: the second run replays

    @property
    def label(self) -> str:
        extra = [f"kv {self.kv_dtype}"] if self.kv_dtype != "auto" else []
        extra += ["fp8 target"] if self.fp8_target else []
        extra += [f"offload {self.offload}"] if self.offload != "none" else []
        extra += ["replay"] if self.replay else []
        return f"{self.preset} {self.mode} w{self.workers}" + (f" ({', '.join(extra)})" if extra else "")


@dataclass
class DryRunResult:
    """Bytes one configuration holds (``device``: on the accelerator; ``host``: CPU RAM), the run's report and the
    measurements behind them."""

    config: DryRunConfig
    device: dict  # category -> bytes
    host: dict  # category -> bytes
    report: dict  # the (last) run's report
    seconds: float
    calls: dict = field(default_factory=dict)  # component -> model calls (real forwards in real_calls)
    real_calls: dict = field(default_factory=dict)
    transients: dict = field(default_factory=dict)  # component -> largest per-call transient

    @property
    def device_total(self) -> int:
        return sum(self.device.values())


_STACKS: dict = {}


def meta_stack(*, fp8_target: bool = False, offload: str = "none", kv_dtype: str = "auto") -> MetaStack:
    """A :class:`MetaStack` per memory setting (built once: a few seconds)."""
    key = (fp8_target, offload, kv_dtype)
    if key not in _STACKS:
        _STACKS[key] = MetaStack(fp8_target=fp8_target, offload=offload, kv_dtype=kv_dtype)
    return _STACKS[key]


def text_context() -> torch.Tensor:
    """A UMT5-shaped prompt context ``[1, 512, 4096]`` (CPU: the loop hashes it for the replay key)."""
    ctx = torch.zeros(1, 512, 4096)
    ctx[:, :12] = 0.1
    return ctx


def pipeline_for(stack: MetaStack, preset: str, router) -> SpeculativePipeline:
    """The preset's context schemes and schedules on fresh generators (:func:`sdvg_engine.loaders.build_pipeline`,
    as every other pipeline of the project): the 1.3B is a Self-Forcing checkpoint (global cache, 4 calls), the 14B a
    Krea one (recompute window, 5 calls)."""
    return build_pipeline(LoadedDiT(stack.drafter, "global_cache", checkpoint_schedule("Wan2.1-T2V-1.3B")),
                          LoadedDiT(stack.target, "recompute_window", checkpoint_schedule("Wan2.1-T2V-14B")),
                          stack.vae, router, preset=preset)


def dry_run(config: DryRunConfig, *, width: int = 832, height: int = 480, num_frames: int = 81,
            scores=DEFAULT_SCORES, max_bytes: int = DEFAULT_MAX_BYTES) -> DryRunResult:
    """Run one configuration at real size on the meta device and account its bytes (see the module docstring)."""
    started = time.perf_counter()
    stack = meta_stack(fp8_target=config.fp8_target, offload=config.offload, kv_dtype=config.kv_dtype)
    stack.probe, stack.vae_cache_peak, stack.vae_held_peak = _Probe(), 0, 0
    stack.max_loaded_blocks = {k: 0 for k in stack.max_loaded_blocks}
    router = ForcedScoreRouter(stack.scorer, scores)
    stack.scorer._dry_stack = stack
    pipe = pipeline_for(stack, config.preset, router)
    pipe.memo = ReplayMemo(max_bytes) if config.replay else None
    options = SDVGOptions(mode=config.mode, schedule_every=3)
    ctx = text_context()
    taus = (0.0, REPLAY_TAU) if config.replay else (0.0,)
    causal_wan.FUSED_ATTENTION_ON_META = True
    try:
        for tau in taus:
            # The scores follow the drafted blocks in order; a replayed run scores only the drafts after its prefix.
            router.tau, router.drafts = tau, replayed_drafts(scores, taus[0], tau) if tau != taus[0] else 0
            result = pipe.generate(ctx, prompt="a corgi running on a beach", num_frames=num_frames, width=width,
                                   height=height, seed=42, options=options, workers=config.workers)
            assert result.frames.shape == (num_frames, height, width, 3), result.frames.shape
    finally:
        causal_wan.FUSED_ATTENTION_ON_META = False
    probe, report = stack.probe, result.report
    device = {f"weights: {k}": v for k, v in stack.weight_bytes().items()}
    for gen in (pipe.drafter, pipe.target):
        if gen.kv_cache is not None:
            device[f"KV cache: {gen.name}"] = gen.kv_cache.nbytes + gen.text_kv.nbytes
    device["VAE decode cache"] = stack.vae_cache_peak
    # A draft's decode keeps the state from before it (to roll back on reject); the loop keeps it until the block is
    # finished, one block later, so up to two older caches are alive beside the current one.
    device["VAE decode cache: older states kept by snapshots"] = stack.vae_held_peak - stack.vae_cache_peak
    lanes = result.report["settings"]["workers"]["lanes"]
    per_lane: dict = {}
    for component, peak in probe.transient.items():
        lane = lanes.get(component, "main")
        per_lane[lane] = max(per_lane.get(lane, 0), peak)
    device["activations (largest per-call transient, per lane, summed)"] = sum(per_lane.values())
    replay = report["replay"]
    host = {"recording (one run)": replay["recording_bytes"], "memo (all kept recordings)": replay["memo_bytes"]}
    return DryRunResult(config=config, device=device, host=host, report=report,
                        seconds=time.perf_counter() - started, calls=dict(probe.calls),
                        real_calls=dict(probe.real_calls), transients=dict(probe.transient))


def replayed_drafts(scores, tau_before: float, tau_after: float) -> int:
    """How many drafted blocks a run at ``tau_after`` replays from one at ``tau_before`` (every block before the first
    decision that changes; sdvg mode, every block after block 0 drafted)."""
    for i, score in enumerate(scores):
        if (score >= tau_before) != (score >= tau_after):
            return i
    return len(scores)


def configurations() -> list[DryRunConfig]:
    """The whole matrix: both presets x 1 and 2 workers x every mode, then the memory settings and replay."""
    out = [DryRunConfig(preset=p, mode=m, workers=w) for p in ("reference", "native") for w in (1, 2) for m in MODES]
    out += [DryRunConfig(preset="native", mode="sdvg", workers=w, kv_dtype="fp8") for w in (1, 2)]
    out += [DryRunConfig(preset="native", mode="sdvg", workers=1, fp8_target=True),
            DryRunConfig(preset="native", mode="sdvg", workers=1, fp8_target=True, offload="target"),
            DryRunConfig(preset="native", mode="sdvg", workers=2, fp8_target=True, offload="both", kv_dtype="fp8")]
    out += [DryRunConfig(preset=p, mode="sdvg", workers=w, replay=True)
            for p in ("reference", "native") for w in (1, 2)]
    return out


def check_recording_fits(result: DryRunResult, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Raise when the recording a replay keeps at this size would not fit ``max_bytes`` (the memo's cap)."""
    replay = result.report["replay"]
    if not replay["enabled"]:
        return
    whole = replay["recorded_blocks"] == result.report["num_blocks"]  # past the cap a recording keeps only a prefix
    if not replay["kept_for_replay"] or not whole or replay["recording_bytes"] > max_bytes:
        raise AssertionError(
            f"{result.config.label}: the replay recording ({replay['recording_bytes'] / GiB:.2f} GiB, "
            f"{replay['recorded_blocks']} blocks kept) does not fit the memo's cap of {max_bytes / GiB:.2f} GiB")
