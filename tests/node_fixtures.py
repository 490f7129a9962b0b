"""Tiny model *files* for the node tests and the ComfyUI end-to-end test.

Files are written under the names of the real checkpoints the shipped workflows reference, so the
API-format workflows run unchanged against a folder of tiny models:

=================================  ==========================================================
models/diffusion_models/           self_forcing_dmd.pt (tiny drafter, Self-Forcing pickle layout),
                                   krea-realtime-video-14b.safetensors (tiny target)
models/sdvg_reward/                ImageReward.pt (tiny, ImageReward-v1.0 head counts 16/12)
models/sdvg_embeddings/            prompts.safetensors: two prompts, [1, 512, 4096] each
models/vae/                        wan_2.1_vae.safetensors: Wan2.1 VAE in ComfyUI's original-key layout
=================================  ==========================================================

ComfyUI hard-codes the Wan2.1 VAE width (``dim=96`` in ``comfy/sd.py``), so it cannot load a tiny VAE:
the VAE written for ComfyUI is full-size (127M parameters, random weights, fp16 = 254 MB). The
in-process node tests use a tiny VAE behind :class:`FakeComfyVAE` instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

from sdvg_engine.models.loading import save_checkpoint
from sdvg_engine.reward import ImageRewardConfig, ImageRewardModel, build_tiny_image_reward, save_image_reward
from sdvg_engine.text_encoder import save_prompt_embeddings
from wan_fixtures import text_context, tiny_wan, to_original_keys, vae_key_to_original

DRAFTER_FILE = "self_forcing_dmd.pt"
TARGET_FILE = "krea-realtime-video-14b.safetensors"
REWARD_FILE = "ImageReward.pt"
EMBEDDINGS_FILE = "prompts.safetensors"
VAE_FILE = "wan_2.1_vae.safetensors"
PROMPTS = ["a red ball rolling on green grass", "a paper boat on a rainy street"]


def write_tiny_models(root: Path, *, target_scheme: str = "global_cache") -> dict[str, Path]:
    """Drafter, target, reward and prompt-embeddings files under ComfyUI-style folders of ``root``."""
    root = Path(root)
    paths = {
        "drafter": root / "diffusion_models" / DRAFTER_FILE,
        "target": root / "diffusion_models" / TARGET_FILE,
        "reward": root / "sdvg_reward" / REWARD_FILE,
        "embeddings": root / "sdvg_embeddings" / EMBEDDINGS_FILE,
    }
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    # Self-Forcing's own layout: {"generator_ema": {"model.<original Wan key>": ...}, ...}.
    drafter = {f"model.{k}": v for k, v in to_original_keys(tiny_wan(seed=1).state_dict()).items()}
    torch.save({"generator_ema": drafter, "critic": {"x": torch.zeros(1)}}, paths["drafter"])
    save_checkpoint(tiny_wan(seed=2), paths["target"], context_scheme=target_scheme)
    torch.save(tiny_reward_model(seed=0).state_dict(), paths["reward"])
    save_prompt_embeddings(paths["embeddings"], PROMPTS, [text_context(seed=1 + i) for i in range(len(PROMPTS))])
    return paths


def tiny_reward_model(seed: int = 0) -> ImageRewardModel:
    """A tiny ImageReward whose widths fit ImageReward-v1.0's head counts (16 vision, 12 text), so a plain
    ``ImageReward.pt`` state dict of it loads with the loader's defaults. Initialised like
    ``build_tiny_image_reward`` so different frames get clearly different scores."""
    cfg = dataclasses.replace(ImageRewardConfig.tiny(), vision_heads=16, text_width=48, text_heads=12)
    gen = torch.Generator().manual_seed(seed)
    model = ImageRewardModel(cfg)
    with torch.no_grad():
        model.init_weights(gen, std=0.2)
        first = True
        for lin in model.mlp.layers:
            if isinstance(lin, torch.nn.Linear):
                lin.weight.normal_(0.0, 0.3 if first else lin.in_features ** -0.5, generator=gen)
                lin.bias.zero_()
                first = False
    return model.requires_grad_(False).eval()


def write_reward_with_heads_metadata(path: Path) -> Path:
    """``build_tiny_image_reward``'s model (2 heads each) as .safetensors with its head counts in the metadata."""
    save_image_reward(build_tiny_image_reward(seed=0), path)
    return path


# ---- Wan VAE in the original (ComfyUI) key layout -------------------------------------------------------------
def random_wan_vae(base_dim: int = 8, seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=base_dim, z_dim=16).eval().requires_grad_(False)


def original_state_dict(vae: AutoencoderKLWan) -> dict[str, torch.Tensor]:
    return {vae_key_to_original(k): v for k, v in vae.state_dict().items()}


def write_comfy_vae(path: Path, *, base_dim: int = 96, dtype=torch.float16) -> Path:
    """A random Wan2.1 VAE in original keys (``base_dim=96`` is the only width ComfyUI loads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = original_state_dict(random_wan_vae(base_dim))
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()}, str(path))
    return path


class _StateDictModule:
    def __init__(self, state: dict):
        self._state = state
        self.calls = 0

    def state_dict(self):
        self.calls += 1
        return dict(self._state)


class FakeComfyVAE:
    """What the sampler reads from ComfyUI's ``comfy.sd.VAE``: ``first_stage_model.state_dict()`` with original
    Wan keys, ``device``, ``vae_dtype`` and ``patcher.offload_device``."""

    def __init__(self, base_dim: int = 8, seed: int = 0):
        self.source = random_wan_vae(base_dim, seed)
        self.first_stage_model = _StateDictModule(original_state_dict(self.source))
        self.device = torch.device("cpu")
        self.vae_dtype = torch.float32
        self.patcher = type("Patcher", (), {"offload_device": torch.device("cpu")})()


class StandInCLIP:
    """What SDVG Prompt Schedule (and CLIPTextEncode) call on ComfyUI's CLIP: ``tokenize(text)`` then
    ``encode_from_tokens_scheduled(tokens)`` -> CONDITIONING ``[[context, {"pooled_output": ...}]]``. ``encode_text``
    maps a text to its UMT5-like context (the real encoder is 11 GB); ``encoded`` lists the texts encoded."""

    def __init__(self, encode_text):
        self.encode_text = encode_text
        self.encoded: list[str] = []

    def tokenize(self, text):
        return {"text": text}

    def encode_from_tokens_scheduled(self, tokens):
        self.encoded.append(tokens["text"])
        return [[self.encode_text(tokens["text"]), {"pooled_output": None}]]


def prompt_context(text: str) -> torch.Tensor:
    """A deterministic UMT5-like context [1, 512, 4096] per text (``text_context`` seeded by the text's bytes)."""
    import zlib

    return text_context(seed=zlib.crc32(text.encode()) % (2**31))
