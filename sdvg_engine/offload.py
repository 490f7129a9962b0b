"""One consumer GPU: stream transformer blocks from CPU RAM, and pick memory settings from a VRAM budget.

**Block streaming** (:func:`enable_block_offload`). The transformer blocks of a causal Wan DiT live in
(pinned) CPU memory and are copied to the GPU one block ahead of use on a side CUDA stream, so the copy
of block ``i + 1`` overlaps the compute of block ``i``; after its use a block's GPU copy is dropped.
Everything outside the blocks (patch/time/text embedders, output head: 0.48 GiB of the 14B) stays on
the GPU. The copies are diffusers' group offloading (``apply_group_offloading``, block level, one block
per group, ``use_stream`` + ``record_stream`` on CUDA: pinned copies, non-blocking transfers, fp8 buffers
included). diffusers fires its groups from each block's ``forward``; :meth:`forward_block` never calls
a block's ``forward`` (it drives the layers itself, with a KV cache), and diffusers' hook also needs
``accelerate``. So the groups are driven here instead, through the model's ``block_hooks``
(``before(layer)`` / ``after(layer)``), with the same order diffusers' prefetching uses: load ``i``,
prefetch ``i + 1``, compute ``i``, drop ``i``.

**Memory budget** (:func:`plan_memory`). A pure function from a card size (GiB) to the settings
(``offload`` none | target | both, ``kv_dtype``, VAE dtype, fp8 target, drafter context) and the
GiB of every component, computed from the architectures' shapes at a given resolution.
``bench/memory_plan.py`` prints it as the memory-plan table; ``sdvg generate --vram-gb N`` applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .choices import KV_DTYPES, OFFLOAD_CHOICES  # noqa: F401 (public here too)

__all__ = [
    "OFFLOAD_CHOICES", "KV_DTYPES", "BlockStreamer", "ResidentPart", "enable_block_offload", "check_offload_device",
    "kv_cache_dtype", "MemorySettings", "plan_memory", "wan_param_counts", "WAN_VAE_PARAMS", "IMAGE_REWARD_PARAMS",
    "dit_flops", "run_memory_components",
]

_KV_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
_GROUP_HOOK = "group_offloading"  # diffusers' hook name (diffusers.hooks.group_offloading._GROUP_OFFLOADING)


def kv_cache_dtype(name: str) -> torch.dtype | None:
    """``"auto"`` -> ``None`` (compute dtype); ``"bf16"`` / ``"fp16"`` / ``"fp32"`` / ``"fp8"`` -> the torch dtype."""
    if name == "auto":
        return None
    try:
        return _KV_TORCH[name]
    except KeyError:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {name!r}") from None


def check_offload_device(device: "str | torch.device", what: str = "the model") -> torch.device:
    """Refuse block offloading where it cannot mean anything: it streams weights from CPU RAM to a CUDA GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"offload streams {what}'s transformer blocks from CPU RAM to a CUDA GPU, but {what} runs on "
            f"{str(device)!r}, where its weights already are in RAM: there is nothing to offload. "
            "Use offload 'none' (or run on a CUDA device).")
    if not torch.cuda.is_available():
        raise ValueError(f"offload needs CUDA, but torch.cuda.is_available() is False (device {str(device)!r})")
    return device


def _streams(offload) -> bool:
    if offload not in (False, True, "none", "blocks"):
        raise ValueError(f"offload must be 'none' or 'blocks' (or a bool), got {offload!r}")
    return offload in (True, "blocks")


def load_device_for(offload, device, name: str = "model", compile: bool = False, kv_dtype: str = "auto") -> "str | torch.device":
    """Where ``load_generator`` loads the weights: the CPU for a streamed model (after checking that streaming
    can work on ``device``), else ``device``. Validates ``offload`` and ``kv_dtype`` before any loading."""
    kv_cache_dtype(kv_dtype)
    if not _streams(offload):
        return device
    check_offload_device(device, f"the {name}")
    if compile:
        raise ValueError("offload and compile cannot be combined (torch.compile does not follow the weight swaps)")
    return "cpu"


def apply_memory_options(model, device, *, offload="none", kv_dtype: str = "auto") -> None:
    """``load_generator``'s ``offload`` / ``kv_dtype`` on a loaded model (see :func:`load_device_for`)."""
    model.use_runtime(kv_cache_dtype=kv_cache_dtype(kv_dtype))
    if _streams(offload):
        enable_block_offload(model, device)


class BlockStreamer:
    """``before(layer)`` / ``after(layer)`` for :attr:`CausalWanTransformer3DModel.block_hooks`.

    Drives one diffusers ``ModuleGroup`` per transformer block: ``before(i)`` makes block ``i``'s weights
    resident (waiting for its prefetch) and starts copying block ``i + 1``; ``after(i)`` drops block ``i``'s
    GPU copy. At most two blocks (three while a dropped one's last kernels finish) are on the GPU.
    """

    def __init__(self, groups: list, stream=None):
        self.groups = groups
        self.stream = stream
        self.loaded: set[int] = set()
        #: counts of group copies, for tests and reports
        self.onloads = 0
        self.offloads = 0

    def _onload(self, i: int) -> None:
        if i not in self.loaded:
            self.groups[i].onload_()
            self.loaded.add(i)
            self.onloads += 1

    def before(self, layer: int) -> None:
        if layer == 0:
            self.release()  # left over by a call that stopped half-way (interrupt, out of memory)
        self._onload(layer)
        if layer + 1 < len(self.groups):
            # onload_() first synchronizes the side stream, so block `layer` is complete after this.
            self._onload(layer + 1)
        elif self.stream is not None:
            self.stream.synchronize()

    def after(self, layer: int) -> None:
        if layer in self.loaded:
            self.groups[layer].offload_()
            self.loaded.discard(layer)
            self.offloads += 1

    def release(self) -> None:
        """Drop every block still on the GPU (ComfyUI's unload / free memory calls this through ResidentPart)."""
        if self.stream is not None:
            self.stream.synchronize()
        for i in sorted(self.loaded):
            self.groups[i].offload_()
            self.offloads += 1
        self.loaded.clear()

    @property
    def num_blocks(self) -> int:
        return len(self.groups)


class ResidentPart(torch.nn.Module):
    """The parts of an offloaded model that stay on the GPU (everything but ``blocks``), as one module.

    Hand this (not the whole model) to a memory manager such as ComfyUI's ``ModelPatcher``: its
    ``.to(device)`` moves only the resident parts (the blocks are the streamer's), its size is what
    the model keeps on the GPU, and any move (ComfyUI unloading it) also drops blocks left on the GPU.
    """

    def __init__(self, model: torch.nn.Module, streamer: BlockStreamer):
        super().__init__()
        for name, child in model.named_children():
            if name != "blocks":
                self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self._streamer = streamer

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._streamer.release()
        return out

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("ResidentPart is a handle for memory managers; call the model itself")


def _pin_in_place(module: torch.nn.Module) -> None:
    """Move every CPU tensor of ``module`` to pinned memory one at a time (peak RAM: the model + one tensor)."""
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == "cpu" and not t.is_pinned():
            t.data = t.data.pin_memory()


def enable_block_offload(model, device: "str | torch.device", *, offload_device: "str | torch.device" = "cpu",
                         use_stream: bool | None = None, move_resident: bool = True,
                         disk_path: str | None = None) -> BlockStreamer:
    """Stream ``model``'s transformer blocks from ``offload_device`` to ``device`` (see the module docstring).

    Args:
        model: a :class:`~sdvg_engine.models.causal_wan.CausalWanTransformer3DModel` whose blocks are on
            ``offload_device`` (load it there); fp8-stored blocks stream as fp8.
        device: where the blocks run (a CUDA device; ``cpu`` only for tests, with ``use_stream=False``).
        use_stream: copy on a side CUDA stream, overlapping compute (default: ``device`` is CUDA).
        move_resident: move the non-block parts to ``device`` now (``False``: a memory manager moves
            :class:`ResidentPart` later, as ComfyUI does).
        disk_path: keep the offloaded blocks in safetensors files here instead of RAM (diffusers'
            ``offload_to_disk_path``; slow, for machines short of RAM).
    Returns:
        the :class:`BlockStreamer`, also the model's ``block_hooks`` (:meth:`use_runtime`); ``model.device`` reports
        ``device``.
    """
    from diffusers.hooks import apply_group_offloading

    device, offload_device = torch.device(device), torch.device(offload_device)
    if getattr(model, "block_hooks", None) is not None:
        raise ValueError("this model already streams its blocks (enable_block_offload was called before)")
    if "forward_block" in vars(model):
        raise ValueError("this model's forward_block is torch.compile'd; offload does not support compile "
                         "(load it without compile)")
    if use_stream is None:
        use_stream = device.type == "cuda"
    if use_stream and device.type != "cuda":
        raise ValueError(f"use_stream needs a CUDA device, got {str(device)!r}")
    wrong = [n for n, p in model.blocks.named_parameters() if p.device != offload_device]
    if wrong:
        raise ValueError(f"the blocks must be on the offload device {str(offload_device)!r} before offloading "
                         f"(load the model there); e.g. blocks.{wrong[0]} is on {model.blocks.get_parameter(wrong[0]).device}")
    if move_resident:
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if not name.startswith("blocks."):
                    t.data = t.data.to(device)
    if use_stream and offload_device.type == "cpu" and disk_path is None:
        _pin_in_place(model.blocks)

    holder = torch.nn.Module()  # group only the blocks: the rest stays where it is (resident)
    holder.blocks = model.blocks
    extra = {} if disk_path is None else {"offload_to_disk_path": disk_path}  # diffusers >= 0.35
    apply_group_offloading(holder, onload_device=device, offload_device=offload_device, offload_type="block_level",
                           num_blocks_per_group=1, use_stream=use_stream, record_stream=use_stream, **extra)
    groups = [block._diffusers_hook.get_hook(_GROUP_HOOK).group for block in model.blocks]
    streamer = BlockStreamer(groups, stream=groups[0].stream if groups else None)
    model.use_runtime(block_hooks=streamer)
    return streamer


# ================================================================================================ memory plan
GiB = 2**30
#: parameters of the Wan2.1 VAE (``AutoencoderKLWan()``) and ImageReward v1 (checked against meta builds in tests)
WAN_VAE_PARAMS = 126_892_531
IMAGE_REWARD_PARAMS = 446_665_953
#: Wan VAE decode cache: measured 9.68 MB in fp32 at 4x4 latents, proportional to the latent area
_VAE_CACHE_FP32_PER_LATENT_PIXEL = 9.68e6 / 16
#: Wan VAE decode of one 3-latent-frame block: the largest live temporaries, 4,033,201,152 bytes in fp32 at 832x480
#: (the real-size dry run, sdvg_engine/dry_run.py, on the real architecture), proportional to the frame area
_VAE_DECODE_TRANSIENT_FP32_PER_PIXEL = 4_033_201_152 / (832 * 480)
_FP32_KEPT = ("time_embedder", "scale_shift_table", "norm")


def wan_param_counts(cfg: dict) -> dict:
    """Parameter counts of a Wan2.1 DiT config, from its shapes: ``total``, ``blocks`` (all blocks),
    ``block_linear`` (Linear weights inside the blocks: what fp8 stores), ``fp32`` (kept float32)."""
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    ffn, L = cfg["ffn_dim"], cfg["num_layers"]
    lin = lambda i, o: i * o + o  # noqa: E731
    attn = 4 * lin(dim, dim) + 2 * dim  # q, k, v, out + RMS norms of q and k
    block = 2 * attn + lin(dim, ffn) + lin(ffn, dim) + 2 * dim + 6 * dim  # self, cross, FFN, norm2, modulation
    block_linear = 8 * dim * dim + 2 * dim * ffn
    p_t, p_h, p_w = cfg["patch_size"]
    in_ch, out_ch = cfg["in_channels"], cfg["out_channels"]
    time_embedder = lin(cfg["freq_dim"], dim) + lin(dim, dim)
    other = (in_ch * dim * p_t * p_h * p_w + dim + time_embedder + lin(dim, 6 * dim)
             + lin(cfg["text_dim"], dim) + lin(dim, dim) + lin(dim, out_ch * p_t * p_h * p_w) + 2 * dim)
    fp32_outside, fp32_blocks = time_embedder + 2 * dim, L * (6 * dim + 2 * dim)
    return {"total": L * block + other, "blocks": L * block, "block_linear": L * block_linear,
            "fp32": fp32_outside + fp32_blocks, "fp32_outside": fp32_outside, "fp32_blocks": fp32_blocks,
            "per_block": block, "dim": dim}


def _weights_bytes(cfg, fp8: bool) -> tuple[float, float]:
    """(all bytes, bytes outside the blocks) of a DiT in bf16 (modulation/time embedding/norm2 float32, as
    loaded), block Linear weights in fp8 if ``fp8``."""
    c = wan_param_counts(cfg)
    outside = (c["total"] - c["blocks"] - c["fp32_outside"]) * 2 + c["fp32_outside"] * 4
    blocks = (c["blocks"] - c["fp32_blocks"]) * 2 + c["fp32_blocks"] * 4
    if fp8:
        blocks -= c["block_linear"]  # 2 -> 1 byte each (+ one 4-byte scale per Linear, negligible)
    return outside + blocks, outside


def _vae_cache_bytes(width: int, height: int, vae_bytes: int) -> float:
    """The Wan VAE's causal decode cache at ``width`` x ``height`` (one more of it is a draft's rollback snapshot)."""
    return _VAE_CACHE_FP32_PER_LATENT_PIXEL * (height // 8) * (width // 8) * vae_bytes / 4


def _transient_bytes(dits, width: int, height: int, vae_bytes: int) -> float:
    """The largest transient of a run: one DiT call's block activations (plus, with an fp8 KV cache, one layer's
    cached prefix dequantised to the compute dtype) or one VAE decode's temporaries, whichever is larger (they run
    one after another, never together). ``dits``: ``(config, cache_frames, kv_dtype, compute_bytes)`` per DiT."""
    tpf = (height // 16) * (width // 16)
    dit_act = prefix = 0.0
    for cfg, frames, kv_dtype, compute_bytes in dits:
        dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        dit_act = max(dit_act, 3 * tpf * (dim * 6 + cfg["ffn_dim"]) * 2 * compute_bytes)
        if kv_dtype == "fp8":
            prefix = max(prefix, 2 * frames * tpf * dim * compute_bytes)
    return max(dit_act + prefix, _VAE_DECODE_TRANSIENT_FP32_PER_PIXEL * height * width * vae_bytes / 4)


def _kv_bytes(cfg, frames: int, tokens_per_frame: int, kv_dtype: str, compute_bytes: int = 2) -> float:
    """A model's self-attention KV cache of ``frames`` latent frames plus its text K/V (512 rows per layer), stored in
    ``kv_dtype`` (``auto``: the compute dtype, ``compute_bytes`` per value; fp8: 1 byte + a 4-byte scale per row)."""
    heads, d, L = cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]
    rows = L * 2 * frames * tokens_per_frame * heads
    per_row = d * 1 + 4 if kv_dtype == "fp8" else d * compute_bytes
    text = L * 2 * 512 * heads * d * compute_bytes
    return rows * per_row + text


def dit_flops(config: dict, query_tokens: int, key_tokens: int, frames: int, *, text_tokens: int = 512,
              batch: int = 1) -> int:
    """Closed-form FLOPs of one ``forward_block`` (multiply-add = 2 FLOPs; norms/RoPE/softmax not counted): the one
    DiT FLOP formula of the project (:func:`offload_slowdown` here, ``bench/cost_model.py``), checked against
    ``torch.utils.flop_counter`` on the real architectures in ``tests/test_cost_model.py``.

    ``query_tokens`` tokens of ``frames`` latent frames attend to ``key_tokens`` keys (cached context + the block)
    and to ``text_tokens`` cross-attention keys whose K/V are cached per prompt (not recomputed per call).
    """
    d = config["num_attention_heads"] * config["attention_head_dim"]
    ffn, layers = config["ffn_dim"], config["num_layers"]
    p_t, p_h, p_w = config["patch_size"]
    patch = p_t * p_h * p_w
    q = query_tokens
    per_layer = (2 * q * d * d * 4            # self-attention q, k, v, o
                 + 2 * 2 * q * key_tokens * d  # q k^T and attn v
                 + 2 * q * d * d * 2           # cross-attention q, o
                 + 2 * 2 * q * text_tokens * d
                 + 2 * 2 * q * d * ffn)        # FFN up, down
    embed = 2 * q * d * config["in_channels"] * patch + 2 * q * d * config["out_channels"] * patch
    time = 2 * frames * (config["freq_dim"] * d + d * d + d * 6 * d)  # per-frame time MLP + projection
    return batch * (layers * per_layer + embed + time)


@dataclass(frozen=True)
class MemorySettings:
    """What :func:`plan_memory` picked, with its arithmetic (GiB per component)."""

    vram_gb: float
    offload: str
    kv_dtype: str
    vae_dtype: str
    fp8_target: bool
    drafter_context: str
    fits: bool
    total_gib: float
    components: dict = field(default_factory=dict)
    #: expected slowdown of the DiT calls against the same settings without offloading (cost model)
    slowdown: dict = field(default_factory=dict)

    @property
    def flags(self) -> str:
        """The ``sdvg generate`` flags these settings stand for (what ``--vram-gb`` applies)."""
        parts = []
        if self.fp8_target:
            parts.append("--fp8-target")
        if self.offload != "none":
            parts.append(f"--offload {self.offload}")
        if self.kv_dtype != "auto":
            parts.append(f"--kv-dtype {self.kv_dtype}")
        if self.vae_dtype != "fp32":
            parts.append(f"--vae-dtype {self.vae_dtype}")
        if self.drafter_context != "auto":
            parts.append(f"--drafter-context {self.drafter_context}")
        return " ".join(parts) or "(defaults)"


#: The ladder :func:`plan_memory` walks: each step adds one saving, lossless ones (offload) before lossy ones.
LADDER = (
    dict(offload="none", kv_dtype="auto", vae_dtype="fp32", fp8_target=False, drafter_context="auto"),
    dict(offload="none", kv_dtype="auto", vae_dtype="fp32", fp8_target=True, drafter_context="auto"),
    dict(offload="target", kv_dtype="auto", vae_dtype="fp32", fp8_target=True, drafter_context="auto"),
    dict(offload="target", kv_dtype="auto", vae_dtype="bf16", fp8_target=True, drafter_context="auto"),
    dict(offload="target", kv_dtype="fp8", vae_dtype="bf16", fp8_target=True, drafter_context="auto"),
    dict(offload="both", kv_dtype="fp8", vae_dtype="bf16", fp8_target=True, drafter_context="auto"),
    dict(offload="both", kv_dtype="fp8", vae_dtype="bf16", fp8_target=True, drafter_context="recompute_window"),
)


def memory_components(*, offload: str, kv_dtype: str, vae_dtype: str, fp8_target: bool, drafter_context: str,
                      width: int = 832, height: int = 480, frames: int = 81, drafter_cfg: dict | None = None,
                      target_cfg: dict | None = None, reserve_gib: float = 1.0) -> dict:
    """GiB of every GPU-resident component for one setting (persistent state + the largest transient)."""
    from .models.causal_wan import wan_config

    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload!r}")
    kv_cache_dtype(kv_dtype)
    d_cfg = drafter_cfg or wan_config("Wan2.1-T2V-1.3B")
    t_cfg = target_cfg or wan_config("Wan2.1-T2V-14B")
    tpf = (height // 16) * (width // 16)
    latent_frames = (frames - 1) // 4 + 1
    d_frames = 6 if drafter_context == "recompute_window" else latent_frames
    vae_bytes = 4 if vae_dtype == "fp32" else 2
    comp = {}
    for role, cfg, fp8, streamed in (("drafter", d_cfg, False, offload == "both"),
                                     ("target", t_cfg, fp8_target, offload != "none")):
        total, outside = _weights_bytes(cfg, fp8)
        per_block = (total - outside) / cfg["num_layers"]
        label = f"{role} weights ({'fp8 blocks' if fp8 else 'bf16'}"
        comp[label + (", streamed: resident part + 3 blocks)" if streamed else ")")] = (
            outside + 3 * per_block if streamed else total)
    comp[f"drafter KV ({d_frames} frames, {'bf16' if kv_dtype == 'auto' else kv_dtype})"] = _kv_bytes(
        d_cfg, d_frames, tpf, kv_dtype)
    comp[f"target KV (recompute window, 6 frames, {'bf16' if kv_dtype == 'auto' else kv_dtype})"] = _kv_bytes(
        t_cfg, 6, tpf, kv_dtype)
    comp[f"VAE weights ({vae_dtype})"] = WAN_VAE_PARAMS * vae_bytes
    comp[f"VAE decode cache ({vae_dtype})"] = _vae_cache_bytes(width, height, vae_bytes)
    # A draft the router may reject keeps the state before its decode until the verdict: one more cache's worth.
    comp[f"VAE rollback snapshot ({vae_dtype}, until each draft's verdict)"] = comp[f"VAE decode cache ({vae_dtype})"]
    comp["ImageReward (fp16)"] = IMAGE_REWARD_PARAMS * 2
    comp["largest transient: DiT block activations or VAE decode temporaries, whichever is larger"] = _transient_bytes(
        [(d_cfg, d_frames, kv_dtype, 2), (t_cfg, 6, kv_dtype, 2)], width, height, vae_bytes)
    comp["CUDA context + allocator slack (reserve)"] = reserve_gib * GiB
    return {k: v / GiB for k, v in comp.items()}


def run_memory_components(models, *, width: int, height: int, vae_dtype: str = "fp32") -> dict:
    """Bytes one run needs on its device beside the weights a memory manager sees: each DiT's KV cache and text K/V,
    the VAE's decode cache and the rollback snapshot of it, and the largest transient (a DiT call's block activations
    or a VAE decode's temporaries, whichever is larger; they never overlap). What the ComfyUI nodes ask
    ``load_models_gpu`` to reserve (``memory_required``); :func:`memory_components` counts the same terms, in GiB, for
    the memory plan.

    ``models``: one ``(role, config, cache_frames, kv_dtype, compute_bytes)`` per DiT the run uses: ``config`` with
    diffusers' names (``num_attention_heads``, ``attention_head_dim``, ``ffn_dim``, ``num_layers``), the cache's
    capacity in latent frames (a context scheme's ``capacity_frames``), ``kv_dtype`` ``auto`` or ``fp8``, bytes per
    value of the compute dtype."""
    if vae_dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"vae_dtype must be fp32, bf16 or fp16, got {vae_dtype!r}")
    tpf = (height // 16) * (width // 16)
    vae_bytes = 4 if vae_dtype == "fp32" else 2
    comp: dict[str, float] = {}
    for role, cfg, frames, kv_dtype, compute_bytes in models:
        kv_cache_dtype(kv_dtype)
        shown = {"auto": f"{compute_bytes}-byte compute dtype"}.get(kv_dtype, kv_dtype)
        comp[f"{role} KV ({frames} frames, {shown})"] = _kv_bytes(cfg, frames, tpf, kv_dtype, compute_bytes)
    cache = _vae_cache_bytes(width, height, vae_bytes)
    comp[f"VAE decode cache ({vae_dtype})"] = cache
    comp[f"VAE rollback snapshot ({vae_dtype}, until each draft's verdict)"] = cache
    comp["largest transient: DiT block activations or VAE decode temporaries, whichever is larger"] = _transient_bytes(
        [model[1:] for model in models], width, height, vae_bytes)
    return comp


def offload_slowdown(*, offload: str, fp8_target: bool, width: int = 832, height: int = 480, tflops: float = 50.0,
                     pcie_gbs: float = 24.0, drafter_cfg: dict | None = None, target_cfg: dict | None = None,
                     drafter_frames: int = 21, accept: float = 0.731, blocks: int = 7) -> dict:
    """Cost model: per DiT call, the blocks' bytes over PCIe (``pcie_gbs`` GB/s) against the call's compute
    (``tflops`` achieved). Transfers overlap compute except the first block's: an offloaded call takes
    ``max(compute, transfer) + transfer / layers``. Returns the per-call ratio for each streamed model and
    the DiT time ratio of a whole ``blocks``-block video at acceptance ``accept`` (VAE and reward unchanged)."""
    from .models.causal_wan import wan_config

    d_cfg = drafter_cfg or wan_config("Wan2.1-T2V-1.3B")
    t_cfg = target_cfg or wan_config("Wan2.1-T2V-14B")
    tpf = (height // 16) * (width // 16)
    q = 3 * tpf
    out = {}
    timing = {}
    for role, cfg, fp8, frames, streamed in (("drafter", d_cfg, False, drafter_frames, offload == "both"),
                                             ("target", t_cfg, fp8_target, 6, offload != "none")):
        compute = dit_flops(cfg, q, frames * tpf, 3) / (tflops * 1e12)  # a 3-latent-frame block after its context
        total, outside = _weights_bytes(cfg, fp8)
        transfer = (total - outside) / (pcie_gbs * 1e9) if streamed else 0.0
        offloaded = max(compute, transfer) + transfer / cfg["num_layers"] if streamed else compute
        timing[role] = (compute, offloaded)
        out[f"{role} call"] = offloaded / compute
        out[f"{role} call s (resident -> offloaded)"] = (compute, offloaded)
    drafted = blocks - 1
    target_calls = (1 + (1 - accept) * drafted) * 7  # 5 denoise + commit + window recompute per target block
    drafter_calls = drafted * 5 + (1 + (1 - accept) * drafted)  # 4 denoise + commit; commits of target blocks
    resident = target_calls * timing["target"][0] + drafter_calls * timing["drafter"][0]
    streamed = target_calls * timing["target"][1] + drafter_calls * timing["drafter"][1]
    out["video DiT time"] = streamed / resident
    return out


def plan_memory(vram_gb: float, *, width: int = 832, height: int = 480, frames: int = 81, reserve_gib: float = 1.0,
                tflops: float = 50.0, pcie_gbs: float = 24.0, drafter_cfg: dict | None = None,
                target_cfg: dict | None = None) -> MemorySettings:
    """The fastest settings whose planned peak fits ``vram_gb`` GiB (one card holding every model).

    Walks :data:`LADDER` (resident bf16 -> fp8 target -> offload target -> bf16 VAE -> fp8 KV ->
    offload both -> drafter on the recompute window) and returns the first step that fits; if none
    does, the last step with ``fits=False`` (its ``total_gib`` says what the card would need).
    """
    if not (isinstance(vram_gb, (int, float)) and math.isfinite(vram_gb) and vram_gb > 0):
        raise ValueError(f"vram_gb must be a positive number of GiB (e.g. 24), got {vram_gb!r}")
    chosen = None
    for step in LADDER:
        comp = memory_components(**step, width=width, height=height, frames=frames, drafter_cfg=drafter_cfg,
                                 target_cfg=target_cfg, reserve_gib=reserve_gib)
        total = sum(comp.values())
        chosen = (step, comp, total)
        if total <= vram_gb:
            break
    step, comp, total = chosen
    slow = offload_slowdown(offload=step["offload"], fp8_target=step["fp8_target"], width=width, height=height,
                            tflops=tflops, pcie_gbs=pcie_gbs, drafter_cfg=drafter_cfg, target_cfg=target_cfg,
                            drafter_frames=6 if step["drafter_context"] == "recompute_window" else (frames - 1) // 4 + 1)
    return MemorySettings(vram_gb=float(vram_gb), fits=total <= vram_gb, total_gib=total, components=comp,
                          slowdown=slow, **step)


def resolve_memory_args(args) -> tuple[str, str]:
    """``sdvg generate``'s ``--vram-gb`` / ``--offload`` / ``--kv-dtype`` -> ``(offload, kv_dtype)``.

    With ``--vram-gb N`` the plan's settings fill every memory flag the user left at its default
    (``--fp8-target``, ``--vae-dtype``, ``--drafter-context``, ``--offload``, ``--kv-dtype``); explicit
    ``--offload`` / ``--kv-dtype`` win. The chosen plan is printed to stderr.
    """
    import sys

    offload, kv_dtype = getattr(args, "offload", None), getattr(args, "kv_dtype", None)
    vram = getattr(args, "vram_gb", None)
    if vram is not None:
        if torch.device(args.device).type != "cuda":
            raise ValueError(f"--vram-gb plans one CUDA card, but --device is {args.device!r}; drop --vram-gb on the CPU")
        if args.drafter_device or args.aux_device:
            raise ValueError("--vram-gb plans ONE card holding every model; it cannot be combined with "
                             "--drafter-device / --aux-device (two-card placement)")
        plan = plan_memory(vram, width=args.width, height=args.height, frames=args.frames)
        if not plan.fits:
            raise ValueError(f"--vram-gb {vram:g}: even the smallest plan ({plan.flags}) needs {plan.total_gib:.1f} GiB "
                             f"at {args.width}x{args.height}x{args.frames}; use a smaller size or a second card")
        args.fp8_target = args.fp8_target or plan.fp8_target
        if args.vae_dtype == "fp32":
            args.vae_dtype = plan.vae_dtype
        if args.drafter_context == "auto":
            args.drafter_context = plan.drafter_context
        offload = offload or plan.offload
        kv_dtype = kv_dtype or plan.kv_dtype
        print(f"--vram-gb {vram:g}: {plan.flags} (planned peak {plan.total_gib:.1f} GiB)", file=sys.stderr)
    return offload or "none", kv_dtype or "auto"
