"""The work of SDVG Speculative Sampler (and SDVG Advanced Options): one speculative generation with all its per-run
state, the models loaded through the host's memory manager in priority order with room for what it cannot see, and
the replay memo that carries earlier runs across executions (a tau change replays every block it does not change).
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field

import torch

from sdvg_engine import presets
from sdvg_engine.choices import SCHEDULE_EVERY
from sdvg_engine.loaders import LoadedDiT, build_pipeline
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions, SDVGResult, video_frames_to_latent_frames

from . import schema
from .loaders import SDVGModel, SDVGRouter, context_from_conditioning, streaming_vae
from .prompt_schedule import SDVGSchedule, engine_schedule
from .services import Services

__all__ = ["FPS", "PREVIEW_MAX_PX", "REPLAY_MEMO", "SamplerOutput", "advanced_options_node", "advanced_values",
           "check_comfy_models", "check_drafter_not_larger", "clear_replay_memo", "effective_schedule_veto",
           "frame_to_pil", "geometry_problem", "needed_inputs", "replay_memo_for", "run_memory_required",
           "run_sampler", "sampler_summary", "score_plot"]

FPS = 16.0
PREVIEW_MAX_PX = 512


# ========================================================================================================== sampler
def geometry_problem(width, height, length) -> str | None:
    """Why ``width``/``height``/``length`` cannot work (``None`` when they can); linked values (``None``) pass."""
    for name, value in (("width", width), ("height", height), ("length", length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return (f"{name} must be a whole number, got {value!r} ({type(value).__name__}); "
                    f"e.g. {name}={schema.SAMPLER.input(name).default}")
    for name, value in (("width", width), ("height", height)):
        if value is not None and (value < 16 or value > 2048 or value % 16):
            return f"{name} must be a multiple of 16 in 16..2048, got {value}"
    if length is not None:
        if length > schema.MAX_LENGTH:
            return f"length must be at most {schema.MAX_LENGTH}, got {length}"
        try:
            video_frames_to_latent_frames(int(length))
        except ValueError as e:
            return f"length: {e}"
    return None


def needed_inputs(mode: str, drafter=None, target=None, router=None, schedule_veto: bool = False) -> list[str]:
    """The lazy sampler inputs ``mode`` uses that are not evaluated yet (ComfyUI's ``check_lazy_status``): the
    router only where drafts are scored (``sdvg``, or ``schedule`` with ``schedule_veto``)."""
    needs = SDVGOptions(mode=mode, schedule_veto=bool(schedule_veto))
    needed = []
    if drafter is None and needs.uses_drafter:
        needed.append("drafter")
    if target is None and needs.uses_target:
        needed.append("target")
    if router is None and needs.scores_drafts:
        needed.append("router")
    return needed


def advanced_values(options) -> dict:
    """The settings an SDVG Advanced Options output carries (checked: a wrong socket gives a clear error)."""
    if not isinstance(options, dict) or set(options) != set(schema.ADVANCED_NAMES):
        raise ValueError(f"advanced_options: expected the output of SDVG Advanced Options, got "
                         f"{type(options).__name__}; connect that node or leave the input empty")
    return dict(options)


def advanced_options_node(**values) -> dict:
    """The work of SDVG Advanced Options: its widget values, by name, for the sampler's advanced_options input."""
    return {name: values[name] for name in schema.ADVANCED_NAMES}


def effective_schedule_veto(schedule_veto: bool, advanced_options=None) -> bool:
    """The schedule_veto a sampler run uses (the Advanced Options node's when connected): the lazy router check
    needs it before the run starts."""
    if isinstance(advanced_options, dict) and "schedule_veto" in advanced_options:
        return bool(advanced_options["schedule_veto"])
    return bool(schedule_veto)


@dataclass
class SamplerOutput:
    frames: torch.Tensor       # [T, H, W, 3] float32 0..1
    mask: torch.Tensor         # [T, H, W] float32 0/1
    latent: dict               # {"samples": [1, 16, T_lat, h, w]} in ComfyUI's Wan21 latent space
    fps: float
    report: str                # JSON
    plot: torch.Tensor         # [1, h, w, 3]
    result: SDVGResult = field(repr=False)


def _json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _json_safe(x.tolist())
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


def frame_to_pil(frame: torch.Tensor):
    """``[H, W, 3]`` 0..1 -> PIL RGB image."""
    from PIL import Image

    array = (frame.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array)


def run_sampler(*, drafter: SDVGModel | None, target: SDVGModel | None, router: SDVGRouter | None, positive, vae,
                reward_prompt: str = "", width: int = 832, height: int = 480, length: int = 81, seed: int = 42,
                mode: str = "sdvg", force_first_block: bool = True, refine_from_step: int = 0, cascade: bool = False,
                random_accept_prob: float = 0.73, services: Services | None = None, preset: str = "reference",
                workers: str = "auto", replay: bool = True, schedule_every: int = SCHEDULE_EVERY,
                schedule_veto: bool = False, advanced_options: dict | None = None,
                prompt_schedule: SDVGSchedule | None = None) -> SamplerOutput:
    """The work of SDVGSpeculativeSampler: one speculative generation, all per-run state built here.

    With ``replay`` the module's :data:`REPLAY_MEMO` carries earlier runs across executions, so a run that
    differs only in the router's tau settings reuses every block before its first changed decision, and one that
    differs only in later prompt switches (``prompt_schedule``) every block before the first changed switch."""
    services = services or Services()
    if advanced_options is not None:  # SDVG Advanced Options wins over the sampler's own widgets
        chosen = advanced_values(advanced_options)
        refine_from_step, cascade, random_accept_prob = (chosen["refine_from_step"], chosen["cascade"],
                                                         chosen["random_accept_prob"])
        preset, workers, replay = chosen["preset"], chosen["workers"], chosen["replay"]
        schedule_every, schedule_veto = chosen["schedule_every"], chosen["schedule_veto"]
    presets.check_preset(preset)
    if str(workers) not in schema.WORKER_CHOICES:
        raise ValueError(f"workers must be one of {schema.WORKER_CHOICES}, got {workers!r}")
    if mode not in schema.MODES:
        raise ValueError(f"mode must be one of {schema.MODES}, got {mode!r}")
    problem = geometry_problem(width, height, length)
    if problem:
        raise ValueError(problem)
    # target_only never runs the drafter and draft_only never runs the target: ComfyUI does not even load
    # the unused one (lazy input), and the model in use stands in for it.
    options = SDVGOptions(mode=mode, force_first_block=bool(force_first_block),
                          random_accept_prob=float(random_accept_prob),
                          refine_from_step=int(refine_from_step) or None, cascade=bool(cascade),
                          schedule_every=int(schedule_every), schedule_veto=bool(schedule_veto),
                          **(prompt_schedule.options() if isinstance(prompt_schedule, SDVGSchedule) else {}))
    missing = [role for role in needed_inputs(mode, drafter, target, router=True) if role in ("drafter", "target")]
    if missing:
        raise ValueError(f"mode {mode!r} needs the {' and the '.join(missing)}")
    if drafter is not None and target is not None and options.uses_drafter and options.uses_target:
        check_drafter_not_larger(drafter, target)
    used = [m for m in (drafter, target) if m is not None]
    drafter_model, target_model = drafter or target, target or drafter
    running = list(dict.fromkeys(m for m, runs in ((drafter_model, options.uses_drafter),
                                                   (target_model, options.uses_target)) if runs))
    check_comfy_models(running)
    # A MODEL's ops cast (and on low-VRAM loads patch and move) its weights per call through ComfyUI's shared state;
    # a second worker thread would race that, so a run with a MODEL-backed model is one lane.
    one_lane = [m.role for m in running if m.comfy_backed]
    if one_lane:
        workers = "1"
    context = context_from_conditioning(positive, text_dim=used[0].model.config.text_dim)
    for m in used:
        if m.model.config.text_dim != context.shape[-1]:
            raise ValueError(f"the {m.role} expects text width {m.model.config.text_dim}, the conditioning is "
                             f"{context.shape[-1]} wide")
    prompt = reward_prompt or ""
    scores_drafts = options.scores_drafts
    if scores_drafts:
        if router is None:
            raise ValueError("mode 'sdvg' needs a router (SDVG Reward Router)" if mode == "sdvg" else
                             "schedule_veto scores the drafted blocks: link a router (SDVG Reward Router) or turn "
                             "schedule_veto off")
        if not prompt.strip():
            raise ValueError("reward_prompt is empty: ImageReward scores frames against the prompt TEXT, which "
                             "CONDITIONING does not carry. Type the positive prompt into reward_prompt or link "
                             "SDVG Load Prompt Embeddings' prompt output.")

    stream, vae_patcher = streaming_vae(vae, services)
    # Per-run objects: the cached SDVG_MODEL / SDVG_ROUTER values are never modified.
    run_router = router.new_router() if (scores_drafts and router is not None) else None
    # The one pipeline builder (presets applied there); a loader's explicit context_scheme wins over the preset.
    pipe = build_pipeline(LoadedDiT.of(drafter_model.model, drafter_model.info),
                          LoadedDiT.of(target_model.model, target_model.info), stream, run_router, preset=preset,
                          drafter_context=drafter_model.requested_context_scheme,
                          target_context=target_model.requested_context_scheme,
                          workers=workers if workers == "auto" else int(workers),
                          memo=replay_memo_for(drafter_model, target_model) if replay else None)
    schedule = None
    if prompt_schedule is not None:  # the opening prompt (positive, reward_prompt) at block 0, then the switches
        schedule = engine_schedule(prompt_schedule, context, prompt, length=int(length),
                                   frames_per_block=pipe.target.frames_per_block, text_dim=context.shape[-1],
                                   needs_prompt=scores_drafts, mode=mode)

    # In load priority (ComfyServices.load_run): the VAE and the reward (loaded whole), the drafter, then the target,
    # which gets what is left; each keeps what the ones before it need, and room is reserved for what the memory
    # manager cannot see (KV caches, VAE decode state, activations, streamed blocks).
    patchers = [vae_patcher, router.patcher if run_router is not None else None,
                drafter_model.patcher if options.uses_drafter else None,
                target_model.patcher if options.uses_target else None]
    memory = run_memory_required(pipe, options, int(width), int(height), stream)
    services.load_run([p for p in dict.fromkeys(patchers) if p is not None], memory_required=int(sum(memory.values())))

    total = video_frames_to_latent_frames(int(length), pipe.target.frames_per_block) // pipe.target.frames_per_block
    services.progress(0, total, None)

    activity = _Activity(services, total, options)

    def on_block(record) -> None:
        activity.done = record.index + 1
        preview = frame_to_pil(record.frames[-1]) if record.frames is not None and len(record.frames) else None
        services.progress(record.index + 1, total, preview)

    text = dict(prompt_schedule=schedule) if schedule is not None else dict(prompt_embeds=context, prompt=prompt)
    result = pipe.generate(**text, num_frames=int(length), width=int(width), height=int(height), seed=int(seed),
                           options=options, before_call=activity.before_call, on_block=on_block)

    out_device = services.intermediate_device()
    frames = result.frames.float()
    t, h, w, _ = frames.shape
    mask = result.acceptance_mask.float().view(t, 1, 1).expand(t, h, w).contiguous()
    samples = stream.denormalize(result.latents.float())
    report = dict(result.report)
    report["models"] = {"drafter": drafter.describe() if options.uses_drafter and drafter else None,
                        "target": target.describe() if options.uses_target and target else None,
                        "reward": os.path.basename(router.path) if run_router is not None else None}
    report["output"] = {"frames": t, "height": h, "width": w, "fps": FPS, "latent_shape": list(samples.shape)}
    report["memory_required"] = {"bytes": int(sum(memory.values())),
                                 "components": {k: int(v) for k, v in memory.items()}}
    if one_lane:
        workers_report = dict(report.get("settings", {}).get("workers", {}))
        workers_report["one_lane"] = (f"the {' and the '.join(one_lane)} {'is a' if len(one_lane) == 1 else 'are'} "
                                      "ComfyUI MODEL: one worker lane (ComfyUI casts and moves its weights per call)")
        report["settings"] = {**report.get("settings", {}), "workers": workers_report}
    plot = score_plot(report)
    return SamplerOutput(
        frames=frames.to(out_device), mask=mask.to(out_device), latent={"samples": samples.to(out_device)},
        fps=FPS, report=json.dumps(_json_safe(report), indent=2, allow_nan=False), plot=plot.to(out_device),
        result=result,
    )


def check_drafter_not_larger(drafter: SDVGModel, target: SDVGModel) -> None:
    """Refuse a drafter with more parameters than the target (the two inputs swapped): SDVG saves time only when the
    cheap model drafts and the expensive one verifies."""
    small, large = drafter.info.num_parameters, target.info.num_parameters

    def size(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n:,}"

    if small > large:
        raise ValueError(f"the drafter ({drafter.info.architecture}, {size(small)} parameters) is larger than the "
                         f"target ({target.info.architecture}, {size(large)} parameters): SDVG drafts with the "
                         "small model and lets the large one redo rejected blocks. Swap them: the 1.3B (Self-Forcing) "
                         "on the drafter input, the 14B (Krea Realtime) on the target input.")


def check_comfy_models(models: list) -> None:
    """Refuse two MODEL-backed models of one run that are clones of one ComfyUI model with different patches (e.g. one
    Load Diffusion Model feeding the drafter directly and the target through a LoRA): ComfyUI holds one set of patches
    per loaded model, so loading one would unpatch the other."""
    comfy = [m for m in models if m.comfy_backed]
    for i, a in enumerate(comfy):
        for b in comfy[i + 1:]:
            if a.patcher is not b.patcher and a.patcher.is_clone(b.patcher):
                raise ValueError(f"the {a.role} and the {b.role} are the same ComfyUI model with different patches "
                                 "(LoRAs or other model patches on one Load Diffusion Model): ComfyUI keeps one set of "
                                 "patches per loaded model, so they cannot run side by side. Use two Load Diffusion "
                                 "Model nodes, or connect the same MODEL to both.")


def run_memory_required(pipe, options: SDVGOptions, width: int, height: int, stream) -> dict:
    """Bytes the run needs beside the weights the memory manager loads (its DiTs' KV caches and text K/V for their
    context schemes and KV dtypes, the VAE decode cache and its rollback snapshot, the largest transient), for the
    memory manager to reserve (:func:`sdvg_engine.offload.run_memory_components`, the memory plan's terms), and the
    pack's own weights it never sees: the blocks a file loader's ``offload: blocks`` streams (its patcher holds the
    resident part only), 3 per streamed model as in the plan (in use, prefetched, one being freed).

    The VAE's and the reward model's weights are not in it: they are handed to the memory manager, and
    ``ComfyServices.load_run`` keeps them (and the drafter's) free before sizing the target's partial load."""
    from sdvg_engine.offload import run_memory_components

    models, streamed = [], {}
    for role, gen, runs in (("drafter", pipe.drafter, options.uses_drafter),
                            ("target", pipe.target, options.uses_target)):
        if not runs:
            continue
        model = gen.model
        kv = "fp8" if model.kv_cache_dtype == torch.float8_e4m3fn else "auto"
        compute_bytes = torch.empty((), dtype=model.compute_dtype).element_size()
        models.append((role, dict(model.config), gen.context.capacity_frames(gen.frames_per_block), kv, compute_bytes))
        if getattr(model, "block_hooks", None) is not None and id(model) not in streamed:
            block = model.blocks[0]
            streamed[id(model)] = (role, 3 * sum(t.numel() * t.element_size()
                                                 for t in [*block.parameters(), *block.buffers()]))
    vae_param = next(iter(stream.vae.parameters()), None)
    vae_dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(getattr(vae_param, "dtype", None), "fp32")
    memory = run_memory_components(models, width=width, height=height, vae_dtype=vae_dtype)
    for role, size in streamed.values():
        memory[f"{role} streamed blocks (3 on the device)"] = size
    return memory


class _Activity:
    """The sampler's ``before_call``: checks the host's interrupt before every model call, then labels the node with
    what runs now ("drafting block 2/7", "verifying ...", "target regenerating ..."), sending only changes."""

    _PHASES = {"drafter": "drafting", "vae": "decoding", "reward": "verifying", "replay": "replaying"}

    def __init__(self, services: Services, total: int, options: SDVGOptions):
        self.services, self.total, self.options = services, total, options
        self.done = 0  # blocks final so far (set by on_block)
        self._last = None
        self._lock = threading.Lock()

    def before_call(self, component: str, kind: str) -> None:
        self.services.check_interrupt()  # first: a cancel must raise whatever the label
        if component == "target":
            first = self.done == 0 or not self.options.uses_drafter  # target_only: every target block is new
            phase = "target context" if kind in ("commit", "recompute", "text") else \
                "target generating" if first else "target regenerating"
        else:
            phase = self._PHASES.get(component, component)
        text = f"{phase} block {min(self.done + 1, self.total)}/{self.total}"
        with self._lock:
            if text == self._last:
                return
            self._last = text
        self.services.activity(text)


# =========================================================================================================== replay
#: Earlier sampler runs, for replay across executions (CPU RAM; SDVG_REPLAY_GB caps it, default 4).
REPLAY_MEMO = ReplayMemo(max_bytes=int(float(os.environ.get("SDVG_REPLAY_GB", "4")) * (1 << 30)))
_replay_models: tuple | None = None
_replay_lock = threading.Lock()


def replay_memo_for(drafter: SDVGModel, target: SDVGModel) -> ReplayMemo:
    """The shared memo, emptied first when the models differ from the last run's (a reload, other files, or
    ComfyUI's "free memory", which makes the loaders run again)."""
    global _replay_models
    models = (id(drafter.model), id(target.model))
    with _replay_lock:
        if models != _replay_models:
            REPLAY_MEMO.clear()
            _replay_models = models
    return REPLAY_MEMO


def clear_replay_memo() -> None:
    global _replay_models
    with _replay_lock:
        REPLAY_MEMO.clear()
        _replay_models = None


# ============================================================================================================= plot
def score_plot(report: dict, width: int = 640, height: int = 360) -> torch.Tensor:
    """The report's score plot (:mod:`sdvg_engine.score_view`: per block, the quantity compared with tau against the
    block's own threshold) as a ComfyUI IMAGE ``[1, height, width, 3]`` float 0..1."""
    from sdvg_engine.score_view import draw_score_plot

    array = torch.from_numpy(draw_score_plot(report, width, height))
    return (array.float() / 255.0).unsqueeze(0)


# ========================================================================================================= reports
def sampler_summary(report_json: str) -> str:
    """A short human-readable line for the node's UI."""
    report = json.loads(report_json)
    acc = report.get("acceptance", {})
    rate = acc.get("rate_of_drafted")
    speed = report.get("speedup_vs_target")
    parts = [f"{report.get('num_blocks', 0)} blocks", " ".join(s[0].upper() for s in report.get("decisions", []))]
    if rate is not None:
        parts.append(f"kept {acc.get('accepted_blocks')}/{acc.get('drafted_blocks')} drafts ({rate:.0%})")
    if speed is not None:
        parts.append(f"~{speed:.2f}x vs target-only")
    switches = (report.get("settings", {}).get("prompt_schedule") or [])[1:]
    if switches:
        parts.append(f"{len(switches) + 1} prompts: switches at frame{'s' if len(switches) > 1 else ''} "
                     + ", ".join(str(s["first_frame"]) for s in switches))
    return " | ".join(p for p in parts if p)

