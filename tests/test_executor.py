"""The shipped workflows run the way ComfyUI's executor runs them (``comfy_executor``), with tiny real models.

Under ``torch.inference_mode()``, with ComfyUI's one-shot interrupt flag, its output cache and a ModelPatcher-like
load/unload lifecycle. Both defects of main f4b706e fail here: every sampler run raised "Inference tensors do not
track version counter", and a Cancel seen by the speculating target worker was dropped with the speculation.
"""

from __future__ import annotations

import ast
import json
import threading
import time
import traceback
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`

from comfy_executor import Executor  # noqa: E402
from nodes import logic, schema  # noqa: E402
from node_fixtures import PROMPTS, write_tiny_models  # noqa: E402
from sdvg_engine.text_encoder import load_prompt_embeddings  # noqa: E402
from workflow_checks import ROOT, node_of, sized_api_workflow  # noqa: E402

API_DIR = ROOT / "tests" / "api_workflows"
W, H, LENGTH = 48, 32, 33  # 3 blocks
LONG = 57  # 5 blocks, for cancels in the middle


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("executor_models")
    paths = write_tiny_models(root, target_scheme="recompute_window")  # the target runs Krea's scheme, as the 14B would
    folders = {name: [str(root / name)] for name in ("diffusion_models", "sdvg_reward", "sdvg_embeddings")}
    return folders, dict(load_prompt_embeddings(paths["embeddings"]))


def encode_text(embeddings):
    """CLIPTextEncode's stand-in: the UMT5 context of one of the fixture prompts (the real encoder is 11 GB)."""
    def encode(text):
        return embeddings[PROMPTS[0]].float() if text not in embeddings else embeddings[text].float()
    return encode


@pytest.fixture
def executor(models):
    folders, embeddings = models
    logic.clear_replay_memo()
    return Executor(folders, encode_text=encode_text(embeddings))


def test_every_api_workflow_is_run_here_or_in_a_real_comfyui():
    """The workflows left out above are exactly the MODEL-loader ones, and the e2e suite runs those."""
    left_out = sorted(p.stem for p in API_DIR.glob("*.json") if _uses_model_loaders(p))
    assert left_out == ["sdvg_native_gguf", "sdvg_native_model"]
    e2e = (ROOT / "tests" / "test_comfyui_e2e.py").read_text()
    assert all(name in e2e for name in left_out)


def workflow(name: str, length: int = LENGTH, **sampler_inputs) -> dict:
    return sized_api_workflow(name, W, H, length, **sampler_inputs)


nid = node_of


def sampler_outputs(prompt, result):
    assert result.status == "success", "".join(traceback.format_exception(result.error))
    frames, mask, latent, fps, report, plot = result.outputs[nid(prompt, "SDVGSpeculativeSampler")]
    return frames, mask, latent, json.loads(report), plot


#: core nodes that make a ComfyUI MODEL: the executor has no ModelPatcher or ComfyUI ops to stand in for them, so the
#: workflows built on them (SDVG Drafter / Target from MODEL) run only in the real ComfyUIs (make e2e,
#: tests/test_comfyui_e2e.py; in process: tests/test_comfy_model.py)
MODEL_LOADERS = {"UNETLoader", "UnetLoaderGGUF", "LoraLoaderModelOnly"}


def _uses_model_loaders(path: Path) -> bool:
    return any(node.get("class_type") in MODEL_LOADERS for node in json.loads(path.read_text()).values())


@pytest.mark.parametrize("name", sorted(p.stem for p in API_DIR.glob("*.json") if not _uses_model_loaders(p)))
def test_every_shipped_workflow_runs_under_inference_mode(executor, name):
    prompt = workflow(name, seed=3)
    result = executor.queue(prompt)
    frames, mask, latent, report, plot = sampler_outputs(prompt, result)
    assert frames.shape == (LENGTH, H, W, 3) and frames.dtype == torch.float32
    assert mask.shape == (LENGTH, H, W) and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert latent["samples"].shape == (1, 16, 9, H // 8, W // 8)
    assert plot.shape == (1, 360, 640, 3)
    assert report["num_blocks"] == 3 and report["output"]["frames"] == LENGTH
    expected_mask = [1.0 if b["source"] == "draft" else 0.0 for b in report["blocks"] for _ in range(*b["video_frames"])]
    assert mask[:, 0, 0].tolist() == expected_mask
    mode = prompt[nid(prompt, "SDVGSpeculativeSampler")]["inputs"]["mode"]
    assert report["settings"]["mode"] == mode
    # every output node ran; the sampler labelled its phases and reported progress per block
    assert {nid(prompt, t) for t in ("SaveVideo", "SaveAnimatedWEBP", "SaveImage", "PreviewAny")} <= set(result.executed)
    sampler = nid(prompt, "SDVGSpeculativeSampler")
    assert [(v, t) for n, v, t in executor.progress if n == sampler] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    labels = [text for n, text in executor.activity if n == sampler]
    assert labels[0] == "target generating block 1/3" if mode != "draft_only" else labels[0] == "drafting block 1/3"
    assert "3 blocks" in result.ui[sampler]


def test_tau_only_change_reruns_router_and_sampler_and_replays(executor):
    prompt = workflow("sdvg_prompt_embeddings", seed=11)
    router = nid(prompt, "SDVGRewardRouter")
    prompt[router]["inputs"]["tau"] = -5.0  # keeps every draft
    first = executor.queue(prompt)
    *_, first_report, _ = sampler_outputs(prompt, first)
    assert first_report["decisions"] == ["target", "draft", "draft"]
    prompt[router]["inputs"]["tau"] = 5.0  # rejects every draft: only block 0 can be reused
    second = executor.queue(prompt)
    loaders = {nid(prompt, t) for t in ("SDVGLoadDrafter", "SDVGLoadTarget", "SDVGLoadPromptEmbeddings", "VAELoader")}
    assert loaders <= set(second.cached)
    assert {router, nid(prompt, "SDVGSpeculativeSampler")} <= set(second.executed)
    *_, report, _ = sampler_outputs(prompt, second)
    assert report["replay"]["replayed_blocks"] == 1 and report["decisions"] == ["target", "target", "target"]
    # Back to the first tau after ComfyUI unloaded the models (new storage, same weights): everything replays.
    executor.unload_models()
    prompt[router]["inputs"]["tau"] = -5.0
    third = executor.queue(prompt)
    frames, mask, latent, report, _ = sampler_outputs(prompt, third)
    assert report["replay"]["replayed_blocks"] == 3 and report["model_calls"] == {"drafter": {}, "target": {}}
    assert all(p.loads == 2 for p in executor.patchers if p.unloads)
    fresh_prompt = json.loads(json.dumps(prompt))
    fresh_prompt[nid(prompt, "SDVGSpeculativeSampler")]["inputs"]["replay"] = False
    fresh_frames, fresh_mask, fresh_latent, fresh_report, _ = sampler_outputs(fresh_prompt, executor.queue(fresh_prompt))
    assert fresh_report["replay"]["replayed_blocks"] == 0
    assert torch.equal(frames, fresh_frames) and torch.equal(mask, fresh_mask)
    assert torch.equal(latent["samples"], fresh_latent["samples"])


def test_free_memory_reloads_and_the_next_run_works(executor):
    prompt = workflow("sdvg_prompt_embeddings", seed=12)
    frames, *_ = sampler_outputs(prompt, executor.queue(prompt))
    executor.free_memory()  # loaders run again: new model objects, an empty replay memo
    again = executor.queue(prompt)
    assert nid(prompt, "SDVGLoadTarget") in again.executed
    frames_again, *_, report, _ = sampler_outputs(prompt, again)
    assert report["replay"]["replayed_blocks"] == 0 and torch.equal(frames, frames_again)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("tau", [-5.0, 5.0])
def test_cancel_during_block_1_stops_the_run(executor, workers, tau):
    """Cancel while block 1 is worked on: with 2 workers the target speculates beside the verification, and keeping
    every draft (tau=-5) drops that speculation; the one-shot flag must still stop the run."""
    prompt = workflow("sdvg_prompt_embeddings", length=LONG, seed=13, workers=workers)
    prompt[nid(prompt, "SDVGRewardRouter")]["inputs"]["tau"] = tau
    executor.on_progress = lambda value, total: executor.interrupt.set() if value == 1 else None
    result = executor.queue(prompt)
    assert result.status == "interrupted", (result.status, result.error)
    assert not executor.interrupt.is_set  # consumed by the check that raised
    sampler = nid(prompt, "SDVGSpeculativeSampler")
    assert max(v for n, v, _ in executor.progress if n == sampler) < 5
    executor.on_progress = None
    executor.progress.clear()
    after = executor.queue(prompt)
    *_, report, _ = sampler_outputs(prompt, after)
    assert report["num_blocks"] == 5


def test_cancel_seen_by_the_speculating_target_stops_the_run(executor):
    """The interleaving that lost a Cancel on main f4b706e: the target worker, regenerating a block beside its
    verification, is the one whose check sees (and clears) ComfyUI's flag; the draft is then kept and the speculation
    dropped. The run must stop all the same."""
    prompt = workflow("sdvg_prompt_embeddings", length=LONG, seed=15, workers="2", replay=False)
    prompt[nid(prompt, "SDVGRewardRouter")]["inputs"]["tau"] = -5.0  # every draft kept: the speculation is dropped
    first = executor.queue(prompt)
    *_, report, _ = sampler_outputs(prompt, first)
    assert report["schedule"]["dropped_speculative_blocks"] >= 1
    target = first.outputs[nid(prompt, "SDVGLoadTarget")][0].model
    state = {"armed": False, "fired": False}

    forward_block = target.forward_block

    def click_cancel(*args, **kwargs):  # the user clicks while the target computes a speculative block
        if state["armed"] and not state["fired"]:
            state["fired"] = True
            executor.interrupt.set()
        return forward_block(*args, **kwargs)

    def target_checks_first():  # the drafter side waits until someone else took the flag
        deadline = time.time() + 10
        while threading.current_thread().name == "sdvg-side" and executor.interrupt.is_set and time.time() < deadline:
            time.sleep(0.001)

    target.forward_block = click_cancel
    try:
        executor.before_check = target_checks_first
        executor.on_progress = lambda value, total: state.update(armed=True) if value == 1 else None
        prompt[nid(prompt, "SDVGSpeculativeSampler")]["inputs"]["seed"] = 16
        result = executor.queue(prompt)
    finally:
        del target.forward_block
        executor.before_check = executor.on_progress = None
    assert state["fired"] and executor.interrupt.raised_on == ["sdvg-lead"]
    assert result.status == "interrupted", (result.status, result.error)
    *_, report, _ = sampler_outputs(prompt, executor.queue(prompt))  # and the next run works
    assert report["num_blocks"] == 5


def test_cancel_during_replay_stops_the_run(executor):
    prompt = workflow("sdvg_prompt_embeddings", length=LONG, seed=14)
    router = nid(prompt, "SDVGRewardRouter")
    prompt[router]["inputs"]["tau"] = -5.0
    sampler_outputs(prompt, executor.queue(prompt))
    prompt[router]["inputs"]["tau"] = -4.95  # the same decisions: the whole run is replay, no model call
    executor.on_progress = lambda value, total: executor.interrupt.set() if value == 2 else None
    result = executor.queue(prompt)
    assert result.status == "interrupted", (result.status, result.error)


def test_queue_time_errors(executor):
    prompt = workflow("sdvg_prompt_embeddings", length=40)
    with pytest.raises(ValueError, match="use 33 or 45"):
        executor.queue(prompt)


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}


def test_the_v3_classes_make_the_calls_this_executor_makes():
    """comfy_nodes cannot be imported without ComfyUI: read it. Each node's execute is logic.run_node with its own
    id; the sampler's lazy and queue-time hooks are the functions the executor calls."""
    tree = ast.parse((ROOT / "nodes" / "comfy_nodes.py").read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef) and c.name in schema.BY_ID}
    assert set(classes) == set(schema.BY_ID)
    for name, cls in classes.items():
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        run = [n for n in ast.walk(methods["execute"]) if isinstance(n, ast.Call) and ast.unparse(n.func) == "logic.run_node"]
        assert len(run) == 1 and ast.literal_eval(run[0].args[0]) == name, name
    sampler = {f.name: f for f in classes["SDVGSpeculativeSampler"].body if isinstance(f, ast.FunctionDef)}
    assert "logic.needed_inputs" in _calls(sampler["check_lazy_status"])
    assert "logic.geometry_problem" in _calls(sampler["validate_inputs"])


def test_run_node_fills_defaults_and_names_bad_inputs(models):
    folders, _ = models
    services = logic.Services(folders)
    with pytest.raises(TypeError, match=r"SDVGLoadDrafter has no input\(s\) \['ckpt'\]"):
        logic.run_node("SDVGLoadDrafter", services, ckpt="x")
    with pytest.raises(TypeError, match=r"missing the required input\(s\) \['dtype', 'device', 'context_scheme'\]"):
        logic.run_node("SDVGLoadDrafter", services, ckpt_name="self_forcing_dmd.pt")
    with pytest.raises(ValueError, match="unknown SDVG node 'SDVGNope'"):
        logic.run_node("SDVGNope", services)
    # a workflow saved before offload / kv_dtype existed: the schema's defaults
    out = logic.run_node("SDVGLoadDrafter", services, ckpt_name="self_forcing_dmd.pt", dtype="fp32", device="cpu",
                         context_scheme="auto")
    model, = out.outputs
    assert model.describe()["dtype"] == "fp32" and "offload" not in model.describe()


def test_schedule_mode_runs_without_a_router_input(executor):
    prompt = workflow("sdvg_prompt_embeddings", length=LONG, seed=17, mode="schedule", schedule_every=2)
    result = executor.queue(prompt)
    *_, report, _ = sampler_outputs(prompt, result)
    assert report["decisions"] == ["target", "draft", "target", "draft", "target"]
    assert nid(prompt, "SDVGRewardRouter") not in result.executed + result.cached  # lazy: never evaluated
