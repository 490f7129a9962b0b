"""The ComfyUI MODEL path (SDVG Drafter / Target from MODEL, ``nodes/comfy_model.py``) in a real ComfyUI, in process.

Tiny Wan2.1 DiTs (width 256, 2 heads, 2 layers, text width 4096: what ComfyUI's detection recognises) are written in
ComfyUI's ``diffusion_models`` layout and loaded the way Load Diffusion Model (``UNETLoader``) does
(``comfy.sd.load_diffusion_model``); LoRAs go through ``comfy.sd.load_lora_for_models`` (what LoraLoaderModelOnly
calls). Every result is compared with the pack's own loader on the same (merged, dequantised) weights.

Needs a ComfyUI checkout and its Python (skipped otherwise)::

    COMFYUI_PATH=.e2e/ComfyUI .e2e/venv/bin/python -m pytest -q -p no:xdist tests/test_comfy_model.py

ComfyUI reads its launch flags once, when ``comfy.model_management`` is first imported: ``--cpu`` is set here first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from comfyui_in_process import SCALE_KEYS, comfyui_or_skip, dequantised

ROOT = Path(__file__).resolve().parents[1]
COMFYUI_PATH, mm = comfyui_or_skip(__file__)  # --cpu

import comfy.ldm.modules.attention as comfy_attention  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.sd  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from nodes import comfy_model, comfy_nodes, logic  # noqa: E402
from node_fixtures import FakeComfyVAE  # noqa: E402
from sdvg_engine.comfy_bridge import ModuleHolder  # noqa: E402
from sdvg_engine.replay_key import weights_fingerprint  # noqa: E402
from wan_fixtures import text_context, tiny_wan, write_checkpoint, write_scaled_fp8  # noqa: E402

try:  # the LTS fork keeps the interrupt flag in comfy.interruption (its model_management wrapper returns nothing)
    from comfy.interruption import InterruptProcessingException, processing_interrupted  # noqa: E402
except ImportError:  # 0.3.64
    InterruptProcessingException, processing_interrupted = mm.InterruptProcessingException, mm.processing_interrupted

if mm.get_torch_device().type != "cpu":
    pytest.skip("comfy.model_management was imported before this module without --cpu", allow_module_level=True)

W, H, FRAMES = 48, 32, 33  # 3 blocks of 3 latent frames
CPU = torch.device("cpu")
PREFIX = "model.diffusion_model."
POSITIVE = [[text_context(seed=1), {"pooled_output": None}]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_models")
    out = {}
    for role, seed in (("drafter", 1), ("target", 2)):
        (root / role).mkdir()
        out[role] = write_checkpoint("comfyui", tiny_wan(seed=seed), root / role)
    return out


@pytest.fixture(scope="module")
def vae():
    return FakeComfyVAE()


@pytest.fixture(scope="module")
def comfy_vae():
    """The same VAE for the runs under ComfyServices (a VAE's conversion is cached with the patcher that made it)."""
    return FakeComfyVAE()


@pytest.fixture
def load_calls(monkeypatch):
    """Every ``load_models_gpu`` call's arguments (the real function still runs)."""
    calls, real = [], mm.load_models_gpu

    def recording(models, *args, **kwargs):
        calls.append((list(models), kwargs))
        return real(models, *args, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", recording)
    return calls


def unet(path, dtype=None):
    """What Load Diffusion Model (UNETLoader) returns for ``path`` with weight_dtype ``dtype``."""
    return comfy.sd.load_diffusion_model(str(path), model_options={} if dtype is None else {"dtype": dtype})


def pack_model(path, role):
    return logic.load_sdvg_model(str(path), role=role, dtype="fp32", device="cpu", services=logic.Services())


def sample(drafter, target, services, vae, mode="first_block_only", **kw):
    kw.setdefault("replay", False)
    return logic.run_sampler(drafter=drafter, target=target, router=None, positive=POSITIVE, vae=vae, width=W, height=H,
                             length=FRAMES, seed=3, mode=mode, services=services, **kw)


def original_state(path) -> dict:
    return {k[len(PREFIX):]: v for k, v in load_file(str(path)).items() if k.startswith(PREFIX)}


def write_original(state: dict, path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({PREFIX + k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def make_lora(state: dict, seed: int, rank: int = 4) -> dict:
    """A LoRA in the common ``diffusion_model.<module>.lora_up/lora_down/alpha`` format on every attention projection,
    the first FFN layer of each block and the time projection."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for key, weight in state.items():
        if key.endswith(".weight") and weight.ndim == 2 and any(
                part in key for part in (".q.", ".k.", ".v.", ".o.", "ffn.0", "time_projection")):
            name = "diffusion_model." + key[:-len(".weight")]
            lora[name + ".lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=g) * 0.1
            lora[name + ".lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=g) * 0.1
            lora[name + ".alpha"] = torch.tensor(float(rank) / 2)
    return lora


def merged(state: dict, lora: dict, strength: float) -> dict:
    """``state`` with ``lora`` merged offline: W + strength * alpha / rank * up @ down."""
    out = dict(state)
    for key in lora:
        if key.endswith(".lora_up.weight"):
            name = key[:-len(".lora_up.weight")]
            up, down = lora[key], lora[name + ".lora_down.weight"]
            target = name[len("diffusion_model."):] + ".weight"
            scale = lora[name + ".alpha"].item() / down.shape[0]
            out[target] = state[target] + strength * scale * (up @ down)
    return out


def lowvram(patcher) -> bool:
    """Whether ComfyUI loaded the MODEL partially (0.3.64 keeps the flag on the model, the LTS fork on the patcher's
    memory measurements)."""
    return getattr(patcher, "_memory_measurements", patcher.model).model_lowvram


def latents_error(a, b) -> float:
    return (a.result.latents - b.result.latents).abs().max().item()


# ------------------------------------------------------------------------------------------------------ equivalence
def test_the_model_path_equals_the_packs_loader(files, vae, comfy_vae, load_calls):
    own = sample(pack_model(files["drafter"], "drafter"), pack_model(files["target"], "target"), logic.Services(), vae)
    drafter = logic.run_node("SDVGDrafterFromModel", comfy_nodes.ComfyServices(), model=unet(files["drafter"]),
                             context_scheme="auto", kv_dtype="auto").outputs[0]
    target = logic.run_node("SDVGTargetFromModel", comfy_nodes.ComfyServices(), model=unet(files["target"]),
                            context_scheme="auto", kv_dtype="auto").outputs[0]
    via = sample(drafter, target, comfy_nodes.ComfyServices(), comfy_vae, workers="2")

    assert latents_error(via, own) <= 1e-5
    assert (via.frames - own.frames).abs().max().item() <= 1e-4
    report, own_report = json.loads(via.report), json.loads(own.report)
    assert report["decisions"] == own_report["decisions"] == ["target", "draft", "draft"]
    assert report["models"]["drafter"]["source"] == "ComfyUI MODEL"
    assert report["models"]["target"]["attention"] == comfy_attention.optimized_attention.__name__
    # workers="2" asked for, one lane run: ComfyUI casts (and on low-VRAM loads moves) a MODEL's weights per call.
    assert not report["settings"]["workers"]["parallel"]
    assert report["settings"]["workers"]["one_lane"].startswith("the drafter and the target are ComfyUI MODEL")
    assert "one_lane" not in own_report["settings"]["workers"]
    # One load call per model of the run (their own patchers, then the converted VAE), the target first: each with
    # room for the KV caches, the VAE state and the activations plus the weights of the models loaded after it
    # (tests/test_load_order.py), partial loads allowed.
    assert [models for models, _ in load_calls][:2] == [[target.patcher], [drafter.patcher]] and len(load_calls) == 3
    room = report["memory_required"]["bytes"]
    assert load_calls[-1][1] == {"memory_required": room, "force_full_load": False}
    assert all(kwargs["memory_required"] >= room and not kwargs["force_full_load"] for _, kwargs in load_calls)
    assert room == sum(report["memory_required"]["components"].values()) > 0


def test_masked_calls_keep_their_mask_whatever_backend_comfyui_chose(files, monkeypatch):
    """The recompute window's attention bias is a masked call: it must reach SDPA even when the backend ComfyUI was
    launched with ignores masks (as flash and sage do); unmasked calls use that backend."""
    used = []

    def mask_dropping(q, k, v, heads, mask=None, **kwargs):
        used.append(mask is not None)
        return comfy_attention.attention_pytorch(q, k, v, heads, skip_reshape=kwargs.get("skip_reshape", False))

    monkeypatch.setattr(comfy_attention, "optimized_attention", mask_dropping)
    view = logic.load_model_from_comfy(unet(files["drafter"]), role="drafter").model
    own = pack_model(files["drafter"], "drafter").model
    context = text_context(seed=4)
    x, t = torch.randn(1, 16, 3, H // 8, W // 8, generator=torch.Generator().manual_seed(0)), torch.full((1, 3), 600.0)
    outs = {}
    with torch.inference_mode():
        for name, model in (("view", view), ("own", own)):
            text, cache = model.encode_text(context), model.new_kv_cache(1, H // 8, W // 8, 9)
            model.forward_block(x, t, text, cache, 0)
            model.forward_block(x, t, text, cache, 3)
            outs[name] = model.forward_block(x, t, text, cache, 6, cache_bias=((0, 3), -3.0))
            outs[name + " unbiased"] = model.forward_block(x, t, text, cache, 6)
    assert (outs["view"] - outs["own"]).abs().max().item() <= 1e-5
    assert (outs["view"] - outs["view unbiased"]).abs().max().item() > 1e-3  # the bias matters here
    assert used and not any(used)  # the chosen backend ran, never with a mask


# ------------------------------------------------------------------------------------------------------------- LoRA
class PartialLoadServices(comfy_nodes.ComfyServices):
    """ComfyUI's low-VRAM load of the MODELs, forced on the CPU (where every load is whole): every op keeps its
    weights where they are and gets the LoRA as a per-call ``LowVramPatch``, as on a GPU short of memory."""

    def load_run(self, patchers, memory_required=0):
        for p in patchers:
            if type(p) is comfy.model_patcher.ModelPatcher:
                p.patch_model(device_to=CPU, lowvram_model_memory=1)
        super().load_run([p for p in patchers if type(p) is not comfy.model_patcher.ModelPatcher], memory_required)


@pytest.mark.parametrize("load", ["full", "lowvram"])
def test_a_lora_equals_its_offline_merge_and_leaves_the_base_weights(files, vae, comfy_vae, tmp_path, load):
    base_state = original_state(files["drafter"])
    lora = make_lora(base_state, seed=5)
    reference = pack_model(write_original(merged(base_state, lora, 0.8), tmp_path / "merged.safetensors"), "drafter")
    plain = sample(pack_model(files["drafter"], "drafter"), None, logic.Services(), vae, mode="draft_only")
    expected = sample(reference, None, logic.Services(), vae, mode="draft_only")

    base = unet(files["drafter"])
    patched, _ = comfy.sd.load_lora_for_models(base, None, lora, 0.8, 0)
    assert len(patched.patches) == sum(k.endswith(".lora_up.weight") for k in lora)
    model = logic.load_model_from_comfy(patched, role="drafter")
    services = comfy_nodes.ComfyServices() if load == "full" else PartialLoadServices()
    out = sample(model, None, services, comfy_vae, mode="draft_only")

    assert latents_error(out, expected) <= 1e-5
    assert latents_error(out, plain) > 1e-3  # the LoRA changes the video
    source = patched.get_model_object("diffusion_model")
    if load == "lowvram":
        assert lowvram(patched)
        assert type(source.blocks[0].self_attn.q.weight_function[0]).__name__ == "LowVramPatch"
        # applied per call: the parameters stayed the base weights all along
        assert all(torch.equal(v, base_state[k]) for k, v in source.state_dict().items())
        patched.unpatch_model(device_to=CPU)
    else:
        assert not torch.equal(source.blocks[0].self_attn.q.weight, base_state["blocks.0.self_attn.q.weight"])
        mm.unload_all_models()
    assert all(torch.equal(v, base_state[k]) for k, v in source.state_dict().items())
    assert not any(getattr(m, "weight_function", None) for m in source.modules())


def test_a_run_after_another_loras_run_uses_its_own_weights(files, vae, comfy_vae):
    """Two copies of one loaded MODEL, one with a LoRA, one without, run one after the other: the second runs on the
    base weights, as a fresh load does. In the LTS fork 0.12.1 ComfyUI alone leaves the LoRA in the shared weights
    (each copy keeps its own record of the patches applied); the sampler unloads the other copy first."""
    base_state = original_state(files["drafter"])
    lora = make_lora(base_state, seed=7)
    base = unet(files["drafter"])
    fresh = sample(logic.load_model_from_comfy(unet(files["drafter"]), role="drafter"), None,
                   comfy_nodes.ComfyServices(), comfy_vae, mode="draft_only")
    mm.unload_all_models()
    for strength in (1.0, 0.5):
        patched, _ = comfy.sd.load_lora_for_models(base, None, lora, strength, 0)
        sample(logic.load_model_from_comfy(patched, role="drafter"), None, comfy_nodes.ComfyServices(), comfy_vae,
               mode="draft_only")
    out = sample(logic.load_model_from_comfy(base, role="drafter"), None, comfy_nodes.ComfyServices(), comfy_vae,
                 mode="draft_only")
    source = base.get_model_object("diffusion_model")
    assert all(torch.equal(v, base_state[k]) for k, v in source.state_dict().items())
    assert latents_error(out, fresh) == 0
    mm.unload_all_models()


# ---------------------------------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("kind", ["fp8_e4m3fn", "fp8_scaled"])
def test_fp8_weights_equal_their_dequantised_reference(files, vae, comfy_vae, tmp_path, kind):
    if kind == "fp8_e4m3fn":  # Load Diffusion Model's weight_dtype fp8_e4m3fn
        patcher = unet(files["drafter"], torch.float8_e4m3fn)
    else:  # a *_fp8_scaled file: float8 weights with a per-tensor scale_weight
        patcher = unet(write_scaled_fp8(tiny_wan(seed=1), tmp_path / "wan_fp8_scaled.safetensors",
                                        marker=PREFIX + "scaled_fp8"))
    source = patcher.get_model_object("diffusion_model")
    state = source.state_dict()
    assert state["blocks.0.self_attn.q.weight"].dtype == torch.float8_e4m3fn
    assert any(f"blocks.0.self_attn.q.{name}" in state for name in SCALE_KEYS) == (kind == "fp8_scaled")
    reference = pack_model(write_original(dequantised(source), tmp_path / "dequantised.safetensors"), "drafter")
    expected = sample(reference, None, logic.Services(), vae, mode="draft_only")
    model = logic.load_model_from_comfy(patcher, role="drafter")
    out = sample(model, None, comfy_nodes.ComfyServices(), comfy_vae, mode="draft_only")
    assert "fp8" in model.describe()["weights"].lower()
    assert latents_error(out, expected) <= 1e-4
    mm.unload_all_models()


# ---------------------------------------------------------------------------------------------------------- replay
def test_the_replay_identity_follows_lora_strength_and_quantisation(files):
    base = unet(files["drafter"])
    state = original_state(files["drafter"])
    lora_a, lora_b = make_lora(state, seed=5), make_lora(state, seed=6)

    def view(patcher):
        return logic.load_model_from_comfy(patcher, role="drafter").model

    def with_lora(lora, strength):
        return view(comfy.sd.load_lora_for_models(base, None, lora, strength, 0)[0])

    a = with_lora(lora_a, 1.0)
    identities = {"a": a.sdvg_identity(), "a again": with_lora(lora_a, 1.0).sdvg_identity(),
                  "a at 0.5": with_lora(lora_a, 0.5).sdvg_identity(), "b": with_lora(lora_b, 1.0).sdvg_identity(),
                  "no lora": view(base).sdvg_identity(),
                  "fp8": view(unet(files["drafter"], torch.float8_e4m3fn)).sdvg_identity()}
    assert identities["a"] == identities["a again"]  # a LoRA loader run again with the same file and strength
    distinct = [identities[k] for k in ("a", "a at 0.5", "b", "no lora", "fp8")]
    assert len(set(distinct)) == len(distinct)
    # What the identity is for: a LoRA not merged into the parameters (patches not applied yet, or a low-VRAM load)
    # leaves the weights' fingerprint as it was.
    assert weights_fingerprint(a) == weights_fingerprint(view(base))


# ---------------------------------------------------------------------------------------------------------- cancel
def test_cancel_stops_a_model_backed_run_and_the_flag_clears(files, comfy_vae):
    class CancelAfterTheFirstBlock(comfy_nodes.ComfyServices):
        done = []

        def progress(self, value, total, preview=None):
            self.done.append(value)
            if value == 1:
                mm.interrupt_current_processing(True)  # the Cancel button

    model = logic.load_model_from_comfy(unet(files["drafter"]), role="drafter")
    with pytest.raises(InterruptProcessingException):
        sample(model, None, CancelAfterTheFirstBlock(), comfy_vae, mode="draft_only")
    assert CancelAfterTheFirstBlock.done == [0, 1]
    assert processing_interrupted() is False
    assert sample(model, None, comfy_nodes.ComfyServices(), comfy_vae, mode="draft_only").frames.shape[0] == FRAMES


# ---------------------------------------------------------------------------------------------------------- memory
def test_the_packs_own_models_load_whole_under_a_partial_budget():
    """Plain torch modules cannot be streamed by ComfyUI: a plain ModelPatcher given a 1-byte budget leaves them on the
    offload device (a forward would then meet weights on two devices); the pack's WholeModulePatcher loads them
    whole and, asked to free memory, frees nothing (so ComfyUI unloads it whole)."""
    plain = comfy.model_patcher.ModelPatcher(ModuleHolder(tiny_wan(seed=3)), load_device=CPU, offload_device=CPU)
    plain.patch_model(device_to=CPU, lowvram_model_memory=1)
    assert plain.loaded_size() < plain.model_size()
    whole = comfy_nodes.ComfyServices().wrap(ModuleHolder(tiny_wan(seed=3)), CPU, CPU)
    whole.patch_model(device_to=CPU, lowvram_model_memory=1)
    assert whole.loaded_size() == whole.model_size() and not lowvram(whole)
    assert whole.partially_unload(CPU, memory_to_free=1) == 0


def test_a_model_that_is_not_a_wan_is_refused_by_name():
    class NotWan(torch.nn.Module):
        pass

    patcher = comfy.model_patcher.ModelPatcher(ModuleHolder(torch.nn.Linear(2, 2)), load_device=CPU, offload_device=CPU)
    patcher.add_object_patch("diffusion_model", NotWan())
    with pytest.raises(ValueError, match=r"model: this MODEL is a .*NotWan .*not a Wan2.1 DiT"):
        logic.run_node("SDVGTargetFromModel", comfy_nodes.ComfyServices(), model=patcher, context_scheme="auto",
                       kv_dtype="auto")


def test_the_view_is_a_comfy_model_view(files):
    """The node's model: ComfyUI's modules under the engine's forward (no weight copied), ComfyUI's device and
    compute dtype, the context scheme from the model's width (the 14B's 5120: recompute window)."""
    patcher = unet(files["target"])
    sdvg_model = logic.load_model_from_comfy(patcher, role="target", kv_dtype="fp8")
    view = sdvg_model.model
    source = patcher.get_model_object("diffusion_model")
    assert view.source is source and {id(p) for p in view.parameters()} == {id(p) for p in source.parameters()}
    assert view.device == patcher.load_device and view.compute_dtype == comfy_model.compute_dtype_of(patcher)
    assert view.kv_cache_dtype == torch.float8_e4m3fn
    assert sdvg_model.context_scheme == "global_cache" and sdvg_model.requested_context_scheme == "auto"
    assert logic.load_model_from_comfy(patcher, role="target", context_scheme="recompute_window").context_scheme == \
        "recompute_window"
    # What ComfyUI's own forward would run and SDVG's does not is named in the report, never silently dropped.
    assert "not_applied" not in sdvg_model.describe()
    patched = patcher.clone()
    patched.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    assert logic.load_model_from_comfy(patched, role="target").describe()["not_applied"] == ["patches.attn1_patch"]


# ------------------------------------------------------------------------------------------------------------- GGUF
def _comfyui_gguf():
    """ComfyUI-GGUF (city96) from this ComfyUI's custom_nodes, imported as its loader imports it (a package)."""
    import importlib.util

    folder = Path(COMFYUI_PATH) / "custom_nodes" / "ComfyUI-GGUF"
    if not (folder / "__init__.py").is_file():
        pytest.skip(f"ComfyUI-GGUF is not in {folder.parent} (make e2e installs it for the GGUF workflow)")
    pytest.importorskip("gguf")
    if "ComfyUI_GGUF" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ComfyUI_GGUF", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["ComfyUI_GGUF"] = package
        spec.loader.exec_module(package)
    import ComfyUI_GGUF.loader
    import ComfyUI_GGUF.nodes
    import ComfyUI_GGUF.ops

    return ComfyUI_GGUF


def test_a_gguf_q8_0_model_equals_its_dequantised_reference(files, vae, comfy_vae, tmp_path):
    """Unet Loader (GGUF)'s MODEL (ComfyUI-GGUF's GGMLOps dequantise per call): equal to the pack's loader on the
    dequantised weights, through the replay key's fingerprints of GGUF tensors."""
    gguf_nodes = _comfyui_gguf()
    from e2e_fixtures import write_q8_0_gguf

    counts = write_q8_0_gguf(files["drafter"], tmp_path / "wan.gguf", tmp_path / "dequantised.safetensors")
    assert counts["Q8_0"] > 0
    ops = gguf_nodes.ops.GGMLOps()
    ops.Linear.dequant_dtype = ops.Linear.patch_dtype = None  # the loader node's "default"
    loaded = comfy.sd.load_diffusion_model_state_dict(gguf_nodes.loader.gguf_sd_loader(str(tmp_path / "wan.gguf")),
                                                      model_options={"custom_operations": ops})
    patcher = gguf_nodes.nodes.GGUFModelPatcher.clone(loaded)
    model = logic.load_model_from_comfy(patcher, role="drafter")
    assert "Q8_0" in model.describe()["weights"]
    expected = sample(pack_model(tmp_path / "dequantised.safetensors", "drafter"), None, logic.Services(), vae,
                      mode="draft_only")
    out = sample(model, None, comfy_nodes.ComfyServices(), comfy_vae, mode="draft_only", replay=True)
    assert latents_error(out, expected) <= 1e-4
    mm.unload_all_models()


def test_the_14b_follows_krea_and_the_1_3b_self_forcing():
    """context_scheme auto follows the model as the file loaders do: ComfyUI's WanModel at the 14B's width (5120,
    40 heads, built on the meta device: no memory) is Krea's target (recompute window, 5-call schedule), the 1.3B's
    (1536) Self-Forcing's drafter (global cache, 4 calls)."""
    import comfy.ldm.wan.model
    import comfy.ops

    for dim, heads, ffn, layers, architecture, scheme, schedule in (
            (5120, 40, 13824, 40, "Wan2.1-T2V-14B", "recompute_window", "krea"),
            (1536, 12, 8960, 30, "Wan2.1-T2V-1.3B", "global_cache", "self_forcing")):
        wan = comfy.ldm.wan.model.WanModel(dim=dim, num_heads=heads, ffn_dim=ffn, num_layers=layers, device="meta",
                                           dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
        holder = ModuleHolder(torch.nn.Linear(1, 1))
        holder.manual_cast_dtype = None
        holder.get_dtype = lambda: torch.bfloat16
        patcher = comfy.model_patcher.ModelPatcher(holder, load_device=CPU, offload_device=CPU)
        patcher.add_object_patch("diffusion_model", wan)
        model = logic.load_model_from_comfy(patcher, role="target")
        assert (model.info.architecture, model.context_scheme, model.schedule) == (architecture, scheme, schedule)
        assert model.model.compute_dtype == torch.bfloat16 and model.dtype == "bf16"


def test_two_clones_of_one_model_with_other_patches_are_refused(files, comfy_vae):
    """One Load Diffusion Model feeding the drafter directly and the target through a LoRA: ComfyUI keeps one set of
    patches per loaded model, so the run is refused before anything loads (the same MODEL for both is fine)."""
    base = unet(files["drafter"])
    lora = make_lora(original_state(files["drafter"]), seed=5)
    drafter = logic.load_model_from_comfy(base, role="drafter")
    target = logic.load_model_from_comfy(comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0], role="target")
    with pytest.raises(ValueError, match=r"the drafter and the target are the same ComfyUI model with different "
                                         r"patches .* Use two Load Diffusion Model nodes"):
        sample(drafter, target, comfy_nodes.ComfyServices(), comfy_vae)
    same = sample(drafter, logic.load_model_from_comfy(base, role="target"), comfy_nodes.ComfyServices(), comfy_vae)
    assert same.frames.shape[0] == FRAMES


# ------------------------------------------------------------------------------------- CUDA's rules (fp8 matmuls)
def _fp8_model(kind, files, tmp_path):
    """A MODEL as an fp8 card loads it: Load Diffusion Model on a ``*_fp8_scaled`` file (+ LoRA), or with weight_dtype
    ``fp8_e4m3fn_fast`` (fp8 matmuls) / ``fp8_e4m3fn`` (storage only); Unet Loader (GGUF) on a Q8_0 file."""
    from cuda_rules import fp8_card

    with fp8_card(mm):
        if kind.startswith("fp8_scaled"):
            path = write_scaled_fp8(tiny_wan(seed=1), tmp_path / "wan_fp8_scaled.safetensors", marker=PREFIX + "scaled_fp8")
            patcher = comfy.sd.load_diffusion_model(str(path))
            if kind.endswith("lora"):
                lora = make_lora(original_state(files["drafter"]), seed=5)
                patcher = comfy.sd.load_lora_for_models(patcher, None, lora, 0.8, 0)[0]
        elif kind == "fp8_e4m3fn_fast":
            patcher = comfy.sd.load_diffusion_model(str(files["drafter"]), model_options={
                "dtype": torch.float8_e4m3fn, "fp8_optimizations": True})
        elif kind == "fp8_e4m3fn":
            patcher = unet(files["drafter"], torch.float8_e4m3fn)
        else:
            gguf_nodes = _comfyui_gguf()
            from e2e_fixtures import write_q8_0_gguf

            write_q8_0_gguf(files["drafter"], tmp_path / "wan.gguf", tmp_path / "dequantised.safetensors")
            ops = gguf_nodes.ops.GGMLOps()
            ops.Linear.dequant_dtype = ops.Linear.patch_dtype = None
            loaded = comfy.sd.load_diffusion_model_state_dict(
                gguf_nodes.loader.gguf_sd_loader(str(tmp_path / "wan.gguf")), model_options={"custom_operations": ops})
            patcher = gguf_nodes.nodes.GGUFModelPatcher.clone(loaded)
    return patcher


@pytest.mark.parametrize("kind", ["fp8_scaled", "fp8_scaled_lora", "fp8_e4m3fn_fast", "fp8_e4m3fn", "gguf_q8_0"])
def test_the_model_path_runs_under_cudas_rules_with_comfyuis_fp8_matmuls(kind, files, comfy_vae, tmp_path):
    """On an fp8 card ComfyUI's ops call ``torch._scaled_mm`` (CUDA's checks in front, ``tests/cuda_rules.py``). The
    MODEL path feeds them what ComfyUI's own Wan does, so per DiT call it makes the same fp8 matmuls (the text
    projections once per prompt) and a whole run passes CUDA's checks (before: a float32 time MLP, refused with
    "Bias is not supported when out_dtype is set to Float32" at block 0)."""
    from cuda_rules import cuda_scaled_mm

    with torch.inference_mode():  # as ComfyUI's executor runs every node (a LoRA's fp8 re-rounding needs it)
        _run_under_cudas_rules(kind, files, comfy_vae, tmp_path, cuda_scaled_mm)


def _run_under_cudas_rules(kind, files, comfy_vae, tmp_path, cuda_scaled_mm):
    patcher = _fp8_model(kind, files, tmp_path)
    model = logic.load_model_from_comfy(patcher, role="drafter")
    assert model.model.compute_dtype == torch.bfloat16
    mm.load_models_gpu([patcher])
    source = patcher.get_model_object("diffusion_model")
    x = torch.randn(1, 16, 3, H // 8, W // 8, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)
    context = POSITIVE[0][0].to(torch.bfloat16)
    with cuda_scaled_mm() as comfy_log, torch.no_grad():  # ComfyUI's own Wan, one call (timestep per frame)
        source(x, torch.full((1, 3), 937.5), context)
    with cuda_scaled_mm() as ours:
        text_kv = model.model.encode_text(context)
        model.model.forward_block(x, torch.full((1, 3), 937.5), text_kv, model.model.new_kv_cache(1, H // 8, W // 8, 3))

    def weights(log):  # one (K x N) weight, output dtype, bias dtype per matmul; the rows differ (time MLP per frame)
        return sorted((str(mat2), str(out), str(bias)) for _, mat2, out, bias in log.calls)

    assert comfy_log.refused == [] and ours.refused == []
    assert weights(ours) == weights(comfy_log)
    if kind.startswith("fp8_scaled"):  # fp8_e4m3fn_fast: 0.3.64's fp8_ops skip them for a model in training mode,
        assert len(ours) > 0          # as ComfyUI leaves its WanModel; ComfyUI's own Wan is the reference there
    with cuda_scaled_mm() as run:
        out = sample(model, None, comfy_nodes.ComfyServices(), comfy_vae, mode="draft_only")
    assert run.refused == [] and out.result.latents.isfinite().all()
    mm.unload_all_models()


# ------------------------------------------------------------------------------------- dynamic VRAM (0.33.0, a stand-in)
def _dynamic_stand_in(patcher):
    """``patcher``'s model under ComfyUI 0.33.0's ModelPatcherDynamic with the CPU as its load device. Core hands a CPU
    load device the plain patcher (``ModelPatcherDynamic.__new__``), and dynamic VRAM is off under ``--cpu``; this
    stand-in builds the dynamic patcher anyway (comfy-aimdo's host buffers work without a GPU), so its ``load`` runs:
    every op is switched to per-call casting (``comfy_cast_weights``) with its LoRA patch attached as
    ``weight_lowvram_function``, small ops and non-op parameters (``modulation``) are loaded whole. What it cannot show:
    aimdo's VRAM (``_vbar_get`` is None on the CPU, so no op gets a ``_v`` and ``cast_bias_weight`` takes its plain
    path, which does not apply ``weight_lowvram_function``: a LoRA on the larger ops is left out here, by core's own
    forward alike) and unloading (``partially_unload`` asserts a non-CPU device). docs/dev/dynamic_vram.md."""
    import importlib

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no dynamic VRAM (ModelPatcherDynamic: 0.33.0 and later)")
    import comfy_aimdo.control
    import comfy_aimdo.host_buffer

    if comfy_aimdo.host_buffer.lib is None:  # main.py loads comfy-aimdo's library only where dynamic VRAM is on
        if not comfy_aimdo.control.init():
            pytest.skip("comfy-aimdo's library does not load here")
        importlib.reload(comfy_aimdo.host_buffer)  # it binds the library when imported (comfy imported it before)
    dynamic = object.__new__(comfy.model_patcher.ModelPatcherDynamic)  # past __new__'s reroute of CPU load devices
    dynamic.__init__(patcher.model, CPU, CPU)
    dynamic.patches, dynamic.patches_uuid = patcher.patches, patcher.patches_uuid  # a LoRA clone's patches
    return dynamic


def _forget(patcher):
    """Take a stand-in patcher off ComfyUI's loaded list (it cannot be unloaded: see _dynamic_stand_in)."""
    patcher.restore_loaded_backups()
    mm.current_loaded_models[:] = [m for m in mm.current_loaded_models if m.model is not patcher]


def test_the_model_path_under_a_dynamic_vram_stand_in(files, vae, comfy_vae, tmp_path):
    """0.33.0's dynamic loading (ModelPatcherDynamic.load through the run's one load_models_gpu call, beside the pack's
    own whole-loading patcher) of a core causal-AR file (``sdvg export-comfy``'s export: CausalWanModel): the MODEL
    path still equals the file loaders; with a LoRA, SDVG's forward over the ops equals core's own
    ``CausalWanModel.forward_block`` on the same loaded model, block after block through the KV cache (what core
    computes, SDVG computes: both go through the same op calls and ``cast_to``)."""
    from sdvg_engine.models.comfy_layout import export_comfy

    import importlib.util

    if importlib.util.find_spec("comfy.ldm.wan.ar_model") is None:  # the LTS fork 0.12.1 has dynamic VRAM, not this
        pytest.skip("this ComfyUI has no causal Wan (comfy/ldm/wan/ar_model.py: upstream 0.3x and later)")
    causal = tmp_path / "causal_ar.safetensors"
    export_comfy(files["drafter"], causal, dtype="fp32")
    base = unet(causal)
    assert type(base.get_model_object("diffusion_model")).__name__ == "CausalWanModel"
    dynamic = _dynamic_stand_in(base)
    assert dynamic.is_dynamic()
    services = comfy_nodes.ComfyServices()
    try:
        out = sample(logic.load_model_from_comfy(dynamic, role="drafter"), None, services, comfy_vae, mode="draft_only")
        source = dynamic.get_model_object("diffusion_model")
        ops = [m for m in source.modules() if hasattr(m, "comfy_cast_weights")]
        assert ops and all(m.comfy_cast_weights for m in ops)  # what ModelPatcherDynamic.load did
        assert any(m.model is dynamic for m in mm.current_loaded_models)
        described = json.loads(out.report)["models"]["drafter"]  # streamed per call, which model_lowvram never says
        assert described["dynamic_vram"] is True and "partially_loaded" not in described
    finally:
        _forget(dynamic)
    expected = sample(pack_model(files["drafter"], "drafter"), None, logic.Services(), vae, mode="draft_only")
    assert latents_error(out, expected) <= 1e-5

    patched, _ = comfy.sd.load_lora_for_models(unet(causal), None, make_lora(original_state(causal), seed=5), 1.0, 0)
    dynamic = _dynamic_stand_in(patched)
    try:
        mm.load_models_gpu([dynamic])
        core = dynamic.get_model_object("diffusion_model")
        assert sum(getattr(m, "weight_lowvram_function", None) is not None for m in core.modules()) > 0
        view = logic.load_model_from_comfy(dynamic, role="drafter").model
        g, t, context = torch.Generator().manual_seed(0), torch.full((1, 3), 600.0), text_context(seed=4)
        blocks = [torch.randn(1, 16, 3, H // 8, W // 8, generator=g) for _ in range(2)]
        with torch.inference_mode():
            text, cache = view.encode_text(context), view.new_kv_cache(1, H // 8, W // 8, 6)
            kv = core.init_kv_caches(1, 6 * view.tokens_per_frame(H // 8, W // 8), CPU, torch.float32)
            cross = core.init_crossattn_caches(1, CPU, torch.float32)
            for start, x in zip((0, 3), blocks):
                ours, theirs = view.forward_block(x, t, text, cache, start), core.forward_block(x, t, context, start, kv, cross)
                assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()  # fp32 order: 6e-6 measured
    finally:
        _forget(dynamic)


# ------------------------------------------------------------------------------------- what a MODEL carries, named
def test_model_compute_dtype_is_read_from_the_clones_object_patch(files, comfy_vae):
    """ModelComputeDtype sets the compute dtype as an object patch of its clone; ComfyUI writes it onto the shared
    model only while that clone is loaded, so reading the model's attribute would leak it into the other clone."""
    base = unet(files["drafter"])
    half = base.clone()
    half.set_model_compute_dtype(torch.bfloat16)
    assert logic.load_model_from_comfy(half, role="drafter").model.compute_dtype == torch.bfloat16
    assert logic.load_model_from_comfy(base, role="drafter").model.compute_dtype == torch.float32
    mm.load_models_gpu([half])  # the patch is now on the shared model
    assert logic.load_model_from_comfy(base, role="drafter").model.compute_dtype == torch.float32
    out = sample(logic.load_model_from_comfy(half, role="drafter"), None, comfy_nodes.ComfyServices(), comfy_vae,
                 mode="draft_only")
    assert json.loads(out.report)["models"]["drafter"]["compute_dtype"] == "bf16"
    mm.unload_all_models()


def test_what_comfyui_itself_never_applies_or_sdvg_does_not_run_is_named(files):
    """A LoRA's ``.diff`` on a block's raw ``modulation`` table is kept by ComfyUI and never applied (its loader
    patches module weights and biases only): not counted as a patched weight, named under ``not_applied``. So are a
    sampling-shift ``model_sampling`` patch and RoPE options, which SDVG's own schedule and RoPE do not read."""
    base = unet(files["drafter"])
    state = original_state(files["drafter"])
    lora = make_lora(state, seed=5)
    lora["diffusion_model.blocks.0.modulation.diff"] = torch.full_like(state["blocks.0.modulation"], 0.5)
    patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0]
    raw = [k for k in patched.patches if str(k).endswith("modulation")]
    assert raw == ["diffusion_model.blocks.0.modulation"]
    described = logic.load_model_from_comfy(patched, role="drafter").describe()
    assert described["patched_weights"] == len(patched.patches) - 1
    assert described["not_applied"] == ["weight patches on 1 raw parameters (blocks.0.modulation): ComfyUI never "
                                        "applies them"]
    mm.load_models_gpu([patched])  # ComfyUI's own loader leaves the table as it was, LoRA patches applied
    source = patched.get_model_object("diffusion_model")
    assert torch.equal(source.blocks[0].modulation.detach().cpu(), state["blocks.0.modulation"])
    assert not torch.equal(source.blocks[0].self_attn.q.weight.detach().cpu(), state["blocks.0.self_attn.q.weight"])
    mm.unload_all_models()

    shifted = base.clone()
    shifted.add_object_patch("model_sampling", base.get_model_object("model_sampling"))
    # what ScaleROPE sets (set_model_rope_options, ComfyUI >= 0.3.6x; 0.3.64 has no setter)
    shifted.model_options.setdefault("transformer_options", {})["rope_options"] = {"scale_t": 2.0, "shift_t": 0.0}
    assert logic.load_model_from_comfy(shifted, role="drafter").describe()["not_applied"] == [
        "model_sampling (shift)", "rope_options"]
