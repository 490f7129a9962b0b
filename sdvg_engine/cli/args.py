"""The ``sdvg`` command line: the parser of every command, in argument groups, and the defaults filled in after parsing.

Building the parser imports nothing heavy (no torch, diffusers or model code): ``sdvg generate --help`` must answer at
once. The choices below that live in heavier modules are copied here and compared with their homes by
tests/test_cli_help.py. The commands themselves are imported when they run (:func:`_command`).

Names follow the ComfyUI nodes' inputs (``--length`` = the sampler's ``length``, ``--random-accept-prob``,
``--preprocess`` = the router's ``preprocess``); the earlier names stay as aliases (``--frames``, ``--random-p``,
``--reward-preprocess``) and keep their destinations (``args.frames``, ``args.random_p``, ``args.reward_preprocess``).
"""

from __future__ import annotations

import argparse
import importlib

from ..presets import PRESETS
from . import export_comfy  # its flags; light (the export itself is imported when it runs)
from .arg_checks import finite_float, tau_value

#: ``sdvg bench``'s tau values when none are given: the paper's table (fixed) or margins around the default (relative)
BENCH_TAUS = {"fixed": "-0.7,-1.0,-1.5,-2.0", "reference": "-0.1,-0.25,-0.5,-1.0"}
from ..choices import (KV_DTYPES, MODES, OFFLOAD_CHOICES, REFERENCE_MODES, SCHEDULE_EVERY,  # noqa: F401
                       SWITCH_ROUTING, TAU_MODES)
from ..options import SDVGOptions  # torch-free: the defaults of --target-after-switch / --switch-routing
CONTEXT_CHOICES = ("auto", "global_cache", "recompute_window")
SCHEDULE_CHOICES = ("auto", "self_forcing", "krea")


def _command(module: str, function: str):
    """``args.func``: the command's module is imported when it runs, not when the parser is built."""

    def run(args):
        return getattr(importlib.import_module(f".{module}", __package__), function)(args)

    run.__name__ = function
    return run


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: ``(default: X)``, ``(default: off)`` for a switch; a flag whose
    default is "not given" says in its own words what happens then (tests/test_cli_help.py checks both)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=110)

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or not action.option_strings:
            return text
        if action.default is argparse.SUPPRESS or action.default is None:
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``sdvg generate: error: argument --tau: ...``), exit status 2; after parsing,
    the router's defaults are filled in (:func:`resolve_router_defaults`), ``--device auto`` is resolved, and
    ``args._flag_names`` records which spelling of each flag was typed (errors name it; else the primary name)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if self._subparsers is None:  # a command's own parser (sdvg generate ...)
            parsed._flag_names = self._flag_names(args or [])
        resolve_router_defaults(parsed)
        resolve_device(parsed)
        return parsed, rest

    def _flag_names(self, argv) -> dict[str, str]:
        names = {a.dest: a.option_strings[0] for a in self._actions if a.option_strings}
        for token in argv:
            if token.startswith("--"):
                action = self._option_string_actions.get(token.split("=", 1)[0])
                if action is not None:
                    names[action.dest] = token.split("=", 1)[0]
        return names


def flag_name(args, dest: str, fallback: str) -> str:
    """How the user spelled the flag of ``dest`` (``--frames`` or ``--length``); ``fallback`` when unknown."""
    return getattr(args, "_flag_names", {}).get(dest, fallback)


def resolve_router_defaults(args) -> None:
    """``--tau-mode`` left out: relative routing with margin -0.25 (the held-out choice, docs/dev/routing.md), unless a
    threshold was given (``--tau`` / ``--taus``), which is on the paper's fixed scale, the only one before the default
    changed: ``--tau -0.7`` alone is the paper's router. ``--tau`` / ``--taus`` left out: the mode's default."""
    # The API's rule (router.default_router_options); --taus counts as a threshold given.
    command = getattr(args, "command", None)
    if command not in ("generate", "bench"):
        return
    from ..router import PAPER_ROUTER_OPTIONS, default_router_options

    if getattr(args, "tau_mode", "") is None:
        given = getattr(args, "tau", None) is not None or getattr(args, "taus", None) is not None
        args.tau_mode = default_router_options({"tau": 0.0} if given else {})["tau_mode"]
    if command == "generate" and args.tau is None:
        args.tau = default_router_options({"tau_mode": args.tau_mode}).get("tau", PAPER_ROUTER_OPTIONS["tau"])
    if command == "bench" and args.taus is None:
        args.taus = BENCH_TAUS["reference" if args.tau_mode in REFERENCE_MODES else "fixed"]


def resolve_device(args) -> None:
    """``--device auto``: ``cuda`` when PyTorch sees a GPU, else ``cpu`` (torch is imported only for this)."""
    if getattr(args, "device", None) == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def _add_model_args(p, *, command: str) -> None:
    """The flags ``generate`` and ``bench`` share, in groups."""
    bench = command == "bench"
    g = p.add_argument_group("models (files)")
    g.add_argument("--drafter", metavar="FILE",
                   help="the fast drafter checkpoint, e.g. self_forcing_dmd.pt; " +
                        ("required" if bench else "required unless --mode target_only, which never loads it"))
    g.add_argument("--target", metavar="FILE",
                   help="the target checkpoint, e.g. krea-realtime-video-14b.safetensors; " +
                        ("required" if bench else "required unless --mode draft_only, which never loads it"))
    g.add_argument("--vae", required=True, metavar="PATH",
                   help="the Wan2.1 VAE: Wan2.1_VAE.pth, wan_2.1_vae.safetensors or a diffusers folder (required)")
    g.add_argument("--reward", metavar="FILE",
                   help="the ImageReward model (ImageReward.pt); " +
                        ("required" if bench else "required when drafts are scored (--mode sdvg, or --mode schedule "
                                                  "--schedule-veto); never loaded otherwise"))
    g.add_argument("--text-encoder", metavar="PATH",
                   help="UMT5-XXL: a transformers folder or ComfyUI's umt5_xxl_*.safetensors; required unless "
                        "--context-file gives the embeddings")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="a local UMT5 tokenizer folder (needed with a single-file --text-encoder); default: the "
                        "--text-encoder folder's own")

    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", metavar="TEXT",
                   help="the prompt (with --context-file: the prompt whose embeddings to use); default: every prompt "
                        "of --prompts-file or --context-file")
    g.add_argument("--prompts-file", metavar="FILE", help="a UTF-8 text file, one prompt per line; default: none")
    g.add_argument("--context-file", metavar="FILE",
                   help="prompt embeddings written by `sdvg encode-prompts` (the text encoder is then not loaded); "
                        "default: none, encode with --text-encoder")
    if not bench:
        g.add_argument("--prompt-schedule", metavar="FILE",
                       help="one video whose prompt changes as it plays: a UTF-8 file of `frame: prompt` lines "
                            "(`0: a red ball rolls`, `33: a blue ball rolls`; # comments) or JSON [{\"frame\": 0, "
                            "\"prompt\": \"...\", \"reward_prompt\": \"...\"}, ...]. The first entry starts at frame "
                            "0, the others in order at block starts (0, 9, 21, 33, ... = 12b-3); each distinct prompt "
                            "is encoded once (with --context-file: looked up there). Not with --prompt/--prompts-file; "
                            "default: none")

    g = p.add_argument_group("video")
    g.add_argument("--length", "--frames", dest="frames", type=int, default=81, metavar="N",
                   help="video frames, 12n-3 (81 = 7 blocks of 3 latent frames); the sampler node's length")
    g.add_argument("--width", type=int, default=832, help="width in pixels, a multiple of 16")
    g.add_argument("--height", type=int, default=480, help="height in pixels, a multiple of 16")
    g.add_argument("--seed", type=int, default=42,
                   help="noise seed of the first video; the n-th prompt uses seed + n. Fix it while tuning --tau")

    g = p.add_argument_group("routing (which blocks the target makes)")
    if not bench:
        g.add_argument("--mode", choices=MODES, default="sdvg",
                       help="sdvg: draft each block, keep it when its reward passes tau, else the target remakes it; "
                            "target_only / draft_only: one model alone; first_block_only: block 0 by the target, the "
                            "rest drafted; random: keep each draft with --random-accept-prob; schedule: the target "
                            "makes every --schedule-every-th block")
        g.add_argument("--tau", type=tau_value, default=None,
                       help="acceptance threshold: with --tau-mode fixed on the block's reward (the paper: -0.7), with "
                            "relative/anchor/baseline on the margin over the reference score; -inf keeps every draft, "
                            "inf none. Default: -0.25 (relative); given without --tau-mode it is a fixed threshold")
    g.add_argument("--tau-mode", choices=TAU_MODES, default=None,
                   help="what tau is compared with. fixed: the draft's reward; relative: reward minus the last "
                        "committed block's (the target's blocks are scored too); anchor: minus block 0's; baseline: "
                        "minus the committed blocks' mean; accept_rate: a running quantile keeping about "
                        "--accept-rate of the drafts. Default: relative, or fixed when --tau/--taus is given")
    g.add_argument("--accept-rate", type=finite_float, default=0.73,
                   help="--tau-mode accept_rate: the share of drafts to keep, in (0, 1)")
    if not bench:
        g.add_argument("--force-first-block", action=argparse.BooleanOptionalAction, default=True,
                       help="block 0 by the target (the drafter's first block is the weakest; relative, anchor and "
                            "baseline need it)")
        g.add_argument("--random-accept-prob", "--random-p", dest="random_p", type=finite_float, default=0.73,
                       metavar="P", help="--mode random: the probability of keeping each draft, in [0, 1]")
        g.add_argument("--schedule-every", type=int, default=SCHEDULE_EVERY, metavar="K",
                       help="--mode schedule: the target makes block 0 and every k-th block (decided before drafting; "
                            "no reward model needed); 0 = only block 0")
        g.add_argument("--schedule-veto", action="store_true",
                       help="--mode schedule: also score each drafted block and let the router (--tau-mode, --tau) "
                            "send it back to the target; needs --reward")
        g.add_argument("--refine-from-step", type=int, default=None, metavar="K",
                       help="hybrid regeneration: a rejected block continues from the drafter's state after k steps "
                            "(1..3 for 4-step, 1..4 for 5-step drafters; the reference's best is 3); default: the "
                            "target starts from noise")
        g.add_argument("--cascade", action="store_true",
                       help="cascade scoring: score 4 frames first and stop early when they decide (--tau-mode fixed "
                            "with --aggregation min only)")
        g.add_argument("--target-after-switch", action=argparse.BooleanOptionalAction,
                       default=SDVGOptions.target_after_switch,
                       help="--prompt-schedule: the first block after each prompt switch is made by the target, as "
                            "block 0 is (--no-target-after-switch: the router decides)")
        g.add_argument("--switch-routing", choices=SWITCH_ROUTING, default=SDVGOptions.switch_routing,
                       help="--prompt-schedule: reset: after a switch the router compares drafts only with blocks "
                            "of the new prompt (as at the start of a video); carry: scores under the old prompt stay "
                            "references")
        g.add_argument("--taus", default=None, metavar="LIST",
                       help="one video per tau, e.g. --taus=-0.5,-1,-1.5 (--mode sdvg): each reuses the blocks an "
                            "earlier tau made up to its first changed decision (identical to separate runs); default: "
                            "one video at --tau")
    else:
        g.add_argument("--taus", default=None, metavar="LIST",
                       help="comma-separated tau values for sdvg mode (-inf/inf allowed); default: -0.7,-1.0,-1.5,-2.0 "
                            "with --tau-mode fixed, -0.1,-0.25,-0.5,-1.0 with relative (the default mode)")
        g.add_argument("--modes", default="sdvg,target_only,draft_only,first_block_only,random",
                       help="comma-separated modes to run")

    g = p.add_argument_group("scoring (ImageReward)")
    g.add_argument("--aggregation", choices=("min", "mean"), default="min",
                   help="how the frames' scores make the block's score (min: one bad frame rejects the block)")
    g.add_argument("--crop", choices=("center", "full"), default="center",
                   help="center: the centre square, as ImageReward was trained; full: the whole frame squeezed")
    g.add_argument("--temporal-weight", type=finite_float, default=0.0, metavar="W",
                   help="adds W x the mean cosine similarity of consecutive frames to the block's score")
    g.add_argument("--preprocess", "--reward-preprocess", dest="reward_preprocess", choices=("pil", "torch"),
                   default="pil",
                   help="pil: frames scored exactly as ImageReward does (8-bit, PIL bicubic); torch: a faster "
                        "on-device resize (scores differ by ~1e-2)")

    g = p.add_argument_group("model settings")
    g.add_argument("--preset", choices=PRESETS, default="reference",
                   help="reference: the paper's configuration (both models on the recompute window, 5 calls); "
                        "native: each model as distilled. --drafter-context/--target-context/--*-schedule other "
                        "than auto win over it")
    for role in ("drafter", "target"):
        g.add_argument(f"--{role}-context", default="auto", choices=CONTEXT_CHOICES,
                       help=f"the {role}'s context scheme; auto: the preset's (or the checkpoint's)")
        g.add_argument(f"--{role}-schedule", default="auto", choices=SCHEDULE_CHOICES,
                       help=f"the {role}'s denoising schedule; auto: the preset's (or the checkpoint's)")
    g.add_argument("--attention-bias", type=finite_float, default=None, metavar="B",
                   help="Scope's KV bias for recompute-window targets, in (0, 1] (Scope uses 0.3); default: none")
    g.add_argument("--max-frames", type=int, default=21, metavar="N",
                   help="a global-cache model's KV capacity in latent frames (21 = 81 video frames)")

    g = p.add_argument_group("devices, memory and speed")
    g.add_argument("--device", default="auto",
                   help="where the models run: cpu, cuda or cuda:N; auto: cuda when PyTorch sees a GPU, else cpu")
    g.add_argument("--drafter-device", default=None, metavar="DEVICE",
                   help="put the drafter on another device; default: --device")
    g.add_argument("--aux-device", default=None, metavar="DEVICE",
                   help="device of the VAE, the reward model and the text encoder; default: --device")
    g.add_argument("--dtype", default="bf16", help="the models' compute dtype: bf16, fp16 or fp32")
    g.add_argument("--vae-dtype", default="fp32", help="the VAE's dtype: bf16, fp16 or fp32")
    g.add_argument("--fp8-target", action="store_true",
                   help="store the target's block weights in float8 (the target loader node's dtype fp8)")
    g.add_argument("--target-dtype", action=_TargetDtype, choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                   help="the target loader node's dtype: bf16, fp16 or fp32 computes the target in that dtype, fp8 "
                        "is --fp8-target; default: --dtype")
    if not bench:
        g.add_argument("--vram-gb", type=float, default=None, metavar="GB",
                       help="plan for ONE card of this many GiB (e.g. 24, 16): sets --fp8-target, --offload, "
                            "--kv-dtype, --vae-dtype, --drafter-context (flags given explicitly win) and prints the "
                            "plan; default: no plan")
        g.add_argument("--offload", choices=OFFLOAD_CHOICES, default=None,
                       help="stream the target's (both: and the drafter's) transformer blocks from CPU RAM to the GPU "
                            "per call (CUDA only); default: none, or the --vram-gb plan's")
        g.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                       help="KV cache storage: auto = the model dtype; fp8 = float8 with per-row scales (about half "
                            "the memory); default: auto, or the --vram-gb plan's")
    g.add_argument("--fuse-qkv", action="store_true", help="fuse the attention projections (faster; inference only)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile both models' block forward (the first blocks pay the compilation)")
    g.add_argument("--workers", choices=("auto", "1", "2"), default="auto",
                   help="auto: overlap verification with the target when they sit on different devices (e.g. "
                        "--drafter-device cuda:1 --aux-device cuda:1); 1: sequential; 2: two CPU threads. Same outputs")


class _TargetDtype(argparse.Action):
    """``--target-dtype`` as the target loader node's ``dtype``: ``fp8`` means ``--fp8-target`` (float8 block weights,
    computed in ``--dtype``), the others set the target's compute dtype."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value == "fp8":
            namespace.fp8_target = True
        else:
            namespace.target_dtype = value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdvg", description="Speculative decoding for autoregressive video diffusion: a fast "
                                              "drafter proposes each block, ImageReward checks it, the target "
                                              "remakes the blocks that fail.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a failure (accepted anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="say what a checkpoint file is (format, architecture, params, dtype, context "
                                       "scheme), validating it as the loaders do",
                       description="Say what a checkpoint file is: a causal Wan DiT, a Wan VAE or ImageReward.")
    p.add_argument("path", help="the file (or diffusers folder) to inspect")
    p.add_argument("--num-heads", type=int, default=None,
                   help="attention heads, for non-standard widths; default: read from the checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_command("inspect", "cmd_inspect"))

    p = sub.add_parser("encode-prompts", help="encode prompts with UMT5-XXL into an embeddings file",
                       description="Encode prompts with UMT5-XXL once, for `sdvg generate --context-file`.")
    g = p.add_argument_group("input")
    g.add_argument("--text-encoder", required=True, metavar="PATH",
                   help="a transformers UMT5 folder or ComfyUI's umt5_xxl_*.safetensors (required)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local tokenizer folder (needed with a single file); default: the --text-encoder folder's")
    g.add_argument("--prompt", metavar="TEXT", help="one prompt; default: none (use --prompts-file)")
    g.add_argument("--prompts-file", metavar="FILE", help="a UTF-8 text file, one prompt per line; default: none")
    g = p.add_argument_group("output")
    g.add_argument("--out", required=True, metavar="FILE",
                   help="the output .safetensors (required; an existing file is kept unless --overwrite)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g = p.add_argument_group("device")
    g.add_argument("--device", default="cpu", help="where the encoder runs: cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="bf16", help="the encoder's dtype: bf16, fp16 or fp32")
    p.set_defaults(func=_command("encode_prompts", "cmd_encode_prompts"))

    export_comfy.add_parser(sub, _command("export_comfy", "cmd_export_comfy"))

    p = sub.add_parser("generate", help="generate videos with SDVG (or a baseline mode)",
                       description="Generate one video per prompt (and per --taus value) with SDVG or a baseline "
                                   "mode; writes videos, acceptance masks and a JSON report into --out.")
    _add_model_args(p, command="generate")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="outputs", metavar="DIR", help="the folder for videos, masks and the report")
    g.add_argument("--format", choices=("mp4", "webp"), default=None,
                   help="video format; default: mp4 when PyAV is installed, else animated webp")
    g.add_argument("--report", default=None, metavar="FILE",
                   help="the report JSON; default: OUT/report.json (an existing file is kept unless --overwrite)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's files in --out (and an existing --report); never done otherwise")
    p.set_defaults(func=_command("generate", "cmd_generate"))

    p = sub.add_parser("bench", help="prompts x tau values x modes -> resumable JSONL, summary table, Pareto plot "
                                     "(shards prompts across ranks under torchrun)",
                       description="Run every prompt at every tau and mode; resumable JSONL results, a summary table "
                                   "and a Pareto plot.")
    _add_model_args(p, command="bench")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="bench_results.jsonl", metavar="FILE",
                   help="the results file (resumed when it exists)")
    g.add_argument("--plot", default=None, metavar="FILE", help="the Pareto plot PNG; default: OUT with .png")
    p.set_defaults(func=_command("bench", "cmd_bench"))
    return parser
