"""UMT5 prompt encoding from a transformers folder and from a ComfyUI-style single file, offline."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sdvg_engine.text_encoder import TEXT_LEN, load_text_encoder

WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "ball", "rolling", "on", "grass", "blue", "cube"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder = tmp_path_factory.mktemp("tok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return folder


@pytest.fixture(scope="module")
def tiny_umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=len(WORDS), d_model=64, d_kv=64, d_ff=96, num_layers=2, num_heads=1,
                        is_encoder_decoder=False, use_cache=False, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    return UMT5EncoderModel(config).eval()


def test_folder_and_single_file_give_the_same_context(tiny_umt5, tokenizer_dir, tmp_path):
    folder = tmp_path / "umt5"
    tiny_umt5.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    from_folder = load_text_encoder(folder, dtype=torch.float32).encode("a red ball rolling on grass")
    assert from_folder.shape == (1, TEXT_LEN, 64)
    # 6 prompt tokens + </s>; everything after is zeroed, as Wan does.
    assert from_folder[0, :7].abs().sum(-1).gt(0).all() and from_folder[0, 7:].abs().sum() == 0

    single = tmp_path / "umt5_xxl_tiny.safetensors"
    state = {k: v.clone() for k, v in tiny_umt5.state_dict().items()}
    state["shared.weight"] = state.pop("encoder.embed_tokens.weight", state.get("shared.weight"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(single))
    from_file = load_text_encoder(single, tokenizer=tokenizer_dir, dtype=torch.float32).encode("a red ball rolling on grass")
    assert torch.allclose(from_file, from_folder, atol=1e-6)
    other = load_text_encoder(single, tokenizer=tokenizer_dir, dtype=torch.float32).encode("a blue cube")
    assert not torch.allclose(other, from_folder)


def test_single_file_needs_a_tokenizer_and_right_keys(tiny_umt5, tmp_path, tokenizer_dir):
    single = tmp_path / "umt5.safetensors"
    save_file({k: v.clone().contiguous() for k, v in tiny_umt5.state_dict().items()}, str(single))
    with pytest.raises(ValueError, match="needs a tokenizer folder"):
        load_text_encoder(single)
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found"):
        load_text_encoder(single, tokenizer=tmp_path / "missing")
    bad = tmp_path / "bad.safetensors"
    save_file({"foo.weight": torch.zeros(2)}, str(bad))
    with pytest.raises(ValueError, match="not a UMT5/T5 encoder"):
        load_text_encoder(bad, tokenizer=tokenizer_dir)
