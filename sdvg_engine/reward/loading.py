"""Reading an ImageReward checkpoint, inferring its sizes and validating its keys strictly.

The unmodified ``ImageReward.pt`` (THUDM/ImageReward on the Hugging Face Hub, ~1.8 GB) is a
plain ``state_dict`` of the ``ImageReward`` module: 625 entries = ViT 294 + text encoder 317
(incl. the ``embeddings.position_ids`` buffer) + ``vision_proj``/``text_proj`` 4 + head 10.
Nothing here downloads anything: a missing file raises ``FileNotFoundError`` saying where to
get it.

Policy for keys (``validate_state_dict``):

* every key the scorer *uses* must be present with the expected shape, else ``ValueError``
  naming the file and listing the keys;
* any key the model does not know is an error too (``ValueError``, listed);
* ``blip.vision_proj.*``, ``blip.text_proj.*`` (unused BLIP projections) and
  ``blip.text_encoder.embeddings.position_ids`` (always ``arange``) are *optional*: loaded when
  present, filled with zeros / arange when absent, so files stripped of them still load.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from .model import ImageRewardConfig, ImageRewardModel

__all__ = [
    "OPTIONAL_KEYS",
    "expected_keys",
    "infer_config",
    "read_state_dict",
    "validate_state_dict",
    "build_model_from_state_dict",
]

_V = "blip.visual_encoder."
_T = "blip.text_encoder."
POSITION_IDS_KEY = _T + "embeddings.position_ids"
#: Keys that may be absent from a checkpoint (unused for scoring, or derivable).
OPTIONAL_KEYS = frozenset(
    {
        POSITION_IDS_KEY,
        "blip.vision_proj.weight",
        "blip.vision_proj.bias",
        "blip.text_proj.weight",
        "blip.text_proj.bias",
    }
)
_MAX_LISTED = 40
_HUB_HINT = (
    "Download ImageReward.pt yourself (https://huggingface.co/THUDM/ImageReward, file "
    "'ImageReward.pt') and pass its local path; SDVG never downloads weights."
)


def expected_keys(cfg: ImageRewardConfig) -> dict[str, torch.Size]:
    """Key -> shape of the state dict of an ``ImageRewardModel(cfg)`` (built on meta, free)."""
    with torch.device("meta"):
        model = ImageRewardModel(cfg)
    return {k: v.shape for k, v in model.state_dict().items()}


def _max_index(keys, pattern: str) -> int | None:
    rx = re.compile(pattern)
    found = [int(m.group(1)) for k in keys if (m := rx.match(k))]
    return max(found) + 1 if found else None


def infer_config(
    state_dict: Mapping[str, torch.Tensor],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
) -> ImageRewardConfig:
    """Infer an ``ImageRewardConfig`` from tensor shapes.

    Widths, depths, patch size, image size (from ``pos_embed``: 1 + (S/p)^2 tokens), FFN sizes,
    vocabulary, max positions, projection and head widths are read from the shapes. Head counts
    cannot be inferred: defaults are ImageReward-v1.0's (16 vision, 12 text).
    Missing keys fall back to v1 values so that ``validate_state_dict`` can list them.
    """
    d = ImageRewardConfig.v1()
    sd = state_dict

    def shape(key: str):
        t = sd.get(key)
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    vision_width, patch, image_size = d.vision_width, d.patch_size, d.image_size
    if (s := shape(_V + "patch_embed.proj.weight")) is not None and len(s) == 4:
        vision_width, patch = s[0], s[-1]
    if (s := shape(_V + "pos_embed")) is not None and len(s) == 3:
        vision_width = s[-1]
        grid = int(round((s[1] - 1) ** 0.5))
        if grid * grid != s[1] - 1:
            raise ValueError(f"pos_embed has {s[1]} tokens: not 1 + a square number of patches")
        image_size = grid * patch
    keys = list(sd.keys())
    vision_layers = _max_index(keys, re.escape(_V) + r"blocks\.(\d+)\.") or d.vision_layers
    vision_mlp = (shape(_V + "blocks.0.mlp.fc1.weight") or (d.vision_mlp_dim,))[0]

    vocab, text_width = shape(_T + "embeddings.word_embeddings.weight") or (
        d.vocab_size,
        d.text_width,
    )
    max_pos = (shape(_T + "embeddings.position_embeddings.weight") or (d.max_position_embeddings,))[0]
    text_layers = _max_index(keys, re.escape(_T) + r"encoder\.layer\.(\d+)\.") or d.text_layers
    text_ffn = (shape(_T + "encoder.layer.0.intermediate.dense.weight") or (d.text_ffn,))[0]
    proj_dim = (shape("blip.vision_proj.weight") or shape("blip.text_proj.weight") or (d.proj_dim,))[0]
    head = tuple(
        (shape(f"mlp.layers.{i}.weight") or (h,))[0] for i, h in zip((0, 2, 4, 6), d.head_hidden)
    )
    return ImageRewardConfig(
        image_size=image_size,
        patch_size=patch,
        vision_width=vision_width,
        vision_layers=vision_layers,
        vision_heads=vision_heads if vision_heads is not None else d.vision_heads,
        vision_mlp_dim=vision_mlp,
        text_width=text_width,
        text_layers=text_layers,
        text_heads=text_heads if text_heads is not None else d.text_heads,
        text_ffn=text_ffn,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        proj_dim=proj_dim,
        head_hidden=head,
    )


def _listing(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_MAX_LISTED])
    more = f", ... (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return f"{len(keys)}: [{shown}{more}]"


def validate_state_dict(
    state_dict: Mapping[str, torch.Tensor], cfg: ImageRewardConfig, *, source: str = "<state dict>"
) -> None:
    """Raise ``ValueError`` (naming ``source``) on missing used keys, unknown keys, wrong shapes
    or a corrupt ``position_ids``; see the module docstring for the optional keys."""
    want = expected_keys(cfg)
    have = set(state_dict.keys())
    non_tensor = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    missing = set(want) - have - OPTIONAL_KEYS
    unexpected = have - set(want)
    problems = []
    if missing:
        problems.append(f"missing keys {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_listing(unexpected)}")
    if non_tensor:
        problems.append(f"non-tensor values {_listing(non_tensor)}")
    if not problems:
        bad = [
            f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(want[k])}"
            for k in sorted(have & set(want))
            if tuple(state_dict[k].shape) != tuple(want[k])
        ]
        if bad:
            problems.append(f"shape mismatches {len(bad)}: [{'; '.join(bad[:_MAX_LISTED])}]")
    if problems:
        raise ValueError(
            f"{source}: not an ImageReward-v1.0-compatible state dict "
            f"(expected {len(want)} keys with blip.visual_encoder.*, blip.text_encoder.*, "
            f"mlp.layers.* names): " + "; ".join(problems)
        )
    pos = state_dict.get(POSITION_IDS_KEY)
    if pos is not None and not pos.is_meta and not torch.equal(
        pos.long().reshape(-1), torch.arange(cfg.max_position_embeddings)
    ):
        raise ValueError(f"{source}: {POSITION_IDS_KEY} is not arange({cfg.max_position_embeddings})")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a checkpoint from disk without executing pickled code (the shared reader,
    :func:`sdvg_engine.checkpoint_io.read_tensor_file`).

    A ``{"state_dict": ...}`` or ``{"model": ...}`` single-entry wrapper is unwrapped. Integer or
    bool tensors other than ``position_ids`` are refused (``CheckpointError``, a ``ValueError``).
    """
    from ..checkpoint_io import CheckpointError, check_float_weights, read_tensor_file

    p = Path(path).expanduser()
    sd, _, _ = read_tensor_file(p, what="ImageReward checkpoint", hint=_HUB_HINT, entries=())
    if len(sd) == 1:
        (only_key, inner), = sd.items()
        if only_key in ("state_dict", "model") and isinstance(inner, Mapping):
            sd = dict(inner)
    if not sd:
        raise CheckpointError(f"{p}: the file holds no tensors. {_HUB_HINT}")
    check_float_weights(sd, p, allow=lambda k: k == POSITION_IDS_KEY)
    return dict(sd)


#: (key markers, what the file is, where it goes): files of the other models of the stack given as the reward
_OTHER_MODELS = (
    (("patch_embedding.", "blocks.0.self_attn.", "blocks.0.attn1.", "condition_embedder."),
     "a Wan DiT (a drafter or target transformer)", "pass it as the drafter or target (--drafter / --target)"),
    (("encoder.block.", "shared.weight"), "a UMT5 text encoder", "pass it to `sdvg encode-prompts --text-encoder`"),
    (("decoder.", "encoder.downsamples.", "encoder.down_blocks.", "conv1.", "post_quant_conv."), "a Wan VAE",
     "pass it as the VAE (--vae)"),
)


def _refuse_other_model(state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """A file with (almost) no ImageReward keys that is another model of the stack: say which, and where it goes,
    instead of listing thousands of missing keys."""
    keys = [k for k in state_dict if isinstance(k, str)]
    if not keys or sum(k.startswith(("blip.", "mlp.")) for k in keys) * 2 > len(keys):
        return
    bare = [k.split("diffusion_model.", 1)[-1].removeprefix("model.").removeprefix("vae.") for k in keys]
    for markers, what, fix in _OTHER_MODELS:
        if any(k.startswith(markers) for k in bare):
            raise ValueError(f"{source}: this is {what}, not an ImageReward checkpoint; {fix}. The reward model is "
                             "ImageReward.pt (THUDM/ImageReward)")


def build_model_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    source: str = "<state dict>",
) -> ImageRewardModel:
    """Infer the config, validate strictly and return an eval-mode CPU model holding the
    checkpoint tensors (built on meta and filled with ``assign=True``: no double allocation)."""
    _refuse_other_model(state_dict, source)
    try:
        cfg = infer_config(state_dict, vision_heads=vision_heads, text_heads=text_heads)
    except ValueError as e:  # e.g. non-square pos_embed, heads not dividing the width
        raise ValueError(f"{source}: {e}") from e
    validate_state_dict(state_dict, cfg, source=source)
    want = expected_keys(cfg)
    sd = dict(state_dict)
    for key in OPTIONAL_KEYS - set(sd):
        # position_ids is arange; the projections are unused for scoring, zeros are harmless.
        sd[key] = (
            torch.arange(cfg.max_position_embeddings).unsqueeze(0)
            if key == POSITION_IDS_KEY
            else torch.zeros(want[key])
        )
    with torch.device("meta"):
        model = ImageRewardModel(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    # Keep a canonical int64 position_ids whatever dtype the file stored it in.
    model.blip.text_encoder.embeddings.position_ids = sd[POSITION_IDS_KEY].long().reshape(1, -1)
    model.requires_grad_(False)
    return model.eval()
