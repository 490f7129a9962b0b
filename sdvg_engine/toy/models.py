"""Configs and loaders of the toy world's tiny models (the engine's real classes, tiny sizes).

* VAE: ``diffusers.AutoencoderKLWan`` (base_dim 8, z_dim 16, one res block per stage), 32x32 px -> 4x4 latents;
  its ``latents_mean`` / ``latents_std`` are the trained encoder's per-channel statistics.
* drafter / target: :class:`CausalWanTransformer3DModel`, patch 1x1x1 (16 tokens per latent frame), text_dim 256
  (:mod:`.text`). The target (12 layers, width 256, 13.3M parameters) costs ~15x the drafter's (2 layers, width 128,
  FFN 1024, 1.0M) multiply-adds per token and ~9x its wall time per block on one CPU thread, like 14B against 1.3B
  at real size (the drafter is bound by per-operation overhead at 48 tokens per call, so its FFN, widened from 512
  in issue 29 (``grow_ffn``), cost ~10% more time; more layers or width would have cost 1.3-1.8x). The target was
  grown from a 6-layer one (``scripts/train_toy.py`` ``grow_depth``), which cost only ~5x the drafter's time. (A
  2-layer, 64-wide drafter never learned to place the object in the first block; see scripts/train_toy.py
  first_block_loss.)
* reward: ``sdvg_engine.reward.ImageRewardModel`` with a tiny config (32x32 ViT), BLIP tokenizer.

Weights live in ``weights/`` as bfloat16 safetensors (loaded as float32); :func:`load_toy_models` checks each file's sha256 against
``weights/MANIFEST.json`` before loading.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

WEIGHTS = Path(__file__).resolve().parent / "weights"
MANIFEST = WEIGHTS / "MANIFEST.json"
FILES = {"vae": "vae.safetensors", "drafter": "drafter.safetensors", "target": "target.safetensors", "reward": "reward.safetensors"}

VAE_CONFIG = dict(base_dim=8, z_dim=16, num_res_blocks=1)
_DIT_COMMON = dict(patch_size=(1, 1, 1), in_channels=16, out_channels=16, text_dim=256, freq_dim=256,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
DRAFTER_CONFIG = dict(_DIT_COMMON, num_attention_heads=4, attention_head_dim=32, ffn_dim=1024, num_layers=2)
TARGET_CONFIG = dict(_DIT_COMMON, num_attention_heads=8, attention_head_dim=32, ffn_dim=1024, num_layers=12)
REWARD_HEADS = dict(vision_heads=2, text_heads=2)


def reward_config():
    from sdvg_engine.reward import ImageRewardConfig

    return ImageRewardConfig.tiny()


def build_vae(latents_mean=None, latents_std=None):
    from diffusers import AutoencoderKLWan

    kw = dict(VAE_CONFIG)
    if latents_mean is not None:
        kw.update(latents_mean=[float(x) for x in latents_mean], latents_std=[float(x) for x in latents_std])
    return AutoencoderKLWan(**kw)


def build_dit(which: str, num_layers: int | None = None, ffn_dim: int | None = None):
    from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel

    config = dict(DRAFTER_CONFIG if which == "drafter" else TARGET_CONFIG)
    if num_layers is not None:
        config["num_layers"] = num_layers
    if ffn_dim is not None:
        config["ffn_dim"] = ffn_dim
    return CausalWanTransformer3DModel(**config)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(weights: Path = WEIGHTS) -> dict:
    entries = {}
    for name, file in FILES.items():
        path = Path(weights) / file
        if path.exists():
            entries[file] = {"sha256": sha256(path), "bytes": path.stat().st_size}
    (Path(weights) / MANIFEST.name).write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return entries


def check_weights(names=tuple(FILES), weights: Path = WEIGHTS) -> None:
    """Raise if a weight file is missing or its sha256 differs from MANIFEST.json."""
    manifest_path = Path(weights) / MANIFEST.name
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path} is missing; run scripts/train_toy.py all")
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        file = FILES[name]
        path = Path(weights) / file
        if not path.exists() or file not in manifest:
            raise FileNotFoundError(f"toy weight {path} (or its MANIFEST entry) is missing; run scripts/train_toy.py {name}")
        digest = sha256(path)
        if digest != manifest[file]["sha256"]:
            raise ValueError(f"{path}: sha256 {digest} does not match MANIFEST.json ({manifest[file]['sha256']})")


def save_vae(vae, path: Path) -> None:
    from safetensors.torch import save_file

    cfg = {k: vae.config[k] for k in ("base_dim", "z_dim", "num_res_blocks", "latents_mean", "latents_std")}
    save_file({k: bf16(v) for k, v in vae.state_dict().items()}, str(path), metadata={"config": json.dumps(cfg)})


def bf16(t: torch.Tensor) -> torch.Tensor:
    """How the toy weights are shipped: floating tensors in bfloat16 (half the bytes; loaded as float32)."""
    return (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()


def load_vae(path: Path = WEIGHTS / FILES["vae"]):
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    vae = build_vae(cfg["latents_mean"], cfg["latents_std"])
    vae.load_state_dict(load_file(str(path)), strict=True)
    return vae.eval().requires_grad_(False)


def load_reward(path: Path = WEIGHTS / FILES["reward"]):
    from sdvg_engine.reward import load_image_reward

    return load_image_reward(path, **REWARD_HEADS)


def vae_round_trip(vae, clip) -> "np.ndarray":
    """A clip ``[T, H, W, 3]`` (0..1) encoded and decoded block by block as the pipeline decodes: the frames
    any generator's output is limited to. ``vae`` is a :class:`~sdvg_engine.vae.StreamingWanVAE` (reset after)."""
    x = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].mul(2).sub(1)
    with torch.no_grad():
        z = vae.normalize(vae.vae.encode(x).latent_dist.mean)
    vae.reset()
    frames = torch.cat([vae.decode_block(z[:, :, b : b + 3]) for b in range(0, z.shape[2], 3)], dim=2)
    vae.reset()
    return ((frames[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1).numpy()


@dataclass
class ToyModels:
    vae: object  # StreamingWanVAE
    drafter: object  # CausalWanTransformer3DModel
    target: object
    scorer: object  # ImageRewardScorer


def load_toy_models(check: bool = True, weights: Path = WEIGHTS) -> ToyModels:
    """Load the four shipped models (float32, CPU) after checking their hashes. ``weights``: another folder
    laid out like ``weights/`` (e.g. a training run's staging folder)."""
    from sdvg_engine.models.loading import load_causal_wan
    from sdvg_engine.vae import StreamingWanVAE

    weights = Path(weights)
    if check:
        check_weights(weights=weights)
    drafter, _ = load_causal_wan(weights / FILES["drafter"], dtype=torch.float32)
    target, _ = load_causal_wan(weights / FILES["target"], dtype=torch.float32)
    return ToyModels(vae=StreamingWanVAE(load_vae(weights / FILES["vae"])), drafter=drafter.eval(), target=target.eval(),
                     scorer=load_reward(weights / FILES["reward"]))
