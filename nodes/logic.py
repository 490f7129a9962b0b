"""Everything the SDVG nodes do, as plain functions that never import ComfyUI, and :func:`run_node`, the body of every
node's ``execute``.

The V3 node classes (``comfy_nodes.py``) only translate between ComfyUI and these functions, passing a
:class:`~nodes.services.Services` object that provides ComfyUI's memory manager, progress bar, interrupt check and
model folders. The work lives in one module per thing it serves:

============================  ===================================================================================
``services.py``               the host's services (devices, memory manager, progress, interrupt, model folders)
``loaders.py``                SDVG Load Drafter / Target, Reward Router, Load Prompt Embeddings; the VAE conversion
``comfy_model.py``            SDVG Drafter / Target from MODEL: a ComfyUI MODEL as the engine's causal DiT
``sampler.py``                SDVG Speculative Sampler and Advanced Options; replay across executions
``prompt_schedule.py``        SDVG Prompt Schedule / SDVG Prompt Switch: the prompts a video switches to
============================  ===================================================================================

This module re-exports their public names (``logic.run_sampler``, ``logic.Services``, ...), as scripts and tests use
them.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import schema
from .comfy_model import load_model_from_comfy
from .loaders import (SDVGModel, SDVGRouter, build_router, card_settings, clear_reward_cache,
                      context_from_conditioning, load_embeddings_node, load_model_node, load_prompt_embedding,
                      load_reward_scorer, load_sdvg_model, reward_dtype, streaming_vae)
from .prompt_schedule import SDVGSchedule, schedule_node, start_frame_problem, switch_node
from .sampler import (FPS, PREVIEW_MAX_PX, REPLAY_MEMO, SamplerOutput, advanced_options_node, advanced_values,
                      check_comfy_models, check_drafter_not_larger, clear_replay_memo, effective_schedule_veto,
                      frame_to_pil, geometry_problem, needed_inputs, replay_memo_for, run_memory_required, run_sampler,
                      sampler_summary, score_plot)
from .services import Services, check_model_name, combo_options, resolve_devices


# ============================================================================================================ nodes
@dataclass
class NodeResult:
    """What a node's ``execute`` returns: its outputs in schema order, and the text its UI shows (or ``None``)."""

    outputs: tuple
    ui_text: str | None = None


def _sampler_node(services: Services, **inputs) -> NodeResult:
    out = run_sampler(services=services, **inputs)
    return NodeResult((out.frames, out.mask, out.latent, out.fps, out.report, out.plot), sampler_summary(out.report))


def _embeddings_node(services: Services, **inputs) -> NodeResult:
    return NodeResult(load_embeddings_node(services=services, **inputs))


_NODE_FUNCTIONS = {
    "SDVGLoadDrafter": lambda services, **kw: NodeResult((load_model_node(role="drafter", services=services, **kw),)),
    "SDVGLoadTarget": lambda services, **kw: NodeResult((load_model_node(role="target", services=services, **kw),)),
    "SDVGRewardRouter": lambda services, **kw: NodeResult((build_router(services=services, **kw),)),
    "SDVGSpeculativeSampler": _sampler_node,
    "SDVGLoadPromptEmbeddings": _embeddings_node,
    "SDVGAdvancedOptions": lambda services, **kw: NodeResult((advanced_options_node(**kw),)),
    "SDVGDrafterFromModel": lambda services, **kw: NodeResult((load_model_from_comfy(role="drafter", services=services,
                                                                                     **kw),)),
    "SDVGTargetFromModel": lambda services, **kw: NodeResult((load_model_from_comfy(role="target", services=services,
                                                                                    **kw),)),
    "SDVGPromptSchedule": lambda services, **kw: NodeResult((schedule_node(**kw),)),
    "SDVGPromptSwitch": lambda services, **kw: NodeResult((switch_node(**kw),)),
}


def run_node(node_id: str, services: Services, **inputs) -> NodeResult:
    """The body of every SDVG node's ``execute``: node ``node_id`` run on ``inputs`` (input name -> value).

    Optional inputs a workflow saved before they existed are absent; they take the schema's default here, so the
    V3 classes, the tests' executor and scripts all run one code path with one set of defaults."""
    spec = schema.BY_ID.get(node_id)
    if spec is None:
        raise ValueError(f"unknown SDVG node {node_id!r}; known: {sorted(schema.BY_ID)}")
    names = {i.name for i in spec.inputs}
    unknown = sorted(set(inputs) - names)
    if unknown:
        raise TypeError(f"{node_id} has no input(s) {unknown}; its inputs are {[i.name for i in spec.inputs]}")
    values = {i.name: i.default for i in spec.inputs if i.optional or i.lazy}
    values.update(inputs)
    missing = [i.name for i in spec.inputs if i.name not in values]
    if missing:
        raise TypeError(f"{node_id} is missing the required input(s) {missing}")
    return _NODE_FUNCTIONS[node_id](services, **values)


__all__ = [
    "FPS", "NodeResult", "PREVIEW_MAX_PX", "REPLAY_MEMO", "SDVGModel", "SDVGRouter", "SDVGSchedule", "SamplerOutput",
    "Services",
    "advanced_options_node", "advanced_values", "build_router", "card_settings", "check_comfy_models",
    "check_drafter_not_larger", "check_model_name", "clear_replay_memo", "clear_reward_cache", "combo_options",
    "context_from_conditioning", "effective_schedule_veto", "frame_to_pil", "geometry_problem",
    "load_embeddings_node", "load_model_from_comfy", "load_model_node", "load_prompt_embedding", "load_reward_scorer",
    "load_sdvg_model", "needed_inputs", "replay_memo_for", "resolve_devices", "reward_dtype", "run_memory_required",
    "run_node", "run_sampler", "sampler_summary", "schedule_node", "score_plot", "start_frame_problem",
    "streaming_vae", "switch_node",
]
