"""The engine's causal-DiT interface on a host's model in the original Wan layout (what a ComfyUI MODEL is),
driven by a plain-torch stand-in of ComfyUI's ops: weights stored in another dtype and cast at call time, a LoRA
applied as a per-call patch (ComfyUI's low-VRAM ``weight_function``), raw modulation tables read through the host.
It must equal the pack's own model on the same (rounded, merged) weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.loaders import LoadedDiT, build_generator
from sdvg_engine.models.causal_wan import CausalWanTransformer3DModel, wan_config
from sdvg_engine.models.original_layout import OriginalLayoutCausalWan, original_layout_info
from sdvg_engine.replay_key import model_identity
from sdvg_engine.sampling import SeededNoise
from wan_fixtures import PoolingAnchorEncoder, text_context, tiny_wan, to_original_keys

H, W = 4, 6
STORAGE = torch.bfloat16  # the stand-in host keeps its weights in bf16 and casts them to the input's dtype per call


# ------------------------------------------------------------------------------------- a stand-in of ComfyUI's ops
class _CastOp:
    """ComfyUI's op contract in plain torch: ``forward_comfy_cast_weights(x)`` casts weight and bias to ``x`` and
    applies every ``weight_function`` (a LoRA patch on a low-VRAM load) on the cast weight."""

    weight_function: list
    calls = 0

    def _cast(self, x):
        type(self).calls += 1
        weight = None if self.weight is None else self.weight.to(x.device, x.dtype)
        for patch in self.weight_function:
            weight = patch(weight)
        bias = None if getattr(self, "bias", None) is None else self.bias.to(x.device, x.dtype)
        return weight, bias

    def forward(self, *args, **kwargs):
        raise AssertionError("the engine must run a host's op through the host's call, never its plain forward")


class StandInLinear(_CastOp, torch.nn.Linear):
    def forward_comfy_cast_weights(self, x):
        weight, bias = self._cast(x)
        return F.linear(x, weight, bias)


class StandInConv3d(_CastOp, torch.nn.Conv3d):
    def forward_comfy_cast_weights(self, x):
        weight, bias = self._cast(x)
        return self._conv_forward(x, weight, bias)


class StandInLayerNorm(_CastOp, torch.nn.LayerNorm):
    def forward_comfy_cast_weights(self, x):
        weight, bias = self._cast(x) if self.weight is not None else (None, None)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class StandInRMSNorm(_CastOp, torch.nn.RMSNorm):
    def forward_comfy_cast_weights(self, x):
        weight, _ = self._cast(x)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class StandInScaledFp8Linear(StandInLinear):
    """ComfyUI's scaled-fp8 Linear with fp8 matmuls on (``scaled_fp8_ops(fp8_matrix_mult=True)``, what an sm_89+ GPU
    gets for a ``*_fp8_scaled`` file), by its contract: the weight stays fp8 with a float32 ``scale_weight``, the input
    is clamped and cast to fp8, and ``torch._scaled_mm`` computes in the input's dtype with the bias cast to it."""

    def forward_comfy_cast_weights(self, x):
        type(self).calls += 1
        rows = x.reshape(-1, x.shape[-1]).clamp(-448, 448).to(torch.float8_e4m3fn).contiguous()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = torch._scaled_mm(rows, self.weight.t(), out_dtype=x.dtype, bias=bias,
                               scale_a=torch.ones((), dtype=torch.float32), scale_b=self.scale_weight)
        return out.reshape(*x.shape[:-1], -1)


def to_scaled_fp8(host: torch.nn.Module) -> torch.nn.Module:
    """Every Linear of the stand-in host as a scaled-fp8 one (weight / scale in fp8, the scale kept), in place."""
    for module in host.modules():
        if type(module) is StandInLinear:
            weight = module.weight.float()
            scale = weight.abs().max() / 448
            module.weight = torch.nn.Parameter((weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
            module.scale_weight = scale.to(torch.float32)
            module.__class__ = StandInScaledFp8Linear
    return host


def _op(cls, *args, **kwargs):
    module = cls(*args, **kwargs, dtype=STORAGE)
    module.weight_function = []
    return module


class _Attention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        for name in "qkvo":
            setattr(self, name, _op(StandInLinear, dim, dim))
        self.norm_q, self.norm_k = _op(StandInRMSNorm, dim, eps=1e-6), _op(StandInRMSNorm, dim, eps=1e-6)


class _Block(torch.nn.Module):
    def __init__(self, dim, ffn_dim):
        super().__init__()
        self.norm1 = _op(StandInLayerNorm, dim, eps=1e-6, elementwise_affine=False)
        self.self_attn, self.cross_attn = _Attention(dim), _Attention(dim)
        self.norm3 = _op(StandInLayerNorm, dim, eps=1e-6, elementwise_affine=True)
        self.norm2 = _op(StandInLayerNorm, dim, eps=1e-6, elementwise_affine=False)
        self.ffn = torch.nn.Sequential(_op(StandInLinear, dim, ffn_dim), torch.nn.GELU(approximate="tanh"),
                                       _op(StandInLinear, ffn_dim, dim))
        self.modulation = torch.nn.Parameter(torch.zeros(1, 6, dim, dtype=STORAGE))


class _Head(torch.nn.Module):
    def __init__(self, dim, out):
        super().__init__()
        self.norm = _op(StandInLayerNorm, dim, eps=1e-6, elementwise_affine=False)
        self.head = _op(StandInLinear, dim, out)
        self.modulation = torch.nn.Parameter(torch.zeros(1, 2, dim, dtype=STORAGE))


class StandInWanModel(torch.nn.Module):
    """ComfyUI's ``WanModel`` module tree (original names), built from an original-layout state dict."""

    def __init__(self, state: dict):
        super().__init__()
        dim, ffn_dim = state["head.modulation"].shape[-1], state["blocks.0.ffn.0.weight"].shape[0]
        text_dim, freq_dim = state["text_embedding.0.weight"].shape[1], state["time_embedding.0.weight"].shape[1]
        self.num_heads = dim // 128
        self.patch_embedding = _op(StandInConv3d, 16, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = torch.nn.Sequential(_op(StandInLinear, text_dim, dim), torch.nn.GELU(approximate="tanh"),
                                                  _op(StandInLinear, dim, dim))
        self.time_embedding = torch.nn.Sequential(_op(StandInLinear, freq_dim, dim), torch.nn.SiLU(),
                                                  _op(StandInLinear, dim, dim))
        self.time_projection = torch.nn.Sequential(torch.nn.SiLU(), _op(StandInLinear, dim, 6 * dim))
        self.blocks = torch.nn.ModuleList(_Block(dim, ffn_dim) for _ in range(sum(
            1 for k in state if k.startswith("blocks.") and k.endswith(".modulation"))))
        self.head = _Head(dim, state["head.head.weight"].shape[0])
        self.load_state_dict(state)  # strict: every key of the file has its place, and every place a key
        self.requires_grad_(False)


def comfy_style_call(op, x):
    return op.forward_comfy_cast_weights(x)


def comfy_style_read(param, dtype, device):
    return param.to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------------------ fixtures
def _rounded(model: CausalWanTransformer3DModel) -> CausalWanTransformer3DModel:
    """The pack's model with every weight rounded through the stand-in's storage dtype (same values, fp32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(STORAGE).float())
    return model


def _lora(state: dict, rank: int = 4, seed: int = 5) -> dict:
    """``key -> (up, down)`` for every self- and cross-attention projection and the first FFN layer."""
    g = torch.Generator().manual_seed(seed)
    targets = [k for k in state if k.endswith(".weight") and any(s in k for s in (".q.", ".k.", ".v.", ".o.", "ffn.0", "time_projection"))]
    return {k: (torch.randn(state[k].shape[0], rank, generator=g) * 0.05,
                torch.randn(rank, state[k].shape[1], generator=g) * 0.05) for k in targets}


def _patch(up, down, strength):
    return lambda weight: weight + strength * (up @ down).to(weight.dtype)


@pytest.fixture(scope="module")
def pack_model():
    return _rounded(tiny_wan(seed=11))


@pytest.fixture(scope="module")
def original_state(pack_model):
    return to_original_keys(pack_model.state_dict())


def _view(host: torch.nn.Module, **kwargs) -> OriginalLayoutCausalWan:
    return OriginalLayoutCausalWan(host, device="cpu", compute_dtype=torch.float32, call=comfy_style_call,
                                   read_param=comfy_style_read, **kwargs)


def _blocks(model, noise_seed=3, bias=None):
    """Three blocks through one KV cache at frames 0, 3, 6 (the last under a cache bias), plus the text K/V."""
    text_kv = model.encode_text(text_context())
    cache = model.new_kv_cache(1, H, W, 9)
    g = torch.Generator().manual_seed(noise_seed)
    outs = []
    for b in range(3):
        x = torch.randn(1, 16, 3, H, W, generator=g)
        t = torch.tensor([[1000.0, 937.5, 833.3]]) if b else torch.full((1, 3), 500.0)
        outs.append(model.forward_block(x, t, text_kv, cache, 3 * b,
                                        cache_bias=((1, 3), math.log(0.3)) if (b == 2 and bias) else None))
    return text_kv, outs, cache


# ---------------------------------------------------------------------------------------------------------- tests
def test_config_is_read_from_the_modules(original_state):
    view = _view(StandInWanModel(original_state))
    expected = wan_config("tiny")
    for key in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "in_channels", "out_channels",
                "text_dim", "freq_dim", "patch_size"):
        assert view.config[key] == expected[key], key
    assert view.config.num_layers == 2 and view.device == torch.device("cpu")
    info = original_layout_info(view, "global_cache", source="ComfyUI MODEL")
    assert info.architecture == "custom Wan2.1 (dim 256, 2 layers, 2 heads)"
    assert info.stored_dtype == "bfloat16" and info.context_scheme == "global_cache"
    assert LoadedDiT.of(view, info).schedule == "self_forcing"


def test_host_model_equals_the_pack_model_through_kv_cache_bias_and_text(pack_model, original_state):
    """Same forward code, the host's casts: fp32 <= 1e-5 on text K/V, cached K/V and every block's flow."""
    host = StandInWanModel(original_state)
    view = _view(host)
    StandInLinear.calls = 0
    ref_text, ref_outs, ref_cache = _blocks(pack_model, bias=True)
    text, outs, cache = _blocks(view, bias=True)
    assert StandInLinear.calls > 0  # the host's ops ran
    for a, b in zip(ref_text.keys + ref_text.values, text.keys + text.values):
        assert (a - b).abs().max().item() <= 1e-5
    for a, b in zip(ref_outs, outs):
        assert a.shape == b.shape == (1, 16, 3, H, W)
        assert (a - b).abs().max().item() <= 1e-5
    assert (ref_cache.keys - cache.keys).abs().max().item() <= 1e-5
    assert all(p.dtype == STORAGE for p in host.parameters())  # nothing cast or moved in place


def test_a_lora_applied_per_call_equals_the_merged_weights(pack_model, original_state):
    """ComfyUI's low-VRAM LoRA (a weight_function on each op) == the pack's model with the LoRA merged offline;
    the host's stored weights are unchanged, and the replay identity sees the patch though the weights do not."""
    host = StandInWanModel(original_state)
    lora = _lora(original_state)
    before = {k: v.clone() for k, v in host.state_dict().items()}
    patches = {}
    for key, (up, down) in lora.items():
        module = host.get_submodule(key.rsplit(".", 1)[0])
        module.weight_function = [_patch(up, down, 0.8)]
        patches[key] = 0.8

    merged = tiny_wan(seed=11)
    merged.load_state_dict(pack_model.state_dict())
    originals = to_original_keys(merged.state_dict())
    renamed = dict(zip(originals, merged.state_dict()))  # original key -> pack key
    with torch.no_grad():
        for key, (up, down) in lora.items():
            merged.get_parameter(renamed[key]).add_(0.8 * (up @ down))

    identity = lambda: tuple(sorted(patches.items()))  # noqa: E731  (the host's patch list)
    view = _view(host, identity=identity)
    _, ref, _ = _blocks(merged, bias=True)
    _, out, _ = _blocks(view, bias=True)
    for a, b in zip(ref, out):
        assert (a - b).abs().max().item() <= 1e-5
    _, unpatched, _ = _blocks(pack_model, bias=True)
    assert (unpatched[-1] - out[-1]).abs().max().item() > 1e-3  # the LoRA changed the output
    assert all(torch.equal(before[k], v) for k, v in host.state_dict().items())

    gen = CausalGenerator(view, context=GlobalCache(max_frames=21), name="drafter")
    first = model_identity(gen)
    patches.update({k: 0.5 for k in patches})  # another strength: same parameters, other outputs
    assert model_identity(gen) != first


def test_a_parameter_the_host_replaces_after_the_view_is_built_is_used(pack_model, original_state):
    """ComfyUI's full-load patching swaps a patched weight's Parameter object (``set_attr_param``) after the node made
    its view: the raw modulation tables must be read from the module every call, not kept from the build."""
    host = StandInWanModel(original_state)
    view = _view(host)
    changed = tiny_wan(seed=11)
    changed.load_state_dict(pack_model.state_dict())
    with torch.no_grad():
        for table in (changed.blocks[0].scale_shift_table, changed.scale_shift_table):
            table.add_(torch.linspace(-0.5, 0.5, table.numel()).view_as(table))
            table.copy_(table.to(STORAGE).float())  # values the host's storage holds exactly
    state = to_original_keys(changed.state_dict())
    for name in ("blocks.0.modulation", "head.modulation"):
        owner, attr = host.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(owner, attr, torch.nn.Parameter(state[name].to(STORAGE), requires_grad=False))
    _, ref, _ = _blocks(changed, bias=True)
    _, out, _ = _blocks(view, bias=True)
    for a, b in zip(ref, out):
        assert (a - b).abs().max().item() <= 1e-5


def test_generators_on_both_agree_under_both_context_schemes(pack_model, original_state):
    view = _view(StandInWanModel(original_state))
    for scheme, schedule in (("global_cache", "self_forcing"), ("recompute_window", "krea")):
        latents = []
        for model in (pack_model, view):
            encoder = PoolingAnchorEncoder()
            context = (GlobalCache(max_frames=21) if scheme == "global_cache"
                       else RecomputeWindow(3, attention_bias=0.3, anchor_encoder=encoder))
            gen = CausalGenerator(model, schedule=schedule, context=context, name="target")
            gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=3)
            out = []
            for b in range(3):
                lat = gen.generate_block(b, SeededNoise(4)).latents
                px = torch.rand(1, 3, 9 if b == 0 else 12, 8 * H, 8 * W, generator=torch.Generator().manual_seed(b))
                gen.commit_block(b, lat, px * 2 - 1)
                out.append(lat)
            latents.append(torch.cat(out, dim=2))
        assert (latents[0] - latents[1]).abs().max().item() <= 1e-5, scheme


def test_the_hosts_attention_backend_is_used_and_gets_the_mask(pack_model, original_state):
    seen = []

    def backend(q, k, v, mask):
        seen.append(mask is not None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    view = _view(StandInWanModel(original_state), attention=backend)
    _, ref, _ = _blocks(pack_model, bias=True)
    _, out, _ = _blocks(view, bias=True)
    assert (ref[-1] - out[-1]).abs().max().item() <= 1e-5
    assert any(seen) and not all(seen)  # the biased block passed its mask; the others and the text had none


def test_a_view_refuses_block_offload_and_non_wan_modules(original_state):
    view = _view(StandInWanModel(original_state))
    with pytest.raises(ValueError, match="memory manager"):
        view.use_runtime(block_hooks=object())
    with pytest.raises(ValueError, match=r"not a Wan2.1 DiT in the original layout \(no patch_embedding"):
        OriginalLayoutCausalWan(torch.nn.Linear(2, 2), device="cpu", compute_dtype=torch.float32)
    with pytest.raises(TypeError, match="forward_block"):
        view(torch.zeros(1))


def test_a_hosts_ops_get_the_dtypes_comfyuis_own_wan_gives_them(original_state):
    """ComfyUI's WanModel feeds the patch embedding float32 and every other op (time MLP and norms included) the
    compute dtype; its ops are built for that (a scaled-fp8 Linear's fp8 matmul computes in the input's dtype)."""
    host = StandInWanModel(original_state)
    names = {module: name for name, module in host.named_modules()}
    seen: dict[str, set] = {}

    def recording(op, x):
        seen.setdefault(names[op], set()).add(x.dtype)
        return comfy_style_call(op, x)

    view = OriginalLayoutCausalWan(host, device="cpu", compute_dtype=torch.bfloat16, call=recording,
                                   read_param=comfy_style_read)
    _blocks(view, bias=True)
    ops = {name for name, m in host.named_modules() if isinstance(m, _CastOp)}
    assert set(seen) == ops  # every op of the model ran through the host's call
    assert seen.pop("patch_embedding") == {torch.float32}
    assert {name: d for name, d in seen.items() if d != {torch.bfloat16}} == {}


def test_scaled_fp8_matmuls_run_under_cudas_rules(original_state):
    """A scaled-fp8 host with fp8 matmuls on, under CUDA's ``_scaled_mm`` checks: every Linear ComfyUI's own Wan runs
    through ``_scaled_mm`` does so once per call here too (the text projections once per prompt, in encode_text), and
    the reference implementations' float32 time MLP is what CUDA refuses."""
    from cuda_rules import cuda_scaled_mm

    host = to_scaled_fp8(StandInWanModel(original_state))
    layers = len(host.blocks)
    view = OriginalLayoutCausalWan(host, device="cpu", compute_dtype=torch.bfloat16, call=comfy_style_call,
                                   read_param=comfy_style_read)
    x, t = torch.randn(1, 16, 3, H, W, generator=torch.Generator().manual_seed(3)), torch.full((1, 3), 937.5)
    with cuda_scaled_mm() as log:
        text_kv = view.encode_text(text_context())
        assert len(log) == 2 + 2 * layers  # text_embedding.0/.2, then each layer's cross-attention k and v
        before = len(log)
        flow = view.forward_block(x, t, text_kv, view.new_kv_cache(1, H, W, 3), 0)
        # time_embedding.0/.2, time_projection.1; per layer self-attention q k v o, cross-attention q o, ffn.0/.2; head
        assert len(log) - before == 3 + 8 * layers + 1
        assert {call[2] for call in log.calls} == {torch.bfloat16}
    assert flow.shape == (1, 16, 3, H, W) and flow.isfinite().all()
    # the dequantised weights in bf16 give nearly the same flow (fp8 inputs add their rounding)
    plain = StandInWanModel(original_state)
    reference = OriginalLayoutCausalWan(plain, device="cpu", compute_dtype=torch.bfloat16, call=comfy_style_call,
                                        read_param=comfy_style_read).forward_block(x, t, text_kv, None, 0)
    assert torch.nn.functional.cosine_similarity(flow.flatten(), reference.flatten(), dim=0) > 0.99
    # the reference implementations' float32 time MLP is what CUDA refuses on this path (what the pack did before)
    with cuda_scaled_mm(), pytest.raises(RuntimeError, match="Bias is not supported when out_dtype is set to Float32"):
        host.time_embedding[0].forward_comfy_cast_weights(torch.randn(1, 3, view.config.freq_dim))


def test_build_generator_runs_a_view_like_a_loaded_checkpoint(original_state):
    view = _view(StandInWanModel(original_state))
    gen = build_generator(LoadedDiT.of(view, original_layout_info(view, "recompute_window")), name="target",
                          preset="native")
    assert gen.context.name == "recompute_window" and gen.model is view
