"""``sdvg generate``: videos with SDVG (or a baseline mode), their acceptance masks and a report."""

from __future__ import annotations

import signal
import time

from .arg_checks import options_of, parse_taus
from .common import UsageError, _print_err, raise_if_interrupted
from .outputs import _finish_outputs, plan_generate_outputs
from .prompts import _contexts, plan_prompts, read_prompt_schedule, schedule_entries


def generator_kwargs(args, role: str) -> dict:
    """Keyword arguments of :func:`sdvg_engine.loaders.load_generator` for ``role`` (``drafter``/``target``);
    one place to map new model flags (:func:`build_pipeline` splits them into loading and building)."""
    common = dict(name=role, dtype=args.dtype, max_frames=args.max_frames, fuse_qkv=args.fuse_qkv, compile=args.compile,
                  preset=args.preset)
    if role == "drafter":
        return dict(common, device=args.drafter_device or args.device, context_scheme=args.drafter_context,
                    schedule=args.drafter_schedule)
    return dict(common, dtype=getattr(args, "target_dtype", None) or args.dtype, device=args.device, fp8=args.fp8_target,
                context_scheme=args.target_context,
                schedule=args.target_schedule, attention_bias=args.attention_bias)


def router_kwargs(args) -> dict:
    """Keyword arguments of :class:`sdvg_engine.router.RewardRouter` (besides the scorer)."""
    return dict(tau=args.tau, aggregation=args.aggregation, crop=args.crop, temporal_weight=args.temporal_weight,
                tau_mode=args.tau_mode, accept_rate=args.accept_rate, preprocess=args.reward_preprocess)


#: load_generator's keywords that configure the generator (build_pipeline) rather than the loaded model (load_dit)
_BUILD_KEYS = ("preset", "context_scheme", "schedule", "max_frames", "attention_bias")


def build_pipeline(args):
    """The run's pipeline through the project's one builder (:func:`sdvg_engine.loaders.build_pipeline`), loading
    only the models the mode uses (:func:`options_of`): ``draft_only`` never opens ``--target``, ``target_only``
    never opens ``--drafter``, and the reward model is loaded only when drafts are scored. A model the mode never
    runs is stood in for by the other one's weights (the pipeline is built from two; the stand-in makes no call and
    holds no cache, and the report names no settings for it: :func:`unused_model_settings`)."""
    from ..loaders import build_pipeline as build, load_dit, parse_dtype
    from ..offload import resolve_memory_args
    from ..vae import load_wan_vae

    options = options_of(args)
    if options.scores_drafts and not args.reward:
        raise UsageError(f"--reward: mode {args.mode!r}{' with --schedule-veto' if args.mode == 'schedule' else ''} "
                         "needs --reward (an ImageReward.pt file)")
    offload, kv_dtype = resolve_memory_args(args)  # --vram-gb / --offload / --kv-dtype (docs/memory.md)
    aux = args.aux_device or args.device
    router = None
    if options.scores_drafts:  # first: a wrong reward file is found before the DiTs (minutes for a 14B) load
        from ..reward import load_image_reward
        from ..router import RewardRouter

        router = RewardRouter(load_image_reward(args.reward, device=aux), **router_kwargs(args))
    vae = load_wan_vae(args.vae, device=aux, dtype=parse_dtype(args.vae_dtype))
    loaded = {}
    for role, used, streamed in (("drafter", options.uses_drafter, offload == "both"),
                                 ("target", options.uses_target, offload != "none")):
        if used:
            kw = {k: v for k, v in generator_kwargs(args, role).items() if k not in _BUILD_KEYS}
            loaded[role] = load_dit(getattr(args, role), **kw, offload="blocks" if streamed else "none",
                                    kv_dtype=kv_dtype)
    drafter = loaded.get("drafter", loaded.get("target"))
    target = loaded.get("target", drafter)
    return build(drafter, target, vae, router, preset=args.preset, drafter_context=args.drafter_context,
                 target_context=args.target_context, drafter_schedule=args.drafter_schedule,
                 target_schedule=args.target_schedule, max_frames=args.max_frames,
                 target_attention_bias=args.attention_bias if "target" in loaded else None,
                 workers=args.workers if args.workers == "auto" else int(args.workers))


def unused_model_settings(report: dict, options) -> None:
    """A model the mode never ran (``draft_only``'s target, ``target_only``'s drafter) was not loaded: its settings
    in the report are ``None`` rather than those of the stand-in."""
    settings = report.get("settings", {})
    for role, used in (("drafter", options.uses_drafter), ("target", options.uses_target)):
        if not used:
            settings[f"{role}_schedule"] = settings[f"{role}_context"] = None
            settings.get("settings_source", {}).pop(role, None)


def block_verdict(record) -> str:
    """What the progress line says of one block: the quantity actually compared with the threshold
    (:meth:`sdvg_engine.router.RouteDecision.comparison`), the threshold and the decision."""
    d = record.decision
    if d is None:
        return "target" if record.source == "target" else "draft kept"
    kept = "accepted" if d.accept else "rejected"
    c = d.comparison()
    if c.threshold is None:
        return f"{c.quantity} {c.value:+.3f} -> {kept}"
    if c.mode == "random":
        return f"random draw u {c.value:.3f} vs p {c.threshold:.3f} (keep if u < p) -> {kept}"
    if c.mode == "accept_rate":
        return f"draft score {c.value:+.3f} vs running-quantile threshold {c.threshold:+.3f} -> {kept}"
    if c.mode == "fixed":
        return f"draft score {c.value:+.3f} vs tau {c.threshold:+.3f} -> {kept}"
    return f"margin {c.value:+.3f} ({c.quantity}) vs tau {c.threshold:+.3f} -> {kept}"


def _progress(num_blocks: int):
    started = time.perf_counter()

    def on_block(record):
        bar = "#" * (record.index + 1) + "." * (num_blocks - record.index - 1)
        _print_err(f"[{bar}] block {record.index + 1}/{num_blocks}: {block_verdict(record)} "
                   f"({time.perf_counter() - started:.1f} s)")

    return on_block


def schedule_report(args, schedule) -> dict:
    """The report's ``prompt_schedule`` of a ``--prompt-schedule`` video: the file and, per entry, its first video frame
    and block, the prompt the video follows and the reward prompt its drafts are scored against (the run's
    ``settings["prompt_schedule"]`` lists the segments as the engine ran them)."""
    from ..prompt_schedule import block_start_frame

    return {"file": str(args.prompt_schedule),
            "entries": [{"frame": block_start_frame(block), "first_block": block, "prompt": prompt,
                         "reward_prompt": reward} for block, prompt, reward in schedule]}


def _video_suffix(args) -> str:
    from ..video_io import default_video_suffix, have_pyav

    if args.format == "mp4" and not have_pyav():
        raise UsageError("--format mp4: needs PyAV (pip install av); or use --format webp")
    suffix = f".{args.format}" if args.format else default_video_suffix()
    if suffix == ".webp" and not have_pyav() and not args.format:
        _print_err("PyAV is not installed: writing animated WebP instead of MP4 (pip install av for MP4)")
    return suffix


def cmd_generate(args) -> int:
    from PIL import Image

    from ..pipeline import CancelToken, GenerationCancelled, NonFiniteOutputError, SDVGOptions, video_frames_to_latent_frames
    from ..prompt_schedule import block_start_frame
    from ..video_io import atomic_output, mask_strip, write_video

    options = SDVGOptions(mode=args.mode, force_first_block=args.force_first_block, random_accept_prob=args.random_p,
                          refine_from_step=args.refine_from_step, cascade=args.cascade,
                          schedule_every=args.schedule_every, schedule_veto=args.schedule_veto,
                          target_after_switch=args.target_after_switch, switch_routing=args.switch_routing)
    num_blocks = video_frames_to_latent_frames(args.frames) // 3
    taus = parse_taus(args.taus) if args.taus else [args.tau]
    # Everything that can be checked without a model is checked before the first load.
    schedule = read_prompt_schedule(args)  # --prompt-schedule: one video, its prompts changing at block starts
    plan = plan_prompts(args, schedule)
    videos = 1 if schedule is not None else len(plan[0])
    suffix = _video_suffix(args)
    out, files, report_path = plan_generate_outputs(args, videos * len(taus), suffix)
    pairs = _contexts(args, plan)  # each distinct prompt encoded once
    pipe = build_pipeline(args)  # --out is created by the first finished video, not before
    if len(taus) > 1:
        from ..memo import ReplayMemo

        pipe.memo = ReplayMemo()  # each tau after the first replays the blocks before its first changed decision
    if schedule is not None:
        # (label, embeddings, seed offset, tau, the pipeline's prompt_schedule)
        entries = schedule_entries(schedule, pairs)
        label = " | ".join(f"{block_start_frame(block)}: {prompt}" for block, prompt, _ in schedule)
        jobs = [(label, None, 0, tau, entries) for tau in taus]
    else:
        jobs = [(prompt, context, i, tau, None) for i, (prompt, context) in enumerate(pairs) for tau in taus]
    sweep_started, estimated_independent = time.perf_counter(), 0.0

    token = CancelToken()

    def on_sigint(signum, frame):
        if token.cancelled:
            raise KeyboardInterrupt
        _print_err("cancelling after the current model call (Ctrl-C again to abort)")
        token.cancel()

    raise_if_interrupted()  # a Ctrl-C while the models loaded, swallowed there: stop before the first video
    previous = signal.signal(signal.SIGINT, on_sigint)
    reports = []
    try:
        for k, (prompt, context, i, tau, entries) in enumerate(jobs):
            _print_err(f"video {k + 1}/{len(jobs)}: {prompt[:80]}" + (f" (tau {tau:g})" if len(taus) > 1 else ""))
            if pipe.router is not None:
                pipe.router.tau = tau
            started = time.perf_counter()
            try:
                inputs = dict(prompt_schedule=entries) if entries is not None else dict(prompt_embeds=context,
                                                                                         prompt=prompt)
                result = pipe.generate(**inputs, num_frames=args.frames, width=args.width, height=args.height,
                                       seed=args.seed + i, options=options, cancel=token,
                                       on_block=_progress(num_blocks))
            except GenerationCancelled as err:
                if reports:  # the finished videos form a complete set with their report (never a mix)
                    _finish_outputs(args, out, files[: len(reports)], report_path, reports)
                _print_err(f"sdvg generate: {err}; {len(reports)} finished video(s) kept in {out}")
                return 130
            except NonFiniteOutputError as err:  # name the files behind "the drafter's"/"the target's" output
                files_used = [f"{role} {getattr(args, role)}" for role, used in (
                    ("drafter", options.uses_drafter), ("target", options.uses_target)) if used]
                raise NonFiniteOutputError(f"video {i + 1} ({prompt[:40]!r}): {err} Files: {', '.join(files_used)}.") from err
            unused_model_settings(result.report, options)
            if schedule is not None:
                result.report["prompt_schedule"] = schedule_report(args, schedule)
            replay = result.report.get("replay", {})
            estimated_independent += time.perf_counter() - started + replay.get("seconds_saved", 0.0)
            if replay.get("replayed_blocks"):
                _print_err(f"  replayed {replay['replayed_blocks']} block(s) of an earlier tau "
                           f"(~{replay['seconds_saved']:.1f} s saved)")
            video_path, mask_path = files[k]
            # Both written to temporary names first, the mask renamed right after the video: a failure (or Ctrl-C) in
            # either leaves neither, never a video without its mask (the earlier set's pair stays as it was).
            mask_path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(mask_path) as tmp:
                Image.fromarray(mask_strip(result.acceptance_mask)).save(tmp, format="PNG")
                video = write_video(result.frames, video_path)  # temporary file + rename
            result.report["video"] = str(video)
            reports.append(result.report)
            speed = result.report["speedup_vs_target"]
            _print_err(f"  -> {video}  acceptance {result.report['acceptance']['rate_after_first_block']}  "
                       f"speedup vs target {speed:.2f}x" if speed else f"  -> {video}")
    except BaseException:
        # Ctrl-C, a failed write or model: the finished videos form a complete set with their report, as after a
        # cancel (with --overwrite never beside an earlier run's report and leftovers), then the error goes on.
        if reports:
            try:
                _finish_outputs(args, out, files[: len(reports)], report_path, reports)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    _finish_outputs(args, out, files, report_path, reports)
    print(f"wrote {len(reports)} video(s) to {out} and the report to {report_path}")
    if len(taus) > 1:
        wall = time.perf_counter() - sweep_started
        print(f"tau sweep {','.join(f'{t:g}' for t in taus)}: {wall:.1f} s with replay; independent runs would take about "
              f"{estimated_independent:.1f} s (each run's time plus what its replayed blocks took), "
              f"{estimated_independent / wall:.2f}x")
    return 0
