"""UMT5-XXL prompt encoding (Wan2.1's text encoder) and the prompt-embeddings file.

Wan encodes a prompt with the UMT5-XXL *encoder*, padded/truncated to 512 tokens, and zeroes the
rows past the prompt's length: ``[1, 512, 4096]``. Both the drafter and the target read the same
context, so a prompt is encoded once.

Sources this module reads, all local (nothing is downloaded; a missing file is an error):
* a transformers folder (``config.json`` + weights + tokenizer files), e.g. ``google/umt5-xxl``
  saved locally;
* ComfyUI's ``umt5_xxl_*.safetensors`` (HF T5 key names; ``*_fp8_scaled`` files are dequantized)
  together with a local tokenizer folder.

The embeddings file written by ``sdvg encode-prompts`` is a safetensors file with one tensor
``context.<i>`` per prompt (``[1, 512, 4096]``) and the prompts in the metadata, in order.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

TEXT_LEN = 512
EMBEDDINGS_FORMAT = "sdvg.prompt_embeddings.v1"

#: google/umt5-xxl encoder configuration (the part Wan uses).
UMT5_XXL_CONFIG = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
    layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
    tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
)


# ---- embeddings files -------------------------------------------------------------------------------
def save_prompt_embeddings(path: str | os.PathLike, prompts: list[str], contexts: list[torch.Tensor]) -> None:
    """Write prompts and their contexts (each ``[1, L, 4096]``) to one safetensors file.

    The file is written to a temporary name next to ``path`` and renamed over it at the end, so an
    interrupted write never leaves a torn file (callers decide whether replacing ``path`` is allowed).
    """
    from safetensors.torch import save_file

    if len(prompts) != len(contexts) or not prompts:
        raise ValueError(f"need one context per prompt, got {len(prompts)} prompts and {len(contexts)} contexts")
    tensors = {}
    for i, ctx in enumerate(contexts):
        if ctx.ndim != 3 or ctx.shape[0] != 1:
            raise ValueError(f"context {i} must be [1, L, D], got {tuple(ctx.shape)}")
        if not bool(torch.isfinite(ctx).all()):
            raise ValueError(f"context {i} ({prompts[i][:60]!r}) holds NaN/inf values; the text encoder output is broken "
                             "(try --dtype fp32)")
        tensors[f"context.{i}"] = ctx.detach().to("cpu").contiguous()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": EMBEDDINGS_FORMAT, "prompts": json.dumps(prompts)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_prompt_embeddings(path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """Read a file written by :func:`save_prompt_embeddings`: ``[(prompt, context [1, L, 4096]), ...]``.

    Refuses (``CheckpointError``, a ``ValueError``, naming the file and tensor key) files that are not
    embeddings files, hold no prompts, miss a ``context.<i>`` tensor, or hold non-float or NaN/inf values.
    """
    from .checkpoint_io import CheckpointError, check_finite, json_metadata, read_tensor_file

    path = Path(path)
    if not path.is_file() and not path.exists():
        raise FileNotFoundError(f"prompt embeddings file not found: {path} (write one with `sdvg encode-prompts`)")
    tensors, meta, _ = read_tensor_file(path, what="prompt embeddings file", hint="write one with `sdvg encode-prompts`",
                                        entries=())
    if meta.get("format") != EMBEDDINGS_FORMAT:
        raise CheckpointError(f"{path}: not an SDVG prompt-embeddings file (write one with `sdvg encode-prompts`)")
    prompts = json_metadata(meta.get("prompts", ""), "prompts", path)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise CheckpointError(f"{path}: metadata 'prompts' must be a JSON list of strings; rewrite it with `sdvg encode-prompts`")
    if not prompts:
        raise CheckpointError(f"{path}: holds zero prompts; rewrite it with `sdvg encode-prompts --prompt ...`")
    pairs = []
    for i, prompt in enumerate(prompts):
        key = f"context.{i}"
        ctx = tensors.get(key)
        if ctx is None:
            raise CheckpointError(f"{path}: tensor '{key}' for prompt {prompt[:60]!r} is missing; rewrite the file with "
                                  "`sdvg encode-prompts`")
        if not ctx.is_floating_point():
            raise CheckpointError(f"{path}: tensor '{key}' is {str(ctx.dtype).replace('torch.', '')}, not floating point; "
                                  "rewrite the file with `sdvg encode-prompts`")
        if ctx.ndim != 3 or ctx.shape[0] != 1:
            raise CheckpointError(f"{path}: tensor '{key}' has shape {tuple(ctx.shape)}, expected [1, L, D]; rewrite the "
                                  "file with `sdvg encode-prompts`")
        check_finite(ctx, key, path, fix="re-encode the prompts with `sdvg encode-prompts` (try --dtype fp32)")
        pairs.append((prompt, ctx))
    return pairs


# ---- the encoder ----------------------------------------------------------------------------------------
class UMT5TextEncoder:
    """UMT5 encoder + tokenizer producing Wan contexts ``[1, 512, d_model]`` with zeroed padding rows."""

    def __init__(self, model, tokenizer, text_len: int = TEXT_LEN):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.text_len = text_len

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        tokens = self.tokenizer(prompt, padding="max_length", truncation=True, max_length=self.text_len,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        # Wan keeps only the prompt's rows and pads with zeros (not the encoder's padding outputs).
        return (hidden * mask[..., None]).cpu()


#: A tokenizer folder needs one of these (the fast tokenizer's serialisation, or UMT5's SentencePiece model).
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


def _check_tokenizer_folder(tokenizer_dir: Path, *, model_folder: bool = False) -> None:
    """Refuse, before any weights load, a tokenizer folder that cannot give a tokenizer: name the folder, the files
    it lacks and what it holds. ``model_folder``: the folder is the text encoder's own (no ``tokenizer=`` given)."""
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder not found: {tokenizer_dir} (a local copy of google/umt5-xxl's tokenizer files: "
            "tokenizer.json or spiece.model with tokenizer_config.json)"
        )
    if any((tokenizer_dir / name).is_file() for name in TOKENIZER_FILES):
        return
    held = sorted(p.name for p in tokenizer_dir.iterdir())
    shown = ", ".join(held[:12]) + (f", ... (+{len(held) - 12} more)" if len(held) > 12 else "") if held else "nothing"
    where = ("the UMT5 folder has no tokenizer" if model_folder else "the tokenizer folder has no tokenizer")
    fix = ("copy google/umt5-xxl's tokenizer files (tokenizer.json or spiece.model, with tokenizer_config.json and "
           "special_tokens_map.json) into it, or pass a tokenizer folder (tokenizer=... / --tokenizer DIR)"
           if model_folder else
           "pass a folder holding google/umt5-xxl's tokenizer files (tokenizer.json or spiece.model, with "
           "tokenizer_config.json)")
    raise ValueError(f"{tokenizer_dir}: {where}: it holds neither {' nor '.join(TOKENIZER_FILES)} (found: {shown}); "
                     f"{fix}")


def _read_tokenizer(tokenizer_dir: str | os.PathLike, *, model_folder: bool = False):
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    _check_tokenizer_folder(tokenizer_dir, model_folder=model_folder)
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as e:  # transformers' own wording names neither the folder nor the files
        raise ValueError(f"{tokenizer_dir}: the tokenizer files cannot be read ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); pass a folder with google/umt5-xxl's tokenizer.json "
                         "or spiece.model and tokenizer_config.json") from e


def load_text_encoder(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None, device="cpu",
                      dtype=torch.bfloat16) -> UMT5TextEncoder:
    """Load UMT5 from a transformers folder or a ComfyUI ``umt5_xxl_*.safetensors`` (+ ``tokenizer`` folder)."""
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"text encoder not found: {path}")
    if path.is_dir():
        # The tokenizer is checked before the (11 GB) weights load.
        _check_tokenizer_folder(Path(tokenizer or path), model_folder=tokenizer is None)
        model = UMT5EncoderModel.from_pretrained(str(path), local_files_only=True, torch_dtype=dtype)
        return UMT5TextEncoder(model.to(device), _read_tokenizer(tokenizer or path, model_folder=tokenizer is None))
    if tokenizer is None:
        raise ValueError(f"{path}: a single-file text encoder needs a tokenizer folder (--tokenizer)")
    _check_tokenizer_folder(Path(tokenizer))
    from .checkpoint_io import CheckpointError, check_float_weights, check_tensors, read_tensor_file

    state, _, _ = read_tensor_file(path, what="text encoder", hint="pass a transformers UMT5 folder or umt5_xxl_*.safetensors",
                                   entries=())
    check_tensors(state, path)
    state = {k: v for k, v in state.items() if k != "scaled_fp8"}
    check_float_weights(state, path)
    for key in [k for k in state if k.endswith(".scale_weight")]:  # ComfyUI *_fp8_scaled files
        weight_key = key[: -len(".scale_weight")] + ".weight"
        if weight_key not in state:
            raise CheckpointError(f"{path}: '{key}' has no weight '{weight_key}' to scale; the file is damaged")
        state[weight_key] = state[weight_key].float() * state.pop(key).float()
    layers = {int(k.split(".")[2]) for k in state if re.match(r"encoder\.block\.\d+\.", k)}
    if not layers or "shared.weight" not in state:
        raise CheckpointError(f"{path}: no 'shared.weight' / 'encoder.block.*' keys; this is not a UMT5/T5 encoder file "
                              "(pass umt5_xxl_fp16.safetensors / umt5_xxl_fp8_e4m3fn_scaled.safetensors or a "
                              "transformers UMT5 folder)")
    needed = ["encoder.block.0.layer.0.SelfAttention.q.weight", "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"]
    absent = [k for k in needed if k not in state]
    if absent or state["shared.weight"].ndim != 2:
        raise CheckpointError(f"{path}: not a UMT5 encoder file: key {(absent or ['shared.weight'])[0]!r} is missing or "
                              "malformed; pass umt5_xxl_fp16.safetensors / umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    config = dict(UMT5_XXL_CONFIG, num_layers=max(layers) + 1)
    config.update(vocab_size=state["shared.weight"].shape[0], d_model=state["shared.weight"].shape[1])
    inner = state["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0]
    if inner != config["num_heads"] * config["d_kv"]:  # not XXL: UMT5 keeps 64-wide heads
        if inner < 64 or inner % 64:
            raise CheckpointError(f"{path}: attention width {inner} is not a multiple of UMT5's 64-wide heads; "
                                  "this is not a UMT5 encoder file")
        config.update(d_kv=64, num_heads=inner // 64)
    config["d_ff"] = state["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0]
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**config))
    expected = set(model.state_dict())
    state = {k: v for k, v in state.items() if k in expected or not k.startswith("decoder.")}
    if "encoder.embed_tokens.weight" in expected and "encoder.embed_tokens.weight" not in state and "shared.weight" in state:
        state["encoder.embed_tokens.weight"] = state["shared.weight"]
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: UMT5 encoder keys do not match; missing {missing[:10]}, unexpected {unexpected[:10]}")
    want = model.state_dict()
    wrong = [k for k in sorted(expected) if tuple(state[k].shape) != tuple(want[k].shape)]
    if wrong:
        raise CheckpointError(f"{path}: tensor '{wrong[0]}' has shape {tuple(state[wrong[0]].shape)}, expected "
                              f"{tuple(want[wrong[0]].shape)} ({len(wrong)} mis-shaped); the file is damaged")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return UMT5TextEncoder(model, _read_tokenizer(tokenizer))
