"""``sdvg``: inspect checkpoints, encode prompts, generate videos (headless, batch-friendly).

    sdvg inspect PATH
    sdvg encode-prompts --text-encoder PATH [--tokenizer DIR] --prompts-file F --out embeds.safetensors
    sdvg generate --drafter D --target T --vae V [--reward R] (--prompt P | --prompts-file F) ...

Failures are one line on stderr naming the argument or file, what is wrong and the fix, with exit
status 2 (130 after Ctrl-C); ``--debug`` adds the traceback. Every argument and output path is checked
(the table :data:`ARG_CHECKS`, then :func:`plan_generate_outputs`) before any model is loaded, outputs
are written to a temporary name and renamed, and nothing existing is replaced without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .router import PAPER_ROUTER_OPTIONS, REFERENCE_MODES, TAU_MODES, default_router_options

#: ``sdvg bench``'s tau values when none are given: the paper's table (fixed) or margins around the default (relative)
BENCH_TAUS = {"fixed": "-0.7,-1.0,-1.5,-2.0", "reference": "-0.1,-0.25,-0.5,-1.0"}


def _print_err(*args):
    print(*args, file=sys.stderr, flush=True)


class UsageError(ValueError):
    """A bad command-line argument; the message starts with the flag and its value."""


# ---- argument types and the validation table ---------------------------------------------------------------
def tau_value(text: str) -> float:
    """A threshold: any float, ``-inf`` (accept every draft) and ``inf`` (reject every draft) included; NaN refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (use e.g. -0.7, -inf or inf)") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError("NaN is not a threshold; use a number, -inf (accept all) or inf (reject all)")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def parse_taus(text: str) -> list[float]:
    """``--taus -0.7,-1.5,-inf`` -> floats; NaN and empty entries refused naming the entry."""
    taus = []
    for part in text.split(","):
        try:
            taus.append(tau_value(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"--taus {text}: entry {part.strip()!r}: {e}") from None
    return taus


def _looks_numeric(token: str) -> bool:
    parts = token.split(",")
    try:
        for part in parts:
            float(part)
    except ValueError:
        return False
    return True


def join_negative_values(argv: list[str]) -> list[str]:
    """``--tau -inf`` -> ``--tau=-inf``: argparse reads a value starting with ``-`` that is not a plain
    negative number (``-inf``, ``-1e3``, ``-0.7,-1.5``) as an option; joining keeps it a value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if (tok.startswith("--") and "=" not in tok and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and _looks_numeric(argv[i + 1])):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


@dataclass(frozen=True)
class ArgCheck:
    """One row of the validation table: ``check(args)`` returns what is wrong (and the fix) or ``None``."""

    flag: str
    check: Callable[[argparse.Namespace], "str | None"]
    commands: tuple[str, ...] = ("generate", "bench")


#: Checked in order by :func:`validate_args` before anything is loaded. Add a row for every new flag
#: (``arg_check("--my-flag")(lambda args: ...)`` or ``ARG_CHECKS.append(ArgCheck(...))``).
ARG_CHECKS: list[ArgCheck] = []


def arg_check(flag: str, *commands: str):
    def register(fn):
        ARG_CHECKS.append(ArgCheck(flag, fn, commands or ("generate", "bench")))
        return fn

    return register


def validate_args(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for the first row of :data:`ARG_CHECKS` that fails for ``args.command``."""
    for row in ARG_CHECKS:
        if args.command not in row.commands:
            continue
        attr = row.flag.lstrip("-").replace("-", "_")
        if not hasattr(args, attr):
            continue
        problem = row.check(args)
        if problem:
            value = getattr(args, attr, None)
            shown = f" {value}" if value is not None and not isinstance(value, bool) else ""
            raise UsageError(f"{row.flag}{shown}: {problem}")


def _flag(args, name):
    return getattr(args, name.lstrip("-").replace("-", "_"), None)


@arg_check("--width")
def _check_width(args):
    return _size_problem(args.width, "width")


@arg_check("--height")
def _check_height(args):
    return _size_problem(args.height, "height")


MAX_SIDE = 4096


def _size_problem(value: int, name: str) -> str | None:
    if value < 16 or value % 16:
        lower = max(16, value - value % 16)
        return f"the {name} must be a positive multiple of 16 (e.g. {lower} or {lower + 16})"
    if value > MAX_SIDE:
        return f"the {name} must be at most {MAX_SIDE} pixels (Wan2.1 is trained at 832x480)"
    return None


@arg_check("--frames")
def _check_frames(args):
    from .pipeline import video_frames_to_latent_frames

    try:
        latent = video_frames_to_latent_frames(args.frames)
    except ValueError as e:
        return str(e).replace(f"num_frames={args.frames} ", "")
    capacity = args.max_frames
    for role in ("drafter", "target"):
        scheme = getattr(args, f"{role}_context")
        if scheme == "auto":
            scheme = _auto_context_scheme(args, role)
        if scheme == "global_cache" and latent > capacity:
            return (f"needs {latent} latent frames but the {role}'s global KV cache holds --max-frames {capacity}; "
                    f"raise --max-frames or use --{role}-context recompute_window")
    return None


def _auto_context_scheme(args, role: str) -> str | None:
    """What ``--<role>-context auto`` will mean: the preset's scheme when a ``--preset`` sets one (main's
    :mod:`sdvg_engine.presets`), else the checkpoint's own (read from a safetensors header); ``None`` = unknown."""
    if getattr(args, "vram_gb", None) is not None:
        return None  # the memory plan may switch the scheme (docs/memory.md); the loader checks the length then
    preset = getattr(args, "preset", None)
    if preset is not None:
        try:
            from . import presets
        except ImportError:
            return None
        try:
            scheme = presets.recipe(preset, role).context_scheme
        except ValueError:
            return None  # a bad preset has its own check
        if scheme != presets.CHECKPOINT:
            return scheme
    return peek_context_scheme(getattr(args, role))


def peek_context_scheme(path) -> str | None:
    """The context scheme a ``.safetensors`` checkpoint was trained with, from its header alone (no tensor is
    read); ``None`` when that cannot be told cheaply (pickles, folders, unreadable files: the loader decides)."""
    from .models.loading import META_CONTEXT

    if path is None or not str(path).endswith(".safetensors") or not Path(path).is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            scheme = (f.metadata() or {}).get(META_CONTEXT)
            if scheme:
                return scheme
            key = next((k for k in f.keys() if k.endswith("patch_embedding.weight")), None)
            if key is None:
                return None
            width = f.get_slice(key).get_shape()[0]
    except Exception:  # noqa: BLE001 - a header we cannot read is the loader's to report, with its message
        return None
    return "recompute_window" if width == 5120 else "global_cache"


@arg_check("--max-frames")
def _check_max_frames(args):
    return None if args.max_frames >= 3 else "must be at least 3 (one block of latent frames)"


@arg_check("--seed")
def _check_seed(args):
    return None if 0 <= args.seed < 2**63 - 10_000 else "must be a non-negative integer (e.g. 42)"


@arg_check("--tau", "generate")
def _check_tau(args):
    return "NaN is not a threshold; use a number, -inf or inf" if math.isnan(args.tau) else None


def _scores_drafts(args) -> bool:
    """Whether the run scores drafts with the reward (--mode sdvg, or --mode schedule with --schedule-veto)."""
    from .pipeline import SDVGOptions

    return SDVGOptions(mode=args.mode, schedule_veto=bool(getattr(args, "schedule_veto", False))).scores_drafts


@arg_check("--schedule-every", "generate")
def _check_schedule_every(args):
    return None if args.schedule_every >= 0 else "must be a whole number >= 0 (0 = only block 0 by the target)"


@arg_check("--random-p", "generate")
def _check_random_p(args):
    return None if 0.0 <= args.random_p <= 1.0 else "must be a probability in [0, 1]"


@arg_check("--refine-from-step", "generate")
def _check_refine(args):
    from .sampling import SCHEDULES

    k = args.refine_from_step
    most = max(s.num_steps for s in SCHEDULES.values()) - 1
    if k is not None and not 1 <= k <= most:
        return (f"must be a drafter step k with 1 <= k < the drafter's steps: 1..3 for the 4-step Self-Forcing "
                f"schedule, 1..{most} for Krea's 5-step one (3 is the reference's best)")
    return None


@arg_check("--cascade", "generate")
def _check_cascade(args):
    if not args.cascade or not _scores_drafts(args):
        return None
    if args.aggregation != "min":
        return "cascade scoring is exact only with --aggregation min; drop --cascade or use --aggregation min"
    if args.temporal_weight != 0.0:
        return "cascade scoring does not combine with --temporal-weight; drop one of them"
    if getattr(args, "tau_mode", "fixed") in REFERENCE_MODES:
        return (f"cascade scoring is not supported with --tau-mode {args.tau_mode}; drop --cascade or use "
                "--tau-mode fixed")
    return None


@arg_check("--tau-mode", "generate")
def _check_tau_mode(args):
    if args.tau_mode in REFERENCE_MODES and _scores_drafts(args) and not args.force_first_block:
        against = {"relative": "the last committed block", "anchor": "block 0"}.get(args.tau_mode, "the committed blocks")
        return (f"compares each draft with {against}, and block 0 has none: drop --no-force-first-block (block 0 by "
                "the target) or use --tau-mode fixed")
    return None


@arg_check("--temporal-weight")
def _check_temporal(args):
    return None if math.isfinite(args.temporal_weight) else "must be a finite number"


@arg_check("--attention-bias")
def _check_attention_bias(args):
    bias = args.attention_bias
    if bias is None:
        return None
    if not 0.0 < bias <= 1.0:
        return "must be in (0, 1] (Scope uses 0.3)"
    scheme = args.target_context if args.target_context != "auto" else _auto_context_scheme(args, "target")
    if scheme == "global_cache":
        where = "--target-context is" if args.target_context != "auto" else \
            f"with --preset {getattr(args, 'preset', None)} the target runs"
        return (f"applies to recompute-window targets only, but {where} global_cache; "
                "drop --attention-bias or use --target-context recompute_window")
    return None


@arg_check("--offload", "generate")
def _check_offload(args):
    if args.offload not in (None, "none") and not str(args.device).startswith("cuda"):
        return (f"streams transformer blocks from CPU RAM to a CUDA GPU, but --device is {args.device}; "
                "drop --offload on a CPU run")
    return None


@arg_check("--reward", "generate")
def _check_reward(args):
    if _scores_drafts(args) and not args.reward:
        if args.mode == "schedule":
            return "--schedule-veto scores the drafted blocks: it needs --reward (an ImageReward.pt file)"
        return "mode 'sdvg' needs --reward (an ImageReward.pt file); or pick another --mode"
    return None


for _dev in ("--device", "--drafter-device", "--aux-device"):
    arg_check(_dev)(lambda args, _dev=_dev: _device_problem(_flag(args, _dev)))
arg_check("--device", "encode-prompts")(lambda args: _device_problem(args.device))


def _device_problem(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return "not a device; use cpu, cuda or cuda:N"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"there are only {torch.cuda.device_count()} CUDA device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})"
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            return "MPS is not available on this machine; use --device cpu"
    elif device.type != "cpu":
        return f"device type {device.type!r} is not supported; use cpu or cuda"
    return None


for _name in ("--dtype", "--vae-dtype"):
    arg_check(_name, "generate", "bench", "encode-prompts")(lambda args, _name=_name: _dtype_problem(_flag(args, _name)))


def _dtype_problem(name) -> str | None:
    from .loaders import DTYPES

    if name is None or name in DTYPES:
        return None
    return f"unknown dtype; choose one of {', '.join(sorted(DTYPES))}"


for _name, _commands in (("--drafter", ("generate", "bench")), ("--target", ("generate", "bench")),
                         ("--vae", ("generate", "bench")), ("--reward", ("generate", "bench")),
                         ("--context-file", ("generate", "bench")), ("--prompts-file", ("generate", "bench", "encode-prompts")),
                         ("--text-encoder", ("generate", "bench", "encode-prompts")),
                         ("--tokenizer", ("generate", "bench", "encode-prompts"))):
    arg_check(_name, *_commands)(lambda args, _name=_name: _input_problem(_flag(args, _name)))


def _input_problem(value) -> str | None:
    if value is None:
        return None
    from .checkpoint_io import missing_reason

    path = Path(value).expanduser()
    if not path.exists():
        reason = missing_reason(path)
        return "not found; check the path" if reason == "not found" else reason
    return None


@arg_check("--taus", "bench", "generate")
def _check_taus(args):
    if args.taus is not None:
        parse_taus(args.taus)
    return None


@arg_check("--taus", "generate")
def _check_generate_taus(args):
    if args.taus is None:
        return None
    if args.mode != "sdvg":
        return f"{args.taus}: one video per tau needs --mode sdvg (mode {args.mode} does not use tau)"
    if args.tau_mode == "accept_rate":
        return f"{args.taus}: --tau-mode {args.tau_mode} sets its own thresholds; use --tau-mode fixed or relative with --taus"
    return None


@arg_check("--accept-rate", "generate", "bench")
def _check_accept_rate(args):
    rate = args.accept_rate
    return None if 0.0 < rate < 1.0 else f"{rate}: must lie strictly between 0 and 1 (the share of drafts to keep)"


@arg_check("--modes", "bench")
def _check_modes(args):
    from .pipeline import MODES

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        return f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}"
    return None


@arg_check("--num-heads", "inspect")
def _check_num_heads(args):
    return None if args.num_heads is None or args.num_heads >= 1 else "must be a positive integer (attention heads)"


# ---- output paths ------------------------------------------------------------------------------------------
def _check_writable_folder(folder: Path, flag: str, shown) -> None:
    """``folder`` (or its nearest existing ancestor, where it will be created) must be a writable folder."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag} {shown}: {probe} is a file, not a folder; choose another path")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".sdvg-write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {shown}: cannot write in {probe} ({e.strerror or e}); choose a writable folder") from None


def check_output_file(path: Path, flag: str, *, overwrite: bool) -> None:
    """An output file: not a folder, not existing (unless ``overwrite``), in a writable folder. Only a regular file is
    ever replaced: a device, FIFO or socket under that name is refused even with ``--overwrite`` (the atomic rename
    would replace the node itself; as root that could be /dev/null)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name (e.g. {path / 'report.json'})")
    if path.exists() and not path.is_file():
        raise UsageError(f"{flag} {path}: exists and is not a regular file (a device, FIFO or socket); it is never "
                         "replaced: choose a file name")
    if path.exists() and not overwrite:
        raise UsageError(f"{flag} {path}: already exists; pass --overwrite to replace it or choose another name")
    _check_writable_folder(path.parent, flag, path)


#: What a run wrote into --out (file names), so that --overwrite removes an earlier set's leftovers and nothing else:
#: a file is deleted only if this tool wrote it, never because its name looks like an output.
MANIFEST = ".sdvg-outputs.json"


def written_by_earlier_run(out: Path) -> list[str]:
    """The names an earlier run in ``out`` recorded in its manifest that are still there (none if unreadable)."""
    path = out / MANIFEST
    try:
        names = json.loads(path.read_text()).get("files", []) if path.is_file() else []
    except (OSError, ValueError, AttributeError):
        return []  # an unreadable manifest: delete nothing
    return [n for n in names if isinstance(n, str) and n == Path(n).name and n not in (".", "..", MANIFEST)
            and (out / n).exists()]


def write_manifest(out: Path, names: list[str]) -> None:
    write_text_atomic(out / MANIFEST, json.dumps({"written_by": "sdvg generate", "files": sorted(set(names))}, indent=1))


def plan_generate_outputs(args, count: int, suffix: str) -> tuple[Path, list[tuple[Path, Path]], Path]:
    """Check ``--out`` / ``--report`` before anything loads: ``(out, [(video, mask)] * count, report)``.

    A folder that holds a file this run would write, or the files of an earlier run (its manifest), is refused
    (naming one) unless ``--overwrite``; then the earlier set's other files are removed after the new set is written
    (never a mix). Files this tool did not write are never touched, whatever their names.
    """
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a folder; choose a folder name")
    _check_writable_folder(out, "--out", out)
    files = [(out / f"video_{i:03d}{suffix}", out / f"mask_{i:03d}.png") for i in range(count)]
    report = Path(args.report).expanduser() if args.report else out / "report.json"
    if args.report:
        check_output_file(report, "--report", overwrite=args.overwrite)
        if report.resolve() in {p.resolve() for pair in files for p in pair}:
            raise UsageError(f"--report {report}: is also a video/mask output; choose another name")
    for path in [p for pair in files for p in pair] + [report]:
        if path.exists() and not path.is_file():
            raise UsageError(f"--out {out}: {path.name} exists and is not a regular file; it is never replaced: "
                             "choose another folder")
    if out.is_dir() and not args.overwrite:
        clashes = sorted({p.name for pair in files for p in pair if p.exists()}
                         | ({report.name} if report.parent.resolve() == out.resolve() and report.exists() else set()))
        earlier = written_by_earlier_run(out)
        if clashes or earlier:
            first = (clashes or earlier)[0]
            count = len(set(clashes) | set(earlier))
            more = f" (and {count - 1} more)" if count > 1 else ""
            what = "which this run would write" if clashes else "from an earlier run"
            raise UsageError(f"--out {out}: already holds {first}{more}, {what}; pass --overwrite to replace that set, "
                             "or choose an empty folder")
    return out, files, report


def write_text_atomic(path: Path, text: str) -> None:
    from .video_io import atomic_output

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(text)


# ---- inspect --------------------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    """Describe a file, validating it exactly as the loaders do; exit 2 when a load would fail."""
    from .models.loading import CheckpointError, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path, num_heads=args.num_heads)
    except CheckpointError:
        other = _describe_other(Path(args.path))
        if other is None:
            raise
        print(json.dumps(other, indent=2) if args.json else
              "\n".join(f"{k + ':':<16}{v}" for k, v in other.items()))
        return 0
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.describe())
    return 0


def _describe_other(path: Path) -> dict | None:
    """Files that are not causal DiTs but that SDVG also reads (Wan VAE, ImageReward), validated by their loaders.

    Returns ``None`` when the file is neither (the DiT error is then the answer); raises the loader's
    error when it is one of them but would not load.
    """
    from .checkpoint_io import read_tensor_file

    if path.is_dir():
        config = path / "config.json"
        if not config.is_file() and (path / "vae" / "config.json").is_file():
            config = path / "vae" / "config.json"
        if not config.is_file() or '"AutoencoderKLWan"' not in config.read_text(errors="replace"):
            return None
        keys = None
    else:
        keys = list(read_tensor_file(path, entries=("state_dict", "model", "module"))[0])
    if keys is not None and any(k.startswith("blip.") for k in keys):
        from .reward import load_image_reward

        scorer = load_image_reward(path)
        n = sum(p.numel() for p in scorer.model.parameters())
        return {"file": str(path), "kind": f"ImageReward reward model ({len(keys)} tensors, {n:,} parameters)"}
    # Original Wan keys (decoder.conv1 / middle / head) or diffusers keys (decoder.conv_in / up_blocks), with or
    # without a prefix such as "vae." or "first_stage_model." (stripped by load_wan_vae too).
    vae_keys = ("decoder.conv1.", "decoder.middle.0.residual", "decoder.head.", "decoder.up_blocks", "decoder.conv_in")
    if keys is None or any(name.startswith(vae_keys) for k in keys for name in (k, k.split(".", 1)[-1])):
        from .vae import load_wan_vae

        vae = load_wan_vae(path)
        return {"file": str(path), "kind": f"Wan VAE (z_dim {vae.vae.config.z_dim}, base_dim {vae.vae.config.base_dim})"}
    return None


# ---- encode-prompts ---------------------------------------------------------------------------------------
def _read_prompts(args) -> list[str]:
    prompts = []
    if getattr(args, "prompt", None) is not None:
        prompts.append(args.prompt)
    if getattr(args, "prompts_file", None):
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts-file {path}: not found or not a file")
        try:
            text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the first prompt
        except UnicodeDecodeError:
            raise UsageError(f"--prompts-file {path}: not a UTF-8 text file (one prompt per line)") from None
        from_file = [line.strip() for line in text.splitlines() if line.strip()]
        if not from_file:
            # Never "no prompts, so all of --context-file": an empty list is a mistake to report.
            raise UsageError(f"--prompts-file {path}: holds no prompts (one per line); add prompts or drop the flag")
        prompts += from_file
    return prompts


def cmd_encode_prompts(args) -> int:
    from .loaders import parse_dtype
    from .text_encoder import load_text_encoder, save_prompt_embeddings

    prompts = _read_prompts(args)
    if not prompts or not all(p.strip() for p in prompts):
        raise UsageError("--prompt/--prompts-file: no (non-empty) prompts; give --prompt TEXT or --prompts-file F")
    out = Path(args.out).expanduser()
    check_output_file(out, "--out", overwrite=args.overwrite)
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.device, dtype=parse_dtype(args.dtype))
    contexts = []
    for i, prompt in enumerate(prompts):
        contexts.append(encoder.encode(prompt))
        _print_err(f"encoded {i + 1}/{len(prompts)}: {prompt[:70]}")
    save_prompt_embeddings(out, prompts, contexts)  # temporary file + rename
    print(f"wrote {len(prompts)} prompt embeddings to {out}")
    return 0


# ---- generate -------------------------------------------------------------------------------------------------
def plan_prompts(args) -> tuple[list[str], list[tuple[str, torch.Tensor]] | None]:
    """The prompts of the run, read without loading a model: ``(prompts, pairs from --context-file or None)``.

    Refuses (before anything loads) an empty prompt list, prompts missing from the context file, a
    text-encoder-less run, and an empty reward prompt in ``sdvg`` mode (it would score against nothing).
    """
    from .text_encoder import load_prompt_embeddings

    pairs = None
    if args.context_file:
        pairs = load_prompt_embeddings(args.context_file)
        wanted = _read_prompts(args)
        if wanted:
            by_prompt = dict(pairs)
            missing = [p for p in wanted if p not in by_prompt]
            if missing:
                raise UsageError(f"--context-file {args.context_file}: has no embeddings for {missing[:3]}; encode them "
                                 "with `sdvg encode-prompts` or drop --prompt/--prompts-file")
            pairs = [(p, by_prompt[p]) for p in wanted]
        prompts = [p for p, _ in pairs]
    else:
        prompts = _read_prompts(args)
        if not prompts:
            raise UsageError("--prompt/--prompts-file/--context-file: no prompts; give one of them")
        if not args.text_encoder:
            raise UsageError("--text-encoder: prompts need a text encoder (with --tokenizer for a single file), "
                             "or give --context-file")
    if getattr(args, "mode", "sdvg") == "sdvg":
        empty = [i for i, p in enumerate(prompts) if not p.strip()]
        if empty:
            where = f"--context-file {args.context_file}" if args.context_file else "--prompt"
            raise UsageError(f"{where}: prompt {empty[0]} is empty; mode 'sdvg' scores drafts against the prompt "
                             "(ImageReward), so give a non-empty prompt or use another --mode")
    return prompts, pairs


def _contexts(args, plan=None) -> list[tuple[str, torch.Tensor]]:
    from .loaders import parse_dtype
    from .text_encoder import load_text_encoder

    prompts, pairs = plan or plan_prompts(args)
    if pairs is not None:
        return pairs
    encoder = load_text_encoder(args.text_encoder, tokenizer=args.tokenizer, device=args.aux_device or args.device,
                                dtype=parse_dtype(args.dtype))
    return [(p, encoder.encode(p)) for p in prompts]


def generator_kwargs(args, role: str) -> dict:
    """Keyword arguments of :func:`sdvg_engine.loaders.load_generator` for ``role`` (``drafter``/``target``);
    one place to map new model flags."""
    common = dict(name=role, dtype=args.dtype, max_frames=args.max_frames, fuse_qkv=args.fuse_qkv, compile=args.compile,
                  preset=args.preset)
    if role == "drafter":
        return dict(common, device=args.drafter_device or args.device, context_scheme=args.drafter_context,
                    schedule=args.drafter_schedule)
    return dict(common, device=args.device, fp8=args.fp8_target, context_scheme=args.target_context,
                schedule=args.target_schedule, attention_bias=args.attention_bias)


def router_kwargs(args) -> dict:
    """Keyword arguments of :class:`sdvg_engine.router.RewardRouter` (besides the scorer)."""
    return dict(tau=args.tau, aggregation=args.aggregation, crop=args.crop, temporal_weight=args.temporal_weight,
                tau_mode=args.tau_mode, accept_rate=args.accept_rate, preprocess=args.reward_preprocess)


def build_pipeline(args):
    from .loaders import load_generator, parse_dtype
    from .pipeline import SpeculativePipeline
    from .router import RewardRouter
    from .vae import load_wan_vae

    if _scores_drafts(args) and not args.reward:
        raise UsageError(f"--reward: mode {args.mode!r}{' with --schedule-veto' if args.mode == 'schedule' else ''} "
                         "needs --reward (an ImageReward.pt file)")
    from .offload import resolve_memory_args

    offload, kv_dtype = resolve_memory_args(args)  # --vram-gb / --offload / --kv-dtype (docs/memory.md)
    aux = args.aux_device or args.device
    vae = load_wan_vae(args.vae, device=aux, dtype=parse_dtype(args.vae_dtype))
    drafter = load_generator(args.drafter, **generator_kwargs(args, "drafter"),
                             offload="blocks" if offload == "both" else "none", kv_dtype=kv_dtype)
    target = load_generator(args.target, **generator_kwargs(args, "target"),
                            offload="none" if offload == "none" else "blocks", kv_dtype=kv_dtype)
    router = None
    if args.reward:
        from .reward import load_image_reward

        scorer = load_image_reward(args.reward, device=aux)
        router = RewardRouter(scorer, **router_kwargs(args))
    pipe = SpeculativePipeline(drafter, target, vae, router)
    pipe.preset = args.preset
    pipe.workers = args.workers if args.workers == "auto" else int(args.workers)
    return pipe


def _progress(num_blocks: int, tau: float | None):
    started = time.perf_counter()

    def on_block(record):
        d = record.decision
        if d is None:
            verdict = "target" if record.source == "target" else "draft kept"
        elif d.frames_scored == 0:
            verdict = f"random draw -> {'accepted' if d.accept else 'rejected'}"
        else:
            verdict = f"draft score {d.block_score:+.3f} vs tau {tau:+.2f} -> {'accepted' if d.accept else 'rejected'}"
        bar = "#" * (record.index + 1) + "." * (num_blocks - record.index - 1)
        _print_err(f"[{bar}] block {record.index + 1}/{num_blocks}: {verdict} ({time.perf_counter() - started:.1f} s)")

    return on_block


def _video_suffix(args) -> str:
    from .video_io import default_video_suffix, have_pyav

    if args.format == "mp4" and not have_pyav():
        raise UsageError("--format mp4: needs PyAV (pip install av); or use --format webp")
    suffix = f".{args.format}" if args.format else default_video_suffix()
    if suffix == ".webp" and not have_pyav() and not args.format:
        _print_err("PyAV is not installed: writing animated WebP instead of MP4 (pip install av for MP4)")
    return suffix


def cmd_generate(args) -> int:
    from PIL import Image

    from .pipeline import CancelToken, GenerationCancelled, NonFiniteOutputError, SDVGOptions, video_frames_to_latent_frames
    from .video_io import atomic_output, mask_strip, write_video

    options = SDVGOptions(mode=args.mode, force_first_block=args.force_first_block, random_accept_prob=args.random_p,
                          refine_from_step=args.refine_from_step, cascade=args.cascade,
                          schedule_every=args.schedule_every, schedule_veto=args.schedule_veto)
    num_blocks = video_frames_to_latent_frames(args.frames) // 3
    taus = parse_taus(args.taus) if args.taus else [args.tau]
    # Everything that can be checked without a model is checked before the first load.
    plan = plan_prompts(args)
    suffix = _video_suffix(args)
    out, files, report_path = plan_generate_outputs(args, len(plan[0]) * len(taus), suffix)
    pairs = _contexts(args, plan)
    pipe = build_pipeline(args)  # --out is created by the first finished video, not before
    if len(taus) > 1:
        from .memo import ReplayMemo

        pipe.memo = ReplayMemo()  # each tau after the first replays the blocks before its first changed decision
    jobs = [(prompt, context, i, tau) for i, (prompt, context) in enumerate(pairs) for tau in taus]
    sweep_started, estimated_independent = time.perf_counter(), 0.0

    token = CancelToken()

    def on_sigint(signum, frame):
        if token.cancelled:
            raise KeyboardInterrupt
        _print_err("cancelling after the current model call (Ctrl-C again to abort)")
        token.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    reports = []
    try:
        for k, (prompt, context, i, tau) in enumerate(jobs):
            _print_err(f"video {k + 1}/{len(jobs)}: {prompt[:80]}" + (f" (tau {tau:g})" if len(taus) > 1 else ""))
            if pipe.router is not None:
                pipe.router.tau = tau
            started = time.perf_counter()
            try:
                result = pipe.generate(context, prompt=prompt, num_frames=args.frames, width=args.width, height=args.height,
                                       seed=args.seed + i, options=options, cancel=token,
                                       on_block=_progress(num_blocks, tau if _scores_drafts(args) else None))
            except GenerationCancelled as err:
                if reports:  # the finished videos form a complete set with their report (never a mix)
                    _finish_outputs(args, out, files[: len(reports)], report_path, reports)
                _print_err(f"sdvg generate: {err}; {len(reports)} finished video(s) kept in {out}")
                return 130
            except NonFiniteOutputError as err:  # name the files behind "the drafter's"/"the target's" output
                raise NonFiniteOutputError(f"video {i + 1} ({prompt[:40]!r}): {err} Files: drafter {args.drafter}, "
                                           f"target {args.target}.") from err
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


def _finish_outputs(args, out: Path, files: list[tuple[Path, Path]], report_path: Path, reports: list[dict]) -> None:
    """Write the report (atomically); with ``--overwrite`` remove an earlier set's leftovers from ``out``."""
    write_text_atomic(report_path, json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    written = [Path(r["video"]).name for r in reports if r.get("video")] + [mask.name for _, mask in files]
    if report_path.parent.resolve() == out.resolve():
        written.append(report_path.name)
    if args.overwrite:
        for name in written_by_earlier_run(out):  # only what an earlier run of this tool wrote
            stale = out / name
            if name not in written and stale.is_file() and not stale.is_symlink():
                stale.unlink()
    write_manifest(out, written)


# ---- bench -------------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    from . import bench
    from .router import RewardRouter

    rank, world = bench.distributed_context()
    taus = parse_taus(args.taus)
    modes = [m.strip() for m in args.modes.split(",")]
    args.mode, args.tau = "sdvg" if "sdvg" in modes else modes[0], taus[0]  # the router is rebuilt per run
    plan = plan_prompts(args)
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise UsageError(f"--out {out}: is a folder; give a .jsonl file name")
    _check_writable_folder(out.parent, "--out", out)
    plot_path = Path(args.plot).expanduser() if args.plot else out.with_suffix(".png")
    if plot_path.is_dir() or plot_path.suffix.lower() != ".png":
        raise UsageError(f"--plot {plot_path}: must be a .png file name")
    if plot_path.resolve() == out.resolve():
        raise UsageError(f"--plot {plot_path}: is the results file; choose another name")
    my_file = bench.shard_path(out, rank) if world > 1 else out
    done = bench.read_done([out, my_file], log=_print_err)  # a broken results file fails here, before any load
    args.mode = "sdvg"
    pairs = _contexts(args, plan)
    contexts = dict(pairs)
    pipe = build_pipeline(args)
    scorer = pipe.router.scorer
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = bench.runs_for([p for p, _ in pairs], taus, modes, args.seed)
    mine = bench.shard(runs, rank, world)
    factory = lambda tau: RewardRouter(scorer, **dict(router_kwargs(args), tau=tau))
    ran = bench.bench_rows(pipe, scorer, contexts, mine, num_frames=args.frames, width=args.width, height=args.height,
                           out_file=my_file, done=done, router_factory=factory, log=_print_err)
    _print_err(f"rank {rank}/{world}: ran {ran} videos, skipped {len(mine) - ran} already in {out}")
    bench.barrier(world)
    if rank == 0:
        rows = bench.merge_shards(out, world)
        summary = bench.summarize(rows)
        print(bench.format_table(summary))
        plot = bench.pareto_plot(summary, plot_path)
        print(f"\n{len(rows)} videos in {out}; Pareto plot {plot}")
    bench.barrier(world)
    return 0


def _add_model_args(p, *, reward_required: bool = False) -> None:
    p.add_argument("--drafter", required=True, help="drafter checkpoint (e.g. self_forcing_dmd.pt)")
    p.add_argument("--target", required=True, help="target checkpoint (e.g. krea-realtime-video-14b.safetensors)")
    p.add_argument("--vae", required=True, help="Wan2.1 VAE (Wan2.1_VAE.pth, wan_2.1_vae.safetensors or a diffusers folder)")
    p.add_argument("--reward", required=reward_required, help="ImageReward.pt (needed for --mode sdvg)")
    p.add_argument("--prompt")
    p.add_argument("--prompts-file")
    p.add_argument("--context-file", help="embeddings written by `sdvg encode-prompts` (skips the text encoder)")
    p.add_argument("--text-encoder")
    p.add_argument("--tokenizer")
    p.add_argument("--aggregation", choices=("min", "mean"), default="min")
    p.add_argument("--crop", choices=("center", "full"), default="center")
    p.add_argument("--temporal-weight", type=finite_float, default=0.0)
    p.add_argument("--frames", type=int, default=81, help="video frames: 12n-3 (81 = 7 blocks)")
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--drafter-device", default=None, help="put the drafter on another device")
    p.add_argument("--aux-device", default=None, help="device for the VAE, reward and text encoder")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    p.add_argument("--vae-dtype", default="fp32")
    p.add_argument("--fp8-target", action="store_true", help="store the target's block weights in float8")
    p.add_argument("--fuse-qkv", action="store_true", help="fuse attention projections (faster; inference only)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile both models' block forward (first blocks pay the compilation; see bench/bench_speed.py)")
    p.add_argument("--drafter-context", default="auto", choices=("auto", "global_cache", "recompute_window"))
    p.add_argument("--target-context", default="auto", choices=("auto", "global_cache", "recompute_window"))
    p.add_argument("--target-schedule", default="auto", choices=("auto", "self_forcing", "krea"))
    p.add_argument("--attention-bias", type=finite_float, default=None, help="Scope's KV bias for recompute-window models (0.3)")
    p.add_argument("--max-frames", type=int, default=21, help="global-cache capacity in latent frames")
    p.add_argument("--preset", choices=("reference", "native"), default="reference",
                   help="reference (default): the paper's configuration, both models on the recompute window with the "
                        "5-call list; native: each model as distilled (drafter: global cache, 4 calls). "
                        "--drafter-context/--target-context/--*-schedule other than auto win over it")
    p.add_argument("--drafter-schedule", default="auto", choices=("auto", "self_forcing", "krea"))
    p.add_argument("--tau-mode", choices=TAU_MODES, default=None,
                   help="default: relative (margin -0.25), or fixed when --tau/--taus is given (--tau -0.7 alone is "
                        "the paper's router). fixed: compare with --tau; accept_rate: per-block threshold = the (1 - r) quantile of the draft "
                        "scores so far (prior N(0.566, 1.071^2) worth 5 blocks), keeping about --accept-rate of the drafts; "
                        "relative: accept when the draft's score minus the last committed block's score >= --tau "
                        "(the target's committed blocks are scored too); anchor: minus block 0's score; baseline: "
                        "minus the mean score of the committed blocks")
    p.add_argument("--accept-rate", type=finite_float, default=0.73, help="target share of kept drafts for --tau-mode accept_rate")
    p.add_argument("--reward-preprocess", choices=("pil", "torch"), default="pil",
                   help="pil (default): frames scored exactly as ImageReward does (8-bit, PIL bicubic, centre crop); "
                        "torch: faster on-device resize (scores differ by ~1e-2, docs/reward_preprocessing.md)")
    p.add_argument("--workers", choices=("auto", "1", "2"), default="auto",
                   help="auto: overlap verification with the target when they sit on different devices (e.g. "
                        "--drafter-device cuda:1 --aux-device cuda:1); 1: sequential; 2: two CPU threads. Same outputs")


# ---- parser ---------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``sdvg generate: error: argument --tau: ...``), exit status 2; the router's
    defaults are filled in after parsing (:func:`resolve_router_defaults`)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        resolve_router_defaults(parsed)
        return parsed, rest


def resolve_router_defaults(args) -> None:
    """``--tau-mode`` left out: relative routing with margin -0.25 (the held-out choice, docs/routing.md), unless a
    threshold was given (``--tau`` / ``--taus``), which is on the paper's fixed scale, the only one before the default
    changed: ``--tau -0.7`` alone is the paper's router. ``--tau`` / ``--taus`` left out: the mode's default."""
    # The API's rule (router.default_router_options); --taus counts as a threshold given.
    if getattr(args, "tau_mode", "") is None:
        given = getattr(args, "tau", None) is not None or getattr(args, "taus", None) is not None
        args.tau_mode = default_router_options({"tau": 0.0} if given else {})["tau_mode"]
    if getattr(args, "command", None) == "generate" and args.tau is None:
        args.tau = default_router_options({"tau_mode": args.tau_mode}).get("tau", PAPER_ROUTER_OPTIONS["tau"])
    if getattr(args, "command", None) == "bench" and args.taus is None:
        args.taus = BENCH_TAUS["reference" if args.tau_mode in REFERENCE_MODES else "fixed"]


def build_parser() -> argparse.ArgumentParser:
    from .pipeline import MODES

    parser = _Parser(prog="sdvg", description="Speculative decoding for autoregressive video diffusion")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="say what a checkpoint file is (format, architecture, params, dtype, context scheme)")
    p.add_argument("path")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads, for non-standard widths")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("encode-prompts", help="encode prompts with UMT5-XXL into an embeddings file")
    p.add_argument("--text-encoder", required=True, help="transformers UMT5 folder or ComfyUI umt5_xxl_*.safetensors")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (needed with a single file)")
    p.add_argument("--prompt")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--out", required=True, help="output .safetensors (an existing file is kept unless --overwrite)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_encode_prompts)

    p = sub.add_parser("generate", help="generate videos with SDVG (or a baseline mode)")
    _add_model_args(p)
    p.add_argument("--tau", type=tau_value, default=None,
                   help="acceptance threshold: with --tau-mode fixed on the block's reward (the paper: -0.7, the "
                        "default there), with relative/anchor/baseline on the margin over the reference (default "
                        "-0.25); -inf accepts all, inf rejects all. Given without --tau-mode, it is a fixed threshold")
    p.add_argument("--mode", choices=MODES, default="sdvg")
    p.add_argument("--force-first-block", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--random-p", type=finite_float, default=0.73, help="acceptance probability of --mode random")
    p.add_argument("--schedule-every", type=int, default=3,
                   help="--mode schedule: the target makes block 0 and every k-th block (decided before drafting; no "
                        "reward model needed); 0 = only block 0")
    p.add_argument("--schedule-veto", action="store_true",
                   help="--mode schedule: also score each drafted block and let the router (--tau-mode, --tau) send "
                        "it back to the target; needs --reward")
    p.add_argument("--refine-from-step", type=int, default=None, help="hybrid regeneration from the drafter's step k")
    p.add_argument("--cascade", action="store_true", help="cascade scoring (4 frames first)")
    p.add_argument("--out", default="outputs")
    p.add_argument("--format", choices=("mp4", "webp"), default=None)
    p.add_argument("--report", default=None, help="report JSON path (default OUT/report.json; an existing file is kept "
                                                  "unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's files in --out (and an existing --report); never done otherwise")
    p.add_argument("--taus", default=None,
                   help="one video per tau (e.g. --taus=-0.5,-1,-1.5): each reuses the blocks an earlier tau already "
                        "made, up to its first changed decision (identical to separate runs); prints the time saved")
    # one consumer GPU (docs/memory.md)
    p.add_argument("--vram-gb", type=float, default=None,
                   help="plan for ONE card of this many GiB (e.g. 24, 16): sets --fp8-target, --offload, --kv-dtype, "
                        "--vae-dtype, --drafter-context (flags given explicitly win); prints the plan")
    p.add_argument("--offload", choices=("none", "target", "both"), default=None,
                   help="stream the target's (both: and the drafter's) transformer blocks from CPU RAM to the GPU per "
                        "call (pinned memory, copies overlap compute; CUDA only)")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp32", "fp8"), default=None,
                   help="KV cache storage: auto = the model dtype; fp8 = float8 with per-row scales (about half the memory)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="prompts x tau values x modes -> resumable JSONL, summary table, Pareto plot "
                                     "(shards prompts across ranks under torchrun)")
    _add_model_args(p, reward_required=True)
    p.add_argument("--taus", default=None, help="comma-separated tau values for sdvg mode (-inf/inf allowed; default: "
                                                "-0.7,-1.0,-1.5,-2.0 with --tau-mode fixed, -0.1,-0.25,-0.5,-1.0 "
                                                "with relative, the default mode)")
    p.add_argument("--modes", default="sdvg,target_only,draft_only,first_block_only,random",
                   help="comma-separated modes")
    p.add_argument("--out", default="bench_results.jsonl")
    p.add_argument("--plot", default=None, help="Pareto PNG (default: OUT with .png)")
    p.set_defaults(func=cmd_bench)
    return parser


#: Failures that are the user's input or environment: reported in one line, exit status 2 (plus the
#: pipeline's NonFiniteOutputError, see :func:`_expected_errors`).
EXPECTED_ERRORS = (ValueError, OSError)


def _expected_errors() -> tuple:
    """:data:`EXPECTED_ERRORS` and the pipeline's refusal of a NaN/inf block (imported only when something failed)."""
    from . import pipeline

    extra = getattr(pipeline, "NonFiniteOutputError", None)
    return EXPECTED_ERRORS + ((extra,) if extra is not None else ())


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename and str(err.filename) not in str(err.args[-1] if err.args else ""):
        text = f"{err.filename}: {err.strerror or err}"
    else:
        text = str(err) or type(err).__name__
    if isinstance(err, KeyError):  # str(KeyError) is the quoted key alone
        text = f"missing key {text}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv=None) -> int:
    """Run one command; returns the exit status (0, 2 for any failure, 130 after Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = join_negative_values([a for a in argv if a != "--debug"])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a one-line usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        validate_args(args)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: interrupted (Ctrl-C); no output was left half-written")
        return 130
    except torch.OutOfMemoryError as err:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: error: out of memory ({_one_line(err)[:200]}); lower --width/--height/--frames, "
                   "use --fp8-target, or put the drafter/VAE on another device (--drafter-device/--aux-device)")
        return 2
    except _expected_errors() as err:
        if debug:
            import traceback

            traceback.print_exc()
        _print_err(f"sdvg {args.command}: error: {_one_line(err)}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
