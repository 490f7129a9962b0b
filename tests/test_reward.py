"""Tests of the ImageReward-compatible scorer (CPU, tiny config; real size only on meta)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from sdvg_engine.reward import (
    REWARD_MEAN,
    REWARD_STD,
    BlipTokenizer,
    ImageRewardConfig,
    ImageRewardModel,
    build_tiny_image_reward,
    count_parameters,
    frames_to_uint8,
    infer_config,
    load_image_reward,
    preprocess_frames,
)
from sdvg_engine.reward.loading import build_model_from_state_dict, expected_keys
from sdvg_engine.reward.tokenizer import VOCAB_SHA256, default_vocab_path

PROMPT = "a photo of a cat"


# ----------------------------------------------------------------------------------------------
# Key list written down independently from the original source (not from our model):
# THUDM/ImageReward ImageReward/models/BLIP/vit.py (timm Block/PatchEmbed names), med.py
# (BertEmbeddings without token types + persistent position_ids buffer, BertLayer with
# crossattention, no pooler), blip_pretrain.py (vision_proj/text_proj) and ImageReward.py (MLP).
# ----------------------------------------------------------------------------------------------


def source_state_dict_shapes(
    *, vision_layers=24, vision_width=1024, patches=196, patch=16, mlp_ratio=4,
    text_layers=12, text_width=768, ffn=3072, vocab=30524, max_pos=512, proj=256,
) -> dict[str, tuple[int, ...]]:
    V, T = "blip.visual_encoder.", "blip.text_encoder."
    vw, tw = vision_width, text_width
    s = {
        V + "cls_token": (1, 1, vw),
        V + "pos_embed": (1, patches + 1, vw),
        V + "patch_embed.proj.weight": (vw, 3, patch, patch),
        V + "patch_embed.proj.bias": (vw,),
    }
    for i in range(vision_layers):
        b = f"{V}blocks.{i}."
        for name, (o, n) in {
            "norm1": (vw, None), "attn.qkv": (3 * vw, vw), "attn.proj": (vw, vw),
            "norm2": (vw, None), "mlp.fc1": (mlp_ratio * vw, vw), "mlp.fc2": (vw, mlp_ratio * vw),
        }.items():
            s[b + name + ".weight"] = (o,) if n is None else (o, n)
            s[b + name + ".bias"] = (o,)
    s[V + "norm.weight"] = (vw,)
    s[V + "norm.bias"] = (vw,)
    s[T + "embeddings.word_embeddings.weight"] = (vocab, tw)
    s[T + "embeddings.position_embeddings.weight"] = (max_pos, tw)
    s[T + "embeddings.LayerNorm.weight"] = (tw,)
    s[T + "embeddings.LayerNorm.bias"] = (tw,)
    s[T + "embeddings.position_ids"] = (1, max_pos)
    for i in range(text_layers):
        b = f"{T}encoder.layer.{i}."
        for att, kv in (("attention", tw), ("crossattention", vw)):
            for name, (o, n) in {
                "self.query": (tw, tw), "self.key": (tw, kv), "self.value": (tw, kv),
                "output.dense": (tw, tw), "output.LayerNorm": (tw, None),
            }.items():
                s[f"{b}{att}.{name}.weight"] = (o,) if n is None else (o, n)
                s[f"{b}{att}.{name}.bias"] = (o,)
        s[b + "intermediate.dense.weight"] = (ffn, tw)
        s[b + "intermediate.dense.bias"] = (ffn,)
        s[b + "output.dense.weight"] = (tw, ffn)
        s[b + "output.dense.bias"] = (tw,)
        s[b + "output.LayerNorm.weight"] = (tw,)
        s[b + "output.LayerNorm.bias"] = (tw,)
    s["blip.vision_proj.weight"] = (proj, vw)
    s["blip.vision_proj.bias"] = (proj,)
    s["blip.text_proj.weight"] = (proj, tw)
    s["blip.text_proj.bias"] = (proj,)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, tw), (128, 1024), (64, 128), (16, 64), (1, 16))):
        s[f"mlp.layers.{i}.weight"] = (o, n)
        s[f"mlp.layers.{i}.bias"] = (o,)
    return s


@pytest.fixture(scope="module")
def scorer():
    return build_tiny_image_reward(seed=0)


def _frames(n, h=48, w=80, seed=1):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------- keys / real-size layout ---------------------------


def test_real_size_keys_match_imagereward_source():
    ours = {k: tuple(v) for k, v in expected_keys(ImageRewardConfig.v1()).items()}
    src = source_state_dict_shapes()
    assert len(src) == 625
    assert set(ours) == set(src)
    assert ours == src  # shapes too
    for key in (
        "blip.visual_encoder.blocks.23.attn.qkv.weight",
        "blip.visual_encoder.patch_embed.proj.weight",
        "blip.text_encoder.encoder.layer.11.crossattention.self.key.weight",
        "blip.text_encoder.encoder.layer.11.crossattention.output.LayerNorm.bias",
        "blip.text_encoder.embeddings.position_ids",
        "mlp.layers.7.bias",
    ):
        assert key in ours
    assert ours["blip.text_encoder.encoder.layer.11.crossattention.self.key.weight"] == (768, 1024)
    assert not any("pooler" in k or "token_type" in k for k in ours)


def test_real_size_param_count_on_meta():
    with torch.device("meta"):
        model = ImageRewardModel(ImageRewardConfig.v1())
    n = count_parameters(model)
    assert n == 446_665_953  # ~446.7M as in the reference notes
    assert count_parameters(model.blip.visual_encoder) == pytest.approx(303.3e6, rel=2e-3)


def test_real_size_state_dict_with_imagereward_names_loads_strictly():
    # Meta tensors with exactly ImageReward.pt's names and shapes (no 1.8 GB allocation).
    sd = {k: torch.empty(s, device="meta") for k, s in source_state_dict_shapes().items()}
    sd["blip.text_encoder.embeddings.position_ids"] = torch.empty(
        1, 512, dtype=torch.long, device="meta"
    )
    cfg = infer_config(sd)
    assert cfg == ImageRewardConfig.v1()
    model = build_model_from_state_dict(sd, source="ImageReward.pt")
    assert set(model.state_dict()) == set(sd)


def test_infer_config_roundtrip_tiny(scorer):
    sd = scorer.model.state_dict()
    assert infer_config(sd, vision_heads=2, text_heads=2) == ImageRewardConfig.tiny()


# ------------------------------------------- loading from a file ------------------------------


def _save(tmp_path, sd, name="ImageReward.pt"):
    path = tmp_path / name
    torch.save(sd, path)
    return path


def test_load_tiny_checkpoint_strict_and_identical(tmp_path, scorer):
    path = _save(tmp_path, {k: v.clone() for k, v in scorer.model.state_dict().items()})
    loaded = load_image_reward(path, vision_heads=2, text_heads=2)
    frames = _frames(3)
    a = scorer.score_frames(frames, PROMPT)
    b = loaded.score_frames(frames, PROMPT)
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)
    torch.testing.assert_close(a.image_features, b.image_features, rtol=0, atol=0)
    assert loaded.config == ImageRewardConfig.tiny()
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_load_safetensors(tmp_path, scorer):
    from safetensors.torch import save_file

    sd = {k: v.clone().contiguous() for k, v in scorer.model.state_dict().items()}
    path = tmp_path / "ir.safetensors"
    save_file(sd, str(path))
    loaded = load_image_reward(path, vision_heads=2, text_heads=2)
    frames = _frames(2)
    torch.testing.assert_close(
        scorer.score_frames(frames, PROMPT).scores, loaded.score_frames(frames, PROMPT).scores
    )


def test_missing_key_fails_with_its_name(tmp_path, scorer):
    sd = dict(scorer.model.state_dict())
    del sd["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    path = _save(tmp_path, sd)
    with pytest.raises(ValueError) as e:
        load_image_reward(path, vision_heads=2, text_heads=2)
    msg = str(e.value)
    assert str(path) in msg
    assert "missing keys 1" in msg
    assert "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight" in msg


def test_unexpected_key_fails_with_its_name(tmp_path, scorer):
    sd = dict(scorer.model.state_dict())
    sd["blip.text_encoder.pooler.dense.weight"] = torch.zeros(32, 32)
    path = _save(tmp_path, sd)
    with pytest.raises(ValueError, match=r"unexpected keys 1: \[blip\.text_encoder\.pooler\.dense\.weight\]"):
        load_image_reward(path, vision_heads=2, text_heads=2)


def test_shape_mismatch_fails(tmp_path, scorer):
    sd = dict(scorer.model.state_dict())
    sd["mlp.layers.2.bias"] = torch.zeros(7)
    with pytest.raises(ValueError, match="shape mismatches 1: .*mlp.layers.2.bias"):
        load_image_reward(_save(tmp_path, sd), vision_heads=2, text_heads=2)


def test_optional_unused_keys_may_be_absent(tmp_path, scorer):
    sd = {k: v for k, v in scorer.model.state_dict().items()
          if "_proj" not in k and not k.endswith("position_ids")}
    loaded = load_image_reward(_save(tmp_path, sd), vision_heads=2, text_heads=2)
    frames = _frames(2)
    torch.testing.assert_close(
        scorer.score_frames(frames, PROMPT).scores, loaded.score_frames(frames, PROMPT).scores
    )


def test_missing_file_and_non_state_dict(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_image_reward("ImageReward-v1.0")
    path = tmp_path / "bad.pt"
    torch.save({"a": object.__new__(torch.nn.Identity)}, path)  # needs unpickling of a class
    with pytest.raises(ValueError, match="weights_only=True"):
        load_image_reward(path)
    torch.save({"blip.visual_encoder.pos_embed": "nope"}, path)
    with pytest.raises(ValueError):
        load_image_reward(path)


# ------------------------------------------- tokenizer -----------------------------------------


def test_tokenizer_ids_and_vocab():
    import hashlib

    assert hashlib.sha256(default_vocab_path().read_bytes()).hexdigest() == VOCAB_SHA256
    tok = BlipTokenizer()
    assert len(tok) == 30524
    assert (tok.dec_token_id, tok.enc_token_id) == (30522, 30523)
    assert tok.encode_ids(PROMPT) == [101, 1037, 6302, 1997, 1037, 4937, 102]
    ids, mask = tok(PROMPT)
    assert ids.shape == mask.shape == (1, 35) and ids.dtype == torch.long
    assert ids[0, :7].tolist() == [101, 1037, 6302, 1997, 1037, 4937, 102]
    assert ids[0, 7:].eq(0).all() and mask.sum() == 7
    long_ids, long_mask = tok("cat " * 100)
    assert long_mask.sum() == 35 and long_ids[0, 0] == 101 and long_ids[0, -1] == 102


def test_tokenizer_rejects_truncated_vocab(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("\n".join(default_vocab_path().read_text(encoding="utf-8").splitlines()[:1000]))
    with pytest.raises(ValueError, match="expected 30524"):
        BlipTokenizer(bad)


def test_prompt_cache(scorer):
    a = scorer.encode_prompt("a red fox")
    assert scorer.encode_prompt("a red fox") is a
    assert scorer.encode_prompt("a blue fox") is not a


# ------------------------------------------- scoring -------------------------------------------


def test_batch_equals_one_at_a_time(scorer):
    frames = _frames(6)
    batched = scorer.score_frames(frames, PROMPT)
    single = [scorer.score_frames(frames[i : i + 1], PROMPT) for i in range(6)]
    assert batched.scores.shape == (6,) and batched.scores.dtype == torch.float32
    assert batched.image_features.shape == (6, 32)
    torch.testing.assert_close(batched.scores, torch.cat([s.scores for s in single]), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        batched.image_features, torch.cat([s.image_features for s in single]), rtol=0, atol=1e-5
    )
    assert batched.scores.std() > 0.05  # the tiny model tells images apart
    # Chunked batches give the same result.
    scorer.batch_size = 4
    try:
        torch.testing.assert_close(scorer.score_frames(frames, PROMPT).scores, batched.scores, atol=1e-5, rtol=0)
    finally:
        scorer.batch_size = None


def test_score_formula_and_prompt_matters(scorer):
    m = scorer.model
    pixels = preprocess_frames(_frames(2), 32)
    feats = scorer.encode_prompt(PROMPT)
    with torch.no_grad():
        embeds = m.blip.visual_encoder(pixels)
        hidden = m.blip.text_encoder(feats.input_ids, feats.attention_mask, embeds)
        x = hidden[:, 0]
        for i in (0, 2, 4, 6, 7):  # dropouts are identities in eval; no activations
            lin = m.mlp.layers[i]
            x = x @ lin.weight.T + lin.bias
        manual = (x.squeeze(-1) - REWARD_MEAN) / REWARD_STD
    out = scorer.score_frames(_frames(2), feats)
    torch.testing.assert_close(out.scores, manual, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.image_features, embeds[:, 0], rtol=0, atol=1e-6)
    other = scorer.score_frames(_frames(2), "an astronaut riding a horse")
    assert not torch.allclose(other.scores, out.scores)


def test_text_encoder_matches_transformers_blip_text_model(scorer):
    """Independent reference: transformers' BlipTextModel (a port of the same med.py) loaded
    with our text-encoder weights (same key names) must give the same hidden states."""
    from transformers import BlipTextConfig, BlipTextModel

    cfg = scorer.config
    hf_cfg = BlipTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.text_width, encoder_hidden_size=cfg.vision_width,
        intermediate_size=cfg.text_ffn, num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads, max_position_embeddings=cfg.max_position_embeddings,
        layer_norm_eps=cfg.text_eps, hidden_act="gelu", is_decoder=True,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    ref = BlipTextModel(hf_cfg, add_pooling_layer=False).eval()
    ours = scorer.model.blip.text_encoder
    sd = {k: v for k, v in ours.state_dict().items() if not k.endswith("position_ids")}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("position_ids") for k in missing)
    ids, mask = scorer.tokenizer("two dogs playing in the snow")
    ids, mask = ids.expand(3, -1), mask.expand(3, -1)
    image = torch.randn(3, 5, cfg.vision_width, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(
            input_ids=ids, attention_mask=mask, encoder_hidden_states=image,
            encoder_attention_mask=torch.ones(3, 5, dtype=torch.long), is_decoder=False,
        ).last_hidden_state
        got = ours(ids, mask, image)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vit_block_matches_manual_reference(scorer):
    """One ViT block and the patch embedding against explicit matmuls (timm semantics)."""
    vit = scorer.model.blip.visual_encoder
    blk = vit.blocks[0]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4))
    heads, d = 2, 16
    with torch.no_grad():
        h = F.layer_norm(x, (32,), blk.norm1.weight, blk.norm1.bias, 1e-6)
        qkv = (h @ blk.attn.qkv.weight.T + blk.attn.qkv.bias).reshape(2, 5, 3, heads, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        o = (att @ v).transpose(1, 2).reshape(2, 5, 32) @ blk.attn.proj.weight.T + blk.attn.proj.bias
        x1 = x + o
        h2 = F.layer_norm(x1, (32,), blk.norm2.weight, blk.norm2.bias, 1e-6)
        m = F.gelu(h2 @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
        torch.testing.assert_close(blk(x), x1 + m, rtol=1e-5, atol=1e-5)
        img = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
        patches = F.unfold(img, 16, stride=16).transpose(1, 2)  # [1, 4, 3*16*16], row-major grid
        want = patches @ vit.patch_embed.proj.weight.reshape(32, -1).T + vit.patch_embed.proj.bias
        torch.testing.assert_close(vit.patch_embed(img), want, rtol=1e-5, atol=1e-5)


def test_bf16_close_to_fp32():
    s = build_tiny_image_reward(seed=0)
    frames = _frames(3)
    ref = s.score_frames(frames, PROMPT).scores
    s.to(dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16
    low = s.score_frames(frames, PROMPT)
    assert low.scores.dtype == torch.float32
    assert (low.scores - ref).abs().max() < 0.25


# ------------------------------------------- preprocessing -------------------------------------


MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


def test_preprocess_center_and_full_shapes():
    frames = _frames(2, h=480, w=832)
    for mode in ("pil", "torch"):
        for crop in ("center", "full"):
            out = preprocess_frames(frames, 224, crop=crop, preprocess=mode)
            assert out.shape == (2, 3, 224, 224) and out.dtype == torch.float32
    # An SxS frame is only normalised (torch) or only 8-bit truncated + normalised (pil), both crops.
    sq = _frames(1, h=32, w=32)
    truncated = torch.floor(sq * 255) / 255  # sq in [0, 1): floor == truncation
    for crop in ("center", "full"):
        torch.testing.assert_close(preprocess_frames(sq, 32, crop=crop, preprocess="torch"), (sq - MEAN) / STD)
        torch.testing.assert_close(preprocess_frames(sq, 32, crop=crop, preprocess="pil"), (truncated - MEAN) / STD)
    # uint8 input is accepted; the caller's tensor is not modified.
    u8 = (sq * 255).round().to(torch.uint8)
    for mode in ("pil", "torch"):
        torch.testing.assert_close(preprocess_frames(u8, 32, preprocess=mode), (u8.float() / 255 - MEAN) / STD)
        wide = _frames(1, h=32, w=60) * 3 - 1
        before = wide.clone()
        preprocess_frames(wide, 32, preprocess=mode)
        assert torch.equal(wide, before)


def test_preprocess_torch_center_crop_geometry():
    # Shorter side -> S (torchvision Resize(int): long = int(S * long / short)), then crop.
    frames = _frames(1, h=64, w=96)
    out = preprocess_frames(frames, 32, crop="center", preprocess="torch")
    resized = F.interpolate(frames, size=(32, 48), mode="bicubic", antialias=True).clamp(0, 1)
    torch.testing.assert_close(out, (resized[..., :, 8:40] - MEAN) / STD)


# ---- PIL-exact path, against a reference written here from torchvision/ImageReward's documented steps ----


def _reference_u8(frames: torch.Tensor) -> np.ndarray:
    """The reference server's TF.to_pil_image(x.clamp(0, 1)): x * 255 truncated, as [N, H, W, 3] uint8."""
    x = np.clip(frames.permute(0, 2, 3, 1).numpy().astype(np.float32), 0.0, 1.0)
    return np.floor(x * np.float32(255.0)).astype(np.uint8)


def _reference_pil(u8_hwc: np.ndarray, size: int, crop: str = "center", *, round_fn=round) -> np.ndarray:
    """Resize(size, BICUBIC) + CenterCrop(size) + ToTensor + Normalize on one PIL image -> [3, S, S] float32."""
    img = Image.fromarray(u8_hwc)
    w, h = img.size
    if crop == "full":
        img = img.resize((size, size), Image.BICUBIC)
    else:
        short, long = min(w, h), max(w, h)
        new_long = int(size * long / short)
        nw, nh = (size, new_long) if w <= h else (new_long, size)
        img = img.resize((nw, nh), Image.BICUBIC)
        top, left = int(round_fn((nh - size) / 2.0)), int(round_fn((nw - size) / 2.0))
        img = img.crop((left, top, left + size, top + size))
    a = np.asarray(img).astype(np.float32) / np.float32(255.0)
    mean = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
    std = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
    return ((a - mean) / std).transpose(2, 0, 1)


# (300, 307): resized to 224x229, crop left offset (229 - 224) / 2 = 2.5 -> 2 with half-to-even (3 rounding up).
@pytest.mark.parametrize("hw", [(300, 500), (500, 300), (480, 832), (300, 307)])
@pytest.mark.parametrize("crop", ["center", "full"])
def test_pil_path_pixels_exact(hw, crop):
    h, w = hw
    frames = _frames(2, h=h, w=w, seed=h + w)
    frames[0, :, :3] = 1.0  # exact 1.0 -> 255 and out-of-range values -> clamped
    frames[1, :, -3:] = 1.7
    frames[1, :, :2] = -0.3
    out = preprocess_frames(frames, 224, crop=crop, preprocess="pil")
    ref = np.stack([_reference_pil(f, 224, crop) for f in _reference_u8(frames)])
    assert torch.equal(out, torch.from_numpy(ref))
    if hw == (300, 307) and crop == "center":
        up = np.stack([_reference_pil(f, 224, crop, round_fn=lambda v: math.floor(v + 0.5)) for f in _reference_u8(frames)])
        assert not np.array_equal(ref, up)  # the .5 offset case really tells the two roundings apart


def test_reference_8bit_conversion_truncates():
    vals = torch.tensor([0.0, 0.5, 0.999, 1.0, 1.5, -0.2, 0.00392, 0.00393, 254.6 / 255])
    frames = vals.view(1, 1, 1, -1).expand(1, 3, 1, -1).contiguous()
    assert frames_to_uint8(frames)[0, 0, 0].tolist() == [0, 127, 254, 255, 255, 0, 0, 1, 254]
    assert frames_to_uint8(frames.half())[0, 0, 0].tolist()[:6] == [0, 127, 254, 255, 255, 0]
    u8 = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert frames_to_uint8(u8) is u8


@pytest.mark.parametrize("hw", [(45, 77), (77, 45), (300, 307)])
def test_uint8_input_equals_float_input(hw):
    frames = _frames(3, h=hw[0], w=hw[1], seed=5)
    u8 = torch.from_numpy(_reference_u8(frames)).permute(0, 3, 1, 2).contiguous()
    for crop in ("center", "full"):
        a = preprocess_frames(frames, 224, crop=crop, preprocess="pil")
        b = preprocess_frames(u8, 224, crop=crop, preprocess="pil")
        assert torch.equal(a, b)


@pytest.mark.parametrize("hw", [(45, 77), (77, 45)])
def test_pil_scores_match_independent_pil_computation(scorer, hw):
    u8 = torch.randint(0, 256, (4, 3, *hw), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    feats = scorer.encode_prompt(PROMPT)
    for crop in ("center", "full"):
        pix = torch.from_numpy(np.stack([_reference_pil(f, 32, crop) for f in u8.permute(0, 2, 3, 1).numpy()]))
        with torch.no_grad():
            ref_scores, ref_feats = scorer.model(pix, feats.input_ids, feats.attention_mask)
        out = scorer.score_frames(u8, feats, crop=crop)  # the scorer's default is "pil"
        assert scorer.preprocess == "pil"
        torch.testing.assert_close(out.scores, ref_scores, rtol=0, atol=1e-4)
        torch.testing.assert_close(out.image_features, ref_feats, rtol=0, atol=1e-4)
        # Float frames that convert to these bytes score the same; the torch path is close but not equal.
        f = u8.float() / 255 + 0.5 / 255
        torch.testing.assert_close(scorer.score_frames(f, feats, crop=crop).scores, ref_scores, rtol=0, atol=1e-4)
        fast = scorer.score_frames(f, feats, crop=crop, preprocess="torch").scores
        assert not torch.equal(fast, out.scores)


def test_nonfinite_frame_scores_nan_in_both_paths(scorer):
    frames = _frames(3, seed=9)
    frames[1, 0, 4, 4] = float("nan")
    frames[2, 1, 0, 0] = float("inf")
    for mode in ("pil", "torch"):
        s = scorer.score_frames(frames, PROMPT, preprocess=mode).scores
        assert math.isfinite(float(s[0])) and math.isnan(float(s[1])) and math.isnan(float(s[2]))
        alone = scorer.score_frames(frames[:1], PROMPT, preprocess=mode).scores
        torch.testing.assert_close(s[:1], alone, rtol=0, atol=1e-5)


def test_preprocess_mode_validation(tmp_path, scorer):
    with pytest.raises(ValueError, match=r"preprocess must be one of \('pil', 'torch'\), got 'cv2'"):
        preprocess_frames(_frames(1), 32, preprocess="cv2")
    with pytest.raises(ValueError, match="preprocess must be one of"):
        scorer.score_frames(_frames(1), PROMPT, preprocess="PIL")
    with pytest.raises(ValueError, match="preprocess must be one of"):
        load_image_reward(tmp_path / "missing.pt", preprocess="bilinear")
    with pytest.raises(ValueError, match="preprocess must be one of"):
        build_tiny_image_reward(preprocess="nearest")
    assert build_tiny_image_reward(preprocess="torch").preprocess == "torch"


@pytest.mark.parametrize("mode", ["pil", "torch"])
def test_full_crop_sees_edges(scorer, mode):
    frames = _frames(2, h=32, w=96, seed=7)
    changed = frames.clone()
    changed[:, :, :, :12] = 1.0 - changed[:, :, :, :12]  # only the left edge
    c0 = scorer.score_frames(frames, PROMPT, crop="center", preprocess=mode).scores
    c1 = scorer.score_frames(changed, PROMPT, crop="center", preprocess=mode).scores
    f0 = scorer.score_frames(frames, PROMPT, crop="full", preprocess=mode).scores
    f1 = scorer.score_frames(changed, PROMPT, crop="full", preprocess=mode).scores
    torch.testing.assert_close(c0, c1, rtol=0, atol=0)  # center crop never sees the left edge
    assert (f0 - f1).abs().max() > 1e-3


def test_bad_frames_and_crop(scorer):
    with pytest.raises(ValueError, match="channels-last"):
        scorer.score_frames(torch.rand(2, 32, 32, 3), PROMPT)
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        scorer.score_frames(torch.rand(3, 32, 32), PROMPT)
    with pytest.raises(ValueError, match="crop must be one of"):
        scorer.score_frames(_frames(1), PROMPT, crop="left")
    with pytest.raises(ValueError, match="empty"):
        scorer.score_frames(torch.rand(0, 3, 32, 32), PROMPT)
    with pytest.raises(TypeError):
        scorer.score_frames(_frames(1), 123)
