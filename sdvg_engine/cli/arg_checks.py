"""The command-line argument types and the validation table: every argument is checked (:func:`validate_args`) before
any model is loaded."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError

# torch, the router and the loaders are imported inside the checks that need them: building the parser and
# ``--help`` import nothing heavy (tests/test_cli_help.py).
from ..choices import REFERENCE_MODES  # noqa: F401


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
            flag = getattr(args, "_flag_names", {}).get(attr, row.flag)  # as typed: --frames or --length
            raise UsageError(f"{flag}{shown}: {problem}")


def options_of(args):
    """The run's :class:`~sdvg_engine.options.SDVGOptions` as far as the command line sets them: what the mode needs
    (``uses_drafter``, ``uses_target``, ``scores_drafts``) is asked of it, never of the mode's name."""
    from ..options import SDVGOptions

    return SDVGOptions(mode=getattr(args, "mode", "sdvg"), schedule_veto=bool(getattr(args, "schedule_veto", False)),
                       target_after_switch=bool(getattr(args, "target_after_switch", SDVGOptions.target_after_switch)),
                       switch_routing=getattr(args, "switch_routing", SDVGOptions.switch_routing))


def _flag(args, name):
    return getattr(args, name.lstrip("-").replace("-", "_"), None)


# ---- the models a run needs: only those its mode uses are required (and loaded) ---------------------------------
def _model_given(role: str, uses: str, what_mode_does: str, example: str, instead: str = ""):
    """The row that requires ``--<role>`` where the run uses that model (``bench`` runs every mode: always)."""

    def check(args):
        if getattr(args, role) is not None or (args.command != "bench" and not getattr(options_of(args), uses)):
            return None
        give = f"give the {role} checkpoint (e.g. --{role} {example})"
        if args.command == "generate":
            return f"missing: --mode {args.mode} {what_mode_does}; {give}{instead}"
        return f"missing: {give}"

    return arg_check(f"--{role}")(check)


_model_given("drafter", "uses_drafter", "drafts blocks", "self_forcing_dmd.pt")
_model_given("target", "uses_target", "runs the target", "krea-realtime-video-14b.safetensors",
             ", or use --mode draft_only")


@arg_check("--reward", "bench")
def _check_bench_reward_given(args):
    return None if args.reward else "missing: sdvg bench scores every draft; give the ImageReward model (ImageReward.pt)"


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
    from ..pipeline import video_frames_to_latent_frames

    try:
        latent = video_frames_to_latent_frames(args.frames)
    except ValueError as e:
        return str(e).replace(f"num_frames={args.frames} ", "")
    capacity = args.max_frames
    options = options_of(args)
    for role in [r for r, used in (("drafter", options.uses_drafter), ("target", options.uses_target)) if used]:
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
            from .. import presets
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
    from ..models.loading import META_CONTEXT

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


#: the largest --seed: the n-th prompt's seed (seed + n) must stay a valid 64-bit generator seed
MAX_SEED = 2**63 - 10_001


@arg_check("--seed")
def _check_seed(args):
    if args.seed < 0:
        return "must be a non-negative integer (e.g. 42)"
    if args.seed > MAX_SEED:
        return f"is too large: seeds go up to {MAX_SEED} (2^63 - 10001, room for seed + the prompt's index); e.g. 42"
    return None


@arg_check("--tau", "generate")
def _check_tau(args):
    return "NaN is not a threshold; use a number, -inf or inf" if math.isnan(args.tau) else None


def _scores_drafts(args) -> bool:
    """Whether the run scores drafts with the reward (--mode sdvg, or --mode schedule with --schedule-veto)."""
    return options_of(args).scores_drafts


@arg_check("--schedule-every", "generate")
def _check_schedule_every(args):
    return None if args.schedule_every >= 0 else "must be a whole number >= 0 (0 = only block 0 by the target)"


@arg_check("--random-p", "generate")
def _check_random_p(args):
    return None if 0.0 <= args.random_p <= 1.0 else "must be a probability in [0, 1]"


@arg_check("--refine-from-step", "generate")
def _check_refine(args):
    from ..sampling import SCHEDULES

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
    import torch

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
    from ..loaders import DTYPES

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
    from ..checkpoint_io import missing_reason

    path = Path(value).expanduser()
    if not path.exists():
        reason = missing_reason(path)
        return "not found; check the path" if reason == "not found" else reason
    return None


@arg_check("--prompt-schedule", "generate")
def _check_prompt_schedule_alone(args):
    """A schedule holds the video's prompts: --prompt / --prompts-file beside it are refused (its file is read and
    checked with the other prompts, :func:`sdvg_engine.cli.prompts.read_prompt_schedule`)."""
    if args.prompt_schedule is None:
        return None
    given = [flag for flag, value in (("--prompt", args.prompt), ("--prompts-file", args.prompts_file))
             if value is not None]
    if given:
        return (f"holds the prompts of the video; drop {' and '.join(given)} (with --context-file the schedule's "
                "prompts are looked up there)")
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
    if not _scores_drafts(args):
        return (f"one video per tau needs drafts judged against tau (--mode sdvg, or --mode schedule "
                f"--schedule-veto); --mode {args.mode} does not use tau")
    if args.tau_mode == "accept_rate":
        return f"--tau-mode {args.tau_mode} sets its own thresholds; use --tau-mode fixed or relative with --taus"
    return None


@arg_check("--accept-rate", "generate", "bench")
def _check_accept_rate(args):
    rate = args.accept_rate
    return None if 0.0 < rate < 1.0 else f"{rate}: must lie strictly between 0 and 1 (the share of drafts to keep)"


@arg_check("--modes", "bench")
def _check_modes(args):
    from ..options import MODES

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        return f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}"
    return None


@arg_check("--num-heads", "inspect")
def _check_num_heads(args):
    return None if args.num_heads is None or args.num_heads >= 1 else "must be a positive integer (attention heads)"

