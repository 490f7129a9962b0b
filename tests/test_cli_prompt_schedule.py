"""`sdvg generate --prompt-schedule FILE` (issue 39): one video whose prompt changes at block starts.

* end to end on tiny real checkpoints: a 2-entry schedule makes one video (one per --taus value, the later taus
  replaying through the memo) whose report lists both segments, and whose first block after the switch is the
  target's; --no-target-after-switch / --switch-routing reach the run;
* the `frame: prompt` and JSON forms give the same schedule; each distinct prompt is encoded once;
* every bad schedule is refused in one line naming the file and the line or entry, before any model loads.
"""

import json

import pytest

from sdvg_engine.cli import _contexts, build_parser, main, plan_prompts, read_prompt_schedule
from sdvg_fixtures import prompt_embeds, write_checkpoint_files
from sdvg_fixtures import generate_argv as _generate_argv


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt_schedule"))


def sdvg_argv(files, out, schedule, *extra):
    """SDVG with every draft kept (--tau=-inf): a block is the target's only where it is forced to be."""
    return _generate_argv(files, out, "--mode", "sdvg", "--reward", str(files / "ImageReward.safetensors"),
                          "--prompt-schedule", str(schedule), *extra)


def report_of(out):
    return json.loads((out / "report.json").read_text())


def test_a_two_prompt_schedule_makes_one_video_per_tau_with_the_target_after_the_switch(files, tmp_path, capsys):
    schedule = tmp_path / "schedule.txt"
    schedule.write_text("# a red ball, then a blue cube from block 2\n0: a red ball\n\n21: a blue cube\n")
    out = tmp_path / "out"
    assert main(sdvg_argv(files, out, schedule, "--frames", "33", "--taus=-inf,inf", "--target-after-switch",
                          "--switch-routing", "reset")) == 0
    assert sorted(p.name for p in out.iterdir()) == [".sdvg-outputs.json", "mask_000.png", "mask_001.png",
                                                     "report.json", "video_000.webp", "video_001.webp"]
    assert json.loads((out / ".sdvg-outputs.json").read_text())["files"] == [  # one video per tau, not per prompt
        "mask_000.png", "mask_001.png", "report.json", "video_000.webp", "video_001.webp"]
    assert "wrote 2 video(s)" in capsys.readouterr().out
    keep_all, reject_all = report_of(out)
    for report in (keep_all, reject_all):
        assert report["settings"]["prompt_schedule"] == [
            {"first_block": 0, "first_frame": 0, "prompt": "a red ball"},
            {"first_block": 2, "first_frame": 21, "prompt": "a blue cube"}]
        assert report["prompt_schedule"] == {"file": str(schedule), "entries": [
            {"frame": 0, "first_block": 0, "prompt": "a red ball", "reward_prompt": "a red ball"},
            {"frame": 21, "first_block": 2, "prompt": "a blue cube", "reward_prompt": "a blue cube"}]}
        assert report["settings"]["target_after_switch"] is True and report["settings"]["switch_routing"] == "reset"
        assert report["settings"]["seed"] == 42  # one video: the seed is not advanced per prompt
    # tau -inf keeps every draft: block 2 is the target's only because the prompt switches there.
    assert keep_all["decisions"] == ["target", "draft", "target"]
    assert reject_all["decisions"] == ["target", "target", "target"]
    # The second tau replays the blocks before its first changed decision (block 0), as without a schedule.
    assert [r["replay"]["replayed_blocks"] for r in (keep_all, reject_all)] == [0, 1]


def test_json_schedule_with_the_switch_flags(files, tmp_path):
    """The JSON form end to end; --no-target-after-switch lets the router keep the block after the switch and
    --switch-routing carry reaches the run."""
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"frame": 0, "prompt": "a red ball"},
                                    {"frame": 9, "prompt": "a blue cube", "reward_prompt": "a cube"}]))
    out = tmp_path / "out"
    assert main(sdvg_argv(files, out, schedule, "--frames", "21", "--tau=-inf", "--no-target-after-switch",
                          "--switch-routing", "carry")) == 0
    report = report_of(out)
    assert report["decisions"] == ["target", "draft"]
    assert report["settings"]["target_after_switch"] is False and report["settings"]["switch_routing"] == "carry"
    assert report["settings"]["prompt_schedule"][1] == {"first_block": 1, "first_frame": 9, "prompt": "a cube"}
    assert report["prompt_schedule"]["entries"][1]["prompt"] == "a blue cube"


def test_help_describes_the_schedule_file_and_the_switch_flags(capsys):
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for needle in ("--prompt-schedule FILE", "`frame: prompt` lines", '[{"frame": 0, "prompt": "...", "reward_prompt": '
                   '"..."}, ...]', "starts at frame 0", "block starts (0, 9, 21, 33, ... = 12b-3)",
                   "Not with --prompt/--prompts-file", "--target-after-switch, --no-target-after-switch",
                   "(default: off)", "--switch-routing {reset,carry}", "(default: carry)"):
        assert needle in text, needle


def parse(files, tmp_path, *extra):
    args = build_parser().parse_args(_generate_argv(files, tmp_path / "out", *extra))
    return args


def test_lines_and_json_give_the_same_schedule(files, tmp_path):
    lines = tmp_path / "s.txt"
    lines.write_text("\ufeff0: a red ball\n# the switch\n33: a blue cube\n69:a red ball\n")  # BOM, comment, no space
    as_json = tmp_path / "s.json"
    as_json.write_text('[{"frame": 0, "prompt": "a red ball"}, [33, "a blue cube"], {"frame": 69, "prompt": '
                       '"a red ball"}]')
    expected = [(0, "a red ball", "a red ball"), (3, "a blue cube", "a blue cube"), (6, "a red ball", "a red ball")]
    for path in (lines, as_json):
        args = parse(files, tmp_path, "--frames", "81", "--prompt-schedule", str(path))
        assert read_prompt_schedule(args) == expected
        # The context file is asked for each distinct prompt once.
        prompts, pairs = plan_prompts(args)
        assert prompts == ["a red ball", "a blue cube"] and [p for p, _ in pairs] == prompts


def test_each_distinct_prompt_is_encoded_once(files, tmp_path, monkeypatch):
    import sdvg_engine.text_encoder as text_encoder

    encoded = []

    class Encoder:
        def encode(self, prompt):
            encoded.append(prompt)
            return prompt_embeds(len(encoded))

    monkeypatch.setattr(text_encoder, "load_text_encoder", lambda *a, **k: Encoder())
    path = tmp_path / "s.txt"
    path.write_text("0: a red ball\n9: a blue cube\n21: a red ball\n33: a blue cube\n")
    argv = [a for a in _generate_argv(files, tmp_path / "out", "--frames", "45", "--prompt-schedule", str(path),
                                      "--text-encoder", str(files / "vae"))]
    i = argv.index("--context-file")
    del argv[i:i + 2]
    args = build_parser().parse_args(argv)
    assert [p for p, _ in _contexts(args)] == ["a red ball", "a blue cube"]
    assert encoded == ["a red ball", "a blue cube"]


# ---- refusals: one line naming the file and the entry, before any model loads --------------------------------------
ERRORS = {
    "beyond-the-video": ("0: a red ball\n33: a blue cube\n", (),
                         "{f} line 2: starts at frame 33, beyond the 21-frame video (frames 0..20; blocks start at "
                         "0, 9)"),
    "unordered": ("0: a red ball\n9: a blue cube\n0: a red ball\n", (),
                  "{f} line 3: frame 0 comes before the previous entry's frame 9; list the entries in order"),
    "overlapping": ("0: a red ball\n9: a blue cube\n9: a red ball\n", (),
                    "{f} line 3: frame 9 repeats the previous entry's frame 9; list the entries in order"),
    "empty-prompt": ("0: a red ball\n9:   \n", (), "{f} line 2: the prompt is empty"),
    "empty-json-prompt": ('[{"frame": 0, "prompt": "a red ball"}, {"frame": 9, "prompt": " "}]', (),
                          "{f} entry 2: the prompt is empty"),
    "off-a-block-start": ("0: a red ball\n12: a blue cube\n", (),
                          "{f} line 2: frame 12 is not the start of a block; prompts change between blocks: use 9 "
                          "(blocks start at 0, 9)"),
    "first-not-at-0": ("9: a blue cube\n", (),
                       "{f} line 1: the first entry starts at frame 9; it must start at frame 0"),
    "not-a-schedule": ("a red ball\n", (), "{f} line 1: expected `frame: prompt`"),
    "no-entries": ("# nothing yet\n", (), "{f}: holds no entries"),
    "bad-json": ('[{"frame": 0, "prompt": "a red ball"}', (), "{f}: not valid JSON"),
    "with-prompt": ("0: a red ball\n", ("--prompt", "a red ball"),
                    "{f}: holds the prompts of the video; drop --prompt (with --context-file the schedule's prompts "
                    "are looked up there)"),
    "with-prompts-file": ("0: a red ball\n", ("--prompts-file", "{f}"), "{f}: holds the prompts of the video; drop "
                                                                        "--prompts-file"),
    "not-in-the-context-file": ("0: a red ball\n9: a green cone\n", (),
                                "--context-file {files}/embeds.safetensors: has no embeddings for the prompts "
                                "['a green cone'] of {f}; encode them with `sdvg encode-prompts`"),
    "empty-reward-prompt": ('[{"frame": 0, "prompt": "a red ball", "reward_prompt": ""}]',
                            ("--mode", "sdvg", "--reward", "{files}/ImageReward.safetensors"),
                            "{f} entry 1: the reward_prompt is empty, and --mode sdvg scores drafts against it"),
    "reset-needs-the-target": ("0: a red ball\n9: a blue cube\n",
                               ("--mode", "sdvg", "--reward", "{files}/ImageReward.safetensors",
                                "--switch-routing", "reset"),
                               "--no-target-after-switch: with --tau-mode relative and --switch-routing reset each "
                               "draft is compared with the blocks made since the last prompt switch of {f}"),
}


@pytest.fixture
def no_model_loads(monkeypatch):
    import sdvg_engine.cli.generate as generate

    def refuse(args):
        raise AssertionError("a model was loaded before the schedule was refused")

    monkeypatch.setattr(generate, "build_pipeline", refuse)


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_a_bad_schedule_is_refused_before_any_model_loads(files, tmp_path, capsys, no_model_loads, case):
    text, extra, message = ERRORS[case]
    path = tmp_path / ("schedule.json" if text.startswith("[") else "schedule.txt")
    path.write_text(text)
    flag = f"--prompt-schedule {path}"
    extra = [e.format(f=path, files=files) for e in extra]
    out = tmp_path / "out"
    assert main(_generate_argv(files, out, "--frames", "21", "--prompt-schedule", str(path), *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdvg generate: error: ") and err.count("\n") == 1, err
    assert message.format(f=flag, files=files) in err, err
    assert not out.exists()


@pytest.mark.parametrize("case", ["missing", "a-folder", "not-utf8"])
def test_an_unreadable_schedule_file_is_refused_naming_it(files, tmp_path, capsys, no_model_loads, case):
    path = tmp_path / "schedule.txt"
    if case == "a-folder":
        path.mkdir()
    elif case == "not-utf8":
        path.write_bytes(b"0: a red ball \xff\xfe\n")
    expected = {"missing": "not found; check the path", "a-folder": "is not a file",
                "not-utf8": "not a UTF-8 text file"}[case]
    assert main(_generate_argv(files, tmp_path / "out", "--prompt-schedule", str(path))) == 2
    assert capsys.readouterr().err.startswith(f"sdvg generate: error: --prompt-schedule {path}: {expected}")
    assert not (tmp_path / "out").exists()
