"""ImageReward-v1.0 compatible network: BLIP ViT + cross-attention BERT + MLP head.

Written from scratch (torch + einops) so that no `image-reward`, `timm`, `fairscale` or
torchvision import is needed at run time. The module tree mirrors the original one so that
``state_dict()`` key names are *exactly* those of ``ImageReward.pt``:

* ``blip.visual_encoder.*``  BLIP's timm-style ViT (``patch_embed.proj``, ``cls_token``,
  ``pos_embed``, ``blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``),
  LayerNorm eps 1e-6, exact-erf GELU, qkv with bias.
* ``blip.text_encoder.*``    BLIP's ``med.py`` BertModel without pooler and *without*
  token-type embeddings: ``embeddings.{word_embeddings,position_embeddings,LayerNorm,position_ids}``
  and ``encoder.layer.{i}.{attention,crossattention}.{self.{query,key,value},output.{dense,LayerNorm}}``,
  ``intermediate.dense``, ``output.{dense,LayerNorm}``; LayerNorm eps 1e-12; the cross-attention
  key/value project from the ViT width.
* ``blip.vision_proj`` / ``blip.text_proj``: present in the checkpoint (BLIP's contrastive
  projections) but unused for scoring; kept so the state dict round-trips 1:1.
* ``mlp.layers.{0,2,4,6,7}``: Linear 768->1024->128->64->16->1 with dropouts at 1, 3, 5 and,
  as in ImageReward, *no* activations (the head is one affine map, trained factorised).

Sources read for the layout (not copied): THUDM/ImageReward ``ImageReward/ImageReward.py``,
``ImageReward/models/BLIP/{vit,med,blip,blip_pretrain}.py`` and ``train/src/config/med_config.json``.

Reward = (mlp(text_hidden[:, 0]) - REWARD_MEAN) / REWARD_STD, where ``text_hidden`` is the text
encoder's last hidden state with the image tokens as cross-attention memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = [
    "REWARD_MEAN",
    "REWARD_STD",
    "ImageRewardConfig",
    "ImageRewardModel",
    "VisionTransformer",
    "TextEncoder",
    "RewardHead",
    "count_parameters",
    "randomize_reward_head",
]

#: Normalisation constants of ImageReward-v1.0 (``ImageReward.mean`` / ``ImageReward.std``).
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072


@dataclass(frozen=True)
class ImageRewardConfig:
    """Sizes of the reward network. ``v1()`` is ImageReward-v1.0; ``tiny()`` is for tests.

    All fields except the head counts can be inferred from a state dict (see
    ``sdvg_engine.reward.loading.infer_config``).
    """

    # Vision (BLIP ViT, timm layout).
    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_mlp_dim: int = 4096
    vision_eps: float = 1e-6
    # Text (BLIP med.py BERT with cross-attention).
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_ffn: int = 3072
    vocab_size: int = 30524
    max_position_embeddings: int = 512
    text_eps: float = 1e-12
    # BLIP contrastive projection width (vision_proj / text_proj; unused for scoring).
    proj_dim: int = 256
    # Reward head hidden sizes (input is text_width, output is 1).
    head_hidden: tuple[int, ...] = field(default=(1024, 128, 64, 16))

    def __post_init__(self) -> None:
        from ..checks import check_int

        for name in ("image_size", "patch_size", "vision_width", "vision_layers", "vision_heads", "vision_mlp_dim",
                     "text_width", "text_layers", "text_heads", "text_ffn", "vocab_size", "max_position_embeddings",
                     "proj_dim"):
            # Before the divisibility checks below: a head count of 0 was a ZeroDivisionError.
            check_int(name, getattr(self, name), low=1,
                      fix="ImageReward v1.0 has vision_heads=16 and text_heads=12" if name.endswith("_heads") else "")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.vision_width % self.vision_heads:
            raise ValueError(
                f"vision_width {self.vision_width} is not divisible by vision_heads {self.vision_heads}"
            )
        if self.text_width % self.text_heads:
            raise ValueError(
                f"text_width {self.text_width} is not divisible by text_heads {self.text_heads}"
            )
        if len(self.head_hidden) != 4:
            # The key names mlp.layers.{0,2,4,6,7} fix the head at five Linear layers.
            raise ValueError(f"head_hidden must have 4 entries, got {self.head_hidden}")
        object.__setattr__(self, "head_hidden", tuple(int(h) for h in self.head_hidden))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def v1(cls) -> "ImageRewardConfig":
        """ImageReward-v1.0: ViT-L/16 @ 224 + BERT-base with cross-attention (446.7M params)."""
        return cls()

    @classmethod
    def tiny(cls) -> "ImageRewardConfig":
        """A ~1.4M-parameter model for CPU tests (mostly the 30524-word embedding)."""
        return cls(
            image_size=32,
            patch_size=16,
            vision_width=32,
            vision_layers=2,
            vision_heads=2,
            vision_mlp_dim=128,
            text_width=32,
            text_layers=2,
            text_heads=2,
            text_ffn=64,
            max_position_embeddings=64,
            proj_dim=16,
        )

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Vision: BLIP ViT (timm 0.6 key layout)
# --------------------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Conv patchifier. ``[B, 3, S, S] -> [B, (S/p)^2, W]``; key ``patch_embed.proj``."""

    def __init__(self, patch_size: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rearrange(self.proj(x), "b c h w -> b (h w) c")


class ViTAttention(nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection (timm layout)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, W]. The fused weight is ordered (q | k | v), each split into heads.
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v)  # scale = head_dim ** -0.5, as timm
        return self.proj(rearrange(out, "b h t d -> b t (h d)"))


class ViTMlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # nn.GELU default = exact erf form


class ViTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, width: int, heads: int, mlp_dim: int, eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=eps)
        self.attn = ViTAttention(width, heads)
        self.norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = ViTMlp(width, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """BLIP's ViT. ``forward([B, 3, S, S]) -> [B, 1 + N, W]`` (CLS first, after the final norm)."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        w = cfg.vision_width
        self.patch_embed = PatchEmbed(cfg.patch_size, w)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, w))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches + 1, w))
        self.blocks = nn.ModuleList(
            ViTBlock(w, cfg.vision_heads, cfg.vision_mlp_dim, cfg.vision_eps)
            for _ in range(cfg.vision_layers)
        )
        self.norm = nn.LayerNorm(w, eps=cfg.vision_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)  # [B, N, W]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# --------------------------------------------------------------------------------------------
# Text: BLIP med.py BERT encoder with cross-attention (HF BERT key layout)
# --------------------------------------------------------------------------------------------


class TextEmbeddings(nn.Module):
    """Word + absolute position embeddings, LayerNorm. No token-type embeddings (as med.py)."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.text_width, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.text_width)
        self.LayerNorm = nn.LayerNorm(cfg.text_width, eps=cfg.text_eps)
        # Persistent, as in med.py, so that the checkpoint's `embeddings.position_ids` key has a
        # home; the loader accepts files without it (it is always arange).
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_position_embeddings).unsqueeze(0), persistent=True
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [B, L] -> [B, L, D]
        pos = self.position_ids[:, : input_ids.shape[1]]
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(pos))


class BertSelfAttention(nn.Module):
    """``query``/``key``/``value`` projections; keys/values from ``kv_width`` inputs."""

    def __init__(self, width: int, kv_width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(kv_width, width)
        self.value = nn.Linear(kv_width, width)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # x: [B, L, D]; memory: [B, M, kv_width]; mask: bool [B, 1, 1, M] (True = attend) or None.
        q = rearrange(self.query(x), "b l (h d) -> b h l d", h=self.heads)
        k = rearrange(self.key(memory), "b m (h d) -> b h m d", h=self.heads)
        v = rearrange(self.value(memory), "b m (h d) -> b h m d", h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return rearrange(out, "b h l d -> b l (h d)")


class BertSelfOutput(nn.Module):
    """Post-norm residual: ``LayerNorm(dense(h) + residual)``."""

    def __init__(self, width: int, in_width: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_width, width)
        self.LayerNorm = nn.LayerNorm(width, eps=eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, width: int, kv_width: int, heads: int, eps: float):
        super().__init__()
        self.self = BertSelfAttention(width, kv_width, heads)
        self.output = BertSelfOutput(width, width, eps)

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return self.output(self.self(x, memory, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.dense = nn.Linear(width, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # med_config hidden_act "gelu" = exact erf form


class BertLayer(nn.Module):
    """Self-attention -> cross-attention to the image tokens -> feed-forward, all post-norm."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        d, eps = cfg.text_width, cfg.text_eps
        self.attention = BertAttention(d, d, cfg.text_heads, eps)
        self.crossattention = BertAttention(d, cfg.vision_width, cfg.text_heads, eps)
        self.intermediate = BertIntermediate(d, cfg.text_ffn)
        self.output = BertSelfOutput(d, cfg.text_ffn, eps)

    def forward(
        self, x: torch.Tensor, text_mask: torch.Tensor, image_embeds: torch.Tensor
    ) -> torch.Tensor:
        x = self.attention(x, x, text_mask)
        # All image tokens are valid (ImageReward passes an all-ones encoder mask): no mask.
        x = self.crossattention(x, image_embeds, None)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.text_layers))


class TextEncoder(nn.Module):
    """BLIP's multimodal text encoder (med.py ``BertModel(add_pooling_layer=False)``)."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_embeds: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids``/``attention_mask``: [B, L] (or [1, L], broadcast to the image batch);
        ``image_embeds``: [B, M, vision_width]. Returns the last hidden state [B, L, text_width].
        """
        b = image_embeds.shape[0]
        if input_ids.shape[0] != b:
            input_ids = input_ids.expand(b, -1)
            attention_mask = attention_mask.expand(b, -1)
        x = self.embeddings(input_ids)
        # Padding keys are excluded (med.py adds -10000, which underflows to exactly 0 weight
        # after softmax in fp32, so a boolean mask gives the same result).
        text_mask = attention_mask.bool()[:, None, None, :]
        image_embeds = image_embeds.to(x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, text_mask, image_embeds)
        return x


# --------------------------------------------------------------------------------------------
# Reward head and the whole model
# --------------------------------------------------------------------------------------------


class RewardHead(nn.Module):
    """ImageReward's ``MLP``: five Linear layers with dropouts between, no activations."""

    def __init__(self, in_width: int, hidden: tuple[int, ...]):
        super().__init__()
        h0, h1, h2, h3 = hidden
        self.layers = nn.Sequential(
            nn.Linear(in_width, h0),
            nn.Dropout(0.2),
            nn.Linear(h0, h1),
            nn.Dropout(0.2),
            nn.Linear(h1, h2),
            nn.Dropout(0.1),
            nn.Linear(h2, h3),
            nn.Linear(h3, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Blip(nn.Module):
    """Container giving the ``blip.`` key prefix of ImageReward.pt."""

    def __init__(self, cfg: ImageRewardConfig):
        super().__init__()
        self.visual_encoder = VisionTransformer(cfg)
        self.text_encoder = TextEncoder(cfg)
        # Unused for scoring; present in the checkpoint (BLIP_Pretrain's ITC projections).
        self.vision_proj = nn.Linear(cfg.vision_width, cfg.proj_dim)
        self.text_proj = nn.Linear(cfg.text_width, cfg.proj_dim)


class ImageRewardModel(nn.Module):
    """The whole ImageReward network. ``state_dict()`` keys equal ImageReward.pt's keys.

    Build on ``torch.device("meta")`` to get shapes/keys without allocating memory.
    """

    def __init__(self, cfg: ImageRewardConfig | None = None):
        super().__init__()
        self.config = cfg or ImageRewardConfig.v1()
        self.blip = Blip(self.config)
        self.mlp = RewardHead(self.config.text_width, self.config.head_hidden)

    # -- initialisation (only for randomly initialised models; checkpoints overwrite it) --

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, *, std: float = 0.02) -> None:
        """BLIP-style init: N(0, std=0.02) linears/embeddings/positions, LayerNorm (1, 0),
        ImageReward's head init N(0, 1/(in+1)) with zero biases. Deterministic given
        ``generator``."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)):
                m.weight.normal_(0.0, std, generator=generator)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()
        vit = self.blip.visual_encoder
        vit.pos_embed.normal_(0.0, std, generator=generator)
        vit.cls_token.normal_(0.0, std, generator=generator)
        for lin in self.mlp.layers:
            if isinstance(lin, nn.Linear):
                lin.weight.normal_(0.0, 1.0 / (self.config.text_width + 1), generator=generator)
                lin.bias.zero_()

    # -- forward pieces --

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: [B, 3, S, S] normalised. Returns ViT tokens [B, 1 + N, vision_width]."""
        return self.blip.visual_encoder(pixels)

    def reward_from_image_embeds(
        self,
        image_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``image_embeds`` [B, M, Wv]; ``input_ids``/``attention_mask`` [1 or B, L].
        Returns normalised rewards [B] (in the head's dtype)."""
        hidden = self.blip.text_encoder(input_ids, attention_mask, image_embeds)
        cls = hidden[:, 0]
        head_dtype = self.mlp.layers[0].weight.dtype
        raw = self.mlp(cls.to(head_dtype)).squeeze(-1)
        return (raw - REWARD_MEAN) / REWARD_STD

    def forward(
        self,
        pixels: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rewards [B], image_features [B, vision_width])`` where the features are the
        ViT CLS token after the final norm."""
        embeds = self.encode_images(pixels)
        return self.reward_from_image_embeds(embeds, input_ids, attention_mask), embeds[:, 0]


@torch.no_grad()
def randomize_reward_head(
    model: ImageRewardModel, generator: torch.Generator | None = None, *, first_std: float = 0.3
) -> None:
    """Re-initialise the reward head of a *random* model so that scores spread out.

    With ImageReward's head init (N(0, 1/(in+1)) through five layers) the head output is ~0
    and every image scores -REWARD_MEAN/REWARD_STD = -0.162. Here the first layer is
    N(0, first_std) and the later ones variance-preserving (N(0, 1/in)), giving scores of
    order 1 that differ between images. For tests, demos and benchmarks only.
    """
    first = True
    for lin in model.mlp.layers:
        if isinstance(lin, nn.Linear):
            std = first_std if first else lin.in_features**-0.5
            lin.weight.normal_(0.0, std, generator=generator)
            lin.bias.zero_()
            first = False


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (buffers excluded); works on meta-device models."""
    return sum(p.numel() for p in model.parameters())

