"""The ``sdvg`` command line: the parser of every command and the defaults filled in after parsing."""

from __future__ import annotations

import argparse

import torch

from ..router import PAPER_ROUTER_OPTIONS, REFERENCE_MODES, TAU_MODES, default_router_options
from .arg_checks import finite_float, tau_value
from .bench import cmd_bench
from .encode_prompts import cmd_encode_prompts
from .generate import cmd_generate
from .inspect import cmd_inspect

#: ``sdvg bench``'s tau values when none are given: the paper's table (fixed) or margins around the default (relative)
BENCH_TAUS = {"fixed": "-0.7,-1.0,-1.5,-2.0", "reference": "-0.1,-0.25,-0.5,-1.0"}


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
    from ..pipeline import MODES

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


