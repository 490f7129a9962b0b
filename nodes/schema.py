"""Static description of every SDVG node: the single source of truth for inputs and outputs.

The ComfyUI V3 classes (``nodes/comfy_nodes.py``) are built from these specs, and the workflow tests
(``tests/test_workflows.py``) read them without ComfyUI installed. Plain data only: importing this
module needs neither ComfyUI nor torch.

Compatibility rules (saved workflows store node ids, input names and *positional* widget values):
never rename a node id or an input, never reorder widgets, and add new inputs only as optional ones
at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATEGORY = "SDVG"

#: Types that ComfyUI shows as widgets (everything else is a socket).
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")

#: Custom socket types of this pack.
SDVG_MODEL = "SDVG_MODEL"
SDVG_ROUTER = "SDVG_ROUTER"

#: Dynamic combo sources, resolved at schema time by the host (ComfyUI: ``folder_paths``).
#: ``files:<folder>[,<folder>...]`` lists model files of those registered folders; ``devices`` lists
#: ``auto``, ``cpu`` and ``cuda:<i>`` for every visible GPU.
DEVICES = "devices"

DRAFTER_FOLDERS = ("diffusion_models", "sdvg")
REWARD_FOLDERS = ("sdvg_reward", "image_reward")
EMBEDDINGS_FOLDERS = ("sdvg_embeddings",)

PRESETS = ("reference", "native")
WORKER_CHOICES = ("auto", "1", "2")
MODES = ("sdvg", "target_only", "draft_only", "first_block_only", "random", "schedule")
CONTEXT_SCHEMES = ("auto", "global_cache", "recompute_window")
DRAFTER_DTYPES = ("bf16", "fp16", "fp32")
TARGET_DTYPES = ("bf16", "fp16", "fp32", "fp8")
MAX_SEED = 0xFFFFFFFFFFFFFFFF
#: Longest video the length widget allows (12n - 3); above 81 frames a recompute-window model is needed.
MAX_LENGTH = 12 * 84 - 3


@dataclass(frozen=True)
class InputSpec:
    """One node input. ``type`` is a ComfyUI type name (``COMBO`` for dropdowns)."""

    name: str
    type: str
    tooltip: str
    default: Any = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    round: float | None = None
    options: tuple = ()
    #: dynamic options: ``("files", folders)`` or ``("devices",)``; see :data:`DEVICES`.
    options_from: tuple = ()
    multiline: bool = False
    slider: bool = False
    control_after_generate: bool = False
    optional: bool = False
    #: evaluated only when the node asks for it (``check_lazy_status``): unused models are never loaded.
    lazy: bool = False

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES

    @property
    def widget_values(self) -> int:
        """Entries this input takes in a UI workflow's ``widgets_values`` (seed's control adds one)."""
        if not self.is_widget:
            return 0
        return 2 if self.control_after_generate else 1


@dataclass(frozen=True)
class OutputSpec:
    name: str
    type: str
    tooltip: str


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    display_name: str
    description: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    category: str = CATEGORY
    is_output_node: bool = False
    #: inputs the node's ``validate_inputs`` checks itself (ComfyUI then skips its own range check for them).
    validated_inputs: tuple[str, ...] = field(default=())

    def input(self, name: str) -> InputSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.node_id} has no input {name!r}")

    @property
    def widgets(self) -> tuple[InputSpec, ...]:
        return tuple(i for i in self.inputs if i.is_widget)


#: the loaders' ``offload`` input (appended, optional): stream the transformer blocks from CPU RAM
OFFLOAD_MODES = ("none", "blocks")
#: the loaders' ``kv_dtype`` input (appended, optional)
KV_DTYPES = ("auto", "fp8")


def _model_loader(node_id: str, display: str, role: str, dtypes: tuple[str, ...], description: str) -> NodeSpec:
    dtype_tip = (
        "Weight dtype. bf16 is the models' native precision; fp16 may overflow; fp32 doubles memory."
        + (" fp8 stores the transformer-block weights in float8 (about half the memory of bf16) and computes in bf16."
           if "fp8" in dtypes else "")
    )
    return NodeSpec(
        node_id=node_id,
        display_name=display,
        description=description,
        inputs=(
            InputSpec("ckpt_name", "COMBO", options_from=("files",) + DRAFTER_FOLDERS,
                      tooltip=f"The causal Wan2.1 {role} checkpoint, from models/diffusion_models (or models/unet) or "
                              "models/sdvg. Self-Forcing .pt, Krea .safetensors, ComfyUI, original Wan and diffusers "
                              "layouts are recognised from the keys."),
            InputSpec("dtype", "COMBO", options=dtypes, default="bf16", tooltip=dtype_tip),
            InputSpec("device", "COMBO", options_from=(DEVICES,), default="auto",
                      tooltip="Where the model runs. auto = ComfyUI's main device; cuda:N puts it on GPU N, so drafter "
                              "and target can sit on different GPUs. Weights wait on the offload device between runs."),
            InputSpec("context_scheme", "COMBO", options=CONTEXT_SCHEMES, default="auto",
                      tooltip="How the model sees earlier frames. auto = what the checkpoint was trained with "
                              "(Self-Forcing 1.3B: global_cache, up to 81 frames; Krea 14B: recompute_window, any "
                              "length). The denoising schedule follows the weights (14B Krea: 5 calls; 1.3B Self-Forcing: 4)."),
            InputSpec("offload", "COMBO", options=OFFLOAD_MODES, default="none", optional=True,
                      tooltip="blocks = keep the transformer blocks in CPU RAM (pinned) and stream them to the GPU one "
                              "block ahead of use, overlapping compute: the 14B fp8 target then needs ~1.5 GB of VRAM "
                              "instead of ~14 GB, at a small slowdown (docs/memory.md). CUDA only. none = all on the GPU."),
            InputSpec("kv_dtype", "COMBO", options=KV_DTYPES, default="auto", optional=True,
                      tooltip="Storage of the attention KV cache. auto = the model's dtype; fp8 = float8 with a scale "
                              "per row, about half the memory (the 14B's 832x480 window: 7.5 -> 4.1 GB), attention still "
                              "in bf16; measured error ~0.6% of the latents (docs/memory.md)."),
        ),
        outputs=(OutputSpec("model", SDVG_MODEL, f"The loaded {role} (shared by runs; never modified by the sampler)."),),
    )


LOAD_DRAFTER = _model_loader(
    "SDVGLoadDrafter", "SDVG Load Drafter", "drafter", DRAFTER_DTYPES,
    "Loads the small causal model that drafts every block (e.g. Self-Forcing Wan2.1 1.3B).",
)

LOAD_TARGET = _model_loader(
    "SDVGLoadTarget", "SDVG Load Target", "target", TARGET_DTYPES,
    "Loads the large causal model that regenerates rejected blocks (e.g. Krea Realtime Wan2.1 14B).",
)

REWARD_ROUTER = NodeSpec(
    node_id="SDVGRewardRouter",
    display_name="SDVG Reward Router",
    description="ImageReward routing: each drafted block is decoded, every frame is scored against the prompt, "
                "and the block is kept when its aggregated score reaches tau. The reward model is loaded once per "
                "file; changing tau only rebuilds this cheap node.",
    inputs=(
        InputSpec("reward_model", "COMBO", options_from=("files",) + REWARD_FOLDERS,
                  tooltip="ImageReward checkpoint (ImageReward.pt from THUDM/ImageReward, or a .safetensors with the "
                          "same keys) from models/sdvg_reward or models/image_reward."),
        InputSpec("tau", "FLOAT", default=-0.7, min=-5.0, max=5.0, step=0.05, round=0.01, slider=True,
                  tooltip="Acceptance threshold on the block score (ImageReward scale, about N(0,1)). Higher = more "
                          "blocks regenerated by the target (better, slower); lower = more drafts kept (faster)."),
        InputSpec("aggregation", "COMBO", options=("min", "mean"), default="min",
                  tooltip="How frame scores make a block score: min (one bad frame rejects the block) or mean."),
        InputSpec("crop", "COMBO", options=("center", "full"), default="center",
                  tooltip="center: ImageReward's own resize + center crop; full: squash the whole frame so the "
                          "borders are scored too."),
        InputSpec("temporal_weight", "FLOAT", default=0.0, min=-10.0, max=10.0, step=0.05, round=0.01,
                  tooltip="Adds this weight x the mean cosine similarity of consecutive frames' features to the "
                          "block score (0 = off). Similarity favours static video; use sparingly."),
        InputSpec("tau_mode", "COMBO", options=("fixed", "accept_rate", "relative", "anchor", "baseline"),
                  default="fixed", optional=True,
                  tooltip="fixed: compare every block with tau. accept_rate: per-block threshold = the "
                          "(1 - accept_rate) quantile of the draft scores seen so far in this video, started from "
                          "a prior N(0.566, 1.071^2) worth 5 blocks, so about accept_rate of the drafts are kept "
                          "(tau is then unused). relative: keep a draft when its score minus the score of the last "
                          "committed block is at least tau (the target's blocks are then scored too). anchor: minus "
                          "block 0's score (the target's, scored once). baseline: minus the mean score of the blocks "
                          "kept so far. The last three remove how much the reward likes the prompt; they need "
                          "force_first_block and no cascade. relative with tau -0.25 is the evidence-based choice "
                          "(held-out scenes, docs/routing.md) and what the shipped workflows use; fixed with tau -0.7 "
                          "is the paper's router and stays this input's default, so saved workflows keep their "
                          "behaviour."),
        InputSpec("accept_rate", "FLOAT", default=0.73, min=0.01, max=0.99, step=0.01, round=0.01, optional=True,
                  tooltip="Target share of drafted blocks to keep when tau_mode is accept_rate (0.72 in the "
                          "reference SDVG server)."),
        InputSpec("preprocess", "COMBO", options=("pil", "torch"), default="pil", optional=True,
                  tooltip="pil: score each frame exactly as ImageReward does (8-bit image, PIL bicubic resize, "
                          "centre crop). torch: faster on-GPU resize of the float frames; scores differ by a few "
                          "thousandths."),
    ),
    outputs=(OutputSpec("router", SDVG_ROUTER, "Routing settings plus the loaded reward model."),),
)

SAMPLER = NodeSpec(
    node_id="SDVGSpeculativeSampler",
    display_name="SDVG Speculative Sampler",
    description="Speculative block-autoregressive video generation: the drafter proposes each 3-latent-frame block, "
                "the router scores its decoded frames, and rejected blocks are regenerated by the target from the "
                "same noise. Outputs decoded frames, the per-frame acceptance mask, latents and a report.",
    inputs=(
        InputSpec("drafter", SDVG_MODEL, lazy=True,
                  tooltip="The drafter from SDVG Load Drafter (not loaded in mode target_only)."),
        InputSpec("target", SDVG_MODEL, lazy=True,
                  tooltip="The target from SDVG Load Target (not loaded in mode draft_only)."),
        InputSpec("router", SDVG_ROUTER, optional=True, lazy=True,
                  tooltip="The reward router from SDVG Reward Router. Needed by mode 'sdvg' only; other modes "
                          "never load the reward model."),
        InputSpec("positive", "CONDITIONING",
                  tooltip="The prompt encoded by Wan2.1's UMT5-XXL: CLIPLoader (type 'wan', umt5_xxl) -> "
                          "CLIPTextEncode, or SDVG Load Prompt Embeddings. Shape [1, >=512, 4096]."),
        InputSpec("vae", "VAE", tooltip="The Wan2.1 VAE (VAELoader, wan_2.1_vae). Converted once to a streaming "
                                        "decoder and cached."),
        InputSpec("reward_prompt", "STRING", default="", multiline=True,
                  tooltip="The prompt TEXT for ImageReward (CONDITIONING carries only embeddings): type the same "
                          "text as the positive prompt, or link SDVG Load Prompt Embeddings' prompt output. "
                          "Required in mode 'sdvg'."),
        InputSpec("width", "INT", default=832, min=16, max=2048, step=16, tooltip="Video width in pixels (multiple of 16)."),
        InputSpec("height", "INT", default=480, min=16, max=2048, step=16, tooltip="Video height in pixels (multiple of 16)."),
        InputSpec("length", "INT", default=81, min=9, max=MAX_LENGTH, step=12,
                  tooltip="Frames, 12n - 3 (9, 21, ..., 81): whole blocks of 3 latent frames. More than 81 needs "
                          "recompute_window models."),
        InputSpec("seed", "INT", default=42, min=0, max=MAX_SEED, control_after_generate=True,
                  tooltip="Noise seed. Block b's noise depends only on (seed, b), so a rejected draft is regenerated "
                          "by the target from exactly the same noise."),
        InputSpec("mode", "COMBO", options=MODES, default="sdvg",
                  tooltip="sdvg: draft, score, keep or regenerate. target_only / draft_only: one model for every "
                          "block (baselines). first_block_only: the target makes block 0, every later draft is kept. "
                          "random: keep drafts with probability random_accept_prob (ablation). schedule: the target "
                          "makes block 0 and every schedule_every-th block, decided before drafting (no reward model, "
                          "the drafter never runs on those blocks)."),
        InputSpec("force_first_block", "BOOLEAN", default=True,
                  tooltip="Let the target generate block 0 without drafting it (it anchors the whole video). "
                          "Ignored by draft_only."),
        InputSpec("refine_from_step", "INT", default=0, min=0, max=8, optional=True,
                  tooltip="Hybrid regeneration: on a rejected draft the target continues from the drafter's state "
                          "after this many steps instead of from pure noise (3 is the reference's best). 0 = off "
                          "(full regeneration)."),
        InputSpec("cascade", "BOOLEAN", default=False, optional=True,
                  tooltip="Score 4 evenly spaced frames first. With min aggregation a partial minimum below tau "
                          "rejects exactly; a partial minimum at least 0.5 above tau accepts early (a heuristic: an "
                          "unscored frame could still be below tau); otherwise all frames are scored. Needs "
                          "temporal_weight 0."),
        InputSpec("random_accept_prob", "FLOAT", default=0.73, min=0.0, max=1.0, step=0.01, round=0.001,
                  optional=True, tooltip="Acceptance probability of mode 'random' (per block, deterministic in the seed)."),
        InputSpec("preset", "COMBO", options=PRESETS, default="reference", optional=True,
                  tooltip="reference: the paper's configuration, both models on Krea's recompute window (context "
                          "rebuilt before every block from an anchor frame + the last 2 latent frames) with the 5-call "
                          "list [1000, 937.5, 833.3, 625, 0]; any length. native: each model as distilled (Self-Forcing "
                          "drafter on its global cache with 4 calls, up to 81 frames). A loader's explicit "
                          "context_scheme wins over the preset."),
        InputSpec("workers", "COMBO", options=WORKER_CHOICES, default="auto", optional=True,
                  tooltip="auto: when the target sits on another GPU than the drafter, VAE and reward (the loaders' "
                          "device inputs), the target regenerates each block while its draft is verified, and decodes "
                          "overlap the next block. 1: strictly one step after another. 2: two CPU threads. Outputs are "
                          "identical in every case; only the time differs."),
        InputSpec("replay", "BOOLEAN", default=True, optional=True,
                  tooltip="Reuse the previous run when only the router's tau settings changed: every block before the "
                          "first decision that flips is taken as it was, so moving tau costs only the tail (identical "
                          "output to a fresh run). Kept in CPU RAM (at most SDVG_REPLAY_GB, default 4), released "
                          "when the models change."),
        InputSpec("schedule_every", "INT", default=3, min=0, max=64, optional=True,
                  tooltip="Mode 'schedule': the target generates block 0 and blocks k, 2k, ... (k = this value), "
                          "decided before drafting; every other block is the drafter's, kept unscored. 0 = only "
                          "block 0 (as first_block_only)."),
        InputSpec("schedule_veto", "BOOLEAN", default=False, optional=True,
                  tooltip="Mode 'schedule': also score each drafted block with the router and let it send the block "
                          "back to the target (e.g. tau_mode relative as a veto). Needs a router."),
    ),
    outputs=(
        OutputSpec("frames", "IMAGE", "Decoded video frames [T, H, W, 3], 0..1."),
        OutputSpec("acceptance", "MASK", "Per-frame acceptance [T, H, W]: 1 where the frame comes from a kept draft, "
                                         "0 where the target generated it."),
        OutputSpec("latent", "LATENT", "The video's Wan2.1 latents {samples: [1, 16, T_lat, H/8, W/8]} in ComfyUI's "
                                       "latent space (VAEDecode-compatible)."),
        OutputSpec("fps", "FLOAT", "Frame rate of Wan2.1 videos (16)."),
        OutputSpec("report", "STRING", "JSON report: settings, per-block decisions and scores, acceptance rates, "
                                       "model calls, timings, estimated speed-up."),
        OutputSpec("score_plot", "IMAGE", "Per-block draft scores against tau (green = kept, red = regenerated, "
                                          "grey = not drafted); the shaded band is the free interval: any tau inside "
                                          "it changes no decision, so the next run replays at once."),
    ),
    validated_inputs=("length",),
)

LOAD_PROMPT_EMBEDDINGS = NodeSpec(
    node_id="SDVGLoadPromptEmbeddings",
    display_name="SDVG Load Prompt Embeddings",
    description="Reads prompt embeddings written by `sdvg encode-prompts`, so a workflow runs without loading the "
                "11 GB UMT5-XXL text encoder.",
    inputs=(
        InputSpec("embeddings_file", "COMBO", options_from=("files",) + EMBEDDINGS_FOLDERS,
                  tooltip="A .safetensors file from `sdvg encode-prompts` in models/sdvg_embeddings."),
        InputSpec("index", "INT", default=0, min=0, max=1_000_000,
                  tooltip="Which prompt of the file (0 = first)."),
    ),
    outputs=(
        OutputSpec("positive", "CONDITIONING", "The prompt's UMT5-XXL context [1, 512, 4096] as CONDITIONING."),
        OutputSpec("prompt", "STRING", "The prompt text stored with it (link it to the sampler's reward_prompt)."),
    ),
)

NODES: tuple[NodeSpec, ...] = (LOAD_DRAFTER, LOAD_TARGET, REWARD_ROUTER, SAMPLER, LOAD_PROMPT_EMBEDDINGS)
BY_ID = {spec.node_id: spec for spec in NODES}


def device_options(cuda_count: int) -> list[str]:
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(cuda_count)]


# ------------------------------------------------------------------------------------------- documentation
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default_and_range(spec: InputSpec) -> str:
    if not spec.is_widget:
        return "optional socket" if spec.optional else "socket"
    parts = []
    if spec.default is not None:
        parts.append(f"default `{spec.default}`" if spec.type != "STRING" or spec.default else "default empty")
    if spec.min is not None or spec.max is not None:
        rng = f"{spec.min:g}..{spec.max:g}" if spec.type == "FLOAT" else f"{spec.min}..{spec.max}"
        parts.append(rng + (f", step {spec.step:g}" if spec.step else ""))
    if spec.options:
        parts.append("options " + " / ".join(f"`{o}`" for o in spec.options))
    elif spec.options_from == (DEVICES,):
        parts.append("`auto` / `cpu` / `cuda:N`")
    elif spec.options_from:
        parts.append("files in " + ", ".join(f"`models/{f}`" for f in spec.options_from[1:]))
    if spec.slider:
        parts.append("slider")
    if spec.control_after_generate:
        parts.append("control after generate")
    if spec.multiline:
        parts.append("multiline")
    if spec.optional:
        parts.append("optional")
    if spec.lazy:
        parts.append("lazy")
    return "; ".join(parts)


def markdown_reference() -> str:
    """The node reference (docs/nodes.md), generated from the specs above."""
    lines = ["# SDVG node reference", "",
             "Generated from `nodes/schema.py` (`python -m nodes.schema > docs/nodes.md`); every node is in the "
             f"`{CATEGORY}` category. Widget order is part of saved workflows and never changes; new inputs are "
             "added as optional ones at the end.", ""]
    for spec in NODES:
        lines += [f"## {spec.display_name} (`{spec.node_id}`)", "", spec.description, "",
                  "| input | type | default / range | tooltip |", "| --- | --- | --- | --- |"]
        for i in spec.inputs:
            lines.append(f"| `{i.name}` | {i.type} | {_cell(_default_and_range(i))} | {_cell(i.tooltip)} |")
        lines += ["", "| output | type | tooltip |", "| --- | --- | --- |"]
        for o in spec.outputs:
            lines.append(f"| `{o.name}` | {o.type} | {_cell(o.tooltip)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
