"""``sdvg bench``: prompts x tau values x modes -> resumable JSONL, summary table, Pareto plot."""

from __future__ import annotations

from pathlib import Path

from .arg_checks import parse_taus
from .common import UsageError, _print_err
from .generate import build_pipeline, router_kwargs
from .outputs import _check_writable_folder
from .prompts import _contexts, plan_prompts


def cmd_bench(args) -> int:
    from .. import bench
    from ..router import RewardRouter

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

