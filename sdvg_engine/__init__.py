"""SDVG engine: speculative decoding for block-autoregressive video diffusion.

Data flow: load (``load_generator``, ``load_wan_vae``, ``load_image_reward``) -> encode the prompt
(``text_encoder``) -> ``SpeculativePipeline.generate``: draft -> decode -> score -> route ->
commit or regenerate -> frames, acceptance mask, report.

Nothing in this package imports ComfyUI; ``nodes/`` adapts it.
"""

from .context import AnchorEncoder, GlobalCache, RecomputeWindow, make_context_scheme
from .generator import BlockSample, CausalGenerator
from .loaders import load_generator, parse_dtype
from .models.causal_wan import CausalWanTransformer3DModel, TextKV, wan_config
from .models.loading import CheckpointError, CheckpointInfo, inspect_checkpoint, load_causal_wan
from .pipeline import MODES, CancelToken, GenerationCancelled, SDVGOptions, SDVGResult, SpeculativePipeline
from .workers import StreamAbandoned
from .report import BlockRecord
from .sampling import KREA_SCHEDULE, SELF_FORCING_SCHEDULE, Schedule, SeededNoise, TensorNoise

__version__ = "0.1.0"

__all__ = [
    "AnchorEncoder", "BlockRecord", "BlockSample", "CancelToken", "CausalGenerator", "CausalWanTransformer3DModel",
    "CheckpointError", "CheckpointInfo", "GenerationCancelled", "StreamAbandoned", "GlobalCache", "KREA_SCHEDULE", "MODES",
    "RecomputeWindow", "SDVGOptions", "SDVGResult", "SELF_FORCING_SCHEDULE", "Schedule", "SeededNoise",
    "SpeculativePipeline", "TensorNoise", "TextKV", "inspect_checkpoint", "load_causal_wan", "load_generator",
    "make_context_scheme", "parse_dtype", "wan_config",
]
