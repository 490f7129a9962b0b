"""ImageReward scoring of video frames (no ComfyUI, no Hub access, no torchvision).

Public API::

    scorer = load_image_reward("ImageReward.pt", device="cuda", dtype=torch.float16)
    feats = scorer.encode_prompt("a cat surfing")          # cached per prompt string
    out = scorer.score_frames(frames, feats, crop="center") # frames [N, 3, H, W] in 0..1 or uint8
    out.scores          # [N] float32 CPU, ImageReward-v1.0 scale (about N(0, 1))
    out.image_features  # [N, vision_width] float32 CPU, ViT CLS after the final norm

All frames of a call go through the ViT and the text encoder in one batch (optionally chunked
by ``batch_size``); the prompt is tokenised once and reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .loading import build_model_from_state_dict, infer_config, read_state_dict, validate_state_dict
from .model import (
    REWARD_MEAN,
    REWARD_STD,
    ImageRewardConfig,
    ImageRewardModel,
    count_parameters,
    randomize_reward_head,
)
from .preprocess import CROP_MODES, PREPROCESS_MODES, frames_to_uint8, preprocess_frames
from .preprocess import _check_mode as _check_preprocess
from .tokenizer import BlipTokenizer

__all__ = [
    "REWARD_MEAN",
    "save_image_reward",
    "HEADS_METADATA_KEY",
    "REWARD_STD",
    "CROP_MODES",
    "PREPROCESS_MODES",
    "frames_to_uint8",
    "ImageRewardConfig",
    "ImageRewardModel",
    "ImageRewardScorer",
    "PromptFeatures",
    "FrameScores",
    "BlipTokenizer",
    "load_image_reward",
    "build_tiny_image_reward",
    "preprocess_frames",
    "read_state_dict",
    "infer_config",
    "validate_state_dict",
    "count_parameters",
    "randomize_reward_head",
]


@dataclass(frozen=True)
class PromptFeatures:
    """A tokenised prompt. Tensors are [1, 35] int64 on CPU (moved to the model per call, so the
    cache stays valid if the model is moved between devices)."""

    prompt: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class FrameScores:
    """Per-frame results of one ``score_frames`` call.

    scores: [N] float32 on CPU (ImageReward-v1.0 normalised reward).
    image_features: [N, vision_width] float32 on CPU (ViT CLS token after the final norm),
        for temporal-consistency terms.
    """

    scores: torch.Tensor
    image_features: torch.Tensor

    def __len__(self) -> int:
        return int(self.scores.shape[0])


class ImageRewardScorer:
    """Scores frames against a prompt with an ``ImageRewardModel``.

    Attributes:
        model: the network (``torch.nn.Module``), exposed so callers can wrap/offload it.
        tokenizer: the BLIP tokenizer.
        batch_size: max frames per forward (None = all frames of a call in one forward).
        preprocess: default frame preprocessing, "pil" (ImageReward-exact: 8-bit frames, PIL
            bicubic resize + centre crop, as the reference server scores them) or "torch"
            (on-device antialiased bicubic on the float frames: faster; scores differ by up to
            ~1e-2, mostly from the 8-bit step; see ``sdvg_engine.reward.preprocess``).
        device, dtype: read from the model's parameters, so they stay right if the model is
            moved by someone else (e.g. a memory manager).
    """

    def __init__(
        self,
        model: ImageRewardModel,
        tokenizer: BlipTokenizer,
        *,
        batch_size: int | None = None,
        prompt_cache_size: int = 256,
        preprocess: str = "pil",
    ):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        _check_preprocess(preprocess)
        if len(tokenizer) != model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                f"{model.config.vocab_size}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self._prompt_cache: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._prompt_cache_size = prompt_cache_size
        self.preprocess = preprocess

    @property
    def config(self) -> ImageRewardConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.blip.visual_encoder.pos_embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.blip.visual_encoder.pos_embed.dtype

    def to(self, device=None, dtype: torch.dtype | None = None) -> "ImageRewardScorer":
        """Move/cast the model; returns self."""
        self.model.to(device=device, dtype=dtype)
        return self

    def encode_prompt(self, prompt: str) -> PromptFeatures:
        """Tokenise ``prompt`` (cached per string, LRU-bounded)."""
        hit = self._prompt_cache.get(prompt)
        if hit is not None:
            self._prompt_cache.move_to_end(prompt)
            return hit
        ids, mask = self.tokenizer(prompt)
        feats = PromptFeatures(prompt, ids, mask)
        self._prompt_cache[prompt] = feats
        if len(self._prompt_cache) > self._prompt_cache_size:
            self._prompt_cache.popitem(last=False)
        return feats

    @torch.no_grad()
    def score_frames(
        self,
        frames: torch.Tensor,
        prompt: str | PromptFeatures,
        *,
        crop: str = "center",
        preprocess: str | None = None,
    ) -> FrameScores:
        """Score each frame of ``frames`` [N, 3, H, W] (float 0..1 or uint8, any H, W) against ``prompt``.

        ``crop``: "center" = ImageReward's resize-shorter-side + center crop; "full" = squash
        the whole frame to the ViT size so that the borders are scored too.
        ``preprocess``: "pil" (ImageReward-exact) or "torch" (fast); None = ``self.preprocess``.
        """
        preprocess = self.preprocess if preprocess is None else preprocess
        _check_preprocess(preprocess)
        feats = self.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        if not isinstance(feats, PromptFeatures):
            raise TypeError(f"prompt must be a str or PromptFeatures, got {type(prompt).__name__}")
        device, dtype = self.device, self.dtype
        if device.type == "meta":
            raise RuntimeError("the reward model has no weights (meta device); load it first")
        pixels = preprocess_frames(
            frames, self.config.image_size, crop=crop, device=device, dtype=dtype, preprocess=preprocess
        )
        ids = feats.input_ids.to(device)
        mask = feats.attention_mask.to(device)
        step = self.batch_size or pixels.shape[0]
        scores, features = [], []
        for i in range(0, pixels.shape[0], step):
            s, f = self.model(pixels[i : i + step], ids, mask)
            scores.append(s.float().cpu())
            features.append(f.float().cpu())
        return FrameScores(torch.cat(scores), torch.cat(features))


def load_image_reward(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    vocab_file: str | Path | None = None,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    batch_size: int | None = None,
    preprocess: str = "pil",
) -> ImageRewardScorer:
    """Load an unmodified ``ImageReward.pt`` (or a ``.safetensors`` with the same keys) strictly.

    ``preprocess`` is the scorer's default frame preprocessing ("pil" = ImageReward-exact,
    "torch" = fast approximation; see :class:`ImageRewardScorer`).

    Sizes are inferred from the tensors; head counts default to ImageReward-v1.0's (16/12).
    Raises ``FileNotFoundError`` if ``path`` is not a file (nothing is ever downloaded) and
    ``ValueError`` naming the file and listing keys on any key/shape mismatch.
    """
    from ..checks import check_device, check_optional_int

    # Every argument is checked before the (1.8 GB) file is read.
    if path is None or not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"path must be the ImageReward checkpoint's file path (ImageReward.pt or a .safetensors), "
                         f"got {path!r}")
    heads_fix = "ImageReward v1.0 has vision_heads=16 and text_heads=12; leave None to use those (or the file's own)"
    vision_heads = check_optional_int("vision_heads", vision_heads, low=1, fix=heads_fix)
    text_heads = check_optional_int("text_heads", text_heads, low=1, fix=heads_fix)
    batch_size = check_optional_int("batch_size", batch_size, low=1,
                                    fix="frames per forward, e.g. batch_size=8, or None for all frames at once")
    check_device("device", device)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    _check_preprocess(preprocess)
    sd = read_state_dict(path)
    if (vision_heads is None or text_heads is None) and str(path).endswith(".safetensors"):
        # Files written by save_image_reward() carry their head counts (shapes cannot tell them).
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            heads = (f.metadata() or {}).get(HEADS_METADATA_KEY)
        if heads:
            v, t = (int(x) for x in heads.split(","))
            vision_heads = v if vision_heads is None else vision_heads
            text_heads = t if text_heads is None else text_heads
    model = build_model_from_state_dict(
        sd, vision_heads=vision_heads, text_heads=text_heads, source=str(path)
    )
    del sd
    model.to(device=device, dtype=dtype)
    return ImageRewardScorer(model, BlipTokenizer(vocab_file), batch_size=batch_size, preprocess=preprocess)


HEADS_METADATA_KEY = "sdvg.reward_heads"


def save_image_reward(scorer: "ImageRewardScorer", path: str | Path) -> None:
    """Write the scorer's network as safetensors with ImageReward.pt's key names plus its head counts."""
    from safetensors.torch import save_file

    cfg = scorer.config
    state = {k: v.detach().cpu().contiguous() for k, v in scorer.model.state_dict().items()}
    save_file(state, str(path), metadata={HEADS_METADATA_KEY: f"{cfg.vision_heads},{cfg.text_heads}"})


def build_tiny_image_reward(
    seed: int = 0, *, vocab_file: str | Path | None = None, preprocess: str = "pil"
) -> ImageRewardScorer:
    """A tiny randomly initialised scorer (``ImageRewardConfig.tiny()``) for tests and demos.

    The backbone uses N(0, 0.2) weights (larger than BLIP's 0.02 so that images actually move
    the text CLS state in a 32-wide model), and the reward head is re-initialised with
    N(0, 0.3) first layer and variance-preserving later layers, so that different images get
    clearly different scores of order 1 (with ImageReward's own head init every score would be
    about -0.162). Deterministic in ``seed``; the global RNG is untouched.
    """
    cfg = ImageRewardConfig.tiny()
    gen = torch.Generator().manual_seed(int(seed))
    model = ImageRewardModel(cfg)
    model.init_weights(gen, std=0.2)
    randomize_reward_head(model, gen, first_std=0.3)
    model.requires_grad_(False)
    return ImageRewardScorer(model.eval(), BlipTokenizer(vocab_file), preprocess=preprocess)
