"""The ComfyUI MODEL glue (``nodes/comfy_model.py`` and the MODEL branch of ``nodes/logic.py``) under ``make test``,
without ComfyUI.

``tests/test_comfy_model.py`` runs the same glue in a real ComfyUI and is skipped here. This file stands in for the
few pieces of ComfyUI (0.3.64) the glue touches, written after ``comfy/model_patcher.py``, ``comfy/ops.py``,
``comfy/model_base.py``, ``comfy/model_management.py`` and ``comfy/ldm/modules/attention.py``:

* :class:`ModelPatcher`: ``model``, ``patches``, ``object_patches``, ``weight_wrapper_patches``, ``model_options``,
  the devices, ``model_dtype()``, ``get_model_object()``, ``is_clone()``, ``clone()``, ``add_patches()`` ... with
  ComfyUI's semantics (a clone shares ``model``; ``add_patches`` appends ``(strength_patch, adapter, strength_model,
  offset, function)`` per key of the model's state dict);
* :class:`BaseModel` (``.diffusion_model``, ``manual_cast_dtype``, ``get_dtype()``) around :class:`WanModel`, a tiny
  real Wan2.1 DiT in ComfyUI's module layout whose ops are plain torch modules with ComfyUI's op contract
  (``forward_comfy_cast_weights`` casts the weights to the input; ``forward`` takes that path only when a cast or a
  ``weight_function`` asks for it), loaded from the same file the pack's own loader reads;
* ``comfy.model_management.cast_to`` / ``throw_exception_if_processing_interrupted`` and
  ``comfy.ldm.modules.attention.optimized_attention`` / ``attention_pytorch``, installed in ``sys.modules`` only for
  the tests that ask for the :func:`comfy` fixture (and removed after each).
"""

from __future__ import annotations

import copy
import json
import sys
import types
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`

from nodes import comfy_model, logic, schema  # noqa: E402
from node_fixtures import REWARD_FILE, FakeComfyVAE, tiny_reward_model  # noqa: E402
from sdvg_engine.offload import run_memory_components  # noqa: E402
from sdvg_engine.options import SDVGOptions  # noqa: E402
from sdvg_engine.workers import plan_lanes  # noqa: E402
from wan_fixtures import text_context, tiny_wan, write_checkpoint  # noqa: E402

W, H, FRAMES = 48, 32, 33  # 3 blocks of 3 latent frames, 3 x 2 tokens per frame
CPU = torch.device("cpu")
PREFIX = "model.diffusion_model."
PROMPT = "a red ball rolling on green grass"
POSITIVE = [[text_context(seed=1), {"pooled_output": None}]]
COMFY_MODULES = ("comfy", "comfy.model_management", "comfy.ldm", "comfy.ldm.modules", "comfy.ldm.modules.attention")
#: every stand-in module ever installed (none may stay in sys.modules after its test)
_STAND_INS: list = []
ONE_LANE = "ComfyUI MODEL: one worker lane (ComfyUI casts and moves its weights per call)"


# =========================================================================================== ComfyUI's ops, in torch
class _CastOp:
    """``comfy.ops.CastWeightBiasOp`` + ``disable_weight_init``: the class-level empty patch lists, and ``forward``
    that casts (``forward_comfy_cast_weights``) only when asked to or when a patch is attached."""

    comfy_cast_weights = False
    weight_function: list = []
    bias_function: list = []
    calls = 0  # op calls (either way in), all ops together

    def _cast(self, x):  # comfy.ops.cast_bias_weight without streams
        bias = None
        if getattr(self, "bias", None) is not None:
            bias = self.bias.to(device=x.device, dtype=x.dtype)
            for f in self.bias_function:
                bias = f(bias)
        weight = None if self.weight is None else self.weight.to(device=x.device, dtype=x.dtype)
        for f in self.weight_function:
            weight = f(weight)
        return weight, bias

    def forward(self, *args, **kwargs):
        _CastOp.calls += 1
        if self.comfy_cast_weights or len(self.weight_function) > 0 or len(self.bias_function) > 0:
            return self.forward_comfy_cast_weights(*args, **kwargs)
        return super().forward(*args, **kwargs)


class Linear(_CastOp, torch.nn.Linear):
    def forward_comfy_cast_weights(self, x):
        _CastOp.calls += 1
        weight, bias = self._cast(x)
        return F.linear(x, weight, bias)


class Conv3d(_CastOp, torch.nn.Conv3d):
    def forward_comfy_cast_weights(self, x):
        weight, bias = self._cast(x)
        return self._conv_forward(x, weight, bias)


class LayerNorm(_CastOp, torch.nn.LayerNorm):
    def forward_comfy_cast_weights(self, x):
        weight, bias = self._cast(x) if self.weight is not None else (None, None)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(_CastOp, torch.nn.RMSNorm):
    def forward_comfy_cast_weights(self, x):
        weight, _ = self._cast(x)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


# ==================================================================== ComfyUI's WanModel layout and its BaseModel
class _Attention(torch.nn.Module):  # WanSelfAttention / WanT2VCrossAttention
    def __init__(self, dim, num_heads, dtype):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (Linear(dim, dim, dtype=dtype) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps=1e-6, dtype=dtype), RMSNorm(dim, eps=1e-6, dtype=dtype)


class _Block(torch.nn.Module):  # WanAttentionBlock (t2v_cross_attn, cross_attn_norm=True)
    def __init__(self, dim, ffn_dim, num_heads, dtype):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.self_attn = _Attention(dim, num_heads, dtype)
        self.norm3 = LayerNorm(dim, eps=1e-6, elementwise_affine=True, dtype=dtype)
        self.cross_attn = _Attention(dim, num_heads, dtype)
        self.norm2 = LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.ffn = torch.nn.Sequential(Linear(dim, ffn_dim, dtype=dtype), torch.nn.GELU(approximate="tanh"),
                                       Linear(ffn_dim, dim, dtype=dtype))
        self.modulation = torch.nn.Parameter(torch.zeros(1, 6, dim, dtype=dtype))


class _Head(torch.nn.Module):
    def __init__(self, dim, out, dtype):
        super().__init__()
        self.norm = LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.head = Linear(dim, out, dtype=dtype)
        self.modulation = torch.nn.Parameter(torch.zeros(1, 2, dim, dtype=dtype))


class WanModel(torch.nn.Module):
    """``comfy.ldm.wan.model.WanModel`` (t2v) as far as SDVG reads it: the same class name, attributes and module
    tree, built from an original-layout state dict (strict load)."""

    def __init__(self, state: dict, dtype: torch.dtype = torch.float32):
        super().__init__()
        dim, ffn_dim = state["head.modulation"].shape[-1], state["blocks.0.ffn.0.weight"].shape[0]
        text_dim, freq_dim = state["text_embedding.0.weight"].shape[1], state["time_embedding.0.weight"].shape[1]
        layers = sum(1 for k in state if k.startswith("blocks.") and k.endswith(".modulation"))
        self.model_type, self.patch_size, self.dtype, self.img_emb = "t2v", (1, 2, 2), dtype, None
        self.dim, self.num_heads, self.num_layers = dim, dim // 128, layers
        self.patch_embedding = Conv3d(16, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2), dtype=torch.float32)
        self.text_embedding = torch.nn.Sequential(Linear(text_dim, dim, dtype=dtype), torch.nn.GELU(approximate="tanh"),
                                                  Linear(dim, dim, dtype=dtype))
        self.time_embedding = torch.nn.Sequential(Linear(freq_dim, dim, dtype=dtype), torch.nn.SiLU(),
                                                  Linear(dim, dim, dtype=dtype))
        self.time_projection = torch.nn.Sequential(torch.nn.SiLU(), Linear(dim, 6 * dim, dtype=dtype))
        self.blocks = torch.nn.ModuleList(_Block(dim, ffn_dim, self.num_heads, dtype) for _ in range(layers))
        self.head = _Head(dim, state["head.head.weight"].shape[0], dtype)
        self.load_state_dict(state)
        self.requires_grad_(False)


class BaseModel(torch.nn.Module):
    """``comfy.model_base.WAN21``'s fields the glue reads: ``diffusion_model``, ``manual_cast_dtype``,
    ``get_dtype()`` (the DiT's ``dtype``)."""

    def __init__(self, diffusion_model: torch.nn.Module, manual_cast_dtype: torch.dtype | None = None):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.manual_cast_dtype = manual_cast_dtype
        self.device = None

    def get_dtype(self):
        return self.diffusion_model.dtype


class ModelPatcher:
    """``comfy.model_patcher.ModelPatcher`` (0.3.64), the parts a MODEL's consumers use, with its semantics."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.size, self.model = size, model
        if getattr(model, "device", None) is None:
            model.device = offload_device
        self.patches, self.backup = {}, {}
        self.object_patches, self.object_patches_backup = {}, {}
        self.weight_wrapper_patches = {}
        self.model_options = {"transformer_options": {}}
        self.load_device, self.offload_device = load_device, offload_device
        self.weight_inplace_update = weight_inplace_update
        self.force_cast_weights = False
        self.patches_uuid = uuid.uuid4()
        self.parent = None
        self.wrappers = {}  # WrappersMP.init_wrappers()
        for name, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                            ("current_weight_patches_uuid", None)):
            if not hasattr(model, name):
                setattr(model, name, value)

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device, self.size,
                           weight_inplace_update=self.weight_inplace_update)
        n.patches = {k: self.patches[k][:] for k in self.patches}
        n.patches_uuid = self.patches_uuid
        n.object_patches = self.object_patches.copy()
        n.weight_wrapper_patches = self.weight_wrapper_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        n.backup, n.object_patches_backup = self.backup, self.object_patches_backup
        n.parent = self
        n.force_cast_weights = self.force_cast_weights
        return n

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def add_weight_wrapper(self, name, function):
        self.weight_wrapper_patches[name] = self.weight_wrapper_patches.get(name, []) + [function]
        self.patches_uuid = uuid.uuid4()

    def get_model_object(self, name: str):
        if name in self.object_patches:
            return self.object_patches[name]
        if name in self.object_patches_backup:
            return self.object_patches_backup[name]
        obj = self.model
        for part in name.split("."):  # comfy.utils.get_attr
            obj = getattr(obj, part)
        return obj

    def model_dtype(self):
        if hasattr(self.model, "get_dtype"):
            return self.model.get_dtype()

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        p = set()
        model_sd = self.model.state_dict()
        for k in patches:
            offset = function = None
            if isinstance(k, str):
                key = k
            else:
                offset, key = k[1], k[0]
                if len(k) > 2:
                    function = k[2]
            if key in model_sd:
                p.add(k)
                current = self.patches.get(key, [])
                current.append((strength_patch, patches[k], strength_model, offset, function))
                self.patches[key] = current
        self.patches_uuid = uuid.uuid4()
        return list(p)


class LoRAAdapter:
    """``comfy.weight_adapter.lora.LoRAAdapter``: what ``comfy.lora.load_lora`` puts in a patch dict."""

    name = "lora"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys, self.weights = loaded_keys, weights


def lora_patches(patcher: ModelPatcher, seed: int, rank: int = 4) -> dict:
    """A LoRA as ``comfy.lora.load_lora`` returns it: model key -> LoRAAdapter((up, down, alpha, mid, dora, reshape))
    on every attention projection of the DiT."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, weight in patcher.model.state_dict().items():
        if key.endswith(".weight") and weight.ndim == 2 and any(f".{p}." in key for p in "qkvo"):
            up = torch.randn(weight.shape[0], rank, generator=g) * 0.1
            down = torch.randn(rank, weight.shape[1], generator=g) * 0.1
            name = "diffusion_model." + key[len("diffusion_model."):-len(".weight")]
            out[key] = LoRAAdapter({name + ".lora_up.weight", name + ".lora_down.weight"},
                                   (up, down, rank / 2, None, None, None))
    return out


def unet(path, manual_cast_dtype=None) -> ModelPatcher:
    """What Load Diffusion Model returns for the ComfyUI-layout file ``path``: a fresh DiT from the file's weights;
    with a ``manual_cast_dtype`` its ops cast every weight to the input (``comfy.ops.manual_cast``)."""
    state = {k[len(PREFIX):]: v for k, v in load_file(str(path)).items() if k.startswith(PREFIX)}
    source = WanModel(state)
    if manual_cast_dtype is not None:
        for module in source.modules():
            if isinstance(module, _CastOp):
                module.comfy_cast_weights = True
    return ModelPatcher(BaseModel(source, manual_cast_dtype), load_device=CPU, offload_device=CPU)


# ============================================================================================ comfy.* in sys.modules
def _cast_to(weight, dtype=None, device=None, non_blocking=False, copy=False, stream=None):
    """comfy.model_management.cast_to (0.3.64) without streams."""
    if device is None or weight.device == device:
        if not copy and (dtype is None or weight.dtype == dtype):
            return weight
        return weight.to(dtype=dtype, copy=copy)
    r = torch.empty_like(weight, dtype=dtype, device=device)
    r.copy_(weight, non_blocking=non_blocking)
    return r


def _attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
    """comfy.ldm.modules.attention.attention_pytorch (one batch chunk)."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return out


@pytest.fixture
def comfy(monkeypatch):
    """The ``comfy.*`` functions the glue imports lazily, as modules in ``sys.modules`` for this test only. Returns
    the namespace of counters: ``optimized`` / ``masked`` attention calls, ``cast_to`` calls."""
    if any(name in sys.modules for name in COMFY_MODULES):
        pytest.skip("a real ComfyUI is imported in this process (tests/test_comfy_model.py): not replaced by stand-ins")
    seen = types.SimpleNamespace(optimized=0, masked=0, cast_to=0, interrupt_checks=0)

    def cast_to(weight, dtype=None, device=None, non_blocking=False, copy=False, stream=None):
        seen.cast_to += 1
        return _cast_to(weight, dtype, device, non_blocking, copy, stream)

    def throw_exception_if_processing_interrupted():
        seen.interrupt_checks += 1

    def attention_pytorch(q, k, v, heads, mask=None, **kwargs):
        seen.masked += 1
        return _attention_pytorch(q, k, v, heads, mask=mask, **kwargs)

    def optimized_attention(q, k, v, heads, mask=None, **kwargs):  # what --use-pytorch-cross-attention picks
        seen.optimized += 1
        options = kwargs.pop("transformer_options", None) or {}
        override = options.get("optimized_attention_override")
        if override is not None:  # wrap_attn
            return override(_attention_pytorch, q, k, v, heads, mask=mask, **kwargs)
        return _attention_pytorch(q, k, v, heads, mask=mask, **kwargs)

    modules = {name: types.ModuleType(name) for name in COMFY_MODULES}
    _STAND_INS.extend(modules.values())
    modules["comfy.model_management"].cast_to = cast_to
    modules["comfy.model_management"].throw_exception_if_processing_interrupted = \
        throw_exception_if_processing_interrupted
    modules["comfy.ldm.modules.attention"].attention_pytorch = attention_pytorch
    modules["comfy.ldm.modules.attention"].optimized_attention = optimized_attention
    for name, module in modules.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(modules[parent], child, module)
        monkeypatch.setitem(sys.modules, name, module)
    return seen



# ============================================================================================== files and services
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The drafter and the target in ComfyUI's diffusion_models layout, and the reward model in its folder."""
    root = tmp_path_factory.mktemp("model_glue")
    out = {}
    for role, seed in (("drafter", 1), ("target", 2)):
        (root / role).mkdir()
        out[role] = write_checkpoint("comfyui", tiny_wan(seed=seed), root / role)
    (root / "sdvg_reward").mkdir()
    torch.save(tiny_reward_model(seed=0).state_dict(), root / "sdvg_reward" / REWARD_FILE)
    out["folders"] = {"sdvg_reward": [str(root / "sdvg_reward")]}
    return out


@pytest.fixture(scope="module")
def vae():
    return FakeComfyVAE()


class RecordingServices(logic.Services):
    """The plain services, recording each ``load_run`` (which ComfyUI's ``load_models_gpu`` would do): the pack's
    own patchers are loaded; a MODEL's patcher is ComfyUI's to load, so it is only recorded."""

    def __init__(self, folders=None):
        super().__init__(folders)
        self.load_runs = []

    def load_run(self, patchers, memory_required=0):
        self.load_runs.append((list(patchers), memory_required))
        self.load([p for p in patchers if not isinstance(p, ModelPatcher)])


def models_loaded(patchers) -> list:
    """The MODELs' patchers among one load call's (in the call's order; the pack's own are the VAE and the router)."""
    return [p for p in patchers if isinstance(p, ModelPatcher)]


def pack_model(path, role):
    """The pack's own loader (SDVG Load Drafter / Target) on the same file, in fp32 on the CPU."""
    return logic.load_sdvg_model(str(path), role=role, dtype="fp32", device="cpu", services=logic.Services())


def sample(drafter, target, services, vae, mode="first_block_only", router=None, **kw):
    kw.setdefault("replay", False)
    return logic.run_sampler(drafter=drafter, target=target, router=router, positive=POSITIVE, vae=vae, width=W,
                             height=H, length=FRAMES, seed=3, mode=mode, services=services, reward_prompt=PROMPT, **kw)


def latents_error(a, b) -> float:
    return (a.result.latents - b.result.latents).abs().max().item()


# ==================================================================================================== replay identity
def test_the_replay_identity_follows_what_the_model_carries(files, comfy):
    """Equal for equal MODELs built again (new modules, new patch tensors, same contents); different when the LoRA's
    strength, one value of a patch tensor, an object patch, a weight wrapper or the compute dtype changes. The weights'
    own fingerprint cannot see a LoRA that is not merged (ComfyUI merges it only when it loads the model)."""
    from sdvg_engine.replay_key import weights_fingerprint

    identity = comfy_model.patcher_identity

    def with_lora(seed=5, strength=1.0, strength_model=1.0, manual_cast_dtype=None, edit=None):
        base = unet(files["drafter"], manual_cast_dtype)
        patches = lora_patches(base, seed)
        if edit is not None:
            edit(patches)
        patched = base.clone()  # what comfy.sd.load_lora_for_models does
        added = patched.add_patches(patches, strength, strength_model)
        assert sorted(added) == sorted(patches) and len(patched.patches) == 16  # q, k, v, o x 2 attentions x 2 blocks
        assert not base.patches  # the clone's patches are its own
        return patched

    def one_value_changed(patches):
        key = sorted(patches)[0]
        up, down, alpha, mid, dora, reshape = patches[key].weights
        up = up.clone()
        up[3, 1] += 1e-3
        patches[key] = LoRAAdapter(patches[key].loaded_keys, (up, down, alpha, mid, dora, reshape))

    def object_patched(name, value):
        patcher = with_lora()
        patcher.add_object_patch(name, value)
        return patcher

    def wrapped():
        patcher = with_lora()
        patcher.add_weight_wrapper("diffusion_model.blocks.0.self_attn.q.weight", torch.nn.functional.relu)
        return patcher

    a = with_lora()
    assert identity(a) == identity(with_lora())
    assert identity(object_patched("manual_cast_dtype", torch.bfloat16)) == \
        identity(object_patched("manual_cast_dtype", torch.bfloat16))
    variants = {
        "strength 0.5": with_lora(strength=0.5),
        "strength_model 0.9": with_lora(strength_model=0.9),
        "another LoRA": with_lora(seed=6),
        "one patch value": with_lora(edit=one_value_changed),
        "no LoRA": unet(files["drafter"]),
        "object patch bf16": object_patched("manual_cast_dtype", torch.bfloat16),
        "object patch fp16": object_patched("manual_cast_dtype", torch.float16),
        "weight wrapper": wrapped(),
        "bf16 compute": with_lora(manual_cast_dtype=torch.bfloat16),
    }
    seen = {"a": identity(a)}
    for name, patcher in variants.items():
        value = identity(patcher)
        assert value not in seen.values(), f"{name} has the identity of {[k for k, v in seen.items() if v == value]}"
        seen[name] = value
    # The compute dtype variant differs in that alone: same weights, same patches.
    assert comfy_model.compute_dtype_of(variants["bf16 compute"]) == torch.bfloat16
    assert comfy_model.compute_dtype_of(a) == torch.float32

    # The view's identity (what the replay key adds to the weights) is the MODEL's, read when asked.
    views = {name: logic.load_model_from_comfy(p, role="drafter").model for name, p in
             (("a", a), ("a again", with_lora()), ("strength 0.5", variants["strength 0.5"]),
              ("no LoRA", variants["no LoRA"]))}
    assert views["a"].sdvg_identity() == views["a again"].sdvg_identity()
    assert views["a"].sdvg_identity() != views["strength 0.5"].sdvg_identity()
    assert views["a"].sdvg_identity()[-1] == identity(a)
    assert weights_fingerprint(views["a"]) == weights_fingerprint(views["no LoRA"])
    a.patches[sorted(a.patches)[0]][0] = (0.25,) + a.patches[sorted(a.patches)[0]][0][1:]
    assert views["a"].sdvg_identity() != views["a again"].sdvg_identity()


# ======================================================================================================= clones
CLONE_REFUSAL = ("the drafter and the target are the same ComfyUI model with different patches (LoRAs or other model "
                 "patches on one Load Diffusion Model): ComfyUI keeps one set of patches per loaded model, so they "
                 "cannot run side by side. Use two Load Diffusion Model nodes, or connect the same MODEL to both.")


def test_two_clones_of_one_model_are_refused_and_one_model_on_both_inputs_runs(files, vae, comfy):
    """One Load Diffusion Model feeding the drafter directly and the target through a LoRA is refused before anything
    loads; the same MODEL on both inputs runs, loaded once, as the pack's loader on that file for both."""
    base = unet(files["drafter"])
    patched = base.clone()
    patched.add_patches(lora_patches(base, seed=5), 1.0)
    assert patched.is_clone(base) and patched is not base
    drafter = logic.load_model_from_comfy(base, role="drafter")
    services = RecordingServices()
    with pytest.raises(ValueError) as refused:
        sample(drafter, logic.load_model_from_comfy(patched, role="target"), services, vae)
    assert str(refused.value) == CLONE_REFUSAL
    assert services.load_runs == []

    same = sample(drafter, logic.load_model_from_comfy(base, role="target"), services, vae)
    [(patchers, _)] = services.load_runs
    assert models_loaded(patchers) == [base] and len(patchers) == 2  # the MODEL once, and the VAE
    own = sample(pack_model(files["drafter"], "drafter"), pack_model(files["drafter"], "target"), RecordingServices(),
                 vae)
    assert json.loads(same.report)["decisions"] == json.loads(own.report)["decisions"] == ["target", "draft", "draft"]
    assert latents_error(same, own) <= 1e-5


# ======================================================================================================= memory
@pytest.mark.parametrize("kv_dtype, manual_cast, kv_bytes", [
    # 2 layers x (K, V) x 6 frames x 6 tokens x 2 heads rows of 128 values: fp8 = 1 byte each + a 4-byte scale per
    # row; text K/V: 2 layers x (K, V) x 512 rows x 2 heads x 128 values in the compute dtype
    ("fp8", None, 2 * 2 * 6 * 6 * 2 * (128 + 4) + 2 * 2 * 512 * 2 * 128 * 4),
    ("auto", None, 2 * 2 * 6 * 6 * 2 * 128 * 4 + 2 * 2 * 512 * 2 * 128 * 4),
    ("auto", torch.bfloat16, 2 * 2 * 6 * 6 * 2 * 128 * 2 + 2 * 2 * 512 * 2 * 128 * 2),
], ids=["fp8", "auto-fp32", "auto-bf16-manual-cast"])
def test_memory_required_counts_each_kv_cache_at_its_dtype(files, vae, comfy, kv_dtype, manual_cast, kv_bytes):
    """What the run asks ComfyUI to reserve beside the weights: the engine's terms for this geometry (48x32: 6 tokens
    per latent frame; the reference preset's recompute windows: 3 context frames + the 3-frame block), each DiT's KV
    cache at the KV dtype (fp8: 1 byte per value plus its row scale), the text K/V and activations at the compute
    dtype (the MODEL's manual cast, else its dtype)."""
    services = RecordingServices()
    models = [logic.load_model_from_comfy(unet(files[role], manual_cast), role=role, kv_dtype=kv_dtype)
              for role in ("drafter", "target")]
    out = sample(*models, services, vae)
    report = json.loads(out.report)
    [(patchers, memory)] = services.load_runs
    assert models_loaded(patchers) == [m.patcher for m in models] and len(patchers) == 3  # + the VAE

    compute_bytes = 2 if manual_cast == torch.bfloat16 else 4
    shown = "fp8" if kv_dtype == "fp8" else f"{compute_bytes}-byte compute dtype"
    config = {"num_attention_heads": 2, "attention_head_dim": 128, "ffn_dim": 256, "num_layers": 2}
    assert {k: models[0].model.config[k] for k in config} == config
    expected = run_memory_components([(role, config, 6, kv_dtype, compute_bytes) for role in ("drafter", "target")],
                                     width=W, height=H, vae_dtype="fp32")
    components = report["memory_required"]["components"]
    assert components == {k: int(v) for k, v in expected.items()}
    assert components[f"drafter KV (6 frames, {shown})"] == components[f"target KV (6 frames, {shown})"] == kv_bytes
    assert memory == report["memory_required"]["bytes"] == sum(components.values())
    # ... and what the view really allocates: its KV cache for 6 frames and the prompt's text K/V
    view = models[0].model
    with torch.inference_mode():
        text = view.encode_text(POSITIVE[0][0])
    allocated = view.new_kv_cache(1, H // 8, W // 8, 6).nbytes + sum(t.nbytes for t in text.keys + text.values)
    assert allocated == kv_bytes


# ===================================================================================================== lane plans
#: mode -> (the drafter runs, the target runs, drafts are scored (a router is loaded), the drafter leads)
MODE_PLAN = {
    "sdvg": (True, True, True, False),
    "target_only": (False, True, False, False),
    "draft_only": (True, False, False, True),
    "first_block_only": (True, True, False, True),
    "random": (True, True, False, False),
    "schedule": (True, True, False, False),
}
COMPONENTS = ("drafter", "target", "vae", "reward")
TAU = -2.1  # between the two drafts' scores of these models (-1.72 kept, -2.49 rejected)


def lanes(drafter_leads: bool) -> dict:
    """plan_lanes on one device with two workers: the leading model's lane (the target shares the drafter's when the
    drafter leads), and the other side's."""
    return {"drafter": "lead" if drafter_leads else "side", "target": "lead", "vae": "side", "reward": "side"}


def test_every_mode_has_its_lane_plan():
    from sdvg_engine import choices

    assert tuple(MODE_PLAN) == schema.MODES == choices.MODES


@pytest.mark.parametrize("mode", schema.MODES)
def test_what_each_mode_runs_and_which_model_leads(mode):
    options = SDVGOptions(mode=mode)
    drafter_runs, target_runs, scored, leads = MODE_PLAN[mode]
    assert (options.uses_drafter, options.uses_target, options.scores_drafts, options.drafter_leads) == \
        (drafter_runs, target_runs, scored, leads)
    one_device = {c: CPU for c in COMPONENTS}
    assert plan_lanes(options, one_device, workers=2) == lanes(leads)
    assert plan_lanes(mode, one_device, workers=2) == lanes(leads)
    one_lane = {c: "main" for c in COMPONENTS}
    assert plan_lanes(options, one_device, workers=1) == plan_lanes(options, one_device) == one_lane


@pytest.mark.parametrize("mode", schema.MODES)
def test_a_model_backed_run_loads_what_its_mode_runs_on_one_lane(files, vae, comfy, mode):
    """Both MODELs connected, workers=2 asked for: the run loads (one load call) and runs only the models its mode
    uses, plus the VAE and, where drafts are scored, the router; it runs on one lane, and the report says why."""
    drafter_runs, target_runs, scored, _ = MODE_PLAN[mode]
    services = RecordingServices(files["folders"])
    drafter = logic.load_model_from_comfy(unet(files["drafter"]), role="drafter")
    target = logic.load_model_from_comfy(unet(files["target"]), role="target")
    router = logic.build_router(REWARD_FILE, TAU, "min", "center", 0.0, services=services) if scored else None
    out = sample(drafter, target, services, vae, mode=mode, router=router, workers="2")
    report = json.loads(out.report)

    [(patchers, _)] = services.load_runs
    models = [m.patcher for m, runs in ((drafter, drafter_runs), (target, target_runs)) if runs]
    assert models_loaded(patchers) == models
    assert len(patchers) == len(models) + 1 + scored  # + the VAE, + the router where drafts are scored
    assert (router is not None and router.patcher in patchers) == scored
    for role, runs in (("drafter", drafter_runs), ("target", target_runs)):
        assert bool(report["model_calls"][role]) == runs, role
        assert (report["models"][role] is not None) == runs, role
    roles = [role for role, runs in (("drafter", drafter_runs), ("target", target_runs)) if runs]
    workers = report["settings"]["workers"]
    assert workers["lanes"] == {c: "main" for c in COMPONENTS} and workers["parallel"] is False
    assert workers["one_lane"] == f"the {' and the '.join(roles)} {'is a' if len(roles) == 1 else 'are'} {ONE_LANE}"
    expected = {"sdvg": ["target", "draft", "target"], "target_only": ["target"] * 3, "draft_only": ["draft"] * 3,
                "first_block_only": ["target", "draft", "draft"], "random": ["target", "target", "draft"],
                "schedule": ["target", "draft", "draft"]}[mode]
    assert report["decisions"] == expected


# ================================================================================================== equivalence
@pytest.mark.parametrize("mode", ["first_block_only", "sdvg"])
def test_a_model_backed_run_equals_the_packs_loader_on_the_same_weights(files, vae, comfy, mode):
    """The MODEL branch (ComfyUI's module tree, ops, attention and cast_to) against the pack's own loader on the same
    file, both asked for two workers: the file-loaded run gets the mode's two lanes, the MODEL-backed one one lane."""
    services = RecordingServices(files["folders"])
    router = logic.build_router(REWARD_FILE, TAU, "min", "center", 0.0, services=services) if mode == "sdvg" else None
    own = sample(pack_model(files["drafter"], "drafter"), pack_model(files["target"], "target"), services, vae,
                 mode=mode, router=router, workers="2")
    patchers = {role: unet(files[role]) for role in ("drafter", "target")}
    drafter, target = (logic.load_model_from_comfy(patchers[role], role=role) for role in ("drafter", "target"))
    assert drafter.model.source is patchers["drafter"].get_model_object("diffusion_model")
    assert {id(p) for p in target.model.parameters()} == \
        {id(p) for p in patchers["target"].get_model_object("diffusion_model").parameters()}
    _CastOp.calls = 0
    via = sample(drafter, target, services, vae, mode=mode, router=router, workers="2")

    assert latents_error(via, own) <= 1e-5
    assert (via.frames - own.frames).abs().max().item() <= 1e-4
    report, own_report = json.loads(via.report), json.loads(own.report)
    assert report["decisions"] == own_report["decisions"] == (
        ["target", "draft", "target"] if mode == "sdvg" else ["target", "draft", "draft"])
    if mode == "sdvg":
        assert report["draft_scores"][0] is None
        assert report["draft_scores"][1:] == pytest.approx(own_report["draft_scores"][1:], abs=1e-4)
    # ComfyUI's pieces ran: the MODEL's ops, its attention and cast_to (the modulation tables)
    assert _CastOp.calls > 0 and comfy.optimized > 0 and comfy.cast_to > 0
    assert report["models"]["drafter"] == {
        "source": "ComfyUI MODEL", "architecture": "custom Wan2.1 (dim 256, 2 layers, 2 heads)", "dtype": "fp32",
        "device": "cpu", "context_scheme": "global_cache", "schedule": own_report["models"]["drafter"]["schedule"],
        "compute_dtype": "fp32", "weights": "fp32", "attention": "optimized_attention", "patched_weights": 0,
        "partially_loaded": False}
    # lanes: the file-loaded run as planned for the mode, the MODEL-backed one forced to one
    assert own_report["settings"]["workers"] == {"lanes": lanes(MODE_PLAN[mode][3]), "parallel": True}
    assert report["settings"]["workers"] == {"lanes": {c: "main" for c in COMPONENTS}, "parallel": False,
                                             "one_lane": f"the drafter and the target are {ONE_LANE}"}
    assert models_loaded(services.load_runs[-1][0]) == [patchers["drafter"], patchers["target"]]


# ================================================================================================ masked attention
def test_a_masked_call_goes_to_attention_pytorch_with_its_mask(files, comfy):
    """A cache bias (the recompute window's attention_bias) is a masked call: ComfyUI's attention_pytorch gets the
    mask (some backends ComfyUI may pick drop masks); unmasked calls use optimized_attention. Same outputs as the
    pack's model on the same file."""
    view = logic.load_model_from_comfy(unet(files["drafter"]), role="drafter").model
    own = pack_model(files["drafter"], "drafter").model
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 3, H // 8, W // 8, generator=g), torch.full((1, 3), 600.0)
    outs = {}
    with torch.inference_mode():
        for name, model in (("view", view), ("own", own)):
            text, cache = model.encode_text(POSITIVE[0][0]), model.new_kv_cache(1, H // 8, W // 8, 9)
            model.forward_block(x, t, text, cache, 0)
            model.forward_block(x, t, text, cache, 3)
            if name == "view":
                unmasked = (comfy.optimized, comfy.masked)
            outs[name] = model.forward_block(x, t, text, cache, 6, cache_bias=((0, 3), -3.0))
            outs[name + " unbiased"] = model.forward_block(x, t, text, cache, 6)
    assert unmasked[0] > 0 and unmasked[1] == 0  # no bias: no masked call
    assert comfy.masked == 2  # one per layer of the biased block
    assert (outs["view"] - outs["own"]).abs().max().item() <= 1e-5
    assert (outs["view unbiased"] - outs["own unbiased"]).abs().max().item() <= 1e-5
    assert (outs["view"] - outs["view unbiased"]).abs().max().item() > 1e-3  # the bias matters here


# ==================================================================================================== hygiene
def test_the_comfy_stand_ins_do_not_outlive_their_tests():
    """Other files check that ComfyUI is absent (or import the real one): no stand-in may stay in sys.modules. (Runs
    after the tests above, in file order.)"""
    assert all(sys.modules.get(module.__name__) is not module for module in _STAND_INS)
    if "comfy" not in sys.modules:  # no real ComfyUI either: the glue's lazy imports fail as they do in CI
        with pytest.raises(ImportError):
            import comfy.model_management  # noqa: F401
