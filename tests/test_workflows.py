"""Every shipped workflow (UI and API format) against the node schemas, plus the schemas' own contracts.

Runs without ComfyUI: our nodes' schemas come from ``nodes.schema`` (the V3 classes are built from it),
core nodes' from the hand-written table in ``workflow_checks``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
import uuid
from pathlib import Path

import pytest

from workflow_checks import (CORE, FRONTEND_ONLY, OTHER_PACKS, ROOT, SPECS, check_api_workflow, check_ui_workflow,
                             ui_to_api)
from nodes import schema

UI_DIR = ROOT / "workflows"
API_DIR = ROOT / "tests" / "api_workflows"
UI_FILES = sorted(UI_DIR.glob("*.json"))
API_FILES = sorted(API_DIR.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_expected_workflows_ship():
    names = {p.stem for p in UI_FILES}
    assert names == {"sdvg_text_to_video", "sdvg_text_to_video_16gb", "sdvg_text_to_video_48gb",
                     "sdvg_compare_vs_target", "sdvg_prompt_embeddings", "sdvg_native_model", "sdvg_native_gguf",
                     "sdvg_prompt_schedule"}
    assert names == {p.stem for p in API_FILES}, "every UI workflow needs its API-format copy (and vice versa)"


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_workflow_matches_the_schemas(path):
    wf = load(path)
    assert wf.get("version") == 0.4 and isinstance(wf["nodes"], list) and isinstance(wf["links"], list)
    uuid.UUID(wf["id"])  # the frontend's schema rejects a workflow whose id is not a UUID
    assert check_ui_workflow(wf) == []
    assert {n["type"] for n in wf["nodes"]} <= set(SPECS) | set(FRONTEND_ONLY), "only core, SDVG and Note nodes"
    other_packs = {n["type"] for n in wf["nodes"]} & set(OTHER_PACKS)
    assert other_packs <= ({"UnetLoaderGGUF"} if path.stem == "sdvg_native_gguf" else set()), other_packs


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.stem)
def test_api_workflow_matches_the_schemas(path):
    assert check_api_workflow(load(path)) == []


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_api_copy_equals_the_ui_workflow(path):
    api = load(API_DIR / path.name)
    stripped = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
    assert stripped == ui_to_api(load(path))


def test_workflow_modes_and_text_encoding():
    sampler = {p.stem: next(n for n in load(p).values() if n["class_type"] == "SDVGSpeculativeSampler")
               for p in API_FILES}
    assert {name: s["inputs"]["mode"] for name, s in sampler.items()} == dict.fromkeys(sampler, "sdvg")
    # the comparison: two samplers on the same loaders, prompt and seed; the second makes every block with the target
    compare = load(API_DIR / "sdvg_compare_vs_target.json")
    samplers = [n["inputs"] for n in compare.values() if n["class_type"] == "SDVGSpeculativeSampler"]
    assert [s["mode"] for s in samplers] == ["sdvg", "target_only"]
    for key in ("drafter", "target", "positive", "vae", "reward_prompt", "seed", "width", "height", "length"):
        assert samplers[0][key] == samplers[1][key], key
    assert sum(n["class_type"] == "SDVGLoadTarget" for n in compare.values()) == 1
    t2v = load(API_DIR / "sdvg_text_to_video.json")
    clip = next(n for n in t2v.values() if n["class_type"] == "CLIPLoader")
    assert clip["inputs"]["type"] == "wan" and "umt5_xxl" in clip["inputs"]["clip_name"]
    text = next(n for n in t2v.values() if n["class_type"] == "CLIPTextEncode")["inputs"]["text"]
    assert sampler["sdvg_text_to_video"]["inputs"]["reward_prompt"] == text  # ImageReward scores the same prompt
    emb = load(API_DIR / "sdvg_prompt_embeddings.json")
    assert not any(n["class_type"] in ("CLIPLoader", "CLIPTextEncode") for n in emb.values())
    assert isinstance(sampler["sdvg_prompt_embeddings"]["inputs"]["reward_prompt"], list)  # linked to the prompt


# ------------------------------------------------------------------------------------- the checker finds errors
@pytest.fixture
def good():
    return load(UI_DIR / "sdvg_text_to_video.json")


def _node(wf, ntype):
    return next(n for n in wf["nodes"] if n["type"] == ntype)


def test_checker_catches_broken_ui_workflows(good):
    bad = copy.deepcopy(good)
    _node(bad, "SDVGSpeculativeSampler")["widgets_values"].pop(4)  # drops the seed's control value
    assert any("widgets_values" in e for e in check_ui_workflow(bad))

    bad = copy.deepcopy(good)
    values = _node(bad, "SDVGSpeculativeSampler")["widgets_values"]
    values[4], values[5] = values[5], values[4]  # seed and its control swapped
    assert check_ui_workflow(bad)

    bad = copy.deepcopy(good)
    _node(bad, "SDVGRewardRouter")["widgets_values"][1] = 7.5  # tau above its max
    assert any("above max" in e for e in check_ui_workflow(bad))

    bad = copy.deepcopy(good)
    _node(bad, "SDVGSpeculativeSampler")["widgets_values"][3] = 80  # not 12n - 3
    assert any("12n - 3" in e for e in check_ui_workflow(bad))

    bad = copy.deepcopy(good)
    _node(bad, "SDVGLoadTarget")["widgets_values"][1] = "int4"
    assert any("int4" in e for e in check_ui_workflow(bad))

    bad = copy.deepcopy(good)  # the VAE wired into the drafter socket
    sampler = _node(bad, "SDVGSpeculativeSampler")
    vae_link = next(i["link"] for i in sampler["inputs"] if i["name"] == "vae")
    drafter_link = next(i["link"] for i in sampler["inputs"] if i["name"] == "drafter")
    for link in bad["links"]:
        if link[0] == vae_link:
            link[4] = 0
    for inp in sampler["inputs"]:
        if inp["name"] == "drafter":
            inp["link"] = vae_link
        if inp["name"] == "vae":
            inp["link"] = None
    bad["links"] = [l for l in bad["links"] if l[0] != drafter_link]
    errors = check_ui_workflow(bad)
    assert any("VAE" in e and "SDVG_MODEL" in e for e in errors) and any("'vae' is not connected" in e for e in errors)


def test_checker_catches_broken_api_workflows():
    api = load(API_DIR / "sdvg_text_to_video.json")
    sampler_id = next(k for k, v in api.items() if v["class_type"] == "SDVGSpeculativeSampler")
    bad = copy.deepcopy(api)
    bad[sampler_id]["inputs"]["mode"] = "turbo"
    assert any("turbo" in e for e in check_api_workflow(bad))
    bad = copy.deepcopy(api)
    del bad[sampler_id]["inputs"]["positive"]
    assert any("positive" in e for e in check_api_workflow(bad))
    bad = copy.deepcopy(api)
    bad[sampler_id]["inputs"]["positive"] = [bad[sampler_id]["inputs"]["vae"][0], 0]
    assert any("CONDITIONING" in e for e in check_api_workflow(bad))


# ----------------------------------------------------------------------------------------- schema contracts
#: Widget order per node, as saved in users' workflows: append optional inputs only, never reorder.
FROZEN_WIDGETS = {
    "SDVGLoadDrafter": ["ckpt_name", "dtype", "device", "context_scheme", "offload", "kv_dtype", "card"],
    "SDVGLoadTarget": ["ckpt_name", "dtype", "device", "context_scheme", "offload", "kv_dtype", "card"],
    "SDVGRewardRouter": ["reward_model", "tau", "aggregation", "crop", "temporal_weight", "tau_mode", "accept_rate",
                         "preprocess"],
    "SDVGSpeculativeSampler": ["reward_prompt", "width", "height", "length", "seed", "mode", "force_first_block",
                               "refine_from_step", "cascade", "random_accept_prob", "preset", "workers", "replay",
                               "schedule_every", "schedule_veto"],
    "SDVGLoadPromptEmbeddings": ["embeddings_file", "index"],
    "SDVGAdvancedOptions": ["refine_from_step", "cascade", "random_accept_prob", "preset", "workers", "replay",
                            "schedule_every", "schedule_veto"],
    "SDVGDrafterFromModel": ["context_scheme", "kv_dtype"],
    "SDVGTargetFromModel": ["context_scheme", "kv_dtype"],
    "SDVGPromptSchedule": ["text", "target_after_switch", "switch_routing"],
    "SDVGPromptSwitch": ["start_frame", "reward_prompt"],
}


def test_node_ids_and_widget_order_are_frozen():
    assert [s.node_id for s in schema.NODES] == list(FROZEN_WIDGETS)
    for spec in schema.NODES:
        assert spec.node_id.startswith("SDVG") and spec.category == "SDVG"
        assert [w.name for w in spec.widgets] == FROZEN_WIDGETS[spec.node_id]


def test_every_input_and_output_is_documented_and_valid():
    for spec in schema.NODES:
        names = [i.name for i in spec.inputs] + [o.name for o in spec.outputs]
        assert len(set(names)) == len(names), f"{spec.node_id}: V3 needs unique input/output ids"
        for i in spec.inputs:
            assert i.tooltip.strip(), f"{spec.node_id}.{i.name} has no tooltip"
            if i.type == "COMBO" and i.options:
                assert i.default in i.options
            if i.type in ("INT", "FLOAT"):
                assert i.min <= i.default <= i.max
        for o in spec.outputs:
            assert o.tooltip.strip()
    sampler = schema.SAMPLER
    assert sampler.input("seed").control_after_generate and sampler.input("seed").max == 2**64 - 1
    assert sampler.input("reward_prompt").multiline and "TEXT" in sampler.input("reward_prompt").tooltip
    tau = schema.REWARD_ROUTER.input("tau")
    assert (tau.min, tau.max, tau.step, tau.default, tau.slider) == (-5.0, 5.0, 0.05, -0.25, True)
    # a router added from the menu starts where the held-out benchmark chose (docs/dev/routing.md): relative, -0.25
    assert schema.REWARD_ROUTER.input("tau_mode").default == "relative"
    assert schema.SAMPLER.input("length").min == 9 and (schema.MAX_LENGTH - 9) % 12 == 0


def test_loop_options_are_optional_trailing_inputs_with_engine_defaults():
    from sdvg_engine.pipeline import SDVGOptions

    inputs = schema.SAMPLER.inputs
    optional_widgets = [i.name for i in inputs if i.optional and i.is_widget]
    assert optional_widgets == ["refine_from_step", "cascade", "random_accept_prob", "preset", "workers", "replay",
                                "schedule_every", "schedule_veto"]
    assert [i.name for i in inputs[-10:-2]] == optional_widgets
    # then the Advanced Options socket and, appended after it, the prompt schedule's; that node carries the same
    # inputs with the same defaults and ranges
    assert [(i.name, i.type, i.optional) for i in inputs[-2:]] == [
        ("advanced_options", schema.SDVG_OPTIONS, True), ("prompt_schedule", schema.SDVG_PROMPT_SCHEDULE, True)]
    advanced = schema.ADVANCED_OPTIONS.inputs
    strip = lambda i: (i.name, i.type, i.default, i.min, i.max, i.step, i.options)  # noqa: E731
    assert [strip(i) for i in advanced] == [strip(i) for i in inputs[-10:-2]]
    assert all(i.advanced for i in inputs[-10:-2]) and all("Advanced Options" in i.tooltip for i in inputs[-10:-2])
    from sdvg_engine.presets import DEFAULT_PRESET, PRESETS

    assert schema.SAMPLER.input("preset").default == DEFAULT_PRESET and tuple(schema.PRESETS) == PRESETS
    defaults = SDVGOptions()
    assert schema.SAMPLER.input("cascade").default == defaults.cascade
    assert schema.SAMPLER.input("random_accept_prob").default == defaults.random_accept_prob
    assert schema.SAMPLER.input("schedule_every").default == defaults.schedule_every
    assert schema.SAMPLER.input("schedule_veto").default == defaults.schedule_veto
    assert defaults.refine_from_step is None and schema.SAMPLER.input("refine_from_step").default == 0  # 0 = off
    assert schema.SAMPLER.input("force_first_block").default == defaults.force_first_block
    assert tuple(schema.MODES) == tuple(__import__("sdvg_engine.pipeline", fromlist=["MODES"]).MODES)


def test_docs_are_generated_from_the_schema():
    assert (ROOT / "docs" / "nodes.md").read_text(encoding="utf-8") == schema.markdown_reference(), \
        "regenerate with: python -m nodes.schema > docs/nodes.md"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_comfyui_is_imported_only_by_the_adapters():
    comfy = {"comfy", "comfy_api", "folder_paths", "nodes", "server", "execution", "comfy_execution", "latent_preview"}
    adapters = ("logic", "schema", "services", "loaders", "sampler", "compat", "prompt_schedule")  # comfy_model: lazily
    for path in [*(ROOT / "sdvg_engine").rglob("*.py"), *(ROOT / "nodes" / f"{name}.py" for name in adapters)]:
        assert not (_imports(path) & comfy), f"{path} imports ComfyUI"
    # Registered through comfy_entrypoint: a NODE_CLASS_MAPPINGS would make upstream ComfyUI skip it, so the only one
    # is the empty mapping for the LTS fork's loader, behind its check (tests/test_nodes.py runs both loaders' rules).
    for path in (ROOT / "nodes").glob("*.py"):
        assert not re.search(r"^\s*NODE_CLASS_MAPPINGS\s*[:=]", path.read_text(encoding="utf-8"), re.M), path
    root = (ROOT / "__init__.py").read_text(encoding="utf-8")
    assert "comfy_entrypoint" in root
    assert root.count("NODE_CLASS_MAPPINGS: dict = {}") == 1 and "if loader_calls_entrypoint_beside_mappings():" in root


def test_requirements_mirror_the_runtime_dependencies():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    lines = [l.strip() for l in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()]
    requirements = [l for l in lines if l and not l.startswith("#")]
    assert requirements == pyproject["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}
    assert not names & {"torch", "torchvision", "torchaudio", "numpy"}
    comfy = pyproject["tool"]["comfy"]
    assert comfy["DisplayName"] == "SDVG — Speculative Video Generation"
    assert comfy.get("Icon", "") == "" or comfy["Icon"].startswith("https://")  # no icon, or a hosted one
    assert comfy["PublisherId"] and comfy["requires-comfyui"].startswith(">=")


def test_core_schemas_are_minimal_and_sdvg_free():
    assert not set(CORE) & set(schema.BY_ID)
    for spec in CORE.values():
        assert dataclasses.is_dataclass(spec) and not spec.node_id.startswith("SDVG")


@pytest.mark.parametrize("name", ["sdvg_text_to_video", "sdvg_text_to_video_16gb", "sdvg_text_to_video_48gb",
                                  "sdvg_compare_vs_target", "sdvg_native_model", "sdvg_native_gguf",
                                  "sdvg_prompt_schedule"])
def test_the_prompt_is_typed_once(name):
    """One text node feeds both the text encoder and the reward prompt, in the UI and API files alike."""
    ui = json.loads((ROOT / "workflows" / f"{name}.json").read_text())
    links = {link[0]: link for link in ui["links"]}
    sources = {}
    for node in ui["nodes"]:
        for inp in node.get("inputs", []):
            if (node["type"], inp["name"]) in (("CLIPTextEncode", "text"), ("SDVGSpeculativeSampler", "reward_prompt")):
                sources[node["type"]] = links[inp["link"]][1]
    assert len(sources) == 2 and len(set(sources.values())) == 1
    source = next(n for n in ui["nodes"] if n["id"] == sources["CLIPTextEncode"])
    assert source["type"] == "PrimitiveStringMultiline" and source["widgets_values"][0].strip()
    api = json.loads((ROOT / "tests" / "api_workflows" / f"{name}.json").read_text())
    text_links = [node["inputs"][key] for node in api.values() for key in ("text", "reward_prompt")
                  if key in node["inputs"] and node["class_type"] in ("CLIPTextEncode", "SDVGSpeculativeSampler")]
    assert text_links == [[str(source["id"]), 0]] * (len(text_links)) and len(text_links) >= 2


# --------------------------------------------------------------------------- workflows saved by the previous release
PREVIOUS_DIR = ROOT / "tests" / "data" / "previous_release_workflows"
#: The widgets of the previous release (main bb970b3, whose workflows/ are copied in PREVIOUS_DIR), in order.
PREVIOUS_WIDGETS = {
    "SDVGLoadDrafter": ["ckpt_name", "dtype", "device", "context_scheme", "offload", "kv_dtype"],
    "SDVGLoadTarget": ["ckpt_name", "dtype", "device", "context_scheme", "offload", "kv_dtype"],
    "SDVGRewardRouter": ["reward_model", "tau", "aggregation", "crop", "temporal_weight", "tau_mode", "accept_rate",
                         "preprocess"],
    "SDVGSpeculativeSampler": ["reward_prompt", "width", "height", "length", "seed", "control_after_generate", "mode",
                               "force_first_block", "refine_from_step", "cascade", "random_accept_prob", "preset",
                               "workers", "replay", "schedule_every", "schedule_veto"],
    "SDVGLoadPromptEmbeddings": ["embeddings_file", "index"],
}


@pytest.mark.parametrize("path", sorted(PREVIOUS_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_a_workflow_saved_by_the_previous_release_loads_with_identical_values(path):
    wf = load(path)
    assert check_ui_workflow(wf) == []
    now = ui_to_api(wf)  # positional widgets_values read with today's schemas, as the frontend does
    sdvg = [n for n in wf["nodes"] if n["type"].startswith("SDVG")]
    assert sdvg
    for node in sdvg:
        then = dict(zip(PREVIOUS_WIDGETS[node["type"]], node["widgets_values"]))
        then.pop("control_after_generate", None)
        names = list(then)  # a router saved without its trailing optional widgets keeps them at their defaults
        inputs = now[str(node["id"])]["inputs"]
        linked = {i["name"] for i in node.get("inputs", []) if i.get("widget") and i.get("link") is not None}
        assert {k: inputs[k] for k in names if k not in linked} == {k: v for k, v in then.items() if k not in linked}
        # today's widgets start with the previous release's, in the same order ...
        widgets = [w.name for w in schema.BY_ID[node["type"]].widgets]
        assert widgets[:len(names)] == names
        # ... and the ones added since are optional and trailing, with defaults that keep the old behaviour
        added = [w for w in schema.BY_ID[node["type"]].widgets if w.name not in PREVIOUS_WIDGETS[node["type"]]]
        for w in added:
            assert w.optional and w.name not in inputs and w.default == "manual", (node["type"], w.name)


# ------------------------------------------------------------------------------- what a first-time user is given
#: card size of each text-to-video workflow, and the loader settings the memory plan gives it (card wins; the
#: widgets show the same values so the node tells the truth when card is switched to manual)
CARD_OF = {"sdvg_text_to_video": "24 GB", "sdvg_text_to_video_16gb": "16 GB", "sdvg_text_to_video_48gb": "48 GB",
           "sdvg_compare_vs_target": "24 GB", "sdvg_prompt_embeddings": "24 GB", "sdvg_native_model": "24 GB",
           "sdvg_native_gguf": "24 GB", "sdvg_prompt_schedule": "24 GB"}
#: the ComfyUI-native workflows: ComfyUI's loaders, LoRAs, then the SDVG "from MODEL" nodes
NATIVE = ("sdvg_native_model", "sdvg_native_gguf")


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_workflows_fit_their_card_by_the_memory_plan(path):
    from nodes import logic
    from sdvg_engine.offload import plan_memory

    card = CARD_OF[path.stem]
    plan = plan_memory(float(card.split()[0]))
    assert plan.fits and plan.total_gib <= float(card.split()[0])
    api = load(API_DIR / path.name)
    if path.stem in NATIVE:  # ComfyUI's memory manager places the weights; the KV caches follow the plan
        for role, class_type in (("drafter", "SDVGDrafterFromModel"), ("target", "SDVGTargetFromModel")):
            sdvg = next(n for n in api.values() if n["class_type"] == class_type)
            assert sdvg["inputs"]["kv_dtype"] == logic.card_settings(card, role)["kv_dtype"], role
            loader = api[sdvg["inputs"]["model"][0]]  # the LoRA nodes ship bypassed: not in the API copy
            if role == "drafter":
                assert loader["inputs"] == {"unet_name": "self_forcing_dmd_comfy.safetensors", "weight_dtype": "default"}
            elif path.stem == "sdvg_native_gguf":
                assert loader["class_type"] == "UnetLoaderGGUF" and loader["inputs"]["unet_name"].endswith("Q8_0.gguf")
            else:  # the plan's fp8 target, as Load Diffusion Model stores it
                assert logic.card_settings(card, role)["dtype"] == "fp8"
                assert loader["inputs"] == {"unet_name": "krea-realtime-video-14b.safetensors", "weight_dtype": "fp8_e4m3fn"}
        return
    for role, class_type in (("drafter", "SDVGLoadDrafter"), ("target", "SDVGLoadTarget")):
        inputs = next(n["inputs"] for n in api.values() if n["class_type"] == class_type)
        assert inputs["card"] == card
        chosen = logic.card_settings(card, role)
        shown = {k: inputs[k] for k in chosen}
        assert shown == chosen, (role, shown, chosen)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_workflows_ship_their_lora_nodes_bypassed(name):
    """A first run needs no LoRA file: each LoRA node sits between its loader and the SDVG node, bypassed (mode 4),
    and the export leaves it out and wires the loader straight through."""
    wf = load(ROOT / "workflows" / f"{name}.json")
    loras = [n for n in wf["nodes"] if n["type"] == "LoraLoaderModelOnly"]
    assert len(loras) == 2 and all(n.get("mode") == 4 for n in loras)
    api = ui_to_api(wf)
    assert "LoraLoaderModelOnly" not in {n["class_type"] for n in api.values()}
    for class_type in ("SDVGDrafterFromModel", "SDVGTargetFromModel"):
        sdvg = next(n for n in api.values() if n["class_type"] == class_type)
        assert api[sdvg["inputs"]["model"][0]]["class_type"] in ("UNETLoader", "UnetLoaderGGUF")


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_workflows_explain_themselves(path):
    wf = load(path)
    notes = [n for n in wf["nodes"] if n["type"] == "Note"]
    text = "\n".join(n["widgets_values"][0] for n in notes)
    assert len(notes) >= 2 and wf["groups"]
    assert "fix" in text.lower() and "seed" in text.lower()  # fix the seed while tuning tau
    assert "OUTPUTS SHOW" in text or path.stem == "sdvg_compare_vs_target" or "score plot" in text
    if path.stem != "sdvg_prompt_embeddings":
        assert CARD_OF[path.stem] in text and "models/diffusion_models" in text
    # every model file the workflow loads has a download entry on its loader
    loaded = {n["widgets_values"][0]: n for n in wf["nodes"]
              if n["type"] in ("CLIPLoader", "VAELoader", "SDVGLoadDrafter", "SDVGLoadTarget", "SDVGRewardRouter")}
    for name, node in loaded.items():
        assert [m["name"] for m in node["properties"]["models"]] == [name]
    # every sampler's seed is fixed (replay while tuning tau)
    for node in wf["nodes"]:
        if node["type"] == "SDVGSpeculativeSampler":
            assert node["widgets_values"][5] == "fixed"


def test_tooltips_are_short_and_link_their_details():
    """One or two sentences per tooltip (the rest lives in docs/nodes.md, which the tooltip names with an anchor that
    exists there); the seed's says to fix it for tau tuning."""
    docs = (ROOT / "docs" / "nodes.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
               for line in docs.splitlines() if line.startswith("## ")}
    for spec in schema.NODES:
        for i in spec.inputs:
            core = i.tooltip.replace(schema._ADVANCED_WINS, "").split(" Details: ")[0]
            assert len(re.findall(r"[.!?](?:\s|$)", core)) <= 2 and len(core) <= 260, (spec.node_id, i.name, core)
            if i.details:
                link = re.search(r"Details: docs/nodes\.md#([a-z0-9-]+)\.", i.tooltip)
                assert link and link.group(1) in anchors, (spec.node_id, i.name)
    seed = schema.SAMPLER.input("seed").tooltip
    assert "fixed" in seed and "tau" in seed
