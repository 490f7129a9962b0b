"""Bad input never costs a user's files, a raw traceback or a wasted model load (issue #17).

One table of careless-user cases over the ``sdvg`` CLI (in process through ``main()``, plus a few through a
real subprocess) and one over the Python API / node logic. Every CLI case asserts the exit status, that
stderr is exactly one line naming the culprit, that there is no traceback, and that no existing file
changed (a hash of every file under the case folder before and after). Cases refused by argument checks
must also be refused before any model loads: they run with ``--vae`` pointing at a FIFO, which the loader
refuses with its own message ("not a regular file"), so a case that reached a loader would name the FIFO.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdvg_engine.checkpoint_io import CheckpointError
from sdvg_engine.cli import build_parser, join_negative_values, main
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, write_checkpoint_files

REPO = Path(__file__).resolve().parents[1]


# ---- files --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = write_checkpoint_files(tmp_path_factory.mktemp("good"))
    bad = root / "bad"
    bad.mkdir()
    drafter = (root / "drafter.safetensors").read_bytes()
    (bad / "truncated.safetensors").write_bytes(drafter[: len(drafter) // 2])
    (bad / "empty.safetensors").write_bytes(b"")
    (bad / "blank_prompts.txt").write_text("\n   \n\n")
    (bad / "random.pt").write_bytes(os.urandom(4096))
    (bad / "reward_truncated.safetensors").write_bytes((root / "ImageReward.safetensors").read_bytes()[:5000])
    state = load_file(str(root / "drafter.safetensors"))
    with safe_open(str(root / "drafter.safetensors"), framework="pt") as f:
        meta = f.metadata()
    ints = dict(state)
    ints["blocks.0.attn1.to_q.weight"] = ints["blocks.0.attn1.to_q.weight"].to(torch.int32)
    save_file(ints, str(bad / "int_weights.safetensors"), metadata=meta)
    missing = {k: v for k, v in state.items() if k != "blocks.1.ffn.net.2.weight"}
    save_file(missing, str(bad / "missing_key.safetensors"), metadata=meta)
    shaped = dict(state)
    shaped["blocks.0.attn1.to_v.bias"] = torch.zeros(7)
    save_file(shaped, str(bad / "wrong_shape.safetensors"), metadata=meta)
    save_file(state, str(bad / "broken_meta.safetensors"), metadata={"sdvg.config": "{not json"})
    config = json.loads(meta["sdvg.config"])
    save_file(state, str(bad / "negative_heads.safetensors"),
              metadata={"sdvg.config": json.dumps(dict(config, num_attention_heads=-2))})
    bare = {k: v for k, v in state.items()}
    save_file(bare, str(bad / "no_meta.safetensors"))  # width 256: heads inferred as 2
    # prompt-embeddings files
    from sdvg_engine.text_encoder import EMBEDDINGS_FORMAT

    nan_weights = dict(state)
    nan_weights["proj_out.bias"] = torch.full_like(state["proj_out.bias"], float("nan"))
    save_file(nan_weights, str(bad / "nan_weights.safetensors"), metadata=meta)
    nan = prompt_embeds(1).clone()
    nan[0, 2, 5] = float("nan")
    save_file({"context.0": nan}, str(bad / "nan_context.safetensors"),
              metadata={"format": EMBEDDINGS_FORMAT, "prompts": json.dumps(["a red ball"])})
    save_file({"dummy": torch.zeros(1)}, str(bad / "zero_prompts.safetensors"),
              metadata={"format": EMBEDDINGS_FORMAT, "prompts": "[]"})
    save_file({"context.0": prompt_embeds(1).to(torch.int64)}, str(bad / "int_context.safetensors"),
              metadata={"format": EMBEDDINGS_FORMAT, "prompts": json.dumps(["a red ball"])})
    save_file({"context.0": prompt_embeds(1)}, str(bad / "empty_prompt.safetensors"),
              metadata={"format": EMBEDDINGS_FORMAT, "prompts": json.dumps([""])})
    embeds = (root / "embeds.safetensors").read_bytes()
    (bad / "truncated_context.safetensors").write_bytes(embeds[:3000])
    # something that must never be overwritten (the issue: a checkpoint replaced by a report)
    (bad / "precious.safetensors").write_bytes(drafter)
    (bad / "not_a_folder").write_text("a file")
    (bad / "tokenizer").mkdir()
    # a UMT5 folder saved without its tokenizer, and a tokenizer folder that works
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    UMT5EncoderModel(UMT5Config(vocab_size=8, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2)).save_pretrained(
        bad / "umt5_no_tokenizer")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", "x"])},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}))
    os.mkfifo(bad / "hang.fifo")  # the VAE loader refuses it by name: proves a case was refused before loading
    return root


def _digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_fifo():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p.relative_to(root)) + "/"] = "dir"
    return out


def _gen(files, *extra, vae=None, out=None):
    """A generate command line; ``vae=None`` -> the FIFO (any model load would hang)."""
    return ["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(vae or files / "bad" / "hang.fifo"), "--reward", str(files / "ImageReward.safetensors"),
            "--context-file", str(files / "embeds.safetensors"), "--frames", "21", "--width", str(WIDTH),
            "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu", "--format", "webp",
            "--out", str(out or files / "out_unused"), *extra]


def _bench(files, *extra):
    line = _gen(files)
    cut = line.index("--format")
    return ["bench", *line[1:cut], *extra]


def _models(files, **over):
    """A generate line with real models (for cases refused while loading), every role overridable."""
    roles = {"drafter": files / "drafter.safetensors", "target": files / "target.safetensors", "vae": files / "vae",
             "reward": files / "ImageReward.safetensors", "context-file": files / "embeds.safetensors"}
    roles.update({k.replace("_", "-"): v for k, v in over.items()})
    line = ["generate"]
    for k, v in roles.items():
        line += [f"--{k}", str(v)]
    return line + ["--frames", "21", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
                   "--format", "webp", "--out", str(files / "out_unused")]


B = "bad"
# id -> (argv builder, exit code, substrings the one-line message must contain)
CLI_CASES = {
    # ---- arguments, refused before any load (the VAE is a FIFO) ----
    "width-not-16": (lambda f: _gen(f, "--width", "50"), ["--width 50", "multiple of 16", "48 or 64"]),
    "width-absurd": (lambda f: _gen(f, "--width", "100000"), ["--width 100000", "at most 4096"]),
    "height-zero": (lambda f: _gen(f, "--height", "0"), ["--height 0", "multiple of 16"]),
    "frames-not-12n-3": (lambda f: _gen(f, "--frames", "20"), ["--frames 20", "use 9 or 21"]),
    "frames-over-cache": (lambda f: _gen(f, "--frames", "93", "--target-context", "global_cache"),
                          ["--frames 93", "target's global KV cache holds --max-frames 21"]),
    "frames-over-auto-cache": (lambda f: _gen(f, "--frames", "93", "--preset", "native", "--drafter-context", "recompute_window"),
                               ["--frames 93", "target's global KV cache", "--target-context recompute_window"]),
    "tau-nan": (lambda f: _gen(f, "--tau", "nan"), ["argument --tau", "NaN"]),
    "tau-word": (lambda f: _gen(f, "--tau", "high"), ["argument --tau", "'high' is not a number"]),
    "random-p": (lambda f: _gen(f, "--mode", "random", "--random-p", "1.5"), ["--random-p 1.5", "[0, 1]"]),
    "refine-0": (lambda f: _gen(f, "--refine-from-step", "0"), ["--refine-from-step 0", "1..3 for the 4-step Self-Forcing schedule"]),
    "refine-9": (lambda f: _gen(f, "--refine-from-step", "9"), ["--refine-from-step 9"]),
    "seed-negative": (lambda f: _gen(f, "--seed", "-1"), ["--seed -1", "non-negative"]),
    "cascade-mean": (lambda f: _gen(f, "--cascade", "--aggregation", "mean"), ["--cascade", "--aggregation min"]),
    "temporal-inf": (lambda f: _gen(f, "--temporal-weight", "inf"), ["argument --temporal-weight", "finite"]),
    "bias-global": (lambda f: _gen(f, "--attention-bias", "0.3", "--target-context", "global_cache"),
                    ["--attention-bias 0.3", "recompute-window", "--target-context"]),
    "bias-range": (lambda f: _gen(f, "--attention-bias", "2"), ["--attention-bias 2.0", "(0, 1]"]),
    "device-missing": (lambda f: _gen(f, "--device", "cuda:99"), ["--device cuda:99"]),
    "device-word": (lambda f: _gen(f, "--device", "gpu0"), ["--device gpu0", "cpu, cuda or cuda:N"]),
    "dtype": (lambda f: _gen(f, "--dtype", "fp64"), ["--dtype fp64", "bf16"]),
    "drafter-missing": (lambda f: _gen(f, "--drafter", str(f / "nope.pt")), ["--drafter", "nope.pt", "not found"]),
    "sdvg-no-reward": (lambda f: [a for a in _gen(f) if a not in ("--reward", str(f / "ImageReward.safetensors"))],
                       ["--reward", "mode 'sdvg' needs --reward"]),
    "sdvg-empty-prompt": (lambda f: _gen(f, "--context-file", str(f / B / "empty_prompt.safetensors")),
                          ["empty_prompt.safetensors", "prompt 0 is empty"]),
    "prompt-not-in-context": (lambda f: _gen(f, "--prompt", "a green cone"), ["--context-file", "a green cone"]),
    # refused before any model loads (they used to be refused only after all of them had loaded)
    "offload-on-cpu": (lambda f: _gen(f, "--offload", "target"), ["--offload target", "CUDA GPU", "--device is cpu"]),
    "attention-bias-native": (lambda f: _gen(f, "--preset", "native", "--attention-bias", "0.3"),
                              ["--attention-bias 0.3", "--preset native", "global_cache"]),
    # an empty --prompts-file beside --context-file used to generate every prompt of the context file
    "prompts-file-blank": (lambda f: _gen(f, "--prompts-file", str(f / B / "blank_prompts.txt")),
                           ["--prompts-file", "blank_prompts.txt", "holds no prompts"]),
    # ---- context files (read before any model) ----
    "context-nan": (lambda f: _gen(f, "--context-file", str(f / B / "nan_context.safetensors")),
                    ["nan_context.safetensors", "'context.0'", "1 NaN"]),
    "context-zero-prompts": (lambda f: _gen(f, "--context-file", str(f / B / "zero_prompts.safetensors")),
                             ["zero_prompts.safetensors", "zero prompts"]),
    "context-int": (lambda f: _gen(f, "--context-file", str(f / B / "int_context.safetensors")),
                    ["int_context.safetensors", "'context.0'", "int64"]),
    "context-truncated": (lambda f: _gen(f, "--context-file", str(f / B / "truncated_context.safetensors")),
                          ["truncated_context.safetensors", "truncated or corrupt"]),
    # ---- output paths (checked before any model; nothing existing may change) ----
    "out-is-file": (lambda f: _gen(f, out=f / B / "precious.safetensors"), ["--out", "precious.safetensors", "is a file"]),
    "out-read-only": (lambda f: _gen(f, out=Path("/sys/sdvg_out")), ["--out /sys/sdvg_out", "cannot write in /sys"]),
    "out-used": (lambda f: _gen(f, out=f / "used_out"), ["--out", "video_001.webp", "--overwrite"]),
    "report-folder": (lambda f: _gen(f, "--report", str(f / B)), ["--report", "is a folder"]),
    "report-existing": (lambda f: _gen(f, "--report", str(f / B / "precious.safetensors")),
                        ["--report", "precious.safetensors", "already exists", "--overwrite"]),
    "report-under-file": (lambda f: _gen(f, "--report", str(f / B / "not_a_folder" / "r.json")),
                          ["--report", "not_a_folder is a file"]),
    # ---- model files, refused by the shared reader while loading ----
    "drafter-truncated": (lambda f: _models(f, drafter=f / B / "truncated.safetensors"),
                          ["truncated.safetensors", "truncated or corrupt", "download it again"]),
    "drafter-empty": (lambda f: _models(f, drafter=f / B / "empty.safetensors"), ["empty.safetensors", "empty (0 bytes)"]),
    "drafter-random": (lambda f: _models(f, drafter=f / B / "random.pt"), ["random.pt"]),
    "drafter-vae-folder": (lambda f: _models(f, drafter=f / "vae"), ["vae", "this is a Wan VAE folder, not a Wan DiT",
                                                                      "--vae"]),
    "drafter-is-reward": (lambda f: _models(f, drafter=f / "ImageReward.safetensors"),
                          ["ImageReward.safetensors", "this is an ImageReward checkpoint, not a Wan DiT", "--reward"]),
    "target-is-vae-file": (lambda f: _models(f, target=f / "vae" / "diffusion_pytorch_model.safetensors"),
                           ["diffusion_pytorch_model.safetensors", "this is a Wan VAE, not a Wan DiT", "--vae"]),
    "drafter-int": (lambda f: _models(f, drafter=f / B / "int_weights.safetensors"),
                    ["int_weights.safetensors", "'blocks.0.attn1.to_q.weight'", "int32", "not floating point"]),
    "drafter-broken-meta": (lambda f: _models(f, drafter=f / B / "broken_meta.safetensors"),
                            ["broken_meta.safetensors", "'sdvg.config'", "not valid JSON"]),
    "target-missing-key": (lambda f: _models(f, target=f / B / "missing_key.safetensors"),
                           ["missing_key.safetensors", "blocks.1.ffn.net.2.weight"]),
    "reward-truncated": (lambda f: _models(f, reward=f / B / "reward_truncated.safetensors"),
                         ["reward_truncated.safetensors", "truncated or corrupt"]),
    "vae-truncated": (lambda f: _models(f, vae=f / B / "truncated.safetensors"), ["truncated.safetensors"]),
    "vae-is-dit": (lambda f: _models(f, vae=f / "drafter.safetensors"), ["drafter.safetensors", "not a Wan VAE"]),
    "target-nan-output": (lambda f: _models(f, target=f / B / "nan_weights.safetensors") + ["--mode", "target_only"],
                          ["video 1 ('a red ball')", "block 0: the target's output is not finite", "Check the weights",
                           "nan_weights.safetensors."]),
    # ---- inspect: fails exactly when a load would ----
    "inspect-empty": (lambda f: ["inspect", str(f / B / "empty.safetensors")], ["empty.safetensors", "empty (0 bytes)"]),
    "inspect-truncated": (lambda f: ["inspect", str(f / B / "truncated.safetensors")], ["truncated.safetensors"]),
    "inspect-random": (lambda f: ["inspect", str(f / B / "random.pt")], ["random.pt"]),
    "inspect-missing-key": (lambda f: ["inspect", str(f / B / "missing_key.safetensors")], ["blocks.1.ffn.net.2.weight"]),
    "inspect-wrong-shape": (lambda f: ["inspect", str(f / B / "wrong_shape.safetensors")],
                            ["'blocks.0.attn1.to_v.bias'", "(7,)"]),
    "inspect-negative-heads": (lambda f: ["inspect", str(f / B / "negative_heads.safetensors")],
                               ["num_attention_heads", "-2", "--num-heads"]),
    "inspect-int": (lambda f: ["inspect", str(f / B / "int_weights.safetensors")], ["not floating point"]),
    "inspect-heads-0": (lambda f: ["inspect", "--num-heads", "0", str(f / "drafter.safetensors")], ["--num-heads 0"]),
    "inspect-heads-3": (lambda f: ["inspect", "--num-heads", "3", str(f / B / "no_meta.safetensors")],
                        ["not divisible by 3 heads", "--num-heads"]),
    # ---- encode-prompts ----
    "encode-out-exists": (lambda f: ["encode-prompts", "--text-encoder", str(f / "drafter.safetensors"), "--tokenizer",
                                     str(f / B / "tokenizer"), "--prompt", "x", "--out", str(f / B / "precious.safetensors")],
                          ["--out", "precious.safetensors", "already exists", "--overwrite"]),
    "encode-odd-encoder": (lambda f: ["encode-prompts", "--text-encoder", str(f / "drafter.safetensors"), "--tokenizer",
                                      str(f / "tokenizer"), "--prompt", "x", "--out", str(f / "new.safetensors")],
                           ["drafter.safetensors", "not a UMT5/T5 encoder"]),
    # a tokenizer folder without the tokenizer's files: refused naming the folder and the files, before any load
    "encode-folder-no-tokenizer": (lambda f: ["encode-prompts", "--text-encoder", str(f / B / "umt5_no_tokenizer"),
                                              "--prompt", "x", "--out", str(f / "new.safetensors")],
                                   ["umt5_no_tokenizer: the UMT5 folder has no tokenizer", "tokenizer.json",
                                    "spiece.model", "found: config.json", "--tokenizer"]),
    "encode-empty-tokenizer": (lambda f: ["encode-prompts", "--text-encoder", str(f / "drafter.safetensors"),
                                          "--tokenizer", str(f / B / "tokenizer"), "--prompt", "x", "--out",
                                          str(f / "new.safetensors")],
                               ["tokenizer: the tokenizer folder has no tokenizer", "tokenizer.json", "spiece.model",
                                "found: nothing"]),
    "encode-no-prompt": (lambda f: ["encode-prompts", "--text-encoder", str(f / "drafter.safetensors"), "--prompt", " ",
                                    "--out", str(f / "new.safetensors")], ["--prompt", "no (non-empty) prompts"]),
    # ---- bench (all checked before anything runs) ----
    "bench-mode": (lambda f: _bench(f, "--modes", "sdvg,bogus", "--out", str(f / "b.jsonl")),
                   ["--modes", "unknown mode 'bogus'"]),
    "bench-tau-nan": (lambda f: _bench(f, "--taus", "-0.7,nan", "--out", str(f / "b.jsonl")),
                      ["--taus", "'nan'", "NaN"]),
    "bench-out-folder": (lambda f: _bench(f, "--out", str(f / B)), ["--out", "is a folder"]),
    "bench-broken-results": (lambda f: _bench(f, "--out", str(f / "broken.jsonl")),
                             ["broken.jsonl:2", "not a JSON results line"]),
    "bench-results-binary": (lambda f: _bench(f, "--out", str(f / B / "precious.safetensors")),
                             ["precious.safetensors", "not a JSONL results file"]),
}


@pytest.fixture(scope="module")
def prepared(files):
    used = files / "used_out"
    used.mkdir(exist_ok=True)
    (used / "video_001.webp").write_bytes(b"earlier run")
    (files / "broken.jsonl").write_text('{"prompt": "a", "seed": 1, "mode": "sdvg", "tau": 0}\n{"prompt": \n'
                                        '{"prompt": "b", "seed": 2, "mode": "sdvg", "tau": 0}\n')
    return files


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_bad_input(case, prepared, capsys):
    build, needles = CLI_CASES[case]
    if case == "out-read-only" and (not Path("/sys").is_dir() or os.access("/sys", os.W_OK) and os.geteuid() != 0):
        pytest.skip("needs a read-only /sys")
    argv = build(prepared)
    before = _digest(prepared)
    code = main(argv)
    err = capsys.readouterr().err
    # Progress lines of a run that started ("video 1/2: ...", "[#.] block 1/2 ...") may precede the error line.
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("video ", "[", "  -> "))]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"sdvg {argv[0]}: error: "), lines[0]
    assert err.rstrip("\n").endswith(lines[0])  # the error is the last thing said
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert _digest(prepared) == before  # no existing file changed, nothing new left behind
    assert not (prepared / "out_unused").exists()


def test_argument_checks_run_before_any_load(prepared, capsys):
    """The FIFO VAE: a valid line reaches the VAE loader and fails there naming it; the argument cases of the
    table fail with their own message (asserted above), so none of them reached a loader."""
    assert main(_gen(prepared, out=prepared / "fifo_run")) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"sdvg generate: error: {prepared / B / 'hang.fifo'}: not a regular file (a pipe, socket or device); " \
                  "save the Wan VAE checkpoint to a file first"
    assert not (prepared / "fifo_run").exists()  # the out folder is created only once the models are loaded
    for case, (build, needles) in CLI_CASES.items():
        if "--vae" in build(prepared) and str(prepared / B / "hang.fifo") in build(prepared):
            assert not any("hang.fifo" in n for n in needles), case


def test_tau_accepts_signed_infinities():
    parser = build_parser()
    for argv, want in ((["--tau", "-inf"], -math.inf), (["--tau=-inf"], -math.inf), (["--tau", "inf"], math.inf),
                       (["--tau", "-1e3"], -1000.0)):
        args = parser.parse_args(join_negative_values(["generate", "--drafter", "d", "--target", "t", "--vae", "v", *argv]))
        assert args.tau == want
    args = parser.parse_args(join_negative_values(["bench", "--drafter", "d", "--target", "t", "--vae", "v", "--reward",
                                                   "r", "--taus", "-0.7,-inf"]))
    assert args.taus == "-0.7,-inf"


def earlier_run(out: Path, names) -> None:
    """The files of an earlier `sdvg generate` into ``out``, with the manifest it leaves."""
    from sdvg_engine.cli import write_manifest

    for name in names:
        (out / name).write_bytes(b"old")
    write_manifest(out, list(names))


def test_overwrite_never_deletes_files_this_tool_did_not_write(prepared, tmp_path, capsys):
    """Files whose names merely look like outputs (the user's own) are neither called an earlier run nor deleted;
    a FIFO where the report goes is refused even with --overwrite, before anything loads."""
    out = tmp_path / "out"
    out.mkdir()
    mine = {"video_2024.mp4": b"holiday", "mask_777.png": b"art", "video_1234": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    for extra in ([], ["--overwrite"]):
        code = main(_gen(prepared, "--mode", "target_only", *extra, vae=prepared / "vae", out=out))
        assert code == 0, capsys.readouterr().err
        for name, data in mine.items():
            assert (out / name).read_bytes() == data
        if not extra:  # the second run replaces the first's set: a rerun without --overwrite would be refused
            assert main(_gen(prepared, "--mode", "target_only", vae=prepared / "vae", out=out)) == 2
            assert "video_000.webp" in capsys.readouterr().err
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    code = main(_gen(prepared, "--mode", "target_only", "--overwrite", "--report", str(fifo), vae=prepared / "vae",
                     out=tmp_path / "out2"))
    assert code == 2 and "not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not (tmp_path / "out2").exists()


def test_overwrite_replaces_the_whole_earlier_set(prepared, tmp_path, capsys):
    """--overwrite into a folder with a larger earlier run: the new set replaces it, stale files go (never a mix)."""
    out = tmp_path / "out"
    out.mkdir()
    earlier_run(out, ("video_000.webp", "video_001.webp", "video_002.webp", "mask_002.png", "report.json"))
    (out / "notes.txt").write_text("mine")
    code = main(_gen(prepared, "--mode", "target_only", "--overwrite", vae=prepared / "vae", out=out))
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".sdvg-outputs.json", "mask_000.png", "mask_001.png", "notes.txt",
                                                     "report.json", "video_000.webp", "video_001.webp"]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "video_000.webp").read_bytes()[:4] == b"RIFF"
    assert len(json.loads((out / "report.json").read_text())) == 2


def _env():
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")


@pytest.mark.slow
def test_subprocess_errors_are_one_line_with_status_2(prepared):
    """Through the real entry point: status 2, one line, no traceback; ``--debug`` shows the traceback."""
    argv = [sys.executable, "-m", "sdvg_engine.cli", "inspect", str(prepared / B / "truncated.safetensors")]
    plain = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    assert plain.returncode == 2
    assert plain.stdout == ""
    assert plain.stderr.count("\n") == 1 and "truncated.safetensors" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run(argv + ["--debug"], capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


_SIGINT_WHILE_LOADING = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (a background launcher leaves SIGINT ignored)
import sdvg_engine.models.loading as loading
from sdvg_engine.cli import main

real = loading.read_tensor_file

def read_then_interrupt(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the drafter file is being read
    return real(*args, **kwargs)

loading.read_tensor_file = read_then_interrupt
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_subprocess_ctrl_c_while_loading_exits_130(prepared):
    """SIGINT while a model is loading (after the VAE, inside the drafter read): 130, one line, no traceback,
    and no output folder left behind."""
    out = prepared / "sigint_out"
    argv = [sys.executable, "-c", _SIGINT_WHILE_LOADING, *_models(prepared)]
    argv[argv.index(str(prepared / "out_unused"))] = str(out)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=180)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "sdvg generate: interrupted (Ctrl-C); no output was left half-written"
    assert not out.exists()


# ---- the Python API and the node logic ------------------------------------------------------------------------
def _api_cases(f: Path):
    from nodes.logic import Services, check_model_name
    from sdvg_engine.models.loading import inspect_checkpoint, load_causal_wan
    from sdvg_engine.reward import load_image_reward
    from sdvg_engine.text_encoder import load_prompt_embeddings
    from sdvg_engine.vae import load_wan_vae

    services = Services({"diffusion_models": [str(f)]})
    from sdvg_engine.loaders import load_pipeline

    # A drafter path that does not exist: the router options must be refused before any model file is opened.
    pipeline_paths = dict(drafter=f / "missing_drafter.safetensors", target=f / "target.safetensors", vae=f / "vae",
                          reward=f / "ImageReward.safetensors")
    return {
        "pipeline-router-typo": (lambda: load_pipeline(**pipeline_paths, router_options={"taus": -0.7}), ValueError,
                                 ["router_options", "'taus'", "tau_mode"]),
        "pipeline-router-value": (lambda: load_pipeline(**pipeline_paths, router_options={"accept_rate": 3}), ValueError,
                                  ["accept_rate must be in (0, 1)"]),
        "load-truncated": (lambda: load_causal_wan(f / B / "truncated.safetensors"), CheckpointError,
                           ["truncated.safetensors", "truncated or corrupt"]),
        "load-int": (lambda: load_causal_wan(f / B / "int_weights.safetensors"), CheckpointError,
                     ["'blocks.0.attn1.to_q.weight'", "int32"]),
        "inspect-missing-key": (lambda: inspect_checkpoint(f / B / "missing_key.safetensors"), CheckpointError,
                                ["blocks.1.ffn.net.2.weight"]),
        "inspect-num-heads-0": (lambda: inspect_checkpoint(f / "drafter.safetensors", num_heads=0), CheckpointError,
                                ["num_heads (--num-heads)"]),
        "vae-truncated": (lambda: load_wan_vae(f / B / "truncated.safetensors"), CheckpointError, ["truncated.safetensors"]),
        "vae-empty": (lambda: load_wan_vae(f / B / "empty.safetensors"), CheckpointError, ["empty (0 bytes)"]),
        "reward-truncated": (lambda: load_image_reward(f / B / "reward_truncated.safetensors"), CheckpointError,
                             ["reward_truncated.safetensors"]),
        "reward-random": (lambda: load_image_reward(f / B / "random.pt"), CheckpointError, ["random.pt"]),
        "embeddings-nan": (lambda: load_prompt_embeddings(f / B / "nan_context.safetensors"), CheckpointError,
                           ["'context.0'", "NaN"]),
        "embeddings-zero": (lambda: load_prompt_embeddings(f / B / "zero_prompts.safetensors"), CheckpointError,
                            ["zero prompts"]),
        "node-name-dotdot": (lambda: services.resolve(["diffusion_models"], "../good0/drafter.safetensors"), ValueError,
                             ["contains '..'"]),
        "node-name-absolute": (lambda: services.resolve(["diffusion_models"], str(f / "drafter.safetensors")), ValueError,
                               ["absolute path"]),
        "node-name-windows": (lambda: check_model_name("C:\\models\\x.safetensors"), ValueError, ["absolute path"]),
        "node-name-backslash-dotdot": (lambda: check_model_name("sub\\..\\..\\x.pt"), ValueError, ["contains '..'"]),
        "node-name-empty": (lambda: check_model_name(""), ValueError, ["empty"]),
    }


API_IDS = ["load-truncated", "load-int", "inspect-missing-key", "inspect-num-heads-0", "vae-truncated", "vae-empty",
           "reward-truncated", "reward-random", "embeddings-nan", "embeddings-zero", "node-name-dotdot",
           "node-name-absolute", "node-name-windows", "node-name-backslash-dotdot", "node-name-empty",
           "pipeline-router-typo", "pipeline-router-value"]


@pytest.mark.parametrize("case", API_IDS)
def test_api_bad_input(case, prepared):
    call, error, needles = _api_cases(prepared)[case]
    before = _digest(prepared)
    with pytest.raises(error) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert _digest(prepared) == before


def test_node_names_inside_the_folders_still_resolve(prepared):
    from nodes.logic import Services

    services = Services({"diffusion_models": [str(prepared)]})
    assert services.resolve(["diffusion_models"], "bad/truncated.safetensors") == os.path.join(
        str(prepared), "bad/truncated.safetensors")


def test_write_video_never_replaces_without_overwrite(tmp_path):
    from sdvg_engine.video_io import write_video

    target = tmp_path / "v.webp"
    target.write_bytes(b"keep me")
    frames = torch.rand(3, 16, 16, 3)
    with pytest.raises(FileExistsError, match="v.webp already exists"):
        write_video(frames, target, overwrite=False)
    assert target.read_bytes() == b"keep me"
    write_video(frames, target)
    assert target.read_bytes()[:4] == b"RIFF" and sorted(p.name for p in tmp_path.iterdir()) == ["v.webp"]


_CTRL_C_DURING_SECOND_VIDEO = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see above)
import sdvg_engine.pipeline as pipeline
from sdvg_engine.cli import main

real = pipeline.SpeculativePipeline.generate
calls = []

def generate(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C once while video 2 starts
    return real(self, *args, **kwargs)

pipeline.SpeculativePipeline.generate = generate
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_subprocess_ctrl_c_keeps_a_complete_set(prepared, tmp_path):
    """Ctrl-C during video 2 of 2 with --overwrite over a 3-video run: exit 130; the folder holds video 1, its mask
    and a report of that one video, and none of the earlier run's files (never a mix); other files are kept."""
    out = tmp_path / "out"
    out.mkdir()
    earlier_run(out, ("video_000.webp", "video_001.webp", "video_002.webp", "mask_001.png", "report.json"))
    (out / "notes.txt").write_text("mine")
    argv = [sys.executable, "-c", _CTRL_C_DURING_SECOND_VIDEO,
            *_gen(prepared, "--mode", "target_only", "--overwrite", vae=prepared / "vae", out=out)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=180)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("sdvg generate: generation cancelled before a target call; "
                                                    f"1 finished video(s) kept in {out}")
    assert sorted(p.name for p in out.iterdir()) == [".sdvg-outputs.json", "mask_000.png", "notes.txt", "report.json",
                                                     "video_000.webp"]
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["mode"] == "target_only" and report["video"] == str(out / "video_000.webp")


# ---- issue 30's rows: options, routers and loaders refuse bad values naming the argument and the value ----------
NAN = float("nan")
# id -> (SDVGOptions keyword arguments, what the message must contain)
OPTION_ROWS = {
    "refine-float": ({"refine_from_step": 2.5}, ["refine_from_step", "2.5", "whole number"]),
    "refine-bool": ({"refine_from_step": True}, ["refine_from_step", "True", "whole number"]),
    "random-p-string": ({"random_accept_prob": "0.5"}, ["random_accept_prob", "'0.5'", "random_accept_prob=0.73"]),
    "random-p-range": ({"random_accept_prob": 1.5}, ["random_accept_prob", "1.5", "[0, 1]"]),
    "cascade-margin-nan": ({"cascade_margin": NAN}, ["cascade_margin", "nan", "cascade_margin=0.5"]),
    "cascade-margin-negative": ({"cascade": True, "cascade_margin": -0.1}, ["cascade_margin", "-0.1", ">= 0"]),
    "cascade-frames-float": ({"cascade_frames": 2.0}, ["cascade_frames", "2.0", "cascade_frames=4"]),
    "cascade-frames-zero": ({"cascade": True, "cascade_frames": 0}, ["cascade_frames", "0", ">= 1"]),
    "cascade-string": ({"cascade": "yes"}, ["cascade", "'yes'", "True or False"]),
    "force-first-block-string": ({"force_first_block": "no"}, ["force_first_block", "'no'", "True or False"]),
    "force-first-block-int": ({"force_first_block": 2}, ["force_first_block", "2 (int)", "True or False"]),
    "schedule-every-float": ({"mode": "schedule", "schedule_every": 1.5}, ["schedule_every", "1.5", "schedule_every=3"]),
    "schedule-every-bool": ({"mode": "schedule", "schedule_every": True}, ["schedule_every", "True", "whole number"]),
    "schedule-every-negative": ({"mode": "schedule", "schedule_every": -1}, ["schedule_every", "-1", ">= 0"]),
    "schedule-veto-string": ({"mode": "schedule", "schedule_veto": "yes"}, ["schedule_veto", "'yes'", "True or False"]),
    "mode-unknown": ({"mode": "fast"}, ["mode", "'fast'", "'sdvg'", "'target_only'"]),
}


@pytest.mark.parametrize("case", sorted(OPTION_ROWS))
def test_options_refuse_bad_fields(case):
    import dataclasses

    from sdvg_engine.options import SDVGOptions

    kwargs, needles = OPTION_ROWS[case]
    for make in (lambda: SDVGOptions(**kwargs), lambda: dataclasses.replace(SDVGOptions(), **kwargs)):
        with pytest.raises(ValueError) as info:
            make()
        for needle in needles:
            assert needle in str(info.value), (needle, str(info.value))
    # A field assigned after construction is caught by validate() (the pipeline calls it before any model call).
    options = SDVGOptions(mode="schedule" if "schedule_every" in kwargs or "schedule_veto" in kwargs else "sdvg")
    for key, value in kwargs.items():
        setattr(options, key, value)
    with pytest.raises(ValueError) as info:
        options.validate(None)
    assert needles[0] in str(info.value)


def test_options_normalise_and_round_trip():
    import dataclasses

    import numpy as np

    from sdvg_engine.options import SDVGOptions

    options = SDVGOptions(mode="schedule", random_accept_prob=np.float32(0.5), refine_from_step=np.int64(2),
                          cascade_frames=np.int32(3), cascade_margin=1, schedule_every=np.int64(2))
    fields = dataclasses.asdict(options)
    assert fields == {"mode": "schedule", "force_first_block": True, "random_accept_prob": 0.5, "refine_from_step": 2,
                      "cascade": False, "cascade_frames": 3, "cascade_margin": 1.0, "schedule_every": 2,
                      "schedule_veto": False, "target_after_switch": False, "switch_routing": "carry"}
    assert [type(fields[k]) for k in ("random_accept_prob", "refine_from_step", "cascade_frames", "schedule_every")] \
        == [float, int, int, int]
    json.dumps(fields, allow_nan=False)
    assert dataclasses.replace(options, schedule_every=4).schedule_every == 4 and SDVGOptions(**fields) == options
    assert SDVGOptions(refine_from_step=None).refine_from_step is None


def _router_rows():
    from sdvg_engine.reward import build_tiny_image_reward
    from sdvg_engine.router import RandomRouter, RewardRouter

    scorer = build_tiny_image_reward(seed=0)
    return {
        "random-seed-negative": (lambda: RandomRouter(0.5, seed=-1), ["seed", "-1", "0 to 18446744073709551615"]),
        "random-seed-2^64+1": (lambda: RandomRouter(0.5, seed=2**64 + 1), ["seed", str(2**64 + 1), "2**64 - 1"]),
        "random-seed-2^200": (lambda: RandomRouter(0.5, seed=2**200), ["seed", str(2**200), "2**64 - 1"]),
        "random-seed-bool": (lambda: RandomRouter(0.5, seed=True), ["seed", "True (bool)"]),
        "random-p-string": (lambda: RandomRouter("0.5", seed=0), ["p", "'0.5'", "p=0.73"]),
        "router-tau-string": (lambda: RewardRouter(scorer, tau="0.5"), ["tau", "'0.5'", "tau=-0.25"]),
        "router-tau-nan": (lambda: RewardRouter(scorer, tau=NAN), ["tau must not be NaN", "-inf keeps every draft"]),
        "router-aggregation": (lambda: RewardRouter(scorer, aggregation="median"), ["aggregation", "'median'", "'min'"]),
        "router-tau-mode": (lambda: RewardRouter(scorer, tau_mode="relativ"), ["tau_mode", "'relativ'", "'relative'"]),
        "router-temporal-nan": (lambda: RewardRouter(scorer, temporal_weight=NAN), ["temporal_weight", "nan",
                                                                                   "temporal_weight=0.0"]),
        "router-temporal-string": (lambda: RewardRouter(scorer, temporal_weight="0.5"), ["temporal_weight", "'0.5'"]),
        "router-accept-rate-string": (lambda: RewardRouter(scorer, accept_rate="0.5"), ["accept_rate", "'0.5'"]),
        "router-prior-std-bool": (lambda: RewardRouter(scorer, prior_std=True), ["prior_std", "True"]),
        "router-decide-tau-string": (lambda: RewardRouter(scorer).decide([0.1], tau="0.5"), ["tau", "'0.5'"]),
    }


@pytest.mark.parametrize("case", ["random-seed-negative", "random-seed-2^64+1", "random-seed-2^200", "random-seed-bool",
                                  "random-p-string", "router-tau-string", "router-tau-nan", "router-aggregation",
                                  "router-tau-mode", "router-temporal-nan", "router-temporal-string",
                                  "router-accept-rate-string", "router-prior-std-bool", "router-decide-tau-string"])
def test_routers_refuse_bad_arguments(case):
    call, needles = _router_rows()[case]
    with pytest.raises(ValueError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def _loader_rows(f: Path):
    from sdvg_engine.loaders import load_generator, load_pipeline
    from sdvg_engine.models.loading import load_causal_wan
    from sdvg_engine.reward import load_image_reward
    from sdvg_engine.text_encoder import load_text_encoder

    reward = f / "ImageReward.safetensors"
    fifo = f / B / "hang.fifo"  # the reader refuses it by name: a case naming its argument was refused before reading
    # A drafter path that does not exist: router options must be refused before any model file is opened.
    paths = dict(drafter=f / "missing_drafter.safetensors", target=f / "target.safetensors", vae=f / "vae", reward=reward)
    return {
        "reward-vision-heads-0": (lambda: load_image_reward(fifo, vision_heads=0),
                                  ["vision_heads must be a whole number >= 1, got 0", "vision_heads=16"]),
        "reward-text-heads-float": (lambda: load_image_reward(fifo, text_heads=12.0),
                                    ["text_heads must be a whole number, got 12.0"]),
        "reward-heads-not-dividing": (lambda: load_image_reward(reward, vision_heads=7),
                                      ["ImageReward.safetensors", "vision_heads 7"]),
        "reward-batch-0": (lambda: load_image_reward(fifo, batch_size=0),
                           ["batch_size must be a whole number >= 1, got 0", "batch_size=8"]),
        "reward-path-none": (lambda: load_image_reward(None), ["path", "None", "ImageReward"]),
        "reward-device": (lambda: load_image_reward(fifo, device="bogus"), ["device", "'bogus'", "'cpu'"]),
        "reward-as-drafter": (lambda: load_causal_wan(reward),
                              [str(reward), "this is an ImageReward checkpoint, not a Wan DiT", "reward model"]),
        "reward-as-generator": (lambda: load_generator(reward), [str(reward), "ImageReward checkpoint", "reward model"]),
        "vae-file-as-drafter": (lambda: load_causal_wan(f / "vae" / "diffusion_pytorch_model.safetensors"),
                                ["diffusion_pytorch_model.safetensors", "this is a Wan VAE", "as the VAE"]),
        "umt5-folder-no-tokenizer": (lambda: load_text_encoder(f / B / "umt5_no_tokenizer"),
                                     [str(f / B / "umt5_no_tokenizer"), "no tokenizer", "tokenizer.json",
                                      "spiece.model", "found: config.json, model.safetensors"]),
        "umt5-empty-tokenizer-folder": (lambda: load_text_encoder(f / B / "umt5_no_tokenizer", tokenizer=f / B / "tokenizer"),
                                        [str(f / B / "tokenizer"), "tokenizer.json", "found: nothing"]),
        "pipeline-router-tau-string": (lambda: load_pipeline(**paths, router_options={"tau": "0.5"}), ["tau", "'0.5'"]),
        "pipeline-router-aggregation": (lambda: load_pipeline(**paths, router_options={"aggregation": "median"}),
                                        ["aggregation", "'median'"]),
        "pipeline-router-temporal-nan": (lambda: load_pipeline(**paths, router_options={"temporal_weight": NAN}),
                                         ["temporal_weight", "nan"]),
    }


LOADER_ROWS = ["reward-vision-heads-0", "reward-text-heads-float", "reward-heads-not-dividing", "reward-batch-0",
               "reward-path-none", "reward-device", "reward-as-drafter", "reward-as-generator", "vae-file-as-drafter",
               "umt5-folder-no-tokenizer", "umt5-empty-tokenizer-folder", "pipeline-router-tau-string",
               "pipeline-router-aggregation", "pipeline-router-temporal-nan"]


@pytest.mark.parametrize("case", LOADER_ROWS)
def test_loaders_refuse_bad_arguments(case, prepared):
    call, needles = _loader_rows(prepared)[case]
    before = _digest(prepared)
    with pytest.raises(ValueError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert _digest(prepared) == before


def test_options_made_by_earlier_releases_still_work():
    """Values earlier releases ran with stay valid: NumPy bools and 0/1 as switches, and the cascade's settings out of
    range while the cascade is off (they were ignored then and still are)."""
    import dataclasses

    import numpy as np

    from sdvg_engine.options import SDVGOptions

    opts = SDVGOptions(force_first_block=np.bool_(True), cascade=0, schedule_veto=np.False_)
    assert (opts.force_first_block, opts.cascade, opts.schedule_veto) == (True, False, False)
    assert all(type(v) is bool for v in (opts.force_first_block, opts.cascade, opts.schedule_veto))
    assert SDVGOptions(force_first_block=1).force_first_block is True
    off = SDVGOptions(cascade_frames=0, cascade_margin=-1.0)
    assert (off.cascade_frames, off.cascade_margin) == (0, -1.0)
    with pytest.raises(ValueError, match="cascade_frames must be a whole number >= 1, got 0"):
        dataclasses.replace(off, cascade=True)


@pytest.mark.parametrize("kind", ["dit", "vae"])
def test_a_file_of_another_model_given_as_the_reward_says_what_it_is(tmp_path, kind):
    """A Wan DiT or VAE handed to the reward slot is named for what it is and where it goes, instead of a list of
    thousands of missing ImageReward keys."""
    from safetensors.torch import save_file

    from sdvg_engine.reward import load_image_reward

    keys = (["model.diffusion_model.patch_embedding.weight", "model.diffusion_model.blocks.0.self_attn.q.weight"]
            if kind == "dit" else ["decoder.conv1.weight", "encoder.downsamples.0.residual.0.gamma"])
    path = tmp_path / f"{kind}.safetensors"
    save_file({k: torch.zeros(2) for k in keys}, str(path))
    what = "a Wan DiT (a drafter or target transformer)" if kind == "dit" else "a Wan VAE"
    with pytest.raises(ValueError, match=re.escape(f"{kind}.safetensors: this is {what}, not an ImageReward "
                                                   "checkpoint")) as e:
        load_image_reward(path)
    assert len(str(e.value)) < 300
