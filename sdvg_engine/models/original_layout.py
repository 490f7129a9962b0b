"""A Wan2.1 DiT in the original layout (the Wan repository's module names, which ComfyUI's ``WanModel`` keeps) run by
the engine's one block-causal forward, with its weights left where and how its host keeps them.

The host (a ComfyUI node, ``nodes/comfy_model.py``) owns the modules and decides how each one runs: ``call`` runs an
op with its weights cast to the input (ComfyUI: manual casts, fp8 and scaled-fp8 storage, LoRA patches applied per
call on low-VRAM loads, GGUF dequantisation), ``read_param`` reads the raw modulation tables, ``attention`` is the
attention backend the host selected, ``identity`` says which patches are applied (for the replay key). Nothing here
copies, merges or moves a weight, and nothing imports the host.

The forward is :class:`~sdvg_engine.models.causal_wan.CausalWanForward`, the pack's own models' forward: this module
only presents the original names under diffusers' ones (``tests/wan_fixtures.py`` maps the same names for files):

===========================================  ==============================================
original (ComfyUI ``WanModel``)              diffusers (what the forward reads)
===========================================  ==============================================
``patch_embedding``                          ``patch_embedding``
``text_embedding.0`` / ``.2``                ``condition_embedder.text_embedder`` (GELU-tanh MLP)
``time_embedding.0`` / ``.2``                ``condition_embedder.time_embedder.linear_1`` / ``linear_2``
``time_projection.1``                        ``condition_embedder.time_proj``
``blocks.i.self_attn.{q,k,v,o,norm_q,norm_k}``  ``blocks.i.attn1.{to_q,to_k,to_v,to_out.0,norm_q,norm_k}``
``blocks.i.cross_attn.*``                    ``blocks.i.attn2.*``
``blocks.i.norm1`` / ``norm3`` / ``norm2``   ``blocks.i.norm1`` / ``norm2`` (affine) / ``norm3``
``blocks.i.ffn.0`` / ``.2``                  ``blocks.i.ffn`` (GELU-tanh MLP)
``blocks.i.modulation`` ``[1, 6, D]``        ``blocks.i.scale_shift_table``
``head.norm`` / ``head.head``                ``norm_out`` / ``proj_out``
``head.modulation`` ``[1, 2, D]``            ``scale_shift_table``
===========================================  ==============================================
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import FrozenDict

from .causal_wan import CausalWanForward, RuntimeSettings, architecture_name, count_parameters

__all__ = ["OriginalLayoutCausalWan", "original_layout_info", "HostOp"]

#: Wan2.1's head dimension: ComfyUI's model detection also derives the head count as ``dim // 128``.
HEAD_DIM = 128


def _call_module(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _read_param(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return param.to(device=device, dtype=dtype)


class HostOp:
    """One op of the source model, called the host's way: ``op(x) == call(module, x)``.

    It has no ``weight`` attribute on purpose: the forward never reads weights directly (which would skip the host's
    casts and patches); it feeds each op the dtype the host's own Wan feeds it
    (:attr:`~sdvg_engine.models.causal_wan.CausalWanForward.ops_in_host_dtypes`)."""

    __slots__ = ("module", "_call")

    def __init__(self, module: torch.nn.Module, call: Callable):
        self.module, self._call = module, call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self.module, x)


class _GeluMLP:
    """``Linear -> GELU(tanh) -> Linear`` (Wan's text embedding and feed-forward) over two host ops."""

    __slots__ = ("first", "second")

    def __init__(self, first: HostOp, second: HostOp):
        self.first, self.second = first, second

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(F.gelu(self.first(x), approximate="tanh"))


class _Block:
    """One transformer block under diffusers' names; ``scale_shift_table`` is read from the block through the host
    every call (float32 on the compute device), so a patched, replaced or offloaded parameter is always seen as the
    host has it now (ComfyUI's full-load patching replaces the parameter object)."""

    def __init__(self, source_block: torch.nn.Module, op: Callable, param: Callable):
        def attention(a):
            return SimpleNamespace(to_q=op(a.q), to_k=op(a.k), to_v=op(a.v), to_out=[op(a.o)], norm_q=op(a.norm_q),
                                   norm_k=op(a.norm_k))

        self.attn1, self.attn2 = attention(source_block.self_attn), attention(source_block.cross_attn)
        self.norm1, self.norm2, self.norm3 = op(source_block.norm1), op(source_block.norm3), op(source_block.norm2)
        self.ffn = _GeluMLP(op(source_block.ffn[0]), op(source_block.ffn[2]))
        self._source, self._param = source_block, param

    @property
    def scale_shift_table(self) -> torch.Tensor:
        return self._param(self._source.modulation)


def _shape_config(source: torch.nn.Module) -> FrozenDict:
    """The config of a Wan2.1 DiT in the original layout, from its modules' shapes (as ComfyUI's detection does)."""
    missing = [name for name in ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks",
                                 "head") if not hasattr(source, name)]
    if missing or not hasattr(getattr(source, "head", None), "modulation"):
        raise ValueError(f"{type(source).__name__} is not a Wan2.1 DiT in the original layout (no "
                         f"{', '.join(missing) or 'head.modulation'}); SDVG runs Wan2.1 text-to-video models "
                         "(ComfyUI's WanModel, e.g. from Load Diffusion Model)")
    dim = source.head.modulation.shape[-1]
    num_heads = int(getattr(source, "num_heads", dim // HEAD_DIM))
    if dim % num_heads:
        raise ValueError(f"model width {dim} is not divisible by its {num_heads} heads")
    patch = tuple(int(p) for p in source.patch_embedding.kernel_size)
    return FrozenDict(  # diffusers' config type: items are also attributes, as on the pack's own models
        num_attention_heads=num_heads, attention_head_dim=dim // num_heads, ffn_dim=source.blocks[0].ffn[0].out_features,
        num_layers=len(source.blocks), in_channels=source.patch_embedding.in_channels,
        out_channels=source.head.head.out_features // (patch[0] * patch[1] * patch[2]),
        text_dim=source.text_embedding[0].in_features, freq_dim=source.time_embedding[0].in_features,
        patch_size=patch, rope_max_seq_len=1024, eps=1e-6, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    )


class OriginalLayoutCausalWan(CausalWanForward, torch.nn.Module):
    """A host's Wan2.1 DiT in the original layout, run by the engine's block-causal forward (see the module doc).

    Args:
        source: the DiT module (ComfyUI: ``patcher.get_model_object("diffusion_model")``); held as a submodule, so
            ``parameters()`` are its parameters. Never moved, cast or modified here.
        device: where the forward computes (ComfyUI: the patcher's load device).
        compute_dtype: the dtype activations run in (ComfyUI: ``manual_cast_dtype`` or the model's dtype).
        call: ``call(op, x)`` runs one op module (Linear, Conv3d, LayerNorm, RMSNorm) on ``x`` the host's way, with its
            weights cast and every patch applied; ``x`` is in the dtype the host's own Wan gives that op
            (:attr:`ops_in_host_dtypes`). Default: ``op(x)``.
        read_param: ``read_param(param, dtype, device)`` reads a raw parameter (the modulation tables).
            Default: ``param.to(device, dtype)``.
        attention: the attention backend, see :attr:`~sdvg_engine.models.causal_wan.RuntimeSettings.attention`.
            Default: ``F.scaled_dot_product_attention``.
        identity: ``identity() -> tuple`` of what else makes this model's outputs differ (patches and their
            strengths, quantisation): added to the replay key, since patches applied per call leave the parameters,
            and so the weights fingerprint, unchanged. Default: ``()``.
    """

    #: the host's ops get the dtypes its own Wan gives them (time MLP and norms in the compute dtype; see the base)
    ops_in_host_dtypes = True

    def __init__(self, source: torch.nn.Module, *, device: "torch.device | str", compute_dtype: torch.dtype,
                 call: Callable | None = None, read_param: Callable | None = None, attention: Callable | None = None,
                 identity: Callable | None = None):
        torch.nn.Module.__init__(self)
        self.config = _shape_config(source)
        self.source = source
        self._device, self._compute_dtype = torch.device(device), compute_dtype
        self._identity = identity
        call = call or _call_module
        read = read_param or _read_param

        def op(module):
            return HostOp(module, call)

        def param(p):
            return read(p, torch.float32, self._device)

        # Plain attributes, not submodules: they are views of ``source``'s modules, which stay registered once.
        views = dict(
            patch_embedding=op(source.patch_embedding),
            condition_embedder=SimpleNamespace(
                text_embedder=_GeluMLP(op(source.text_embedding[0]), op(source.text_embedding[2])),
                time_embedder=SimpleNamespace(linear_1=op(source.time_embedding[0]), linear_2=op(source.time_embedding[2])),
                time_proj=op(source.time_projection[1])),
            blocks=[_Block(b, op, param) for b in source.blocks],
            norm_out=op(source.head.norm), proj_out=op(source.head.head),
        )
        for name, value in views.items():
            object.__setattr__(self, name, value)
        self._param = param
        self.runtime = RuntimeSettings(attention=attention)

    @property
    def scale_shift_table(self) -> torch.Tensor:
        return self._param(self.source.head.modulation)  # read every call, as the blocks' (see _Block)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._compute_dtype

    def use_runtime(self, **settings) -> "OriginalLayoutCausalWan":
        if settings.get("block_hooks") is not None:
            raise ValueError("block offload streams the pack's own models; a host's model (a ComfyUI MODEL) is "
                             "loaded and offloaded by its host's memory manager (ComfyUI: --lowvram / --novram)")
        return super().use_runtime(**settings)

    def sdvg_identity(self) -> tuple:
        """What besides the weights' values decides this model's outputs (the host's ``identity``), for the replay
        key (:func:`sdvg_engine.replay_key.model_identity`)."""
        return ("original_layout", str(self._compute_dtype), str(self._device),
                tuple(self._identity()) if self._identity is not None else ())

    def forward(self, *args, **kwargs):
        raise TypeError("OriginalLayoutCausalWan runs one block at a time: call forward_block(...)")


def original_layout_info(view: OriginalLayoutCausalWan, context_scheme: str, source: str = "host model"):
    """A :class:`~sdvg_engine.models.loading.CheckpointInfo` for ``view`` (what ``LoadedDiT.of`` reads): the
    architecture by its config, ``context_scheme`` as given (the scheme its weights were trained with)."""
    from .loading import CheckpointInfo

    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in view.source.parameters()})
    return CheckpointInfo(path=source, format="original-layout module", architecture=architecture_name(view.config),
                          config=dict(view.config), num_parameters=count_parameters(view.source),
                          stored_dtype="/".join(dtypes), context_scheme=context_scheme)
