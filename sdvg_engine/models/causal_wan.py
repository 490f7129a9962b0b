"""Block-causal Wan2.1 DiT: diffusers' ``WanTransformer3DModel`` driven one block at a time.

The layers and weights are diffusers' own (so diffusers' key conversion and ``from_pretrained``
apply unchanged); this class adds what diffusers does not have:

* per-frame timesteps ``t [B, F]`` with modulation broadcast per frame (not per token),
* RoPE whose time axis starts at the block's frame position,
* self-attention of the block over ``kv_cache[:end] + block`` (bidirectional inside the block,
  causal across blocks) with an optional additive bias on chosen cached frames,
* text cross-attention whose keys/values are computed once per prompt (:class:`TextKV`).

Shapes below: ``B`` batch, ``C`` latent channels (16), ``F`` latent frames of the block, ``h, w``
latent height/width, ``L = F * (h/2) * (w/2)`` tokens, ``D`` model width, ``H`` heads, ``d`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from .kv_cache import CacheGeometry, KVCache

#: Wan2.1 text-to-video architectures (``wan/configs/wan_t2v_*.py``). Head dim is 128 in both.
WAN_CONFIGS = {
    "Wan2.1-T2V-1.3B": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "Wan2.1-T2V-14B": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
}
_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
               cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)


def wan_config(name: str, **overrides) -> dict:
    """Full ``WanTransformer3DModel`` config for a named architecture (``tiny`` for tests)."""
    if name == "tiny":
        base = dict(num_attention_heads=2, attention_head_dim=128, ffn_dim=256, num_layers=2)
    else:
        try:
            base = WAN_CONFIGS[name]
        except KeyError:
            raise ValueError(f"unknown architecture {name!r}; known: {sorted(WAN_CONFIGS)} and 'tiny'") from None
    return {**_COMMON, **base, **overrides}


def architecture_name(config) -> str:
    """The released architecture a config matches, or a description of a custom one."""
    for name, arch in WAN_CONFIGS.items():
        if all(config[k] == v for k, v in arch.items()) and config["text_dim"] == 4096:
            return name
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return f"custom Wan2.1 (dim {dim}, {config['num_layers']} layers, {config['num_attention_heads']} heads)"


@dataclass
class TextKV:
    """Cross-attention keys/values of one prompt for every layer: ``[B, H, L_text, d]`` each.

    Built once per prompt by :meth:`CausalWanTransformer3DModel.encode_text`; every block and step
    reuses it. All 512 text rows are kept, zero padding included: the reference models attend to the
    padding (which is nonzero after the text MLP), so truncating would change the output.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


def sinusoidal_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's ``[cos, sin]`` timestep embedding, computed in float64 as the original code does.

    timesteps: any shape ``S`` -> ``[*S, dim]`` float64.
    """
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=timesteps.device) / half)
    args = timesteps.to(torch.float64).unsqueeze(-1) * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _linear_fp32(linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` in float32 whatever the weights' dtype (the time MLP and the modulation projection)."""
    weight = linear.weight
    if hasattr(linear, "dequantized_weight"):  # fp8-stored layers (see loading.py)
        weight = linear.dequantized_weight()
    bias = None if linear.bias is None else linear.bias.float()
    return F.linear(x.float(), weight.float(), bias)


@dataclass(frozen=True)
class RuntimeSettings:
    """How a loaded model runs, beside its weights: given when it is loaded or built
    (:meth:`CausalWanTransformer3DModel.use_runtime`), read by its calls, never switched from outside mid-run.

    * ``kv_cache_dtype``: dtype of the KV caches :meth:`~CausalWanTransformer3DModel.new_kv_cache` makes when none is
      given (``None`` = the compute dtype; ``torch.float8_e4m3fn`` = fp8 storage with per-row scales, ``kv_cache.py``).
    * ``block_hooks``: an object with ``before(layer)`` / ``after(layer)``, called around each transformer block's use
      by ``forward_block`` and ``encode_text`` (block weight streaming: ``sdvg_engine/offload.py``).
    * ``fused_attention_on_meta``: on meta tensors, attention returns what a fused (flash / memory-efficient) kernel
      allocates, the output alone (the real-size dry run's models, :mod:`sdvg_engine.dry_run`); see :func:`_attention`.
    * ``attention``: ``attention(q, k, v, mask) -> out`` replacing SDPA (q ``[B, H, L, d]``, k/v ``[B, H, L_kv, d]``,
      ``mask`` ``None`` or additive/boolean, broadcastable to ``[B, H, L, L_kv]``; out ``[B, H, L, d]``): the attention
      backend a host selected (ComfyUI's ``optimized_attention``). It must honour the mask when one is given.
    """

    kv_cache_dtype: "torch.dtype | None" = None
    block_hooks: object = None
    fused_attention_on_meta: bool = False
    attention: object = None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, *,
               fused_on_meta: bool = False, backend=None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (q ``[B, H, L, d]``, k/v ``[B, H, L_kv, d]`` -> ``[B, H, L, d]``).

    With ``fused_on_meta`` (a model's :attr:`RuntimeSettings.fused_attention_on_meta`: the real-size dry run's) a meta
    call returns what a fused (flash / memory-efficient) kernel allocates, the output alone: meta dispatch would
    otherwise take the math fallback and build its ``[B, H, L, L_kv]`` scores, which a GPU run never holds. Elsewhere
    meta calls run the real op, so FLOP counting on meta (bench/cost_model.py) still sees the attention."""
    if q.is_meta and fused_on_meta:
        if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"attention shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        return torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    if backend is not None and not q.is_meta:
        return backend(q, k, v, attn_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (``view_as_complex`` convention). x: ``[B, L, H, d]``, cos/sin: ``[L, 1, d/2]``."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


class CausalWanForward:
    """The block-causal forward of a Wan2.1 DiT (:meth:`forward_block`, :meth:`encode_text`, KV caches), written once
    over diffusers' module names and shared by every way a model reaches the engine: the pack's own
    :class:`CausalWanTransformer3DModel` (diffusers' modules) and
    :class:`~sdvg_engine.models.original_layout.OriginalLayoutCausalWan` (a host's modules in the original Wan layout,
    such as a ComfyUI MODEL). A class using it provides ``config`` (diffusers' names), ``device``, ``patch_embedding``,
    ``condition_embedder``, ``blocks``, ``scale_shift_table``, ``norm_out`` and ``proj_out``.
    """

    # ---- geometry -------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.config.attention_head_dim

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        _, p_h, p_w = self.config.patch_size
        if latent_height % p_h or latent_width % p_w:
            raise ValueError(
                f"latent size {latent_height}x{latent_width} is not divisible by the patch size "
                f"{p_h}x{p_w}; pixel width and height must be multiples of {8 * p_h}"
            )
        return (latent_height // p_h) * (latent_width // p_w)

    #: the settings this model runs with (:class:`RuntimeSettings`); changed only through :meth:`use_runtime`
    runtime: RuntimeSettings = RuntimeSettings()

    #: Which dtypes the ops are fed. ``False`` (the pack's own models): the reference implementations' (Self-Forcing,
    #: Krea): the time MLP and the norms in float32, everything else in the compute dtype. ``True`` (a host's modules,
    #: ``original_layout.py``): what the host's own Wan feeds the same ops. ComfyUI's ``WanModel`` runs the patch
    #: embedding in float32 (its weight is kept in float32) and every other op, time MLP and norms included, in the
    #: compute dtype; its ops are built for those inputs: on fp8-capable GPUs a scaled-fp8 Linear calls
    #: ``torch._scaled_mm`` with the input's dtype as output dtype, which CUDA refuses for float32 with a bias.
    ops_in_host_dtypes: bool = False

    def use_runtime(self, **settings) -> "CausalWanTransformer3DModel":
        """Run with these :class:`RuntimeSettings` fields from now on (the loader's ``kv_dtype`` and ``offload``, the
        dry run's attention); returns the model. Call it when the model is loaded or built, not during a run."""
        unknown = set(settings) - set(RuntimeSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown runtime settings {sorted(unknown)}; known: "
                             f"{sorted(RuntimeSettings.__dataclass_fields__)}")
        if settings.get("block_hooks") is not None and "forward_block" in vars(self):
            raise ValueError("this model's forward_block is torch.compile'd; block streaming does not support compile "
                             "(load it without compile)")
        self.runtime = replace(self.runtime, **settings)
        return self

    @property
    def kv_cache_dtype(self) -> "torch.dtype | None":
        """:attr:`RuntimeSettings.kv_cache_dtype` (assigning it is kept for compatibility: it calls :meth:`use_runtime`)."""
        return self.runtime.kv_cache_dtype

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, value) -> None:
        self.use_runtime(kv_cache_dtype=value)

    @property
    def block_hooks(self):
        """:attr:`RuntimeSettings.block_hooks` (assigning it is kept for compatibility: it calls :meth:`use_runtime`)."""
        return self.runtime.block_hooks

    @block_hooks.setter
    def block_hooks(self, value) -> None:
        self.use_runtime(block_hooks=value)

    def new_kv_cache(self, batch_size: int, latent_height: int, latent_width: int, capacity_frames: int,
                     *, dtype: torch.dtype | None = None) -> KVCache:
        geometry = CacheGeometry(
            num_layers=self.config.num_layers, batch_size=batch_size, num_heads=self.num_heads,
            head_dim=self.head_dim, tokens_per_frame=self.tokens_per_frame(latent_height, latent_width),
            capacity_frames=capacity_frames, dtype=dtype or self.kv_cache_dtype or self.compute_dtype, device=self.device,
            compute_dtype=self.compute_dtype,
        )
        return KVCache(geometry)

    # ---- text -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompt_embeds: torch.Tensor) -> TextKV:
        """prompt_embeds ``[B, L_text, text_dim]`` (UMT5 output, zero padded) -> per-layer cross-attention K/V."""
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"text context must be [B, L, {self.config.text_dim}] (UMT5-XXL embeddings), "
                f"got shape {tuple(prompt_embeds.shape)}"
            )
        context = self.condition_embedder.text_embedder(prompt_embeds.to(self.device, self.compute_dtype))
        keys, values = [], []
        hooks = self.block_hooks
        for layer, block in enumerate(self.blocks):
            if hooks is not None:
                hooks.before(layer)
            attn = block.attn2
            if getattr(attn, "sdvg_fused", False):
                k, v = attn.to_kv(context).chunk(2, dim=-1)
            else:
                k, v = attn.to_k(context), attn.to_v(context)
            keys.append(attn.norm_k(k).unflatten(2, (self.num_heads, -1)).transpose(1, 2).contiguous())
            values.append(v.unflatten(2, (self.num_heads, -1)).transpose(1, 2).contiguous())
            if hooks is not None:
                hooks.after(layer)
        return TextKV(keys, values)

    # ---- positions and time ---------------------------------------------------------------------
    def _rope_tables(self) -> tuple[torch.Tensor, ...]:
        """Per-axis angle tables ``[max_positions, d_axis/2]`` (time, height, width), float64 on CPU.

        Built from the config rather than read from diffusers' rope buffers, whose layout has changed
        between diffusers releases (and which are meta tensors after a meta-device build).
        """
        if getattr(self, "_sdvg_rope_tables", None) is None:
            head_dim = self.config.attention_head_dim
            h_dim = w_dim = 2 * (head_dim // 6)
            t_dim = head_dim - h_dim - w_dim
            positions = torch.arange(self.config.rope_max_seq_len, dtype=torch.float64)
            tables = []
            for dim in (t_dim, h_dim, w_dim):
                inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
                tables.append(torch.outer(positions, inv_freq))
            self._sdvg_rope_tables = tuple(tables)
        return self._sdvg_rope_tables

    def _rope(self, start_frame: int, num_frames: int, hp: int, wp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[L, 1, d/2]`` for frames ``start_frame..start_frame+F-1`` of an ``hp x wp`` token grid."""
        max_positions = self.config.rope_max_seq_len
        if start_frame + num_frames > max_positions or max(hp, wp) > max_positions:
            raise ValueError(
                f"RoPE table has {max_positions} positions; frame position {start_frame + num_frames - 1} "
                f"or grid {hp}x{wp} exceeds it"
            )
        t, h, w = self._rope_tables()
        t = t[start_frame : start_frame + num_frames].view(num_frames, 1, 1, -1).expand(num_frames, hp, wp, -1)
        h = h[:hp].view(1, hp, 1, -1).expand(num_frames, hp, wp, -1)
        w = w[:wp].view(1, 1, wp, -1).expand(num_frames, hp, wp, -1)
        angles = torch.cat([t, h, w], dim=-1).reshape(num_frames * hp * wp, 1, -1)
        return angles.cos().to(device, torch.float32), angles.sin().to(device, torch.float32)

    def _time_embedding(self, timesteps: torch.Tensor):
        """timesteps ``[B, F]`` -> ``temb [B, F, D]`` and modulation ``[B, F, 6, D]`` (float32)."""
        emb = self.condition_embedder
        sinus = sinusoidal_embedding(timesteps, self.config.freq_dim).float()
        if self.ops_in_host_dtypes:  # as the host's own Wan: the time MLP in the compute dtype (see the attribute)
            temb = emb.time_embedder.linear_2(F.silu(emb.time_embedder.linear_1(sinus.to(self.compute_dtype))))
            modulation = emb.time_proj(F.silu(temb))
            return temb.float(), modulation.float().unflatten(-1, (6, -1))
        # The original runs these layers under float32 autocast whatever the weight dtype; so do we.
        hidden = F.silu(_linear_fp32(emb.time_embedder.linear_1, sinus))
        temb = _linear_fp32(emb.time_embedder.linear_2, hidden)
        modulation = _linear_fp32(emb.time_proj, F.silu(temb))
        return temb, modulation.unflatten(-1, (6, -1))

    # ---- attention --------------------------------------------------------------------------------
    def _self_attention(self, attn, x, rope, kv_cache: KVCache | None, layer: int, start_frame: int, attn_mask):
        if getattr(attn, "sdvg_fused", False):
            q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        q = attn.norm_q(q).unflatten(2, (self.num_heads, -1))
        k = attn.norm_k(k).unflatten(2, (self.num_heads, -1))
        v = v.unflatten(2, (self.num_heads, -1))
        # Keys are cached after RoPE, so a cached frame keeps the position it was written at.
        q, k = _apply_rope(q, *rope).transpose(1, 2), _apply_rope(k, *rope).transpose(1, 2)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.write_and_read(layer, start_frame, k, v)
        out = _attention(q, k, v, attn_mask, fused_on_meta=self.runtime.fused_attention_on_meta,
                         backend=self.runtime.attention)
        return attn.to_out[0](out.transpose(1, 2).flatten(2))

    def _cross_attention(self, attn, x, text_k, text_v):
        q = attn.norm_q(attn.to_q(x)).unflatten(2, (self.num_heads, -1)).transpose(1, 2)
        out = _attention(q, text_k, text_v, fused_on_meta=self.runtime.fused_attention_on_meta,
                         backend=self.runtime.attention)
        return attn.to_out[0](out.transpose(1, 2).flatten(2))

    def _attention_bias(self, kv_cache: KVCache, start_frame: int, num_frames: int, bias_frames, bias: float, dtype):
        """Additive logit bias ``[1, 1, 1, end_tokens]`` adding ``bias`` on cached frames in ``bias_frames``."""
        tpf = kv_cache.tokens_per_frame
        mask = torch.zeros(1, 1, 1, (start_frame + num_frames) * tpf, dtype=dtype, device=kv_cache.keys.device)
        lo, hi = bias_frames
        mask[..., lo * tpf : hi * tpf] = bias
        return mask

    # ---- the block forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_block(
        self,
        block_latents: torch.Tensor,
        timesteps: torch.Tensor,
        text_kv: TextKV,
        kv_cache: KVCache | None = None,
        start_frame: int = 0,
        *,
        attn_mask: torch.Tensor | None = None,
        cache_bias: tuple[tuple[int, int], float] | None = None,
    ) -> torch.Tensor:
        """Predict the flow of one block of latent frames.

        Args:
            block_latents: ``[B, C, F, h, w]`` noisy latents of the block (normalized latent space).
            timesteps: ``[B, F]`` (or ``[B]``) float timesteps in [0, 1000], one per frame.
            text_kv: the prompt's cross-attention K/V from :meth:`encode_text`.
            kv_cache: if given, this block's K/V are written at frames ``start_frame..start_frame+F-1``
                and the block attends to all cached frames before it plus itself. If ``None`` the block
                attends only to itself (optionally under ``attn_mask``).
            start_frame: frame position of the block: its RoPE time offset and its cache slot.
            attn_mask: optional boolean/additive mask ``[.., L, L_keys]`` for SDPA (used by tests and
                the full-sequence reference).
            cache_bias: ``((first, end), bias)``: add ``bias`` to the logits of cached frames
                ``first..end-1`` (Krea/Scope's attention bias on older context frames).

        Returns:
            flow ``v = noise - x0`` of shape ``[B, C, F, h, w]`` in float32.
        """
        B, C, n_frames, h, w = block_latents.shape
        p_t, p_h, p_w = self.config.patch_size
        if p_t != 1:
            raise ValueError(f"temporal patch size {p_t} is not supported (Wan2.1 uses 1)")
        if C != self.config.in_channels:
            raise ValueError(f"block has {C} latent channels, the model expects {self.config.in_channels}")
        hp, wp = h // p_h, w // p_w
        tpf = self.tokens_per_frame(h, w)
        if timesteps.ndim == 1:
            timesteps = timesteps[:, None].expand(B, n_frames)
        if tuple(timesteps.shape) != (B, n_frames):
            raise ValueError(f"timesteps must be [B, F] = [{B}, {n_frames}], got {tuple(timesteps.shape)}")
        if kv_cache is not None:
            if kv_cache.tokens_per_frame != tpf or kv_cache.geometry.batch_size != B:
                raise ValueError(
                    f"KV cache was allocated for batch {kv_cache.geometry.batch_size} and {kv_cache.tokens_per_frame} "
                    f"tokens/frame, but the block has batch {B} and {tpf} tokens/frame"
                )
            kv_cache.check_fits(start_frame, n_frames)
            if cache_bias is not None:
                attn_mask = self._attention_bias(kv_cache, start_frame, n_frames, *cache_bias, dtype=self.compute_dtype)

        dtype = self.compute_dtype
        host = self.ops_in_host_dtypes  # the host's dtypes at its ops (see the attribute): no float32 norms
        embed_dtype = torch.float32 if host else dtype
        x = self.patch_embedding(block_latents.to(self.device, embed_dtype)).to(dtype)
        x = x.flatten(2).transpose(1, 2).contiguous()
        temb, modulation = self._time_embedding(timesteps.to(self.device))
        rope = self._rope(start_frame, n_frames, hp, wp, x.device)

        def per_frame(t):  # [B, L, D] <-> [B, F, tokens/frame, D] so modulation broadcasts per frame
            return t.view(B, n_frames, tpf, -1)

        def norm_input(t):  # the norms' input: float32 as the reference implementations, or the host's dtype
            return t if host else t.float()

        hooks = self.block_hooks
        for layer, block in enumerate(self.blocks):
            if hooks is not None:
                hooks.before(layer)
            shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table.float() + modulation).unsqueeze(3).unbind(2)
            normed = (per_frame(block.norm1(norm_input(x))) * (1 + scale) + shift).flatten(1, 2).to(dtype)
            attn_out = self._self_attention(block.attn1, normed, rope, kv_cache, layer, start_frame, attn_mask)
            x = (x.float() + (per_frame(attn_out.float()) * gate).flatten(1, 2)).to(dtype)

            normed = block.norm2(norm_input(x)).to(dtype)
            x = x + self._cross_attention(block.attn2, normed, text_kv.keys[layer], text_kv.values[layer])

            normed = (per_frame(block.norm3(norm_input(x))) * (1 + c_scale) + c_shift).flatten(1, 2).to(dtype)
            ff_out = block.ffn(normed)
            x = (x.float() + (per_frame(ff_out.float()) * c_gate).flatten(1, 2)).to(dtype)
            if hooks is not None:
                hooks.after(layer)

        shift, scale = (self.scale_shift_table.float() + temb.unsqueeze(2)).unsqueeze(3).unbind(2)
        x = (per_frame(self.norm_out(norm_input(x))) * (1 + scale) + shift).flatten(1, 2).to(dtype)
        x = self.proj_out(x)
        # Unpatchify: tokens (f, hp, wp) x (p_t, p_h, p_w, C) -> [B, C, F, h, w].
        x = x.reshape(B, n_frames, hp, wp, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3).float()


class CausalWanTransformer3DModel(CausalWanForward, WanTransformer3DModel):
    """Wan2.1 DiT with a block-causal, KV-cached forward (:meth:`forward_block`, from :class:`CausalWanForward`).

    ``forward`` is diffusers' unchanged (full bidirectional attention, one timestep per sample); it
    is the reference the causal path is tested against.
    """

    # ---- optional torch.compile ---------------------------------------------------------------------
    def compile_forward_block(self, **compile_kwargs) -> None:
        """Replace :meth:`forward_block` on this instance by a ``torch.compile``'d version.

        ``dynamic=True`` by default: the attended KV prefix grows by one block per call, so static
        shapes would recompile for every block position. The first calls pay the compilation
        (about a minute on a CPU); the weights and the state dict are untouched. The compiled function
        is bound to this instance: compile a deep copy again rather than copying a compiled model.
        """
        if self.block_hooks is not None:
            raise RuntimeError("compile_forward_block(): this model streams its blocks from CPU memory (offload); "
                               "torch.compile does not support the weight swaps. Use offload='none' or no compile.")
        compile_kwargs.setdefault("dynamic", True)
        self.forward_block = torch.compile(type(self).forward_block.__get__(self), **compile_kwargs)

    # ---- inference-only fusion ------------------------------------------------------------------------
    @torch.no_grad()
    def fuse_qkv(self) -> int:
        """Fuse each self-attention's q/k/v projections into one matmul (and cross-attention's k/v).

        The separate Linear layers are *replaced*, not kept beside the fused one (diffusers'
        ``fuse_projections`` keeps both, which would add 6 GB to a 14B model), so a fused model is for
        inference only: its state dict no longer has the original keys. Returns how many layers fused.
        """
        fused = 0
        for block in self.blocks:
            for attn, names, fused_name in ((block.attn1, ("to_q", "to_k", "to_v"), "to_qkv"), (block.attn2, ("to_k", "to_v"), "to_kv")):
                if getattr(attn, "sdvg_fused", False):
                    continue
                parts = [getattr(attn, n) for n in names]
                if not all(isinstance(p, torch.nn.Linear) for p in parts):
                    raise RuntimeError("fuse_qkv() must run before fp8 quantization")
                linear = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=True,
                                         device=parts[0].weight.device, dtype=parts[0].weight.dtype)
                linear.weight.copy_(torch.cat([p.weight for p in parts]))
                linear.bias.copy_(torch.cat([p.bias for p in parts]))
                for n in names:
                    delattr(attn, n)
                setattr(attn, fused_name, linear)
                attn.sdvg_fused = True
                fused += 1
        return fused


def block_causal_mask(num_frames: int, frames_per_block: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    """Boolean ``[L, L]`` mask: a token may attend to every token of its own block and earlier blocks."""
    block_of_token = torch.arange(num_frames, device=device).repeat_interleave(tokens_per_frame) // frames_per_block
    return block_of_token[:, None] >= block_of_token[None, :]


def count_parameters(model: torch.nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())
