"""`sdvg generate` outputs under an interrupted or failed write, and the edges of every numeric range (issue 23).

Writes: a Ctrl-C (KeyboardInterrupt) or a full disk (OSError) in the middle of writing a video or its mask leaves no
temporary or torn file, never a video without its mask, and never touches a file this tool did not write; over an
earlier set (``--overwrite``) the folder holds one consistent set afterwards: the videos finished before the failure,
their report and manifest (the same as after a cancel), never new videos beside the old report.

Ranges: for each numeric input the last valid value is accepted and the first invalid one refused (CLI, SDVGOptions,
RewardRouter).
"""

import json
import math

import pytest
from PIL import Image

from sdvg_engine.cli import build_parser, main, validate_args
from sdvg_engine.pipeline import SDVGOptions
from sdvg_engine.router import RewardRouter
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline, write_checkpoint_files
from sdvg_fixtures import generate_argv as generate_args


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt"))


def fail_on_save(monkeypatch, fmt: str, nth: int, error: BaseException):
    """Make the ``nth`` PIL save in format ``fmt`` (WEBP: a video, PNG: a mask) write half a file, then raise."""
    original = Image.Image.save
    seen = []

    def save(self, fp, format=None, **params):
        if (format or "").upper() == fmt:
            seen.append(fp)
            if len(seen) == nth:
                with open(fp, "wb") as f:
                    f.write(b"RIFF\x00\x00half a file")
                raise error
        return original(self, fp, format=format, **params)

    monkeypatch.setattr(Image.Image, "save", save)
    return seen


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


FAILURES = [("WEBP", KeyboardInterrupt()), ("PNG", KeyboardInterrupt()), ("WEBP", OSError(28, "No space left on device")),
            ("PNG", OSError(28, "No space left on device"))]
IDS = ["ctrl-c-in-video", "ctrl-c-in-mask", "disk-full-in-video", "disk-full-in-mask"]


@pytest.mark.parametrize("fmt,error", FAILURES, ids=IDS)
def test_a_failed_first_write_leaves_nothing_and_keeps_the_users_files(files, tmp_path, monkeypatch, fmt, error):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "video_000.webp.bak").write_bytes(b"also mine")
    report = tmp_path / "elsewhere" / "r.json"
    fail_on_save(monkeypatch, fmt, 1, error)
    code = main(generate_args(files, out, "--report", str(report)))
    assert code == (130 if isinstance(error, KeyboardInterrupt) else 2)
    # No temporary, no torn file, no video without its mask, no manifest of a set that does not exist.
    assert listing(out) == ["notes.txt", "video_000.webp.bak"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "video_000.webp.bak").read_bytes() == b"also mine"
    assert not report.exists() and (not report.parent.exists() or listing(report.parent) == [])


@pytest.mark.parametrize("fmt,error", FAILURES[:2], ids=IDS[:2])
def test_a_failed_write_over_an_earlier_set_leaves_one_consistent_set(files, tmp_path, monkeypatch, fmt, error):
    out = tmp_path / "out"
    assert main(generate_args(files, out, "--seed", "1")) == 0  # the earlier set: 2 videos
    (out / "notes.txt").write_text("mine")
    earlier = {name: (out / name).read_bytes() for name in listing(out)}
    assert [r["settings"]["seed"] for r in json.loads((out / "report.json").read_text())] == [1, 2]

    fail_on_save(monkeypatch, fmt, 2, error)  # the second video (or its mask) fails
    code = main(generate_args(files, out, "--seed", "7", "--overwrite"))
    assert code == 130
    names = listing(out)
    assert not [n for n in names if ".tmp" in n]
    assert (out / "notes.txt").read_text() == "mine"
    # One set: the first video of the new run, its mask, its report and the manifest naming exactly them.
    report = json.loads((out / "report.json").read_text())
    reports = report if isinstance(report, list) else [report]
    assert [r["settings"]["seed"] for r in reports] == [7]
    manifest = json.loads((out / ".sdvg-outputs.json").read_text())["files"]
    assert manifest == ["mask_000.png", "report.json", "video_000.webp"]
    assert names == sorted([".sdvg-outputs.json", "notes.txt", *manifest])
    assert (out / "video_000.webp").read_bytes() != earlier["video_000.webp"]  # the new seed's video
    with Image.open(out / "video_000.webp") as im:
        assert im.n_frames == 9


def test_an_interrupted_report_write_keeps_the_earlier_report(files, tmp_path, monkeypatch):
    """The report is written to a temporary name and renamed: a Ctrl-C halfway through the real write (half the text
    on disk) leaves the earlier report whole and no temporary file. Written in place, the report would be torn."""
    from pathlib import Path

    out = tmp_path / "out"
    report = tmp_path / "r.json"
    report.write_text('{"mine": true}')
    original = Path.write_text

    def half_then_interrupted(self, data, *args, **kwargs):
        if data.lstrip().startswith(("[", "{")) and '"settings"' in data:  # the report, not the manifest
            original(self, data[: len(data) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return original(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half_then_interrupted)
    assert main(generate_args(files, out, "--report", str(report), "--overwrite")) == 130
    assert report.read_text() == '{"mine": true}'
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


# ---- the manifest and the report (issue 30) -----------------------------------------------------------------------
@pytest.mark.parametrize("via", ["direct", "dotdot", "symlink"])
def test_a_report_named_as_the_manifest_is_refused_before_generating(files, tmp_path, capsys, via):
    """The manifest is written after the report: a --report at OUT/.sdvg-outputs.json (however spelled) would be
    lost while sdvg said it was written. Refused, naming both, before anything loads or is written."""
    out = tmp_path / "out"
    report = {"direct": out / ".sdvg-outputs.json", "dotdot": out / "sub" / ".." / ".sdvg-outputs.json",
              "symlink": tmp_path / "report.json"}[via]
    if via == "symlink":
        report.symlink_to(out / ".sdvg-outputs.json")
    assert main(generate_args(files, out, "--report", str(report))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sdvg generate: error: --report {report}: is {out / '.sdvg-outputs.json'}, the manifest")
    assert not out.exists()


def test_a_manifest_symlink_is_never_followed(files, tmp_path, capsys):
    """A .sdvg-outputs.json that links to a user's JSON with a "files" list: with --overwrite, the files it lists
    would be deleted as an earlier run's. Refused before generating; nothing is deleted or written."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("thesis.pdf", "video_007.webp"):
        (out / name).write_text("mine")
    users_json = tmp_path / "project.json"
    users_json.write_text(json.dumps({"files": ["thesis.pdf", "video_007.webp"]}))
    (out / ".sdvg-outputs.json").symlink_to(users_json)
    assert main(generate_args(files, out, "--overwrite")) == 2
    assert capsys.readouterr().err.startswith(f"sdvg generate: error: --out {out}: .sdvg-outputs.json is a symbolic "
                                              f"link (to {users_json})")
    assert listing(out) == [".sdvg-outputs.json", "thesis.pdf", "video_007.webp"]
    assert (out / "thesis.pdf").read_text() == "mine" and (out / ".sdvg-outputs.json").is_symlink()
    assert json.loads(users_json.read_text()) == {"files": ["thesis.pdf", "video_007.webp"]}
    from sdvg_engine.cli import written_by_earlier_run

    assert written_by_earlier_run(out) == []  # read directly: a link is not a manifest either


def test_a_manifest_name_that_is_a_folder_fails_before_any_video(files, tmp_path, capsys):
    out = tmp_path / "out"
    (out / ".sdvg-outputs.json").mkdir(parents=True)
    assert main(generate_args(files, out)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sdvg generate: error: --out {out}: .sdvg-outputs.json is a folder") and ".tmp" not in err
    assert listing(out) == [".sdvg-outputs.json"] and listing(out / ".sdvg-outputs.json") == []


def test_an_earlier_runs_leftovers_need_overwrite(files, tmp_path, capsys):
    """Files an earlier run recorded in its manifest are refused without --overwrite even when this run would write
    none of those names; with --overwrite they are replaced by one new set."""
    out = tmp_path / "out"
    assert main(generate_args(files, out)) == 0  # 2 videos, their masks, report.json, the manifest
    for name in ("video_000.webp", "mask_000.png", "report.json"):
        (out / name).unlink()  # what the new run would write is gone; video_001/mask_001 are the leftovers
    before = listing(out)
    capsys.readouterr()
    assert main(generate_args(files, out, "--prompt", "a red ball")) == 2
    assert capsys.readouterr().err.startswith(f"sdvg generate: error: --out {out}: already holds mask_001.png "
                                              "(and 1 more), from an earlier run; pass --overwrite")
    assert listing(out) == before
    assert main(generate_args(files, out, "--prompt", "a red ball", "--overwrite")) == 0
    assert listing(out) == [".sdvg-outputs.json", "mask_000.png", "report.json", "video_000.webp"]


def test_schedule_veto_with_an_empty_prompt_is_refused_before_loading(files, tmp_path, capsys):
    """--mode schedule --schedule-veto scores drafts against the prompt: an empty --prompt is refused naming it, before
    any model loads (the --text-encoder here is not a text encoder: loading it would fail differently)."""
    argv = ["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(files / "vae"), "--reward", str(files / "ImageReward.safetensors"), "--mode", "schedule",
            "--schedule-veto", "--prompt", "", "--text-encoder", str(files / "drafter.safetensors"), "--device", "cpu",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("sdvg generate: error: --prompt: prompt 0 is empty; --mode schedule with "
                                       "--schedule-veto scores drafts against the prompt (ImageReward), so give a "
                                       "non-empty prompt or use another --mode\n")
    assert not (tmp_path / "out").exists()
    # Without the veto nothing is scored: the empty prompt is fine as far as the prompts go.
    argv.remove("--schedule-veto")
    from sdvg_engine.cli import build_parser, plan_prompts

    assert plan_prompts(build_parser().parse_args(argv)) == ([""], None)


# ---- range edges ------------------------------------------------------------------------------------------------
def cli_problem(files, tmp_path, *flags):
    """validate_args' refusal of ``flags`` (None when accepted); nothing is loaded."""
    args = build_parser().parse_args(generate_args(files, tmp_path / "out", *flags))
    try:
        validate_args(args)
    except Exception as err:  # noqa: BLE001 - the UsageError is what we read
        return str(err)
    return None


@pytest.mark.parametrize("flags,ok", [
    (("--width", "16"), True), (("--width", "0"), False), (("--width", "15"), False), (("--width", "17"), False),
    (("--width", "4096"), True), (("--width", "4112"), False),
    (("--height", "16"), True), (("--height", "8"), False), (("--height", "-16"), False),
    (("--frames", "9"), True), (("--frames", "8"), False), (("--frames", "81"), True), (("--frames", "10"), False), (("--frames", "20"), False),
    # A global KV cache of --max-frames latent frames holds exactly that many: 81 frames = 21 latent frames fit 21.
    (("--frames", "81", "--target-context", "global_cache"), True),
    (("--frames", "93", "--target-context", "global_cache"), False),
    (("--length", "81", "--drafter-context", "global_cache", "--mode", "draft_only"), True),
    (("--length", "93", "--drafter-context", "global_cache", "--mode", "draft_only"), False),
    (("--frames", "21", "--max-frames", "6", "--target-context", "global_cache"), True),
    (("--frames", "33", "--max-frames", "6", "--target-context", "global_cache"), False),
    (("--frames", "93", "--target-context", "global_cache", "--mode", "draft_only"), True),  # the target never runs
    (("--random-p", "0"), True), (("--random-p", "1"), True), (("--random-p", "1.0000001"), False),
    (("--random-p", "-0.0000001"), False),
    (("--refine-from-step", "1"), True), (("--refine-from-step", "0"), False), (("--refine-from-step", "4"), True),
    (("--refine-from-step", "5"), False),
    (("--schedule-every", "0"), True), (("--schedule-every", "-1"), False),
    (("--seed", "0"), True), (("--seed", "-1"), False),
    (("--seed", str(2**63 - 10_001)), True), (("--seed", str(2**63 - 10_000)), False),
    (("--max-frames", "3"), True), (("--max-frames", "2"), False),
    (("--tau", "inf"), True), (("--tau=-inf",), True), (("--tau", "nan"), False),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v))
def test_cli_range_edges(files, tmp_path, flags, ok):
    try:
        problem = cli_problem(files, tmp_path, *flags)
    except SystemExit:  # argparse refused the value itself
        problem = "argparse"
    assert (problem is None) == ok, problem


@pytest.mark.parametrize("seed", [2**64 + 1, 2**200])
def test_a_huge_seed_is_refused_as_too_large(files, tmp_path, seed):
    assert cli_problem(files, tmp_path, "--seed", str(seed)) == (
        f"--seed {seed}: is too large: seeds go up to {2**63 - 10_001} (2^63 - 10001, room for seed + the prompt's "
        "index); e.g. 42")


@pytest.mark.parametrize("flags,problem", [
    (("--mode", "schedule", "--schedule-veto"), None),  # the veto judges drafts against tau: a sweep applies
    (("--mode", "schedule"), "--taus -1,0: one video per tau needs drafts judged against tau"),
    (("--mode", "random"), "--taus -1,0: one video per tau needs drafts judged against tau"),
])
def test_taus_need_drafts_judged_against_tau(files, tmp_path, flags, problem):
    found = cli_problem(files, tmp_path, "--reward", str(files / "ImageReward.safetensors"), "--taus=-1,0", *flags)
    assert found == problem if problem is None else found.startswith(problem)


def test_refine_from_step_is_bounded_by_the_drafters_own_steps_at_run_time(files, tmp_path, capsys):
    """The CLI accepts up to Krea's 4; a 4-step Self-Forcing drafter takes 1..3 and refuses 4 before any model call
    (and writes nothing); a 5-step Krea drafter takes 4."""
    sf = ("--drafter-schedule", "self_forcing", "--target-schedule", "self_forcing")
    assert main(generate_args(files, tmp_path / "a", *sf, "--refine-from-step", "3")) == 0
    assert main(generate_args(files, tmp_path / "b", *sf, "--refine-from-step", "4")) == 2
    assert "refine_from_step must be in 1..3" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() or listing(tmp_path / "b") == []
    krea = ("--drafter-schedule", "krea", "--target-schedule", "krea")
    assert main(generate_args(files, tmp_path / "c", *krea, "--refine-from-step", "4")) == 0


@pytest.mark.parametrize("opts,ok", [
    (dict(random_accept_prob=0.0), True), (dict(random_accept_prob=1.0), True),
    (dict(random_accept_prob=1.0000001), False), (dict(random_accept_prob=-1e-12), False),
    (dict(random_accept_prob=math.nan), False),
    (dict(schedule_every=0), True), (dict(schedule_every=-1), False),
    (dict(cascade=True, cascade_frames=1), True), (dict(cascade=True, cascade_frames=0), False),
    (dict(cascade=True, cascade_margin=0.0), True), (dict(cascade=True, cascade_margin=-1e-12), False),
], ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_option_range_edges(opts, ok):
    router = tiny_pipeline().router
    if ok:
        SDVGOptions(**opts).validate(router)
    else:
        with pytest.raises(ValueError):
            SDVGOptions(**opts).validate(router)


@pytest.mark.parametrize("k,ok", [(0, False), (1, True), (3, True), (4, False)])
def test_refine_from_step_edges_in_the_pipeline(k, ok):
    pipe = tiny_pipeline()
    run = lambda: pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=9, width=WIDTH, height=HEIGHT,  # noqa: E731
                                options=SDVGOptions(mode="target_only", refine_from_step=k))
    if ok:
        assert run().report["settings"]["refine_from_step"] == k
    else:
        with pytest.raises(ValueError, match=r"refine_from_step must be in 1\.\.3"):
            run()


@pytest.mark.parametrize("size,ok", [((16, 16), True), ((0, 16), False), ((16, 8), False), ((32, 24), False)])
def test_pipeline_size_edges(size, ok):
    pipe = tiny_pipeline()
    run = lambda: pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=9, width=size[0], height=size[1],  # noqa: E731
                                options=SDVGOptions(mode="target_only"))
    if ok:
        assert tuple(run().frames.shape) == (9, size[1], size[0], 3)
    else:
        with pytest.raises(ValueError, match="multiples of 16"):
            run()


@pytest.mark.parametrize("setting,value,ok", [
    ("tau", math.inf, True), ("tau", -math.inf, True), ("tau", math.nan, False),
    ("accept_rate", 1e-9, True), ("accept_rate", 1 - 1e-9, True), ("accept_rate", 0.0, False), ("accept_rate", 1.0, False),
    ("prior_std", 1e-12, True), ("prior_std", 0.0, False), ("prior_std", math.inf, False),
    ("prior_count", 0.0, True), ("prior_count", -1e-12, False), ("prior_count", math.inf, False),
    ("prior_mean", -1e6, True), ("prior_mean", math.inf, False),
    ("temporal_weight", -1e6, True), ("temporal_weight", math.inf, False), ("temporal_weight", math.nan, False),
])
def test_router_range_edges(setting, value, ok):
    scorer = shared_parts()["scorer"]
    if ok:
        router = RewardRouter(scorer, **{setting: value})
        assert getattr(router, setting) == value
    else:
        with pytest.raises(ValueError):
            RewardRouter(scorer, **{setting: value})
