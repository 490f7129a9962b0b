"""`sdvg --help` a person can read and get at once; Ctrl-C at any moment of `sdvg` is one line and exit status 130.

* every flag of every command has help text and says its default, flags sit in named groups;
* the node input names are flags (``--length``, ``--random-accept-prob``, ``--preprocess``), the earlier names are
  aliases that land in the same place, and an error names the spelling the user typed;
* building the parser and printing ``--help`` import no torch / diffusers / transformers (the CLI package alone, with
  ``sdvg_engine/__init__.py`` kept out; and the real ``python -m sdvg_engine.cli`` once that file imports lazily);
* a SIGINT while torch is being imported, while models load, and during a run: exit 130, no traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sdvg_engine.cli import args as cli_args
from sdvg_engine.cli import arg_checks, build_parser, main
from sdvg_fixtures import write_checkpoint_files
from sdvg_fixtures import generate_argv as _generate_argv

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flag_actions(parser):
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def test_every_flag_of_every_command_has_help_and_its_default():
    parser = build_parser()
    commands = _commands(parser)
    assert sorted(commands) == ["bench", "encode-prompts", "export-comfy", "generate", "inspect"]
    counted = 0
    for name, sub in [("sdvg", parser), *commands.items()]:
        formatter = sub._get_formatter()
        for action in _flag_actions(sub):
            flag = action.option_strings[0] if action.option_strings else action.dest
            assert action.help and action.help.strip(), f"{name} {flag} has no help"
            if not action.option_strings:
                continue  # a positional: required, no default
            shown = formatter._expand_help(action)
            assert "default" in shown.lower() or "required" in shown.lower(), \
                f"{name} {flag}: the help does not say the default: {shown!r}"
            counted += 1
    assert counted >= 100  # every flag of the four commands and --debug (generate alone has 55)
    generate = commands["generate"]
    assert len(_flag_actions(generate)) == 55
    # Grouped: only -h in argparse's catch-all group; the groups a reader scans for.
    titles = [g.title for g in generate._action_groups if g._group_actions]
    assert titles[0] == "options" and [a.dest for a in generate._action_groups[1]._group_actions] == ["help"]
    assert {"models (files)", "prompts", "video", "routing (which blocks the target makes)", "scoring (ImageReward)",
            "model settings", "devices, memory and speed", "output"} <= set(titles)


def test_generate_help_text_shows_groups_defaults_and_aliases(capsys):
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    for needle in ("models (files):", "routing (which blocks the target makes):", "--length N, --frames N",
                   "--random-accept-prob P, --random-p P", "--preprocess {pil,torch}, --reward-preprocess {pil,torch}",
                   "(default: 81)", "(default: off)", "default: OUT/report.json"):
        assert needle in text, needle


def test_copied_choices_equal_their_homes():
    """The parser copies these lists so that --help imports no torch; they must stay the engine's."""
    from sdvg_engine import offload, options, presets, router

    assert cli_args.MODES == options.MODES
    assert cli_args.TAU_MODES == router.TAU_MODES
    assert cli_args.REFERENCE_MODES == arg_checks.REFERENCE_MODES == router.REFERENCE_MODES
    assert cli_args.OFFLOAD_CHOICES == offload.OFFLOAD_CHOICES and cli_args.KV_DTYPES == offload.KV_DTYPES
    assert build_parser is not None and presets.PRESETS == ("reference", "native")


REQUIRED = ["generate", "--drafter", "d", "--target", "t", "--vae", "v"]


@pytest.mark.parametrize("new,old,dest,value", [
    ("--length", "--frames", "frames", "21"),
    ("--random-accept-prob", "--random-p", "random_p", "0.5"),
    ("--preprocess", "--reward-preprocess", "reward_preprocess", "torch"),
])
def test_node_names_and_their_old_aliases_are_the_same_flag(new, old, dest, value):
    from nodes.schema import BY_ID

    node_inputs = {i.name for spec in BY_ID.values() for i in spec.inputs}
    assert new.lstrip("-").replace("-", "_") in node_inputs  # the node's input name
    parse = build_parser().parse_args
    a, b = parse(REQUIRED + [new, value]), parse(REQUIRED + [old, value])
    assert getattr(a, dest) == getattr(b, dest) != getattr(parse(REQUIRED), dest)
    assert a._flag_names[dest] == new and b._flag_names[dest] == old


@pytest.mark.parametrize("flag", ["--length", "--frames"])
def test_an_error_names_the_spelling_typed(flag, tmp_path, capsys):
    code = main(["generate", "--drafter", str(tmp_path), "--target", str(tmp_path), "--vae", str(tmp_path),
                 "--mode", "target_only", "--device", "cpu", flag, "20", "--out", str(tmp_path / "o")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"sdvg generate: error: {flag} 20: does not fill whole blocks")


# ---- imports: --help without torch -------------------------------------------------------------------------------
#: runs sdvg's main with the package's own __init__ kept out (an empty package object on the real folder), so this
#: checks what the CLI package itself imports, whatever sdvg_engine/__init__.py does
_CLI_ALONE = textwrap.dedent(f"""
    import sys, types
    pkg = types.ModuleType("sdvg_engine"); pkg.__path__ = [{str(REPO / "sdvg_engine")!r}]
    sys.modules["sdvg_engine"] = pkg
    from sdvg_engine.cli import main
    code = main(sys.argv[1:])
    print("HEAVY=" + ",".join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)
    sys.exit(code)
""")


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + str(REPO / "tests"))


def _as_in_a_terminal():
    """The child's SIGINT as a foreground command's: default. A test run started in the background of a
    non-interactive shell has SIGINT ignored, children inherit that, and Python then never raises on Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["encode-prompts", "--help"],
                                  ["inspect", "--help"], ["export-comfy", "--help"], ["generate", "--bogus"]])
def test_help_and_usage_errors_import_no_torch(argv):
    proc = subprocess.run([sys.executable, "-c", _CLI_ALONE, *argv], capture_output=True, text=True, cwd=REPO,
                          env=_env(), timeout=60)
    assert proc.returncode == (2 if "--bogus" in argv else 0), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "HEAVY=", proc.stderr
    assert ("sdvg generate: error: " in proc.stderr) if "--bogus" in argv else ("usage: sdvg" in proc.stdout)


@functools.lru_cache(maxsize=None)
def _package_imports_torch() -> bool:
    """Whether ``import sdvg_engine`` starts importing torch (told at the first attempt, without loading torch)."""
    probe = textwrap.dedent("""
        import os, sys
        class Stop:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    print("eager", flush=True)
                    os._exit(0)
        sys.meta_path.insert(0, Stop())
        import sdvg_engine
        print("lazy", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=_env(),
                          timeout=120)
    return proc.stdout.strip() == "eager"


@pytest.mark.slow
def test_sdvg_generate_help_end_to_end_imports_no_torch():
    """The real command line (`python -m sdvg_engine.cli`, what the `sdvg` script runs): no torch in the import
    trace, well under a second of imports. Needs sdvg_engine/__init__.py to import its names lazily."""
    assert not _package_imports_torch(), "sdvg_engine/__init__.py must import its names lazily (PEP 562)"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "sdvg_engine.cli", "generate", "--help"],
                          capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0 and "usage: sdvg generate" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}
    assert elapsed < 5.0  # about 0.1 s alone; generous for a loaded 2-core CI machine


# ---- Ctrl-C at any moment ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt_help"))


#: Ctrl-C exactly while `import torch` runs (the first seconds of a real `sdvg generate`): a finder placed first on
#: sys.meta_path sends SIGINT to this process when torch's import starts, then lets the real import go on.
_SIGINT_DURING_TORCH_IMPORT = _CLI_ALONE.replace("from sdvg_engine.cli import main", textwrap.dedent("""
    import os, signal
    class CtrlCOnTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                os.kill(os.getpid(), signal.SIGINT)
            return None
    sys.meta_path.insert(0, CtrlCOnTorch())
    from sdvg_engine.cli import main""").strip())


def test_ctrl_c_while_torch_imports_exits_130_in_one_line(files, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _SIGINT_DURING_TORCH_IMPORT, *_generate_argv(files, out)],
                          capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120,
                          preexec_fn=_as_in_a_terminal)
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "sdvg generate: interrupted (Ctrl-C); no output was left half-written", proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert not out.exists()


#: a library that swallows a Ctrl-C: its import runs code under a broad ``except`` (as some do around optional
#: imports), and the SIGINT lands inside it
_SIGINT_SWALLOWED_BY_A_LIBRARY = _CLI_ALONE.replace("from sdvg_engine.cli import main", textwrap.dedent("""
    import os, signal, time
    class SwallowsCtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.5)
                except BaseException:
                    pass
            return None
    sys.meta_path.insert(0, SwallowsCtrlC())
    from sdvg_engine.cli import main""").strip())


def test_a_ctrl_c_swallowed_by_a_library_still_stops_the_command(files, tmp_path):
    """Seen once in a loaded `make test`: a Ctrl-C 0.2 s after start was lost and the command ran to the end. The
    CLI's handler remembers the Ctrl-C, so the command stops before the first video: exit 130, one line, no output."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _SIGINT_SWALLOWED_BY_A_LIBRARY, *_generate_argv(files, out)],
                          capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120,
                          preexec_fn=_as_in_a_terminal)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[0] == "sdvg generate: interrupted (Ctrl-C); no output was left half-written"
    assert "Traceback" not in proc.stderr and "video 1/" not in proc.stderr
    assert not out.exists()


def _run_and_interrupt(argv, when):
    """Start ``argv``, send SIGINT once ``when(stderr so far, seconds)`` is true; (status, stderr)."""
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO, env=_env(),
                            preexec_fn=_as_in_a_terminal)
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    err, started, sent = b"", time.perf_counter(), False
    while time.perf_counter() - started < 120:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            err += chunk
        elif chunk == b"" and proc.poll() is not None:
            break  # end of the stream and the process is gone
        if not sent and when(err.decode(errors="replace"), time.perf_counter() - started):
            proc.send_signal(signal.SIGINT)
            sent = True
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    text = err.decode(errors="replace")
    assert sent, text
    return proc.returncode, text


@pytest.mark.slow
def test_ctrl_c_in_the_first_moments_of_the_real_command(files, tmp_path):
    """`python -m sdvg_engine.cli generate ...`, SIGINT 0.2 s after start (the interpreter is still importing)."""
    assert not _package_imports_torch(), "sdvg_engine/__init__.py must import its names lazily (PEP 562)"
    code, err = _run_and_interrupt([sys.executable, "-m", "sdvg_engine.cli", *_generate_argv(files, tmp_path / "o")],
                                   lambda err, seconds: seconds > 0.2)
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith("interrupted (Ctrl-C); no output was left half-written")


@pytest.mark.slow
def test_ctrl_c_during_a_run_cancels_cleanly(files, tmp_path):
    """SIGINT once the first block is made: the run stops at the next model call, exit 130, no traceback, no
    half-written output."""
    out = tmp_path / "o"
    argv = [sys.executable, "-c", _CLI_ALONE, *_generate_argv(files, out, "--frames", "81")]
    code, err = _run_and_interrupt(argv, lambda err, seconds: "block 1/7" in err)
    assert code == 130 and "Traceback" not in err, err
    assert "cancelled" in err.strip().splitlines()[-2]  # the last line is the HEAVY= probe
    assert not out.exists() or not [p for p in out.iterdir() if ".tmp" in p.name]


def test_ctrl_c_while_the_cli_itself_imports_is_one_line():
    """The `sdvg` script imports only `sdvg_engine.cli.main`; a Ctrl-C while that imports the rest of the CLI (the
    window before `entry.main` can catch it) exits 130 with one line. The interrupt is made deterministic: an import
    hook raises KeyboardInterrupt exactly when `sdvg_engine.cli.entry` starts importing."""
    probe = textwrap.dedent("""
        import sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "sdvg_engine.cli.entry":
                    raise KeyboardInterrupt
                return None
        sys.meta_path.insert(0, Interrupt())
        from sdvg_engine.cli import main
        sys.exit(main(["inspect", "x"]))
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=_env(),
                          timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "sdvg: interrupted (Ctrl-C); no output was left half-written"


def test_target_dtype_is_the_target_loader_nodes_dtype():
    """`--target-dtype` speaks the target loader node's `dtype`: fp8 is exactly `--fp8-target` (float8 block weights,
    computed in --dtype); bf16/fp16/fp32 set the target's compute dtype alone (the drafter keeps --dtype)."""
    from sdvg_engine.cli.generate import generator_kwargs

    parser = cli_args.build_parser()
    base = ["generate", "--drafter", "d", "--target", "t", "--vae", "v", "--prompt", "x"]
    assert vars(parser.parse_args(base + ["--target-dtype", "fp8"])) == vars(parser.parse_args(base + ["--fp8-target"]))
    args = parser.parse_args(base + ["--target-dtype", "fp32"])
    assert generator_kwargs(args, "target")["dtype"] == "fp32" and not generator_kwargs(args, "target")["fp8"]
    assert generator_kwargs(args, "drafter")["dtype"] == "bf16"
    plain = parser.parse_args(base)
    assert generator_kwargs(plain, "target")["dtype"] == generator_kwargs(plain, "drafter")["dtype"] == "bf16"
