"""`sdvg export-comfy`: a drafter / target in ComfyUI's `model.diffusion_model.*` layout, from every format the pack reads.

* the key set is exactly ComfyUI's Wan2.1 layout (written out here from the original Wan names, not from the code
  under test), the tensors are bit-equal to what the pack loads from the source at the chosen dtype, the header has
  the metadata ComfyUI reads (``config`` -> ``{"transformer": {"causal_ar": true}}``) and the pack's own;
* the exported file loads back through the pack's loader (``load_causal_wan``, which reads this layout) with
  bit-identical parameters and an identical ``forward_block``;
* refusals, each before anything is written: an existing file (without --overwrite), the input itself, a file that is
  not a Wan DiT (the loader's message: file and key), a pickle with code (never run), an architecture ComfyUI would
  misread, a name that is not .safetensors; an interrupted write leaves no file and keeps an old one whole;
* with a ComfyUI checkout at hand (``COMFYUI_PATH`` / ``COMFYUI_PYTHON``, else the repository's ``.e2e/ComfyUI`` and
  ``.e2e/venv``): ComfyUI's own detection recognises the exported tiny file as Wan and loads every key.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sdvg_engine.checkpoint_io import CheckpointError
from sdvg_engine.cli import entry
from sdvg_engine.models import comfy_layout
from sdvg_engine.models.comfy_layout import export_comfy
from sdvg_engine.models.loading import load_causal_wan, save_checkpoint
from wan_fixtures import text_context, tiny_wan, to_original_keys, write_checkpoint as _write, write_scaled_fp8

FORMATS = ["self_forcing", "krea", "comfyui", "wan_original", "diffusers_folder", "diffusers"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source():
    return tiny_wan(seed=4)




def comfy_layout_keys(num_layers: int) -> set[str]:
    """ComfyUI's Wan2.1 T2V keys, from the original Wan module names (wan/modules/model.py)."""
    top = ["patch_embedding", "text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
           "time_projection.1", "head.head"]
    keys = {f"{name}.{kind}" for name in top for kind in ("weight", "bias")} | {"head.modulation"}
    for n in range(num_layers):
        for attn in ("self_attn", "cross_attn"):
            keys |= {f"blocks.{n}.{attn}.{p}.{kind}" for p in "qkvo" for kind in ("weight", "bias")}
            keys |= {f"blocks.{n}.{attn}.norm_q.weight", f"blocks.{n}.{attn}.norm_k.weight"}
        keys |= {f"blocks.{n}.{m}.{kind}" for m in ("norm3", "ffn.0", "ffn.2") for kind in ("weight", "bias")}
        keys.add(f"blocks.{n}.modulation")
    return {"model.diffusion_model." + k for k in keys}


def _read(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _block_output(model) -> torch.Tensor:
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    return model.forward_block(x, torch.full((1, 3), 833.3333333333334), model.encode_text(text_context().to(model.dtype)))


def _sdvg(argv, monkeypatch):
    """`sdvg ARGV` through the real entry point (one-line errors, exit status). Until args.py registers the command,
    it is added to the real parser the way the registration does (``add_parser``); once registered this is a no-op."""
    import argparse

    from sdvg_engine.cli import args as cli_args, export_comfy as cli_export

    real = cli_args.build_parser

    def build_parser():
        parser = real()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if cli_export.COMMAND not in sub.choices:
            cli_export.add_parser(sub, cli_args._command("export_comfy", "cmd_export_comfy"))
        return parser

    monkeypatch.setattr(entry, "build_parser", build_parser)
    return entry.main([str(a) for a in argv])


# ---- what the file holds ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_exports_the_comfy_layout_bit_equal_to_what_the_pack_loads(fmt, source, tmp_path):
    src = _write(fmt, source, tmp_path)
    out = tmp_path / "out" / "drafter_comfy.safetensors"
    result = export_comfy(src, out, dtype="fp32")
    assert result.path == out and result.info.format == fmt
    tensors, metadata = _read(out)
    assert set(tensors) == comfy_layout_keys(2)
    # Bit-equal to the pack's own load of the source, mapped with the test's own (independent) key map.
    loaded, _ = load_causal_wan(src, dtype=torch.float32)
    expected = {"model.diffusion_model." + k: v for k, v in to_original_keys(loaded.state_dict()).items()}
    assert set(expected) == set(tensors)
    for key, tensor in expected.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), key
    # The EMA weights, not the raw generator (self_forcing): equal to the model that was saved.
    assert torch.equal(tensors["model.diffusion_model.blocks.1.cross_attn.k.weight"],
                       source.blocks[1].attn2.to_k.weight)
    # The metadata newer ComfyUI reads to build CausalWanModel, and the pack's own.
    assert json.loads(metadata["config"]) == {"transformer": {"causal_ar": True}}
    config = json.loads(metadata["sdvg.config"])
    assert (config["num_attention_heads"], config["attention_head_dim"], config["num_layers"]) == (2, 128, 2)
    assert metadata["sdvg.context_scheme"] == "global_cache"
    assert json.loads(metadata["sdvg.source"])["format"] == fmt
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_export_equals_the_pack_load_at_that_dtype(dtype, source, tmp_path):
    src = _write("self_forcing", source, tmp_path)
    out = tmp_path / f"drafter_{dtype}.safetensors"
    export_comfy(src, out, dtype=dtype)
    tensors, _ = _read(out)
    loaded, _ = load_causal_wan(src, dtype=DTYPES[dtype])
    expected = {"model.diffusion_model." + k: v for k, v in to_original_keys(loaded.state_dict()).items()}
    for key, tensor in expected.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), key
    # What the pack keeps in float32 whatever the dtype (modulation, time embedding, the affine norm), and the rest.
    assert tensors["model.diffusion_model.blocks.0.modulation"].dtype == torch.float32
    assert tensors["model.diffusion_model.time_embedding.0.weight"].dtype == torch.float32
    assert tensors["model.diffusion_model.blocks.0.norm3.weight"].dtype == torch.float32
    assert tensors["model.diffusion_model.blocks.0.self_attn.q.weight"].dtype == DTYPES[dtype]


def test_a_scaled_fp8_comfy_file_exports_dequantised_like_the_pack_loads_it(source, tmp_path):
    src = write_scaled_fp8(source, tmp_path / "wan_fp8_scaled.safetensors", marker="model.diffusion_model.scaled_fp8")
    out = tmp_path / "dequantised.safetensors"
    export_comfy(src, out, dtype="fp32")
    tensors, _ = _read(out)
    assert set(tensors) == comfy_layout_keys(2)  # no scale_weight / scaled_fp8 keys: plain weights
    loaded, _ = load_causal_wan(src, dtype=torch.float32)
    for key, tensor in to_original_keys(loaded.state_dict()).items():
        assert torch.equal(tensors["model.diffusion_model." + key], tensor), key


# ---- the exported file through the pack's own loader ---------------------------------------------------------------
@pytest.mark.parametrize("fmt,dtype", [(fmt, "fp32") for fmt in FORMATS] + [("self_forcing", "bf16")])
def test_the_export_loads_back_identically_through_the_pack_loader(fmt, dtype, source, tmp_path):
    src = _write(fmt, source, tmp_path)
    out = tmp_path / "drafter_comfy.safetensors"
    export_comfy(src, out, dtype=dtype)
    reference, reference_info = load_causal_wan(src, dtype=DTYPES[dtype])
    model, info = load_causal_wan(out, dtype=DTYPES[dtype])
    assert info.format == "comfyui" and info.config == reference_info.config
    assert info.context_scheme == reference_info.context_scheme
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert torch.equal(_block_output(model), _block_output(reference))


def test_the_context_scheme_of_the_source_survives_the_export(source, tmp_path):
    src = tmp_path / "target_like.safetensors"
    save_checkpoint(source, src, context_scheme="recompute_window")
    out = tmp_path / "target_comfy.safetensors"
    export_comfy(src, out, dtype="fp32")
    assert _read(out)[1]["sdvg.context_scheme"] == "recompute_window"
    assert load_causal_wan(out, dtype=torch.float32)[1].context_scheme == "recompute_window"


# ---- refusals --------------------------------------------------------------------------------------------------------
def test_an_existing_output_is_refused_without_overwrite_and_replaced_with_it(source, tmp_path, monkeypatch, capsys):
    src = _write("krea", source, tmp_path)
    out = tmp_path / "taken.safetensors"
    out.write_bytes(b"somebody else's file")
    with pytest.raises(ValueError, match=r"taken\.safetensors: already exists; pass --overwrite"):
        export_comfy(src, out, dtype="fp32")
    assert out.read_bytes() == b"somebody else's file"
    assert _sdvg(["export-comfy", "--in", src, "--out", out], monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"sdvg export-comfy: error: --out {out}: already exists; pass --overwrite" in err
    assert out.read_bytes() == b"somebody else's file"
    assert _sdvg(["export-comfy", "--in", src, "--out", out, "--dtype", "fp32", "--overwrite"], monkeypatch) == 0
    assert f"to {out}" in capsys.readouterr().out
    assert set(_read(out)[0]) == comfy_layout_keys(2)


def test_the_input_itself_is_refused_as_output(source, tmp_path, monkeypatch, capsys):
    src = _write("comfyui", source, tmp_path)
    before = src.read_bytes()
    link, hard = tmp_path / "link.safetensors", tmp_path / "hard.safetensors"
    link.symlink_to(src)
    os.link(src, hard)
    for out in (src, link, hard, tmp_path / "sub" / ".." / src.name):
        with pytest.raises(ValueError, match="is the source file itself"):
            export_comfy(src, out, overwrite=True)
        assert _sdvg(["export-comfy", "--in", src, "--out", out, "--overwrite"], monkeypatch) == 2
        assert "is the --in file itself; the export never overwrites its input" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_a_file_that_is_not_a_wan_dit_is_refused_with_the_loaders_message(tmp_path, monkeypatch, capsys):
    unet = tmp_path / "sdxl_unet.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 4, 3, 3)}, str(unet))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=r"sdxl_unet\.safetensors: key 'patch_embedding\.weight' is missing; "
                                              r"this is not a Wan2\.1 transformer"):
        export_comfy(unet, out)
    vae = tmp_path / "wan_2.1_vae.safetensors"
    save_file({f"decoder.conv{i}.weight": torch.zeros(2) for i in range(3)}
              | {"encoder.conv1.weight": torch.zeros(2)}, str(vae))
    assert _sdvg(["export-comfy", "--in", vae, "--out", out], monkeypatch) == 2
    assert "wan_2.1_vae.safetensors: this is a Wan VAE, not a Wan DiT" in capsys.readouterr().err
    assert _sdvg(["export-comfy", "--in", tmp_path / "nowhere.pt", "--out", out], monkeypatch) == 2
    assert "nowhere.pt" in capsys.readouterr().err
    corrupt = tmp_path / "cut_short.safetensors"
    corrupt.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(CheckpointError, match=r"cut_short\.safetensors: not a readable safetensors file, the file is "
                                              r"truncated or corrupt"):
        export_comfy(corrupt, out)
    assert not out.exists()


def test_a_wan_file_missing_a_key_is_refused_naming_file_and_key(source, tmp_path):
    state = to_original_keys(source.state_dict())
    del state["blocks.1.cross_attn.k.weight"]
    broken = tmp_path / "broken.safetensors"
    save_file(state, str(broken))
    with pytest.raises(CheckpointError, match=r"broken\.safetensors: the weights do not match .* 1 missing keys, "
                                              r"e\.g\. \['blocks\.1\.attn2\.to_k\.weight'\]"):
        export_comfy(broken, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_pickle_with_code_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    src = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator_ema": {"model.x": Evil()}}, src)
    with pytest.raises(CheckpointError, match=r"self_forcing_dmd\.pt: cannot be read .* weights_only=True"):
        export_comfy(src, tmp_path / "out.safetensors")
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_an_architecture_comfyui_would_misread_is_refused(tmp_path):
    # Width 256 as 4 heads of 64: ComfyUI would build 2 heads of 128 (heads = width // 128) from the same tensors.
    src = tmp_path / "heads64.safetensors"
    save_checkpoint(tiny_wan(seed=1, num_attention_heads=4, attention_head_dim=64), src)
    with pytest.raises(CheckpointError, match=r"heads64\.safetensors: config 'attention_head_dim' is 64; ComfyUI's "
                                              r"Wan detection assumes 128"):
        export_comfy(src, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_output_names_and_dtypes_the_command_refuses(source, tmp_path, monkeypatch, capsys):
    src = _write("krea", source, tmp_path)
    assert _sdvg(["export-comfy", "--in", src, "--out", tmp_path / "drafter.pt"], monkeypatch) == 2
    assert "give it a .safetensors name (e.g. drafter.safetensors)" in capsys.readouterr().err
    assert _sdvg(["export-comfy", "--in", src, "--out", tmp_path / "o.safetensors", "--dtype", "fp8"], monkeypatch) == 2
    assert "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\], got 'int8'"):
        export_comfy(src, tmp_path / "o.safetensors", dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


# ---- interrupted writes ----------------------------------------------------------------------------------------------
def _interrupting_save(tensors, path, metadata):
    Path(path).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"half")  # the first bytes of a file, then Ctrl-C
    raise KeyboardInterrupt


def test_an_interrupted_export_leaves_no_file_and_keeps_an_old_one_whole(source, tmp_path, monkeypatch, capsys):
    (tmp_path / "in").mkdir()
    src = _write("self_forcing", source, tmp_path / "in")
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.setattr(comfy_layout, "_save_file", _interrupting_save)
    with pytest.raises(KeyboardInterrupt):
        export_comfy(src, folder / "drafter.safetensors")
    assert list(folder.iterdir()) == []
    assert _sdvg(["export-comfy", "--in", src, "--out", folder / "drafter.safetensors"], monkeypatch) == 130
    assert "interrupted (Ctrl-C); no output was left half-written" in capsys.readouterr().err
    assert list(folder.iterdir()) == []
    old = folder / "old.safetensors"
    old.write_bytes(b"the previous export")
    with pytest.raises(KeyboardInterrupt):
        export_comfy(src, old, overwrite=True)
    assert old.read_bytes() == b"the previous export" and list(folder.iterdir()) == [old]


def test_a_file_that_appears_during_the_export_is_not_replaced(source, tmp_path, monkeypatch):
    src = _write("krea", source, tmp_path)
    out = tmp_path / "racing.safetensors"
    real = comfy_layout._save_file

    def save_while_someone_else_writes(tensors, path, metadata):
        real(tensors, path, metadata)
        out.write_bytes(b"written meanwhile")

    monkeypatch.setattr(comfy_layout, "_save_file", save_while_someone_else_writes)
    with pytest.raises(FileExistsError, match="appeared while the export was written; pass --overwrite"):
        export_comfy(src, out)
    assert out.read_bytes() == b"written meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, out.name])


# ---- ComfyUI's own detection (needs a ComfyUI checkout; not in CI) ------------------------------------------------------
def _comfyui() -> tuple[str, str] | None:
    path = os.environ.get("COMFYUI_PATH") or (str(REPO / ".e2e" / "ComfyUI") if (REPO / ".e2e" / "ComfyUI").is_dir() else "")
    python = os.environ.get("COMFYUI_PYTHON") or (str(REPO / ".e2e" / "venv" / "bin" / "python")
                                                  if (REPO / ".e2e" / "venv" / "bin" / "python").exists() else "")
    return (path, python) if path and python and Path(path, "comfy", "model_detection.py").exists() else None


_DETECT = textwrap.dedent("""
    import json, logging, sys
    import comfy.options
    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's own flag: the CPU is its load device
    import torch
    import comfy.model_detection, comfy.sd, comfy.utils
    path, inputs, result = (sys.stdin.readline().strip() for _ in range(3))
    sd = comfy.utils.load_torch_file(path)
    config = comfy.model_detection.detect_unet_config(sd, "model.diffusion_model.")
    model_config = comfy.model_detection.model_config_from_unet(sd, "model.diffusion_model.")
    logged = []
    handler = logging.Handler(); handler.emit = lambda r: logged.append(r.getMessage())
    logging.getLogger().addHandler(handler)
    patcher = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    module = patcher.model.diffusion_model
    own = module.state_dict()
    file = {k[len("model.diffusion_model."):]: v for k, v in sd.items()}
    x = comfy.utils.load_torch_file(inputs)
    with torch.no_grad():  # ComfyUI's own (non-causal) Wan forward over one 3-frame block
        flow = module(x["x"], x["t"], x["context"])
    comfy.utils.save_torch_file({"flow": flow.contiguous()}, result)
    print(json.dumps({
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "model_config": type(model_config).__name__, "module": type(module).__name__,
        "missing": sorted(set(own) - set(file)), "unexpected": sorted(set(file) - set(own)),
        "equal": all(torch.equal(own[k].float(), file[k].float()) for k in own if k in file),
        "logged": [m for m in logged if "missing" in m or "left over" in m or "unet" in m.lower()],
    }))
""")


@pytest.mark.slow
@pytest.mark.skipif(_comfyui() is None, reason="needs a ComfyUI checkout: COMFYUI_PATH (+ COMFYUI_PYTHON) or .e2e/")
def test_comfyui_detects_the_export_as_wan_and_loads_every_key(source, tmp_path):
    comfy_path, python = _comfyui()
    src = _write("self_forcing", source, tmp_path)
    out = tmp_path / "self_forcing_dmd_comfy.safetensors"
    export_comfy(src, out, dtype="fp32")
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    context, t = text_context(), 833.3333333333334
    inputs, result = tmp_path / "inputs.safetensors", tmp_path / "flow.safetensors"
    save_file({"x": x, "t": torch.tensor([t]), "context": context}, str(inputs))
    env = {**os.environ, "PYTHONPATH": comfy_path, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([python, "-c", _DETECT], input=f"{out}\n{inputs}\n{result}\n", capture_output=True,
                         text=True, cwd=comfy_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    config = found["config"]
    assert config["image_model"] == "wan2.1" and config["model_type"] == "t2v"
    # Newer core (model_detection's Wan branch) merges metadata["config"]["transformer"] into this config, and
    # supported_models.WAN21_CausalAR_T2V (listed before WAN21_T2V) matches these three entries -> CausalWanModel.
    newer = {**config, **json.loads(_read(out)[1]["config"])["transformer"]}
    assert {k: newer.get(k) for k in ("image_model", "model_type", "causal_ar")} == \
        {"image_model": "wan2.1", "model_type": "t2v", "causal_ar": True}
    assert (config["dim"], config["num_heads"], config["num_layers"], config["ffn_dim"]) == (256, 2, 2, 256)
    assert (config["in_dim"], config["out_dim"]) == (16, 16)
    # 0.3.64 has no causal class: the plain Wan2.1 T2V config and WanModel, built from every key of the file.
    assert found["model_config"] in ("WAN21_T2V", "WAN21_CausalAR_T2V")
    assert found["module"] in ("WanModel", "CausalWanModel")
    assert found["missing"] == [] and found["unexpected"] == [] and found["equal"], found
    assert found["logged"] == [], found["logged"]
    # ComfyUI's forward on the exported file = the pack's block forward on the source (block 0, no cache), fp32.
    model, _ = load_causal_wan(src, dtype=torch.float32)
    ours = model.forward_block(x, torch.full((1, 3), t), model.encode_text(context))
    with safe_open(str(result), framework="pt") as f:
        theirs = f.get_tensor("flow")
    assert theirs.shape == ours.shape
    # Measured 8.0e-5 on outputs up to 6.6 (1.2e-5 relative): 0.3.64 computes the timestep sinusoid and the time MLP
    # in float32 where the pack uses float64 / keeps them apart, and this tiny random model amplifies that. A wrong
    # name map (q/k, norm2/norm3, modulation rows swapped) moves the output by O(1).
    assert (theirs - ours).abs().max().item() <= 1e-4 * ours.abs().max().item()
