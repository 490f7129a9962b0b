"""Checks of ComfyUI workflow files against node schemas.

Without ComfyUI (``tests/test_workflows.py``): our nodes' schemas come from ``nodes.schema`` (what the V3 classes are
built from), and the core nodes the shipped workflows use get a minimal hand-written schema here, copied from
ComfyUI's source (Comfy-Org/ComfyUI a125cd84, v0.3.64: nodes.py, comfy_extras/nodes_video.py, nodes_images.py,
nodes_mask.py, nodes_preview_any.py), with ComfyUI-GGUF's loader (city96/ComfyUI-GGUF nodes.py) for the GGUF workflow.

Against a real server (``tests/test_comfyui_e2e.py``): :func:`live_specs` reads every node's schema from the server's
``/object_info`` instead (core nodes change between ComfyUI versions: 0.33.0's CreateVideo has an optional
``bit_depth``, its SaveVideo a nested ``format`` combo and outputs), and the same checks run with ``specs=`` those:
widget values against the live options (the model files the server lists), ranges and types.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nodes import schema  # noqa: E402
from nodes.schema import InputSpec as I, NodeSpec, OutputSpec as O  # noqa: E402

MODEL_EXTENSIONS = (".ckpt", ".pt", ".pt2", ".bin", ".pth", ".safetensors", ".pkl", ".sft", ".gguf")
CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")


def _core(node_id, inputs, outputs=(), output_node=False) -> NodeSpec:
    return NodeSpec(node_id=node_id, display_name=node_id, description="", inputs=tuple(inputs),
                    outputs=tuple(O(t, t, "") for t in outputs), category="core", is_output_node=output_node)


CORE = {s.node_id: s for s in (
    _core("CLIPLoader", [I("clip_name", "COMBO", "", options_from=("files", "text_encoders")),
                         I("type", "COMBO", "", options=("stable_diffusion", "wan")),  # a subset: "wan" is what we use
                         I("device", "COMBO", "", options=("default", "cpu"), optional=True)], ["CLIP"]),
    _core("CLIPTextEncode", [I("text", "STRING", "", multiline=True), I("clip", "CLIP", "")], ["CONDITIONING"]),
    _core("VAELoader", [I("vae_name", "COMBO", "", options_from=("files", "vae"))], ["VAE"]),
    _core("CreateVideo", [I("images", "IMAGE", ""), I("fps", "FLOAT", "", default=30.0, min=1.0, max=120.0, step=1.0),
                          I("audio", "AUDIO", "", optional=True)], ["VIDEO"]),
    _core("SaveVideo", [I("video", "VIDEO", ""), I("filename_prefix", "STRING", "", default="video/ComfyUI"),
                        I("format", "COMBO", "", options=("auto", "mp4"), default="auto"),
                        I("codec", "COMBO", "", options=("auto", "h264"), default="auto")], output_node=True),
    _core("SaveAnimatedWEBP", [I("images", "IMAGE", ""), I("filename_prefix", "STRING", "", default="ComfyUI"),
                               I("fps", "FLOAT", "", default=6.0, min=0.01, max=1000.0, step=0.01),
                               I("lossless", "BOOLEAN", "", default=True),
                               I("quality", "INT", "", default=80, min=0, max=100),
                               I("method", "COMBO", "", options=("default", "fastest", "slowest"))], output_node=True),
    _core("MaskToImage", [I("mask", "MASK", "")], ["IMAGE"]),
    _core("SaveImage", [I("images", "IMAGE", ""), I("filename_prefix", "STRING", "", default="ComfyUI")], output_node=True),
    _core("PreviewAny", [I("source", "*", "")], output_node=True),
    # comfy_extras/nodes_primitive.py (StringMultiline): one text typed once, linked to CLIPTextEncode and the sampler.
    _core("PrimitiveStringMultiline", [I("value", "STRING", "", multiline=True)], ["STRING"]),
    # nodes.py: Load Diffusion Model and the model-only LoRA loader (the ComfyUI-native workflows)
    _core("UNETLoader", [I("unet_name", "COMBO", "", options_from=("files", "diffusion_models")),
                         I("weight_dtype", "COMBO", "", options=("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"))],
          ["MODEL"]),
    _core("LoraLoaderModelOnly", [I("model", "MODEL", ""), I("lora_name", "COMBO", "", options_from=("files", "loras")),
                                  I("strength_model", "FLOAT", "", default=1.0, min=-100.0, max=100.0, step=0.01)],
          ["MODEL"]),
)}
#: Custom nodes of other packs that a shipped workflow uses (the server has them only where that pack is installed).
OTHER_PACKS = {s.node_id: s for s in (
    _core("UnetLoaderGGUF", [I("unet_name", "COMBO", "", options_from=("files", "unet_gguf"))], ["MODEL"]),
)}

SPECS: dict[str, NodeSpec] = {**CORE, **OTHER_PACKS, **schema.BY_ID}
#: Nodes of the frontend alone (no server class, never in an API prompt): the shipped workflows' notes.
FRONTEND_ONLY = ("Note", "MarkdownNote")


def spec_of(class_type: str, specs: dict | None = None) -> NodeSpec:
    specs = SPECS if specs is None else specs
    if class_type not in specs:
        raise AssertionError(f"unknown node type {class_type!r}: not an SDVG node nor a core node the tests know"
                             if specs is SPECS else f"unknown node type {class_type!r}: the server has no such node")
    return specs[class_type]


# ------------------------------------------------------------------------------------------ live schemas (a server's)
#: V3's combo whose chosen option adds inputs of its own (0.33.0's SaveVideo ``format``); saved in ``widgets_values``
#: as its key followed by the values of the inputs the key adds, in API prompts as ``parent.child`` keys.
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"


@dataclasses.dataclass(frozen=True)
class LiveInput(I):
    """An input as a server's ``/object_info`` describes it (more kinds than ``nodes.schema`` has)."""

    #: ``forceInput``: a widget type shown as a socket
    socket: bool = False
    #: V3 ``hidden``: accepted in API prompts (old names kept for compatibility), no widget in the UI
    hidden: bool = False
    #: a DynamicCombo's options: ``((key, (LiveInput, ...)), ...)``, the inputs each key adds
    nested: tuple = ()

    @property
    def is_widget(self) -> bool:
        return not (self.socket or self.hidden) and (self.type in schema.WIDGET_TYPES or self.type == DYNAMIC_COMBO)


@dataclasses.dataclass(frozen=True)
class LiveNodeSpec(NodeSpec):
    """A node as a server describes it. A workflow saved by an older ComfyUI may list fewer outputs than the server
    has now (0.33.0's SaveImage and SaveVideo gained outputs): the saved ones must be the first of the live ones."""


def _live_inputs(section: dict, order: list, optional: bool) -> list[LiveInput]:
    inputs = []
    for name in order:
        entry = section[name]
        kind, opts = entry[0], (entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {})
        options, nested = (), ()
        if isinstance(kind, list):  # V1 combo: the options are the type
            kind, options = "COMBO", tuple(kind)
        elif kind == "COMBO":
            options = tuple(opts.get("options", ()))
        elif kind == DYNAMIC_COMBO:
            nested = tuple((o["key"], tuple(
                _live_inputs(o["inputs"].get("required", {}), list(o["inputs"].get("required", {})), False)
                + _live_inputs(o["inputs"].get("optional", {}), list(o["inputs"].get("optional", {})), True)))
                for o in opts["options"])
            options = tuple(key for key, _ in nested)
        inputs.append(LiveInput(
            name=name, type=kind, tooltip=opts.get("tooltip", ""), default=opts.get("default"), min=opts.get("min"),
            max=opts.get("max"), step=opts.get("step"), options=options, multiline=bool(opts.get("multiline")),
            control_after_generate=bool(opts.get("control_after_generate")), optional=optional,
            lazy=bool(opts.get("lazy")), advanced=bool(opts.get("advanced")), socket=bool(opts.get("forceInput")),
            hidden=bool(opts.get("hidden")), nested=nested))
    return inputs


def live_spec(node_id: str, info: dict) -> LiveNodeSpec:
    """One node's schema from a server's ``/object_info`` entry: inputs in the server's ``input_order`` (required, then
    optional; hidden ones such as PROMPT left out), combo options as the server lists them (model files included)."""
    order, section = info.get("input_order", {}), info.get("input", {})
    inputs = (_live_inputs(section.get("required", {}), order.get("required", []), False)
              + _live_inputs(section.get("optional", {}), order.get("optional", []), True))
    names = info.get("output_name") or info["output"]
    return LiveNodeSpec(node_id=node_id, display_name=info.get("display_name", node_id),
                        description=info.get("description", ""), inputs=tuple(inputs),
                        outputs=tuple(O(n, t, "") for n, t in zip(names, info["output"])),
                        category=info.get("category", ""), is_output_node=bool(info.get("output_node")))


def live_specs(object_info: dict) -> dict[str, LiveNodeSpec]:
    """Every node of a server (``GET /object_info``) as a schema the checks below take (``specs=``)."""
    return {node_id: live_spec(node_id, info) for node_id, info in object_info.items()}


def _widgets_for(spec: NodeSpec, values: list) -> list:
    """The widgets a node shows for its saved ``values``, in ``widgets_values`` order: a DynamicCombo is followed by
    the widgets its chosen key adds (named ``parent.child``, as API prompts name them); otherwise the spec's widgets."""
    out, k = [], 0

    def walk(widgets, prefix):
        nonlocal k
        for w in widgets:
            value = values[k] if k < len(values) else None
            out.append(dataclasses.replace(w, name=prefix + w.name) if prefix else w)
            k += w.widget_values
            if getattr(w, "nested", ()):
                walk([c for c in dict(w.nested).get(value, ()) if c.is_widget], f"{prefix}{w.name}.")

    walk(spec.widgets, "")
    return out


def api_inputs(spec: NodeSpec, inputs: dict) -> list:
    """The inputs an API prompt may give a node: the spec's, and the ``parent.child`` inputs its DynamicCombo values
    add (optional here: 0.33.0 runs a SaveVideo whose API prompt gives ``format`` without ``format.codec``)."""
    out = list(spec.inputs)

    def walk(inputs_of, prefix):
        for i in inputs_of:
            if getattr(i, "nested", ()) and isinstance(inputs.get(prefix + i.name), str):
                chosen = dict(i.nested).get(inputs[prefix + i.name], ())
                out.extend(dataclasses.replace(c, name=f"{prefix}{i.name}.{c.name}", optional=True) for c in chosen)
                walk(chosen, f"{prefix}{i.name}.")

    walk(spec.inputs, "")
    return out


def types_match(out_type: str, in_type: str) -> bool:
    if "*" in (out_type, in_type):
        return True
    return bool(set(out_type.split(",")) & set(in_type.split(",")))


def value_problem(spec: I, value) -> str | None:
    """Why ``value`` is not valid for widget ``spec`` (what ComfyUI's server validation checks, plus our own)."""
    where = f"{spec.name}={value!r}"
    if spec.type == "INT":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{where}: not an int"
    elif spec.type == "FLOAT":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{where}: not a number"
    elif spec.type == "BOOLEAN":
        if not isinstance(value, bool):
            return f"{where}: not a boolean"
    elif spec.type == "STRING":
        if not isinstance(value, str):
            return f"{where}: not a string"
    elif spec.type in ("COMBO", DYNAMIC_COMBO):
        if spec.options or isinstance(spec, LiveInput):  # a server's list is the whole list, even when empty
            if value not in spec.options:
                return f"{where}: not one of {list(spec.options)}"
        elif spec.options_from == (schema.DEVICES,):
            if not (value in ("auto", "cpu") or re.fullmatch(r"cuda:\d+", str(value))):
                return f"{where}: not a device"
        elif not (isinstance(value, str) and value.endswith(MODEL_EXTENSIONS)):
            return f"{where}: not a model file name"
    if spec.type in ("INT", "FLOAT"):
        if spec.min is not None and value < spec.min:
            return f"{where}: below min {spec.min}"
        if spec.max is not None and value > spec.max:
            return f"{where}: above max {spec.max}"
    return None


def node_problems(class_type: str, values: dict) -> list[str]:
    """Cross-widget checks our nodes' ``validate_inputs`` would make (linked values are skipped)."""
    problems = []
    if class_type == "SDVGSpeculativeSampler":
        length = values.get("length")
        if isinstance(length, int) and ((length - 9) % 12 or length < 9):
            problems.append(f"length={length}: not 12n - 3")
        for k in ("width", "height"):
            if isinstance(values.get(k), int) and values[k] % 16:
                problems.append(f"{k}={values[k]}: not a multiple of 16")
        if values.get("mode") == "sdvg" and isinstance(values.get("reward_prompt"), str) and not values["reward_prompt"].strip():
            problems.append("reward_prompt is empty in mode sdvg")
    return problems


# ---------------------------------------------------------------------------------------------------- UI format
def check_ui_workflow(wf: dict, specs: dict | None = None) -> list[str]:
    """All problems of a UI-format (litegraph v0.4) workflow; empty when it is valid. ``specs``: the node schemas to
    check against (default: :data:`SPECS`; a server's: :func:`live_specs`)."""
    specs = SPECS if specs is None else specs
    errors: list[str] = []
    nodes = {n["id"]: n for n in wf["nodes"]}
    if len(nodes) != len(wf["nodes"]):
        errors.append("duplicate node ids")
    links = {}
    for link in wf["links"]:
        if len(link) != 6:
            errors.append(f"link {link}: expected [id, src, src_slot, dst, dst_slot, type]")
            continue
        links[link[0]] = link
    if wf.get("last_link_id", 0) < max(links, default=0) or wf.get("last_node_id", 0) < max(nodes, default=0):
        errors.append("last_node_id / last_link_id smaller than the ids used")

    for node in wf["nodes"]:
        where = f"node {node['id']} ({node['type']})"
        if node["type"] in FRONTEND_ONLY:
            if node.get("inputs") or node.get("outputs") or len(node.get("widgets_values") or []) != 1:
                errors.append(f"{where}: a note has one text widget and no sockets")
            continue
        try:
            spec = spec_of(node["type"], specs)
        except AssertionError as e:
            errors.append(str(e))
            continue
        # widgets_values: positional, one per widget (+1 after a control_after_generate seed).
        values = list(node.get("widgets_values") or [])
        widgets = _widgets_for(spec, values)
        expected = sum(i.widget_values for i in widgets)
        # A workflow saved before optional widgets were appended has fewer values: the frontend assigns
        # widgets_values by position and leaves the missing trailing (optional) widgets at their defaults.
        present = _present_widgets(widgets, len(values))
        if len(values) != expected and present is None:
            errors.append(f"{where}: {len(values)} widgets_values, expected {expected} "
                          f"({[i.name for i in widgets]})")
            continue
        errors_before = len(errors)
        named, k = {}, 0
        for w in present or widgets:
            named[w.name] = values[k]
            k += 1
            if w.control_after_generate:
                if values[k] not in CONTROL_VALUES:
                    errors.append(f"{where}: control_after_generate value {values[k]!r} after {w.name}")
                k += 1
        linked_widgets = {i["name"] for i in node.get("inputs", []) if i.get("widget") and i.get("link") is not None}
        for w in present or widgets:
            if w.name not in linked_widgets and (p := value_problem(w, named[w.name])):
                errors.append(f"{where}: {p}")
        errors += [f"{where}: {p}" for p in node_problems(node["type"], {k: v for k, v in named.items() if k not in linked_widgets})]
        if len(values) != expected and len(errors) > errors_before:
            # Short by whole optional widgets, but the values do not fit: more likely a value went missing.
            errors.append(f"{where}: {len(values)} widgets_values, expected {expected} "
                          f"({[i.name for i in widgets]}; fewer only if trailing optional ones are left out)")
        # Inputs: sockets and linked widgets, with matching names and types.
        by_name = {i.name: i for i in spec.inputs}
        seen = set()
        for slot, inp in enumerate(node.get("inputs", [])):
            ispec = by_name.get(inp["name"])
            if ispec is None:
                errors.append(f"{where}: unknown input {inp['name']!r}")
                continue
            seen.add(inp["name"])
            if ispec.is_widget and not inp.get("widget"):
                errors.append(f"{where}: widget input {inp['name']!r} listed without its 'widget' entry")
            want_type = ispec.type if ispec.type != "COMBO" else "COMBO"
            if inp.get("type") != want_type:
                errors.append(f"{where}: input {inp['name']!r} has type {inp.get('type')!r}, schema says {want_type!r}")
            lid = inp.get("link")
            if lid is not None:
                link = links.get(lid)
                if link is None or link[3] != node["id"] or link[4] != slot:
                    errors.append(f"{where}: input {inp['name']!r} names link {lid} which does not end at slot {slot}")
        sockets = [i["name"] for i in node.get("inputs", []) if i["name"] in by_name and not by_name[i["name"]].is_widget]
        expected_sockets = [i.name for i in sorted(spec.inputs, key=lambda i: i.optional) if not i.is_widget]
        if [n for n in expected_sockets if n in sockets] != sockets:
            errors.append(f"{where}: socket order {sockets}, the frontend's is {expected_sockets} (required, then optional)")
        for ispec in spec.inputs:
            if not ispec.is_widget and not ispec.optional:
                linked = [i for i in node.get("inputs", []) if i["name"] == ispec.name and i.get("link") is not None]
                if not linked:
                    errors.append(f"{where}: required input {ispec.name!r} is not connected")
        # Outputs: the schema's, in order, each listing its links.
        outs = node.get("outputs", [])
        live_outputs = spec.outputs[:len(outs)] if isinstance(spec, LiveNodeSpec) else spec.outputs
        if [(o["name"], o["type"]) for o in outs] != [(o.name, o.type) for o in live_outputs]:
            errors.append(f"{where}: outputs {[(o['name'], o['type']) for o in outs]} != schema "
                          f"{[(o.name, o.type) for o in spec.outputs]}")
        for slot, out in enumerate(outs):
            for lid in out.get("links") or []:
                link = links.get(lid)
                if link is None or link[1] != node["id"] or link[2] != slot:
                    errors.append(f"{where}: output {out['name']!r} lists link {lid} which does not start at slot {slot}")

    for lid, (_, src, src_slot, dst, dst_slot, ltype) in links.items():
        if src not in nodes or dst not in nodes:
            errors.append(f"link {lid}: missing node")
            continue
        try:
            out = spec_of(nodes[src]["type"], specs).outputs[src_slot]
            dst_input = nodes[dst]["inputs"][dst_slot]
            in_spec = spec_of(nodes[dst]["type"], specs).input(dst_input["name"])
        except (IndexError, KeyError, AssertionError) as e:
            errors.append(f"link {lid}: bad slot ({e})")
            continue
        if ltype != out.type:
            errors.append(f"link {lid}: type {ltype!r} but the source output is {out.type!r}")
        if not types_match(out.type, in_spec.type):
            errors.append(f"link {lid}: {nodes[src]['type']}.{out.name} ({out.type}) -> "
                          f"{nodes[dst]['type']}.{in_spec.name} ({in_spec.type})")
        if dst_input.get("link") != lid:
            errors.append(f"link {lid}: the destination input does not name it")
        if lid not in (nodes[src]["outputs"][src_slot].get("links") or []):
            errors.append(f"link {lid}: the source output does not list it")
    if not any(spec_of(n["type"], specs).is_output_node for n in wf["nodes"] if n["type"] in specs):
        errors.append("no output node: ComfyUI would refuse to run it")
    for node in wf["nodes"]:  # ComfyUI templates' model list: what the missing-models dialog offers to download
        for entry in (node.get("properties") or {}).get("models", []):
            if set(entry) != {"name", "url", "directory"} or not entry["url"].startswith("https://huggingface.co/") \
                    or not entry["url"].endswith("/" + entry["name"]):
                errors.append(f"node {node['id']} ({node['type']}): bad properties.models entry {entry}")
            elif entry["name"] not in (node.get("widgets_values") or []):
                errors.append(f"node {node['id']} ({node['type']}): properties.models names {entry['name']!r}, "
                              "which the node does not load")
    return errors


# --------------------------------------------------------------------------------------------------- API format
def check_api_workflow(prompt: dict, specs: dict | None = None) -> list[str]:
    """All problems of an API-format prompt (what POST /prompt takes); empty when it is valid. ``specs`` as in
    :func:`check_ui_workflow`."""
    specs = SPECS if specs is None else specs
    errors: list[str] = []
    for nid, node in prompt.items():
        where = f"node {nid} ({node.get('class_type')})"
        try:
            spec = spec_of(node["class_type"], specs)
        except AssertionError as e:
            errors.append(str(e))
            continue
        inputs = node.get("inputs", {})
        all_inputs = api_inputs(spec, inputs)
        by_name = {i.name: i for i in all_inputs}
        for name in inputs:
            if name not in by_name:
                errors.append(f"{where}: unknown input {name!r}")
        plain = {}
        for ispec in all_inputs:
            if ispec.name not in inputs:
                if not ispec.optional:
                    errors.append(f"{where}: required input {ispec.name!r} missing")
                continue
            value = inputs[ispec.name]
            if isinstance(value, list):  # a link [source id, output slot]
                if len(value) != 2 or str(value[0]) not in prompt:
                    errors.append(f"{where}: {ispec.name} links to a missing node {value}")
                    continue
                src = prompt[str(value[0])]
                try:
                    out = spec_of(src["class_type"], specs).outputs[value[1]]
                except (IndexError, AssertionError) as e:
                    errors.append(f"{where}: {ispec.name} links to a bad output ({e})")
                    continue
                if not types_match(out.type, ispec.type):
                    errors.append(f"{where}: {ispec.name} ({ispec.type}) linked to {src['class_type']}.{out.name} ({out.type})")
            elif not (ispec.is_widget or (getattr(ispec, "hidden", False) and not ispec.socket
                                          and ispec.type in schema.WIDGET_TYPES + (DYNAMIC_COMBO,))):
                errors.append(f"{where}: socket {ispec.name!r} must be a link, got {value!r}")
            else:
                plain[ispec.name] = value
                if p := value_problem(ispec, value):
                    errors.append(f"{where}: {p}")
        errors += [f"{where}: {p}" for p in node_problems(node["class_type"], plain)]
    if not any(spec_of(n["class_type"], specs).is_output_node for n in prompt.values() if n.get("class_type") in specs):
        errors.append("no output node: ComfyUI would refuse to run it")
    return errors


def _present_widgets(widgets, n_values: int):
    """The leading widgets that ``n_values`` saved values cover when only trailing optional widgets are
    missing (an older workflow); None when the count fits no such prefix."""
    k = 0
    for i, w in enumerate(widgets):
        if k == n_values:
            return list(widgets[:i]) if all(x.optional for x in widgets[i:]) else None
        k += w.widget_values
    return list(widgets) if k == n_values else None


#: LiteGraph node modes: 0 always, 2 never (muted: left out), 4 bypass (left out, its inputs passed through)
MUTED, BYPASSED = 2, 4


def ui_to_api(wf: dict, specs: dict | None = None) -> dict:
    """What the frontend's "Export (API)" makes of a UI workflow (links as [src, slot], widgets by name). A bypassed
    node is left out and whatever read its output reads its input of the same type instead (as the frontend does).
    ``specs`` as in :func:`check_ui_workflow`."""
    links = {l[0]: l for l in wf["links"]}
    nodes = {n["id"]: n for n in wf["nodes"]}

    def source(link):  # follow bypassed nodes back to a node that runs: (node id, slot)
        node_id, slot, link_type = link[1], link[2], link[5]
        node = nodes[node_id]
        while node.get("mode") == BYPASSED:
            through = next(i for i in node.get("inputs", []) if i.get("type") == link_type and i.get("link") is not None)
            link = links[through["link"]]
            node_id, slot = link[1], link[2]
            node = nodes[node_id]
        return [str(node_id), slot]

    prompt = {}
    for node in wf["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode") in (MUTED, BYPASSED):
            continue
        spec = spec_of(node["type"], specs)
        values, k, inputs = list(node.get("widgets_values") or []), 0, {}
        widgets = _widgets_for(spec, values)
        for w in _present_widgets(widgets, len(values)) or widgets:
            inputs[w.name] = values[k]
            k += 2 if w.control_after_generate else 1
        for inp in node.get("inputs", []):
            if inp.get("link") is not None:
                inputs[inp["name"]] = source(links[inp["link"]])
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def sized_api_workflow(name: str, width: int, height: int, length: int, **sampler_inputs) -> dict:
    """A shipped API workflow (tests/api_workflows/NAME.json) with the sampler set to a small size (and more inputs)."""
    import json

    prompt = json.loads((ROOT / "tests" / "api_workflows" / f"{name}.json").read_text())
    for node in prompt.values():
        if node["class_type"] == "SDVGSpeculativeSampler":
            node["inputs"].update(width=width, height=height, length=length, **sampler_inputs)
    return prompt


def node_of(prompt: dict, class_type: str) -> str:
    """The id of the (first) node of ``class_type`` in an API prompt."""
    return next(k for k, v in prompt.items() if v["class_type"] == class_type)
