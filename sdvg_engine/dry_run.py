"""Real-size dry run: the whole SDVG loop at 832x480x81 with the real architectures, on the meta device, in seconds.

The Wan2.1 1.3B drafter, the 14B target, the Wan VAE and ImageReward-v1.0 are built with their real configs on
``torch.device("meta")``: every tensor has its real shape and dtype and no values, so nothing is computed and
nothing is allocated. :func:`dry_run` then runs :meth:`SpeculativePipeline.generate` unchanged, on a pipeline made by
the project's one builder (:func:`sdvg_engine.loaders.build_pipeline`) under a preset, with the shipped default router
(:func:`sdvg_engine.router.default_router_options`: relative routing, margin -0.25), through the real worker layouts,
fp8 KV caches, fp8 target weights, block streaming (the real :class:`~sdvg_engine.offload.BlockStreamer` schedule) and
replay, and reports the bytes each category holds:

* **weights** (per component): the modules' parameters and buffers, each storage once. A streamed model counts its
  resident part plus the most blocks the streamer held at once (measured from ``BlockStreamer.loaded``).
* **KV caches**: the self-attention cache (+ fp8 scales) and the prompt's cross-attention K/V of each model that ran.
* **VAE decode cache**: the largest, over the run, of the causal decode cache plus the snapshots still alive, each
  tensor once. A draft the router may reject (the modes that score drafts) keeps the VAE state from before its decode
  until the router's verdict (kept: released; rejected: restored), so at most one older cache is alive beside the
  current one; the modes that keep every draft take no snapshot.
* **recording / memo** (host RAM): what a run keeps for replay (``report["replay"]``); checked against the cap.
* **activations**: per model call, the peak live bytes of the tensors the call itself created (:class:`LiveBytes`,
  a :class:`TorchDispatchMode` that sees every op's outputs; a weakref finalizer per output tells when its storage
  dies; views and in-place results count once, by storage). Limits: only tensors created *inside* a DiT, VAE or
  reward call are counted (the loop's own small tensors between calls are not); the allocator's rounding and
  fragmentation, CUDA workspaces and kernels that allocate internally (e.g. attention backends) are not seen.

Values are never read: decisions come from :class:`ForcedScoreRouter`, the default router whose ImageReward calls
return forced scores: the ``n``-th judged draft gets ``scores[n]``, a committed target block (which relative routing
scores as the next draft's reference) gets ``target_score``. So the margin decides as usual, and a margin change
flips exactly the blocks it crosses (that is how replay is exercised). The finite checks of the loop say "nothing to
check" for meta tensors, and attention on the dry run's models returns what a fused kernel allocates (their
``RuntimeSettings.fused_attention_on_meta``; ``causal_wan._attention``), not the math fallback's score matrix.

**What runs for real and what is replayed.** A meta op costs the same as long as its shapes are the same, and a
call's output, its transient bytes and its effect are functions of its input shapes (and of the cache geometry). So,
per component, the *first* call of each shape signature runs the real forward on meta (every layer, measured), and
every later call with the same signature *replays* the measured result without running the forward:

* DiT ``forward_block`` / ``encode_text``: replayed calls return an empty output of the measured shape, check that
  the block fits the KV cache and call the streamer's hooks per layer (as the forward does);
* VAE ``decode_block``: replayed calls put new empty slots of the measured shapes in the decode cache and advance the
  frame count (what the decode does to the streaming state); ``encode_frame`` (the recompute window's anchor)
  always runs for real;
* ImageReward: replayed calls skip the forward (the forced scores need no values).

:class:`DryRunResult` counts both per component (``calls``, ``real_calls``, ``replayed_calls``, and ``shapes``, the
distinct signatures; :meth:`DryRunResult.what_ran` says it in words). Configurations of one memory setting share their
measurements (a shape measured by an earlier one is replayed); ``dry_run(..., remeasure=True)`` starts from none. So
measured, at 832x480x81, reference preset, sdvg mode, one worker (7 blocks; drafts 3 and 6 rejected): the drafter makes 37 calls, 3
of them real; the target 18, 3 real; the VAE decodes 9 blocks, 2 for real (block 0's 9 frames, one 12-frame block),
and re-encodes 7 anchor frames, all real; ImageReward runs 10 times (6 drafts, 2 committed target blocks, 2 seam
frames), 3 of them for real (9, 12 and 1 frame).
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
from .models.causal_wan import CausalWanTransformer3DModel, TextKV, wan_config
from .models.loading import build_model, quantize_blocks_fp8
from .pipeline import MODES, SDVGOptions, SpeculativePipeline
from .reward import FrameScores, ImageRewardConfig, ImageRewardModel, ImageRewardScorer
from .reward.tokenizer import BlipTokenizer
from .router import DEFAULT_ROUTER_OPTIONS, RewardRouter, default_router_options
from .vae import StreamingWanVAE, load_wan21_vae_config

META = torch.device("meta")
GiB = 2**30
#: block scores of the drafted blocks 1..6, and of every committed target block (relative routing scores those as
#: the next draft's reference). Under the default router (relative, margin ``FIRST_TAU`` = -0.25) the drafts are
#: accepted, accepted, rejected, accepted, accepted, rejected (4/6: see :func:`forced_decisions`); a fixed threshold
#: of -0.25 would keep block 3 (0.1), which relative routing rejects (0.1 - 0.6 = -0.5). A second run at margin
#: ``REPLAY_TAU`` flips only block 5 (0.2 - 0.3 = -0.1 < 0), so it replays blocks 0..4.
DEFAULT_SCORES = (0.1, 0.6, 0.1, 0.3, 0.2, -0.4)
TARGET_SCORE = 0.0
FIRST_TAU = DEFAULT_ROUTER_OPTIONS["tau"]
REPLAY_TAU = 0.0


# ================================================================================================ byte accounting
class MetaBytes(TorchDispatchMode):
    """The project's one byte counter for model calls on the meta device (or real tensors): the ops run under this
    mode (in this thread) are counted two ways, each switched on by its flag.

    * ``live=True`` (the dry run's :class:`LiveBytes`): ``live`` / ``peak`` bytes of the tensors the ops create. Each
      op output whose storage is new is counted once (views and in-place results of tracked storages add a
      reference, outputs aliasing an input that was made elsewhere are not counted); a weakref finalizer on every
      output releases the storage's bytes when its last tracked tensor dies.
    * ``moved=True`` (``bench/cost_model.py``'s ``ByteCounter``): ``bytes`` read and written by eager execution
      without fusion, inputs + outputs of every non-view ATen op (an upper bound for one kernel per op; weights are
      read once per use). ``depth > 0`` pauses it, for a caller that counts a fused kernel itself (:meth:`add_moved`).
    """

    #: ops that move no bytes (allocation without a write, metadata)
    FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
            "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size"}

    def __init__(self, *, live: bool = True, moved: bool = False):
        super().__init__()
        self.count_live, self.count_moved = live, moved
        self.live = self.peak = 0
        self.bytes = 0
        self.depth = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [live tensors, nbytes]
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.count_moved and self.depth == 0 and not func.is_view and func.overloadpacket.__name__ not in self.FREE:
            self.add_moved(tree_leaves((args, kwargs, out)))
        if self.count_live:
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._track(t, inputs)
        return out

    def add_moved(self, values) -> None:
        """Count the bytes of the tensors among ``values`` (each its own elements, not its storage's) as moved."""
        self.bytes += sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))

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


class LiveBytes(MetaBytes):
    """Peak live bytes of the tensors created by the ops run under this mode (:class:`MetaBytes` with ``live``)."""

    def __init__(self):
        super().__init__(live=True)


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
        self.shapes: dict[str, set] = {}  # the distinct call signatures this run used, measured now or before

    def note(self, component: str, peak: int, real: bool, counted_as: str | None = None, key=None) -> None:
        """One call of ``component`` (its lane's transient) with signature ``key``; counted under ``counted_as``
        (default: ``component``)."""
        self.transient[component] = max(self.transient.get(component, 0), peak)
        counted_as = counted_as or component
        self.shapes.setdefault(counted_as, set()).add(key)
        self.calls[counted_as] = self.calls.get(counted_as, 0) + 1
        if real:
            self.real_calls[counted_as] = self.real_calls.get(counted_as, 0) + 1


def _measured(probe_of, component: str, fn, *args, counted_as: str | None = None, key=None, **kwargs):
    """Run ``fn`` under a fresh :class:`LiveBytes` and note its peak on the current probe."""
    with LiveBytes() as live:
        out = fn(*args, **kwargs)
    probe = probe_of()
    if probe is not None:
        probe.note(component, live.peak, real=True, counted_as=counted_as, key=key)
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
            # a meta model attends as a fused kernel allocates (RuntimeSettings.fused_attention_on_meta)
            model.use_runtime(kv_cache_dtype=kv_cache_dtype(kv_dtype), fused_attention_on_meta=True)
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

        streamer = BlockStreamer([Group() for _ in model.blocks])
        model.use_runtime(block_hooks=streamer)
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
                                      key=key,
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
                self.probe.note(name, peak, real=False, key=key)
            return torch.empty(shape, dtype=dtype, device=META)

        def encode_text(prompt_embeds):
            key = (name, "text", tuple(prompt_embeds.shape))
            if key not in self._signatures:
                text_kv, peak = _measured(probe_of, name, encode, prompt_embeds, key=key)
                self._signatures[key] = ([(tuple(k.shape), k.dtype) for k in text_kv.keys], peak)
                return text_kv
            shapes, peak = self._signatures[key]
            if self.probe is not None:
                self.probe.note(name, peak, real=False, key=key)
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
                self.probe.note("vae", peak, real=real, counted_as="vae decode", key=key)
            self.vae_cache_peak = max(self.vae_cache_peak, tensor_bytes(vae._feat_cache))
            held = tensor_bytes(vae._feat_cache, [s.feat_cache for s in list(self._snapshots)])
            self.vae_held_peak = max(self.vae_held_peak, held)
            return pixels

        def take_snapshot():
            state = snapshot()
            self._snapshots.add(state)
            return state

        vae.decode_block, vae.snapshot = decode_block, take_snapshot
        # the recompute window's anchor re-encode: always run for real (counted apart from the decodes)
        vae.encode_frame = lambda pixels: _measured(probe_of, "vae", encode, pixels, counted_as="vae encode",
                                                    key=("vae encode", tuple(pixels.shape)))[0]

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
    """The shipped default router (:func:`sdvg_engine.router.default_router_options`: relative, margin -0.25, unless
    ``options`` say otherwise) whose ImageReward calls return forced scores.

    Each call runs the real ImageReward forward on the (meta) frames the first time its shapes are seen and replays
    the measurement after that (see the module docstring). The ``n``-th judged draft of a run gets ``scores[n]`` as
    every frame's score; a committed target block (scored by the reference modes) gets ``target_score``; a seam
    feature call (one frame) gets 0, unused. Features are ones on the CPU, as the real scorer hands them back
    (``[N, 1024]`` float32). ``preprocess="torch"``: the default "pil" path needs the pixel values on the host.
    """

    def __init__(self, scorer, scores=DEFAULT_SCORES, *, target_score: float = TARGET_SCORE, **options):
        super().__init__(scorer, **{**default_router_options(options), "preprocess": "torch"})
        self.scores, self.target_score, self.drafts = list(scores), float(target_score), 0
        self._judging = threading.local()  # set while judge() scores a draft (on the reward lane's thread)

    def judge(self, frames, prompt, **kwargs):
        self._judging.on = True
        try:
            return super().judge(frames, prompt, **kwargs)
        finally:
            self._judging.on = False

    def score_frames(self, frames, prompt_features):
        from .reward.preprocess import _preprocess_torch

        scorer = self.scorer
        feats = scorer.encode_prompt(prompt_features) if isinstance(prompt_features, str) else prompt_features
        pixels = _preprocess_torch(frames, scorer.config.image_size, self.crop, scorer.device).to(scorer.dtype)
        ids, mask = feats.input_ids.to(scorer.device), feats.attention_mask.to(scorer.device)
        stack = scorer._dry_stack
        key = ("reward", tuple(pixels.shape), tuple(ids.shape))
        if key not in stack._signatures:
            stack._signatures[key] = _measured(lambda: stack.probe, "reward", scorer.model, pixels, ids, mask, key=key)[1]
        else:
            stack.probe.note("reward", stack._signatures[key], real=False, key=key)
        n = frames.shape[0]
        if getattr(self._judging, "on", False):
            value = self.scores[self.drafts % len(self.scores)] if self.scores else 0.0
            self.drafts += 1
        else:
            value = self.target_score if n > 1 else 0.0
        return FrameScores(torch.full((n,), float(value)), torch.ones(n, scorer.config.vision_width))


def forced_decisions(scores=DEFAULT_SCORES, tau: float = FIRST_TAU, *, tau_mode: str = "relative",
                     target_score: float = TARGET_SCORE) -> list[bool]:
    """The verdicts :class:`ForcedScoreRouter` gives drafted blocks 1..len(scores) in sdvg mode (block 0 by the
    target), worked out by hand from the router's rule (:meth:`RewardRouter.reference_of`): ``fixed`` accepts a
    score >= tau; ``relative`` / ``anchor`` / ``baseline`` accept ``score - reference >= tau``, the reference being the
    last committed block's score / block 0's / their mean (a rejected draft's block is the target's: ``target_score``)."""
    committed, verdicts = [target_score], []
    for score in scores:
        reference = {"fixed": 0.0, "relative": committed[-1], "anchor": committed[0],
                     "baseline": sum(committed) / len(committed)}[tau_mode]
        accept = score - reference >= tau
        verdicts.append(accept)
        committed.append(score if accept else target_score)
    return verdicts


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
    replay: bool = False  # run twice (margin FIRST_TAU, then REPLAY_TAU) with a ReplayMemo: the second run replays
    switch_at: int | None = None  # a prompt schedule switching to a second prompt at this block (issue 39)

    @property
    def label(self) -> str:
        extra = [f"kv {self.kv_dtype}"] if self.kv_dtype != "auto" else []
        extra += ["fp8 target"] if self.fp8_target else []
        extra += [f"offload {self.offload}"] if self.offload != "none" else []
        extra += ["replay"] if self.replay else []
        extra += [f"prompt switch at block {self.switch_at}"] if self.switch_at is not None else []
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
    calls: dict = field(default_factory=dict)  # component -> model calls, over every run of the configuration
    real_calls: dict = field(default_factory=dict)  # component -> calls that ran the forward on meta
    transients: dict = field(default_factory=dict)  # component -> largest per-call transient
    shapes: dict = field(default_factory=dict)  # component -> distinct call signatures (each measured once per stack)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def replayed_calls(self) -> dict:
        """component -> calls that replayed an earlier call's measurement instead of running (module docstring)."""
        return {c: n - self.real_calls.get(c, 0) for c, n in self.calls.items()}

    def what_ran(self) -> str:
        """Per component, how many calls ran the real forward on meta and how many replayed a measured shape."""
        return "; ".join(f"{c}: {n} calls, {self.real_calls.get(c, 0)} real, {self.replayed_calls[c]} replayed "
                         f"({self.shapes.get(c, 0)} shapes)" for c, n in self.calls.items())


_STACKS: dict = {}


def meta_stack(*, fp8_target: bool = False, offload: str = "none", kv_dtype: str = "auto") -> MetaStack:
    """A :class:`MetaStack` per memory setting (built once: a few seconds)."""
    key = (fp8_target, offload, kv_dtype)
    if key not in _STACKS:
        _STACKS[key] = MetaStack(fp8_target=fp8_target, offload=offload, kv_dtype=kv_dtype)
    return _STACKS[key]


def text_context(words: int = 12) -> torch.Tensor:
    """A UMT5-shaped prompt context ``[1, 512, 4096]`` (CPU: the loop hashes it for the replay key)."""
    ctx = torch.zeros(1, 512, 4096)
    ctx[:, :words] = 0.1
    return ctx


PROMPT, SWITCHED_PROMPT = "a corgi running on a beach", "a corgi swimming in the sea"


def pipeline_for(stack: MetaStack, preset: str, router) -> SpeculativePipeline:
    """The preset's context schemes and schedules on fresh generators (:func:`sdvg_engine.loaders.build_pipeline`,
    as every other pipeline of the project): the 1.3B is a Self-Forcing checkpoint (global cache, 4 calls), the 14B a
    Krea one (recompute window, 5 calls)."""
    return build_pipeline(LoadedDiT(stack.drafter, "global_cache", checkpoint_schedule("Wan2.1-T2V-1.3B")),
                          LoadedDiT(stack.target, "recompute_window", checkpoint_schedule("Wan2.1-T2V-14B")),
                          stack.vae, router, preset=preset)


def dry_run(config: DryRunConfig, *, width: int = 832, height: int = 480, num_frames: int = 81,
            scores=DEFAULT_SCORES, max_bytes: int = DEFAULT_MAX_BYTES, remeasure: bool = False) -> DryRunResult:
    """Run one configuration at real size on the meta device and account its bytes (see the module docstring).

    The stack of a memory setting is shared by the configurations that use it, with its measured call signatures:
    a shape an earlier configuration measured is replayed here too (``real_calls`` counts the forwards run by this
    configuration, ``shapes`` the distinct signatures it used). ``remeasure=True`` forgets them first, so the counts
    are this configuration's alone (slower: every shape's first call runs the forward again)."""
    started = time.perf_counter()
    stack = meta_stack(fp8_target=config.fp8_target, offload=config.offload, kv_dtype=config.kv_dtype)
    stack.probe, stack.vae_cache_peak, stack.vae_held_peak = _Probe(), 0, 0
    if remeasure:  # measure every shape again: this configuration's real / replayed counts then stand alone
        stack._signatures.clear()
    stack.max_loaded_blocks = {k: 0 for k in stack.max_loaded_blocks}
    router = ForcedScoreRouter(stack.scorer, scores)  # the shipped default router (relative), forced scores
    stack.scorer._dry_stack = stack
    pipe = pipeline_for(stack, config.preset, router)
    pipe.memo = ReplayMemo(max_bytes) if config.replay else None
    options = SDVGOptions(mode=config.mode)  # the defaults of every other option (schedule_every: SDVGOptions')
    if config.switch_at is None:
        prompts = {"prompt_embeds": text_context(), "prompt": PROMPT}
    else:  # the schedule's contexts live on the host, like a one-prompt run's
        prompts = {"prompt_schedule": [(0, text_context(), PROMPT), (config.switch_at, text_context(14), SWITCHED_PROMPT)]}
    taus = (router.tau, REPLAY_TAU) if config.replay else (router.tau,)
    for tau in taus:
        # The scores follow the drafted blocks in order; a replayed run scores only the drafts after its prefix.
        router.tau, router.drafts = tau, replayed_drafts(scores, taus[0], tau) if tau != taus[0] else 0
        result = pipe.generate(**prompts, num_frames=num_frames, width=width, height=height, seed=42, options=options,
                               workers=config.workers)
        assert result.frames.shape == (num_frames, height, width, 3), result.frames.shape
    probe, report = stack.probe, result.report
    device = {f"weights: {k}": v for k, v in stack.weight_bytes().items()}
    for gen in (pipe.drafter, pipe.target):
        if gen.kv_cache is not None:
            device[f"KV cache: {gen.name}"] = gen.kv_cache.nbytes + gen.text_kv.nbytes
    device["VAE decode cache"] = stack.vae_cache_peak
    # A draft the router may reject keeps the state from before its decode until the router's verdict (kept: let go;
    # rejected: restored), so at most one older cache is alive beside the current one; the modes that keep every
    # draft keep none (the pipeline's _decode_draft / _keep_draft / _restore).
    device["VAE decode cache: older states kept by snapshots"] = stack.vae_held_peak - stack.vae_cache_peak
    lanes = result.report["settings"]["workers"]["lanes"]
    per_lane: dict = {}
    for component, peak in probe.transient.items():
        lane = lanes.get(component, "main")
        per_lane[lane] = max(per_lane.get(lane, 0), peak)
    device["activations (largest per-call transient, per lane, summed)"] = sum(per_lane.values())
    replay = report["replay"]
    host = {"recording (one run)": replay["recording_bytes"], "memo (all kept recordings)": replay["memo_bytes"]}
    if config.switch_at is not None:
        host["prompt schedule (text contexts)"] = tensor_bytes([ctx for _, ctx, _ in prompts["prompt_schedule"]])
    return DryRunResult(config=config, device=device, host=host, report=report,
                        seconds=time.perf_counter() - started, calls=dict(probe.calls),
                        real_calls=dict(probe.real_calls), transients=dict(probe.transient),
                        shapes={c: len(k) for c, k in probe.shapes.items()})


def replayed_drafts(scores, tau_before: float, tau_after: float, *, tau_mode: str = "relative",
                    target_score: float = TARGET_SCORE) -> int:
    """How many drafted blocks a run at ``tau_after`` replays from one at ``tau_before`` (every block before the first
    decision that changes, :func:`forced_decisions`; sdvg mode, every block after block 0 drafted)."""
    before = forced_decisions(scores, tau_before, tau_mode=tau_mode, target_score=target_score)
    after = forced_decisions(scores, tau_after, tau_mode=tau_mode, target_score=target_score)
    return next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(scores))


def configurations() -> list[DryRunConfig]:
    """The whole matrix: both presets x 1 and 2 workers x every mode, then the memory settings and replay."""
    out = [DryRunConfig(preset=p, mode=m, workers=w) for p in ("reference", "native") for w in (1, 2) for m in MODES]
    out += [DryRunConfig(preset="native", mode="sdvg", workers=w, kv_dtype="fp8") for w in (1, 2)]
    out += [DryRunConfig(preset="native", mode="sdvg", workers=1, fp8_target=True),
            DryRunConfig(preset="native", mode="sdvg", workers=1, fp8_target=True, offload="target"),
            DryRunConfig(preset="native", mode="sdvg", workers=2, fp8_target=True, offload="both", kv_dtype="fp8")]
    out += [DryRunConfig(preset=p, mode="sdvg", workers=w, replay=True)
            for p in ("reference", "native") for w in (1, 2)]
    out += [DryRunConfig(preset="native", mode="sdvg", workers=w, switch_at=3) for w in (1, 2)]
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
