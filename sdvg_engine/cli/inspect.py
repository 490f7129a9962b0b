"""``sdvg inspect``: say what a checkpoint file is, validating it as the loaders do."""

from __future__ import annotations

import json
from pathlib import Path


# ---- inspect --------------------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    """Describe a file, validating it exactly as the loaders do; exit 2 when a load would fail."""
    from ..models.loading import CheckpointError, inspect_checkpoint

    try:
        info = inspect_checkpoint(args.path, num_heads=args.num_heads)
    except CheckpointError:
        other = _describe_other(Path(args.path))
        if other is None:
            raise
        print(json.dumps(other, indent=2) if args.json else
              "\n".join(f"{k + ':':<16}{v}" for k, v in other.items()))
        return 0
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.describe())
    return 0


def _describe_other(path: Path) -> dict | None:
    """Files that are not causal DiTs but that SDVG also reads (Wan VAE, ImageReward), validated by their loaders.

    Returns ``None`` when the file is neither (the DiT error is then the answer); raises the loader's
    error when it is one of them but would not load.
    """
    from ..checkpoint_io import read_tensor_file

    if path.is_dir():
        config = path / "config.json"
        if not config.is_file() and (path / "vae" / "config.json").is_file():
            config = path / "vae" / "config.json"
        if not config.is_file() or '"AutoencoderKLWan"' not in config.read_text(errors="replace"):
            return None
        keys = None
    else:
        keys = list(read_tensor_file(path, entries=("state_dict", "model", "module"))[0])
    if keys is not None and any(k.startswith("blip.") for k in keys):
        from ..reward import load_image_reward

        scorer = load_image_reward(path)
        n = sum(p.numel() for p in scorer.model.parameters())
        return {"file": str(path), "kind": f"ImageReward reward model ({len(keys)} tensors, {n:,} parameters)"}
    # Original Wan keys (decoder.conv1 / middle / head) or diffusers keys (decoder.conv_in / up_blocks), with or
    # without a prefix such as "vae." or "first_stage_model." (stripped by load_wan_vae too).
    vae_keys = ("decoder.conv1.", "decoder.middle.0.residual", "decoder.head.", "decoder.up_blocks", "decoder.conv_in")
    if keys is None or any(name.startswith(vae_keys) for k in keys for name in (k, k.split(".", 1)[-1])):
        from ..vae import load_wan_vae

        vae = load_wan_vae(path)
        return {"file": str(path), "kind": f"Wan VAE (z_dim {vae.vae.config.z_dim}, base_dim {vae.vae.config.base_dim})"}
    return None

