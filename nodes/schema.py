"""Static description of every SDVG node: the single source of truth for inputs and outputs.

The ComfyUI V3 classes (``nodes/comfy_nodes.py``) are built from these specs, and the workflow tests
(``tests/test_workflows.py``) read them without ComfyUI installed. Plain data only: importing this
module needs neither ComfyUI nor torch.

Compatibility rules (saved workflows store node ids, input names and *positional* widget values):
never rename a node id or an input, never reorder widgets, and add new inputs only as optional ones
at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sdvg_engine import choices  # torch-free: the choice lists' one home
from sdvg_engine.options import SDVGOptions  # torch-free: the run options' defaults

CATEGORY = "SDVG"

#: Types that ComfyUI shows as widgets (everything else is a socket).
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")

#: Custom socket types of this pack.
SDVG_MODEL = "SDVG_MODEL"
SDVG_ROUTER = "SDVG_ROUTER"
SDVG_OPTIONS = "SDVG_OPTIONS"
SDVG_PROMPT_SCHEDULE = "SDVG_PROMPT_SCHEDULE"

#: Where the node reference lives (tooltips point there for the details).
DOCS = "docs/nodes.md"

#: Dynamic combo sources, resolved at schema time by the host (ComfyUI: ``folder_paths``).
#: ``files:<folder>[,<folder>...]`` lists model files of those registered folders; ``devices`` lists
#: ``auto``, ``cpu`` and ``cuda:<i>`` for every visible GPU.
DEVICES = "devices"

DRAFTER_FOLDERS = ("diffusion_models", "sdvg")
REWARD_FOLDERS = ("sdvg_reward", "image_reward")
EMBEDDINGS_FOLDERS = ("sdvg_embeddings",)

PRESETS = ("reference", "native")
WORKER_CHOICES = ("auto", "1", "2")
MODES = choices.MODES
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
    #: an expert setting: frontends that support it (1.3x+) fold it under the node's "advanced" toggle; the widget
    #: keeps its place in ``widgets_values``.
    advanced: bool = False
    #: longer explanation for the node reference (docs/nodes.md); the tooltip stays one or two sentences.
    details: str = ""

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
KV_DTYPES = tuple(d for d in choices.KV_DTYPES if d in ("auto", "fp8"))  # the two that change a card size
#: the loaders' ``card`` input (appended, optional): one choice that applies the memory plan for that card size
#: (``sdvg_engine.offload.plan_memory`` at 832x480, 81 frames); ``manual`` uses the loader's own widgets.
CARDS = ("manual", "16 GB", "24 GB", "48 GB", "80 GB")
#: Router defaults for a node added from the menu: the held-out routing benchmark's choice (docs/dev/routing.md).
#: Saved workflows keep their own values (they store every widget).
DEFAULT_TAU_MODE, DEFAULT_TAU = "relative", -0.25
TAU_MODES = choices.TAU_MODES
SWITCH_ROUTING = choices.SWITCH_ROUTING


def _docs(anchor: str) -> str:
    return f" Details: {DOCS}#{anchor}."


def _model_loader(node_id: str, display: str, role: str, dtypes: tuple[str, ...], description: str) -> NodeSpec:
    anchor = display.lower().replace(" ", "-")
    fp8 = "fp8" in dtypes
    return NodeSpec(
        node_id=node_id,
        display_name=display,
        description=description,
        inputs=(
            InputSpec("ckpt_name", "COMBO", options_from=("files",) + DRAFTER_FOLDERS,
                      tooltip=f"The causal Wan2.1 {role} checkpoint, from models/diffusion_models or models/sdvg."
                              + _docs(anchor),
                      details="Self-Forcing .pt, Krea .safetensors, ComfyUI, original Wan and diffusers layouts are "
                              "recognised from the keys; models/unet is searched too."),
            InputSpec("dtype", "COMBO", options=dtypes, default="bf16",
                      tooltip="Weight precision: bf16 is the models' own"
                              + ("; fp8 halves the 14B's memory (24 GB and 16 GB cards)." if fp8 else ".")
                              + " A card other than 'manual' overrides it." + _docs(anchor),
                      details="fp16 may overflow; fp32 doubles memory."
                              + (" fp8 stores the transformer-block weights in float8 with a per-tensor scale and "
                                 "computes in bf16." if fp8 else "")),
            InputSpec("device", "COMBO", options_from=(DEVICES,), default="auto",
                      tooltip="Where the model runs: auto = ComfyUI's main device; cuda:N puts it on GPU N (drafter "
                              "and target may sit on different GPUs)." + _docs(anchor),
                      details="Weights wait on ComfyUI's offload device between runs."),
            InputSpec("context_scheme", "COMBO", options=CONTEXT_SCHEMES, default="auto",
                      tooltip="How the model sees earlier frames; auto = what the checkpoint was trained with."
                              + _docs(anchor),
                      details="Self-Forcing 1.3B: global_cache, up to 81 frames; Krea 14B: recompute_window, any "
                              "length. The denoising schedule follows the weights (14B Krea: 5 calls; 1.3B "
                              "Self-Forcing: 4). The 16 GB card sets the drafter to recompute_window."),
            InputSpec("offload", "COMBO", options=OFFLOAD_MODES, default="none", optional=True, advanced=True,
                      tooltip="blocks = keep the transformer blocks in CPU RAM and stream them to the GPU as they "
                              "run (CUDA only); a card other than 'manual' overrides it." + _docs(anchor),
                      details="The 14B fp8 target then needs ~1.5 GB of VRAM instead of ~14 GB, at a small slowdown "
                              "(pinned memory, one block prefetched ahead; bit-identical output)."),
            InputSpec("kv_dtype", "COMBO", options=KV_DTYPES, default="auto", optional=True, advanced=True,
                      tooltip="Storage of the attention KV cache: auto = the model's dtype; fp8 about halves it. "
                              "A card other than 'manual' overrides it." + _docs(anchor),
                      details="fp8 is float8 with a scale per row (the 14B's 832x480 window: 7.5 -> 4.1 GB); "
                              "attention still runs in bf16; measured error ~0.6% of the latents."),
            InputSpec("card", "COMBO", options=CARDS, default="manual", optional=True,
                      tooltip="Your GPU's memory: applies the memory plan's settings for this model and overrides "
                              "dtype, offload and kv_dtype (manual = use them as set)." + _docs(anchor),
                      details="The plan (sdvg_engine.offload.plan_memory at 832x480, 81 frames) per card: 80 GB: "
                              "everything bf16; 48 GB: fp8 target; 24 GB: fp8 target streamed from CPU RAM, fp8 KV "
                              "caches; 16 GB: also the drafter streamed and on the recompute window. The VAE is "
                              "ComfyUI's: it runs in bf16 on RTX 30xx/40xx by default (do not launch with "
                              "--fp32-vae on 16/24 GB). On a CPU device nothing is streamed (the weights are in RAM "
                              "already). Set the same card on both loaders."),
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

_ROUTER_DOCS = _docs("sdvg-reward-router")
REWARD_ROUTER = NodeSpec(
    node_id="SDVGRewardRouter",
    display_name="SDVG Reward Router",
    description="ImageReward routing: each drafted block is decoded, every frame is scored against the prompt, "
                "and the block is kept when its score passes the threshold (see tau_mode). The reward model is "
                "loaded once per file; changing tau only rebuilds this cheap node.",
    inputs=(
        InputSpec("reward_model", "COMBO", options_from=("files",) + REWARD_FOLDERS,
                  tooltip="ImageReward checkpoint (ImageReward.pt from THUDM/ImageReward) in models/sdvg_reward or "
                          "models/image_reward." + _ROUTER_DOCS,
                  details="A .safetensors with the same keys works too."),
        InputSpec("tau", "FLOAT", default=DEFAULT_TAU, min=-5.0, max=5.0, step=0.05, round=0.01, slider=True,
                  tooltip="The keep threshold: higher = more blocks regenerated by the target (better, slower). "
                          "relative/anchor/baseline: a margin over the reference score, about -1..0.5 (-0.25 "
                          "chosen on held-out scenes); fixed: an ImageReward score, about -2..2 (paper: -0.7)."
                          + _ROUTER_DOCS,
                  details="Unused in accept_rate mode. Fix the sampler's seed while tuning tau: a tau change then "
                          "replays every block before the first decision that flips. The score plot draws the "
                          "quantity compared with tau and the band of tau values that change nothing."),
        InputSpec("aggregation", "COMBO", options=("min", "mean"), default="min",
                  tooltip="How frame scores make a block score: min (one bad frame rejects the block) or mean."),
        InputSpec("crop", "COMBO", options=("center", "full"), default="center",
                  tooltip="center: ImageReward's own resize + center crop; full: squash the whole frame so the "
                          "borders are scored too."),
        InputSpec("temporal_weight", "FLOAT", default=0.0, min=-10.0, max=10.0, step=0.05, round=0.01,
                  tooltip="Adds this weight x the similarity of consecutive frames to the block score (0 = off)."
                          + _ROUTER_DOCS,
                  details="The mean cosine similarity of consecutive frames' ImageReward features; similarity "
                          "favours static video, so use it sparingly."),
        InputSpec("tau_mode", "COMBO", options=TAU_MODES, default=DEFAULT_TAU_MODE, optional=True,
                  tooltip="What tau is compared with: relative = the draft's score minus the last kept block's "
                          "(the held-out benchmark's choice); fixed = the raw score (the paper's)." + _ROUTER_DOCS,
                  details="accept_rate: per-block threshold = the (1 - accept_rate) quantile of the draft scores "
                          "seen so far in this video, started from a prior N(0.566, 1.071^2) worth 5 blocks (tau "
                          "unused). anchor: minus block 0's score. baseline: minus the mean score of the blocks "
                          "kept so far. relative, anchor and baseline remove how much the reward likes the prompt; "
                          "they need force_first_block and no cascade. A node added from the menu starts at "
                          "relative / -0.25; saved workflows keep the values they were saved with."),
        InputSpec("accept_rate", "FLOAT", default=0.73, min=0.01, max=0.99, step=0.01, round=0.01, optional=True,
                  tooltip="Share of drafted blocks to keep when tau_mode is accept_rate (0.72 in the reference "
                          "SDVG server)."),
        InputSpec("preprocess", "COMBO", options=("pil", "torch"), default="pil", optional=True, advanced=True,
                  tooltip="pil: score frames exactly as ImageReward does; torch: a faster on-GPU resize (scores "
                          "differ by a few thousandths)."),
    ),
    outputs=(OutputSpec("router", SDVG_ROUTER, "Routing settings plus the loaded reward model."),),
)

_SAMPLER_DOCS = _docs("sdvg-speculative-sampler")
_ADVANCED_WINS = " SDVG Advanced Options, when connected, wins over this widget."

#: The expert inputs: widgets of the sampler (kept for saved workflows) and of SDVG Advanced Options.
ADVANCED_INPUTS = (
    InputSpec("refine_from_step", "INT", default=0, min=0, max=8, optional=True, advanced=True,
              tooltip="On a rejected draft the target continues from the drafter's state after this many steps "
                      "instead of from noise; 0 = off." + _SAMPLER_DOCS,
              details="Hybrid regeneration; 3 is the reference's best."),
    InputSpec("cascade", "BOOLEAN", default=False, optional=True, advanced=True,
              tooltip="Score 4 frames first and decide early when they are clear." + _SAMPLER_DOCS,
              details="With min aggregation a partial minimum below tau rejects exactly; a partial minimum at least "
                      "0.5 above tau accepts early (a heuristic: an unscored frame could still be below tau); "
                      "otherwise all frames are scored. Needs temporal_weight 0 and tau_mode fixed or accept_rate."),
    InputSpec("random_accept_prob", "FLOAT", default=0.73, min=0.0, max=1.0, step=0.01, round=0.001,
              optional=True, advanced=True,
              tooltip="Mode random: the probability of keeping each draft (drawn from the seed)."),
    InputSpec("preset", "COMBO", options=PRESETS, default="reference", optional=True, advanced=True,
              tooltip="reference: the paper's setup (both models on Krea's recompute window, 5 calls, any length); "
                      "native: each model as distilled (drafter up to 81 frames)." + _SAMPLER_DOCS,
              details="reference: context rebuilt before every block from an anchor frame + the last 2 latent frames, "
                      "with the 5-call list [1000, 937.5, 833.3, 625, 0]. native: Self-Forcing drafter on its global "
                      "cache with 4 calls. A loader's explicit context_scheme wins over the preset."),
    InputSpec("workers", "COMBO", options=WORKER_CHOICES, default="auto", optional=True, advanced=True,
              tooltip="auto: overlap the target with verification when it sits on another GPU; 1: one step after "
                      "another; 2: two threads. The output is identical." + _SAMPLER_DOCS,
              details="With the target on another GPU than the drafter, VAE and reward (the loaders' device "
                      "inputs), the target regenerates each block while its draft is verified, and decodes overlap "
                      "the next block. Only the time differs. A run with a drafter or target from MODEL (SDVG "
                      "Drafter / Target from MODEL) uses one lane whatever this says: ComfyUI casts, patches and "
                      "moves a MODEL's weights per call, which a second thread would race (the report says so)."),
    InputSpec("replay", "BOOLEAN", default=True, optional=True, advanced=True,
              tooltip="Reuse the previous run when only the router's tau settings changed (identical output)."
                      + _SAMPLER_DOCS,
              details="Every block before the first decision that flips is taken as it was, so moving tau costs only "
                      "the tail. Kept in CPU RAM (at most SDVG_REPLAY_GB, default 4), released when the models "
                      "change. Needs a fixed seed."),
    InputSpec("schedule_every", "INT", default=choices.SCHEDULE_EVERY, min=0, max=64, optional=True, advanced=True,
              tooltip="Mode schedule: the target makes block 0 and every k-th block (k = this value), decided "
                      "before drafting; 0 = only block 0."),
    InputSpec("schedule_veto", "BOOLEAN", default=False, optional=True, advanced=True,
              tooltip="Mode schedule: also score each drafted block and let the router send it back to the "
                      "target. Needs a router."),
)
ADVANCED_NAMES = tuple(i.name for i in ADVANCED_INPUTS)


def _on_sampler(spec: InputSpec) -> InputSpec:
    return replace(spec, tooltip=spec.tooltip + _ADVANCED_WINS)


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
                  tooltip="The prompt encoded by Wan2.1's UMT5-XXL (CLIPLoader type 'wan' -> CLIPTextEncode), or "
                          "SDVG Load Prompt Embeddings." + _SAMPLER_DOCS,
                  details="Shape [1, >=512, 4096]."),
        InputSpec("vae", "VAE", tooltip="The Wan2.1 VAE (VAELoader, wan_2.1_vae). Converted once to a streaming "
                                        "decoder and cached."),
        InputSpec("reward_prompt", "STRING", default="", multiline=True,
                  tooltip="The prompt TEXT ImageReward scores against (CONDITIONING carries only embeddings): link "
                          "the same text as the positive prompt. Required in mode 'sdvg'."),
        InputSpec("width", "INT", default=832, min=16, max=2048, step=16, tooltip="Video width in pixels (multiple of 16)."),
        InputSpec("height", "INT", default=480, min=16, max=2048, step=16, tooltip="Video height in pixels (multiple of 16)."),
        InputSpec("length", "INT", default=81, min=9, max=MAX_LENGTH, step=12,
                  tooltip="Frames, 12n - 3 (9, 21, ..., 81): whole blocks of 3 latent frames. More than 81 needs "
                          "recompute_window models."),
        InputSpec("seed", "INT", default=42, min=0, max=MAX_SEED, control_after_generate=True,
                  tooltip="Noise seed: set 'control after generate' to fixed while tuning tau, so a tau change "
                          "replays instead of making a new video." + _SAMPLER_DOCS,
                  details="Block b's noise depends only on (seed, b), so a rejected draft is regenerated by the "
                          "target from exactly the same noise. 'randomize' makes every run a new video and "
                          "defeats replay."),
        InputSpec("mode", "COMBO", options=MODES, default="sdvg",
                  tooltip="sdvg: draft, score, keep or regenerate; target_only / draft_only: one model for every "
                          "block (baselines)." + _SAMPLER_DOCS,
                  details="first_block_only: the target makes block 0, every later draft is kept. random: keep "
                          "drafts with probability random_accept_prob (ablation). schedule: the target makes block 0 "
                          "and every schedule_every-th block, decided before drafting (no reward model, the drafter "
                          "never runs on those blocks)."),
        InputSpec("force_first_block", "BOOLEAN", default=True,
                  tooltip="Let the target make block 0 without drafting it (it anchors the whole video). Ignored "
                          "by draft_only."),
        *(_on_sampler(i) for i in ADVANCED_INPUTS),
        InputSpec("advanced_options", SDVG_OPTIONS, optional=True,
                  tooltip="Optional SDVG Advanced Options node: when connected, its values replace this node's "
                          "refine_from_step ... schedule_veto widgets."),
        InputSpec("prompt_schedule", SDVG_PROMPT_SCHEDULE, optional=True,
                  tooltip="Optional SDVG Prompt Schedule / SDVG Prompt Switch: the prompts the video switches to at "
                          "later frames (positive and reward_prompt open it)." + _docs("sdvg-prompt-schedule"),
                  details="Each switch must start a block (9, 21, 33, ... for 3-latent-frame blocks) inside the "
                          "video. With a fixed seed, a run that changes only later switches replays every block "
                          "before the first changed one."),
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
        OutputSpec("score_plot", "IMAGE", "Per block, the quantity compared with tau (the score, its margin over the "
                                          "reference, or the random draw) against each block's threshold (green = "
                                          "kept, red = regenerated, grey = not drafted); the shaded band: tau values "
                                          "that change no decision, so the next run replays at once."),
    ),
    validated_inputs=("length",),
)

ADVANCED_OPTIONS = NodeSpec(
    node_id="SDVGAdvancedOptions",
    display_name="SDVG Advanced Options",
    description="Expert settings of the SDVG Speculative Sampler in one optional node: connect its output to the "
                "sampler's advanced_options input and these values replace the sampler's own widgets of the same "
                "names.",
    inputs=tuple(replace(i, optional=False, advanced=False) for i in ADVANCED_INPUTS),
    outputs=(OutputSpec("options", SDVG_OPTIONS, "The settings, for the sampler's advanced_options input."),),
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

_SCHEDULE_DOCS = _docs("sdvg-prompt-schedule")
#: the prompt-schedule nodes' previous-switches socket (both nodes chain through it)
_PREVIOUS_SCHEDULE = InputSpec(
    "schedule", SDVG_PROMPT_SCHEDULE, optional=True,
    tooltip="Earlier switches (another SDVG Prompt Switch or SDVG Prompt Schedule): chain nodes to switch more than "
            "once; the switches are put in frame order.")
_SCHEDULE_OUTPUT = OutputSpec("prompt_schedule", SDVG_PROMPT_SCHEDULE,
                              "The switches (and settings), for the sampler's prompt_schedule input or the next "
                              "node's schedule input.")

PROMPT_SCHEDULE = NodeSpec(
    node_id="SDVGPromptSchedule",
    display_name="SDVG Prompt Schedule",
    description="Steers a video while it is made: `frame: prompt` lines, encoded with the clip, switch the prompt at "
                "those frames (the sampler's positive prompt opens the video). Also sets what happens at each switch.",
    inputs=(
        InputSpec("text", "STRING", default="", multiline=True,
                  tooltip="One `frame: prompt` line per switch (`45: the fox stops and looks back`), its text also "
                          "its reward prompt; frames start blocks: 9, 21, 33, 45, 57, 69 (81 frames)."
                          + _SCHEDULE_DOCS,
                  details="Lines after `#` and blank lines are skipped; a JSON list "
                          "`[{\"frame\": 45, \"prompt\": \"...\", \"reward_prompt\": \"...\"}]` works too. Frame 0 "
                          "is refused: the sampler's positive and reward_prompt hold the opening prompt. Block b "
                          "starts at frame 12 b - 3; the sampler refuses a frame beyond its length."),
        InputSpec("target_after_switch", "BOOLEAN", default=SDVGOptions.target_after_switch,
                  tooltip="On: the first block after each switch is made by the target, as block 0 is (draft_only "
                          "ignores it); off (the default): the router decides it like any block." + _SCHEDULE_DOCS,
                  details="On, the target anchors the new prompt as it anchors the opening one; on the toy world "
                          "that bought no measurable quality and cost 7% of the speed (docs/dev/prompt_schedule.md). "
                          "Off with "
                          "switch_routing 'reset' and a relative, anchor or baseline tau_mode is refused: the first "
                          "block after a switch would have no reference score."),
        InputSpec("switch_routing", "COMBO", options=SWITCH_ROUTING, default=SDVGOptions.switch_routing,
                  tooltip="What the router's state does at a switch: carry (the default) = compare scores across the "
                          "switch as they are; reset = each prompt starts like a new video." + _SCHEDULE_DOCS,
                  details="reset: relative / anchor / baseline compare only with blocks since the switch, and "
                          "accept_rate's pool restarts from its prior. carry: scores under the old prompt are "
                          "references for drafts under the new one, although ImageReward likes the prompts "
                          "differently."),
        InputSpec("clip", "CLIP", optional=True,
                  tooltip="The text encoder for the lines: Wan2.1's UMT5-XXL (CLIPLoader with type 'wan'), the "
                          "one that encodes the sampler's positive prompt."),
        _PREVIOUS_SCHEDULE,
    ),
    outputs=(_SCHEDULE_OUTPUT,),
)

PROMPT_SWITCH = NodeSpec(
    node_id="SDVGPromptSwitch",
    display_name="SDVG Prompt Switch",
    description="One prompt switch from a CONDITIONING: from start_frame on the video follows this prompt. Chain "
                "several through schedule; an SDVG Prompt Schedule at the end of the chain sets the switch settings "
                f"(without one: target_after_switch {'on' if SDVGOptions.target_after_switch else 'off'}, "
                f"switch_routing {SDVGOptions.switch_routing}).",
    inputs=(
        InputSpec("conditioning", "CONDITIONING",
                  tooltip="The prompt the video switches to, encoded as the sampler's positive is (CLIPTextEncode "
                          "with Wan2.1's UMT5-XXL)."),
        InputSpec("start_frame", "INT", default=45, min=9, max=MAX_LENGTH - 1, step=12,
                  tooltip="The video frame the prompt starts at: the start of a block (9, 21, 33, 45, ...) inside "
                          "the sampler's length." + _SCHEDULE_DOCS,
                  details="Block b starts at frame 12 b - 3; frame 0 is the opening prompt's (the sampler's "
                          "positive)."),
        InputSpec("reward_prompt", "STRING", default="", multiline=True,
                  tooltip="The TEXT of this prompt, which ImageReward scores its blocks against (required in mode "
                          "'sdvg'): link the same text as the conditioning's."),
        _PREVIOUS_SCHEDULE,
    ),
    outputs=(_SCHEDULE_OUTPUT,),
    validated_inputs=("start_frame",),
)

#: ComfyUI's own socket type of a loaded diffusion model (Load Diffusion Model, LoraLoaderModelOnly, Unet Loader (GGUF)).
MODEL = "MODEL"


def _from_model(node_id: str, display: str, role: str, description: str) -> NodeSpec:
    anchor = display.lower().replace(" ", "-")
    return NodeSpec(
        node_id=node_id,
        display_name=display,
        description=description,
        inputs=(
            InputSpec("model", MODEL,
                      tooltip=f"The Wan2.1 text-to-video MODEL to run as the {role}: its LoRAs, fp8 or GGUF weights "
                              "and ComfyUI's attention backend apply. A MODEL-backed run uses one worker lane."
                              + _docs(anchor),
                      details="The block-causal forward runs through ComfyUI's own modules, so what the MODEL carries "
                              "applies: bf16/fp16/fp32 weights, fp8_e4m3fn storage, *_fp8_scaled files, GGUF "
                              "(ComfyUI-GGUF), LoRA patches (also on low-VRAM loads), --fast fp8 matmuls, and the "
                              "attention ComfyUI was launched with (sage, flash, pytorch ...; the recompute window's "
                              "masked calls use PyTorch attention, which honours the mask). ComfyUI's memory manager "
                              "loads it, partially when VRAM is short (--lowvram / --novram stream its layers). A run "
                              "with a MODEL-backed drafter or target uses one worker lane, so no second thread races "
                              "ComfyUI's weight casting. A LoRA or strength change makes a new video (no replay)."),
            InputSpec("context_scheme", "COMBO", options=CONTEXT_SCHEMES, default="auto",
                      tooltip="How the model sees earlier frames; auto = follow the model (width 5120, the 14B: "
                              "recompute_window, else global_cache)." + _docs(anchor),
                      details="As the file loaders' context_scheme: an explicit choice wins over the sampler's "
                              "preset; auto lets the preset decide (reference: both models on the recompute window)."),
            InputSpec("kv_dtype", "COMBO", options=KV_DTYPES, default="auto", advanced=True,
                      tooltip="Storage of the attention KV cache: auto = the model's compute dtype; fp8 about halves "
                              "it." + _docs(anchor),
                      details="fp8 is float8 with a scale per row; attention still runs in the compute dtype."),
        ),
        # not "model": V3 needs input and output ids distinct, and the input is "model"
        outputs=(OutputSpec("sdvg_model", SDVG_MODEL, f"The MODEL as the sampler's {role} (shared by runs; never "
                                                      "modified by the sampler)."),),
    )


DRAFTER_FROM_MODEL = _from_model(
    "SDVGDrafterFromModel", "SDVG Drafter from MODEL", "drafter",
    "Uses a Wan2.1 MODEL loaded by ComfyUI (Load Diffusion Model, with LoRAs, fp8 or GGUF) as the drafter, e.g. "
    "Self-Forcing 1.3B exported with `sdvg export-comfy`.",
)

TARGET_FROM_MODEL = _from_model(
    "SDVGTargetFromModel", "SDVG Target from MODEL", "target",
    "Uses a Wan2.1 MODEL loaded by ComfyUI (Load Diffusion Model, with LoRAs, fp8 or GGUF) as the target, e.g. "
    "Krea Realtime 14B.",
)

NODES: tuple[NodeSpec, ...] = (LOAD_DRAFTER, LOAD_TARGET, REWARD_ROUTER, SAMPLER, LOAD_PROMPT_EMBEDDINGS,
                               ADVANCED_OPTIONS, DRAFTER_FROM_MODEL, TARGET_FROM_MODEL, PROMPT_SCHEDULE, PROMPT_SWITCH)
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
    if spec.advanced:
        parts.append("advanced")
    return "; ".join(parts)


def markdown_reference() -> str:
    """The node reference (docs/nodes.md), generated from the specs above."""
    lines = ["# SDVG node reference", "",
             "Generated from `nodes/schema.py` (`python -m nodes.schema > docs/nodes.md`); every node is in the "
             f"`{CATEGORY}` category. Widget order is part of saved workflows and never changes; new inputs are "
             "added as optional ones at the end. Inputs marked *advanced* are expert settings: newer frontends fold "
             "them under the node's advanced toggle, and SDVG Advanced Options sets the sampler's in one place.", ""]
    for spec in NODES:
        lines += [f"## {spec.display_name}", "", f"Node id `{spec.node_id}`. {spec.description}", "",
                  "| input | type | default / range | what it does |", "| --- | --- | --- | --- |"]
        for i in spec.inputs:
            text = i.tooltip.split(f" Details: {DOCS}")[0] + (" " + i.details if i.details else "")
            lines.append(f"| `{i.name}` | {i.type} | {_cell(_default_and_range(i))} | {_cell(text)} |")
        lines += ["", "| output | type | what it holds |", "| --- | --- | --- |"]
        for o in spec.outputs:
            lines.append(f"| `{o.name}` | {o.type} | {_cell(o.tooltip)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_reference(), end="")
