"""ComfyUI V3 node classes of SDVG: thin wrappers built from ``schema`` around ``logic``.

Only this module, the pack's root ``__init__.py`` and the functions of ``comfy_model`` that adapt a MODEL (lazily,
when they run) import ComfyUI. Registration is through ``comfy_entrypoint`` alone (a module-level
NODE_CLASS_MAPPINGS would make ComfyUI skip it).
"""

from __future__ import annotations

import math

import comfy.model_management as model_management
import comfy.model_patcher
import comfy.utils
import folder_paths

try:  # a pinned API version where this ComfyUI has one (its io/ui stay stable), else the moving "latest"
    from comfy_api.v0_0_3 import ComfyExtension, io, ui
except ImportError:
    try:
        from comfy_api.v0_0_2 import ComfyExtension, io, ui
    except ImportError:
        from comfy_api.latest import ComfyExtension, io, ui

from . import compat, logic, sampler, schema, services

MODEL_FOLDERS = compat.MODEL_FOLDERS


def register_model_folders() -> None:
    """Register models/sdvg, models/sdvg_reward, models/image_reward and models/sdvg_embeddings
    (extra_model_paths.yaml entries with these names are kept and extended)."""
    compat.register_folders_in(folder_paths, MODEL_FOLDERS)


class WholeModulePatcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's patcher for the pack's own models (file loaders, the converted VAE, ImageReward): plain torch modules
    that ComfyUI cannot stream. Its low-VRAM mode casts weights per call only inside ComfyUI's ops
    (``comfy_cast_weights``); a plain ``nn.Linear`` left on the offload device by a partial load would meet its input
    on another device. So these load whole and, when ComfyUI needs room, unload whole (never half), while the MODEL
    patchers of the same run load partially where VRAM is short, all in one ``load_models_gpu`` call. (The loaders'
    offload='blocks' streams the pack's own blocks instead.)"""

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        return super().load(device_to, lowvram_model_memory, force_patch_weights, True, **kwargs)

    def partially_unload(self, *args, **kwargs):
        return 0  # nothing freed: ComfyUI then unloads the whole model (model_unload -> detach)


def unload_copies_with_other_patches(patchers) -> list:
    """Unload, with their patches taken out of the weights, the loaded copies (clones) of a run's MODELs that carry
    other patches (another LoRA or strength); returns them.

    ComfyUI 0.3.64 takes such a copy's patches out itself when the run's copy loads. The LTS fork 0.12.1 keeps the
    record of which patches are in the shared weights per copy (``ModelPatcher.clone`` copies
    ``_memory_measurements``), so a copy loaded after another one ran on the other's LoRA (a stale LoRA).
    Unloading the other copy first restores the base weights from the backup the copies share, in both versions."""
    unloaded = []
    for loaded in list(model_management.current_loaded_models):
        other = loaded.model
        if other is None or any(other is p for p in patchers):
            continue
        if any(p.is_clone(other) and p.patches_uuid != other.patches_uuid for p in patchers
               if hasattr(p, "patches_uuid")):
            loaded.model_unload()  # unpatch_weights=True: back to the base weights
            model_management.current_loaded_models.remove(loaded)
            unloaded.append(other)
    return unloaded


#: ``load_models_gpu`` first frees 1.1 x the weights its models still have to bring to their device, beside the room
#: (0.3.64, the LTS fork 0.12.1 and 0.33.0 alike).
FREE_FACTOR = 1.1


def weights_to_load(patcher, device) -> int:
    """Bytes of ``patcher``'s weights that loading it on ``device`` still brings there: ComfyUI's own measure
    (``LoadedModel.model_memory_required``: the offloaded part of a model loaded there, else all of it)."""
    return int(model_management.LoadedModel(patcher).model_memory_required(device))


def load_in_priority_order(patchers, memory_required: int = 0) -> None:
    """Load ``patchers`` (first = most important) so that each keeps what it needs before a later one is sized:
    one ``load_models_gpu`` call per patcher, the last one first, each reserving ``memory_required`` (the room the
    run allocates beside the weights) plus 1.1 x the weights of the patchers before it on its device.

    Why (docs/dev/memory.md, "Load order in ComfyUI"): in one call ComfyUI sizes each model's partial load in the
    order it iterates the call's models (a ``set`` in 0.3.64 and the LTS fork, which changes from start to start; the
    list reversed in 0.33.0) as "everything free but the room": the first MODEL takes the card, the next one gets
    ComfyUI's minimum, and a model loaded whole (the pack's own) takes its weights out of the room. And every call
    first frees 1.1 x its model's missing weights beside the room, taking the model itself off ComfyUI's list of
    loaded models first: for a model that does not fit whole beside the room (the target) that unloads every other
    model on the device, earlier calls' models included. So the target loads first and the others after it, into
    what it left.

    The reservation counts the whole weights of the models before it, unless the model loaded is on the device in
    full already (a call for it then frees no more than the room, and what the others still miss is reserved). Where
    ComfyUI's floor gives the first model more than asked (``MIN_WEIGHT_MEMORY_RATIO`` 0.4 off NVIDIA), the next
    call frees the shortfall from the most offloaded model first: the target."""
    order = list(dict.fromkeys(patchers))
    for k in range(len(order) - 1, -1, -1):
        patcher = order[k]
        device = patcher.load_device
        in_full = weights_to_load(patcher, device) == 0
        ahead = sum(weights_to_load(p, device) if in_full else int(model_management.LoadedModel(p).model_memory())
                    for p in order[:k] if p.load_device == device)
        room = int(memory_required) + math.ceil(FREE_FACTOR * ahead)
        model_management.load_models_gpu([patcher], memory_required=room, force_full_load=False)


class ComfyServices(services.Services):
    """ComfyUI's memory manager, progress bar, interrupt flag and model folders for ``logic``."""

    def __init__(self, node_id: str | None = None):
        super().__init__()
        self.node_id = node_id
        self._bar = None

    def main_device(self):
        return model_management.get_torch_device()

    def offload_device(self):
        return model_management.unet_offload_device()

    def intermediate_device(self):
        return model_management.intermediate_device()

    def wrap(self, holder, load_device, offload_device):
        return WholeModulePatcher(holder, load_device=load_device, offload_device=offload_device)

    def load(self, patchers):
        self.load_run(patchers)

    def load_run(self, patchers, memory_required=0):
        # patchers in load priority (run_sampler: the VAE and the reward, loaded whole, then the drafter, then the
        # target, which gets what is left). Partial loads are allowed: the MODEL patchers (ComfyUI's own modules)
        # stream what does not fit; the pack's own WholeModulePatchers load whole. memory_required reserves the KV
        # caches, VAE state and activations ComfyUI cannot see; the weights of the models before each one are
        # reserved on top (load_in_priority_order).
        unload_copies_with_other_patches(patchers)
        load_in_priority_order(patchers, int(memory_required))

    def check_interrupt(self):
        model_management.throw_exception_if_processing_interrupted()

    def activity(self, text):
        # ComfyUI >= 0.3.7x labels a running node ("drafting block 3/7"); 0.3.64 has no such call.
        try:
            from comfy_execution.progress import get_progress_state
        except ImportError:
            return
        registry = get_progress_state()
        if self.node_id is not None and hasattr(registry, "set_activity"):
            registry.set_activity(self.node_id, text)

    def progress(self, value, total, preview=None):
        if self._bar is None:
            self._bar = comfy.utils.ProgressBar(total, node_id=self.node_id)
        self._bar.update_absolute(value, total, ("JPEG", preview, sampler.PREVIEW_MAX_PX) if preview is not None else None)

    def list_files(self, folders):
        names = []
        for folder in folders:
            if folder in folder_paths.folder_names_and_paths:
                names += folder_paths.get_filename_list(folder)
        return sorted(dict.fromkeys(names))

    def resolve(self, folders, name):
        for folder in folders:
            if folder in folder_paths.folder_names_and_paths:
                path = folder_paths.get_full_path(folder, name)
                if path is not None:
                    return path
        raise FileNotFoundError(f"model file {name!r} not found in {list(folders)} "
                                f"(ComfyUI models/ folders or extra_model_paths.yaml)")


# ------------------------------------------------------------------------------------------------- schema building
_CUSTOM = {name: io.Custom(name) for name in (schema.SDVG_MODEL, schema.SDVG_ROUTER, schema.SDVG_OPTIONS,
                                              schema.SDVG_PROMPT_SCHEDULE)}
_SOCKETS = {"CONDITIONING": io.Conditioning, "CLIP": io.Clip, "VAE": io.Vae, "IMAGE": io.Image, "MASK": io.Mask,
            "LATENT": io.Latent, "FLOAT": io.Float, "STRING": io.String, schema.MODEL: io.Model, **_CUSTOM}


def _input(spec: schema.InputSpec):
    made = _make_input(spec)
    if spec.advanced and isinstance(getattr(made, "extra_dict", None), dict):
        # Sent in /object_info as the input's "advanced" option: frontends that know it (1.3x+) fold the widget under
        # the node's advanced toggle; older ones ignore it. Its place in widgets_values is unchanged.
        made.extra_dict["advanced"] = True
    return made


def _make_input(spec: schema.InputSpec):
    common = dict(optional=spec.optional, tooltip=spec.tooltip, lazy=spec.lazy or None)
    if spec.type == "INT":
        return io.Int.Input(spec.name, default=spec.default, min=spec.min, max=spec.max, step=spec.step,
                            control_after_generate=spec.control_after_generate or None, **common)
    if spec.type == "FLOAT":
        return io.Float.Input(spec.name, default=spec.default, min=spec.min, max=spec.max, step=spec.step,
                              round=spec.round, display_mode=io.NumberDisplay.slider if spec.slider else None, **common)
    if spec.type == "STRING":
        return io.String.Input(spec.name, default=spec.default, multiline=spec.multiline, **common)
    if spec.type == "BOOLEAN":
        return io.Boolean.Input(spec.name, default=spec.default, **common)
    if spec.type == "COMBO":
        options = logic.combo_options(spec, ComfyServices())
        default = spec.default if spec.default in options else None
        return io.Combo.Input(spec.name, options=options, default=default, **common)
    return _SOCKETS[spec.type].Input(spec.name, **common)


def build_schema(spec: schema.NodeSpec, hidden=None) -> io.Schema:
    return io.Schema(
        node_id=spec.node_id, display_name=spec.display_name, category=spec.category, description=spec.description,
        inputs=[_input(i) for i in spec.inputs],
        outputs=[_SOCKETS[o.type].Output(o.name, display_name=o.name, tooltip=o.tooltip) for o in spec.outputs],
        hidden=hidden, is_output_node=spec.is_output_node,
    )


# ------------------------------------------------------------------------------------------------------------ nodes
def _output(result: logic.NodeResult) -> io.NodeOutput:
    if result.ui_text is None:
        return io.NodeOutput(*result.outputs)
    return io.NodeOutput(*result.outputs, ui=ui.PreviewText(result.ui_text))


class SDVGLoadDrafter(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.LOAD_DRAFTER)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGLoadDrafter", ComfyServices(), **inputs))


class SDVGLoadTarget(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.LOAD_TARGET)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGLoadTarget", ComfyServices(), **inputs))


class SDVGRewardRouter(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.REWARD_ROUTER)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGRewardRouter", ComfyServices(), **inputs))


class SDVGSpeculativeSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.SAMPLER, hidden=[io.Hidden.unique_id])

    @classmethod
    def check_lazy_status(cls, mode, drafter=None, target=None, router=None, schedule_veto=False,
                          advanced_options=None, **_):
        return logic.needed_inputs(mode, drafter, target, router,
                                   logic.effective_schedule_veto(schedule_veto, advanced_options))

    @classmethod
    def validate_inputs(cls, length):
        # Only length: ComfyUI then still range-checks width/height itself (multiples of 16 are checked at run time),
        # and a bad length gives one error at queue time instead of one per validated input.
        return logic.geometry_problem(None, None, length) or True

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        return _output(logic.run_node("SDVGSpeculativeSampler", ComfyServices(node_id), **inputs))


class SDVGLoadPromptEmbeddings(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.LOAD_PROMPT_EMBEDDINGS)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGLoadPromptEmbeddings", ComfyServices(), **inputs))


class SDVGAdvancedOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.ADVANCED_OPTIONS)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGAdvancedOptions", ComfyServices(), **inputs))


class SDVGDrafterFromModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.DRAFTER_FROM_MODEL)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGDrafterFromModel", ComfyServices(), **inputs))


class SDVGTargetFromModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.TARGET_FROM_MODEL)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGTargetFromModel", ComfyServices(), **inputs))


class SDVGPromptSchedule(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.PROMPT_SCHEDULE)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGPromptSchedule", ComfyServices(), **inputs))


class SDVGPromptSwitch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return build_schema(schema.PROMPT_SWITCH)

    @classmethod
    def validate_inputs(cls, start_frame):
        # Ours instead of ComfyUI's range check: frame 0 and frames between block starts get a message with the fix
        # (the sampler checks the frame against its length).
        return logic.start_frame_problem(start_frame) or True

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return _output(logic.run_node("SDVGPromptSwitch", ComfyServices(), **inputs))


NODE_CLASSES = [SDVGLoadDrafter, SDVGLoadTarget, SDVGRewardRouter, SDVGSpeculativeSampler, SDVGLoadPromptEmbeddings,
                SDVGAdvancedOptions, SDVGDrafterFromModel, SDVGTargetFromModel, SDVGPromptSchedule, SDVGPromptSwitch]
assert [c.__name__ for c in NODE_CLASSES] == [s.node_id for s in schema.NODES]


class SDVGExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODE_CLASSES)


async def comfy_entrypoint() -> SDVGExtension:
    register_model_folders()
    return SDVGExtension()
