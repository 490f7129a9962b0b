"""The block-causal DiT against diffusers' Wan and against full-sequence attention with a mask."""

import math

import pytest
import torch

from sdvg_engine.models.causal_wan import block_causal_mask
from wan_fixtures import text_context, tiny_wan


@pytest.fixture(scope="module")
def model():
    return tiny_wan(seed=0)


@pytest.fixture(scope="module")
def text(model):
    ctx = text_context()
    return ctx, model.encode_text(ctx)


@pytest.mark.parametrize("t", [1000.0, 937.5, 833.3333333333334, 625.0, 0.0])
@pytest.mark.parametrize("size", [(4, 6), (6, 4), (2, 8)])
def test_single_block_matches_diffusers(model, text, t, size):
    ctx, text_kv = text
    x = torch.randn(1, 16, 3, *size, generator=torch.Generator().manual_seed(5))
    reference = model(x, torch.tensor([t]), ctx, return_dict=False)[0]
    ours = model.forward_block(x, torch.full((1, 3), t), text_kv)
    assert ours.shape == reference.shape == (1, 16, 3, *size)
    # Ours computes the timestep sinusoid in float64 as Wan's original code does; diffusers in float32, whose rounding
    # of t * freq grows with t: measured (diffusers 0.42.1) 0.9-1.1e-4 at t = 1000, 4e-6 at t = 0, outputs ~5.
    assert (ours - reference).abs().max().item() <= (2e-4 if t > 500 else 2e-5)


def _blocks_and_times(num_blocks, size=(4, 6), seed=7):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, 3 * num_blocks, *size, generator=g)
    times = torch.rand(1, 3 * num_blocks, generator=g) * 1000  # a different timestep per frame
    return latents, times


def test_kv_cached_blocks_equal_block_causal_full_forward(model, text):
    _, text_kv = text
    latents, times = _blocks_and_times(3)
    tpf = model.tokens_per_frame(4, 6)
    full = model.forward_block(latents, times, text_kv, attn_mask=block_causal_mask(9, 3, tpf))

    cache = model.new_kv_cache(1, 4, 6, capacity_frames=9)
    for b in range(3):
        frames = slice(3 * b, 3 * b + 3)
        out = model.forward_block(latents[:, :, frames], times[:, frames], text_kv, cache, start_frame=3 * b)
        assert (out - full[:, :, frames]).abs().max().item() <= 1e-5

    # Without the cache the later blocks would not see the earlier ones: the comparison is not vacuous.
    alone = model.forward_block(latents[:, :, 6:9], times[:, 6:9], text_kv)
    assert (alone - full[:, :, 6:9]).abs().max().item() > 1e-3


def test_rewriting_a_block_overwrites_its_slots(model, text):
    """Noisy steps and the clean commit share slots: only the last write of a block counts."""
    _, text_kv = text
    latents, times = _blocks_and_times(2)
    cache_a = model.new_kv_cache(1, 4, 6, capacity_frames=6)
    cache_b = model.new_kv_cache(1, 4, 6, capacity_frames=6)
    garbage = torch.randn_like(latents[:, :, :3])
    model.forward_block(garbage, torch.full((1, 3), 900.0), text_kv, cache_a, 0)
    model.forward_block(latents[:, :, :3], times[:, :3], text_kv, cache_a, 0)
    model.forward_block(latents[:, :, :3], times[:, :3], text_kv, cache_b, 0)
    out_a = model.forward_block(latents[:, :, 3:], times[:, 3:], text_kv, cache_a, 3)
    out_b = model.forward_block(latents[:, :, 3:], times[:, 3:], text_kv, cache_b, 3)
    assert torch.equal(out_a, out_b)


def test_recompute_window_semantics_with_attention_bias(model, text):
    """Context frames at positions 0..2 then the block at 3..5, with log(bias) on context frames 1..2."""
    _, text_kv = text
    latents, times = _blocks_and_times(2, seed=11)
    times[:, :3] = 0.0  # the context is rebuilt at t = 0
    tpf = model.tokens_per_frame(4, 6)
    mask = torch.zeros(6 * tpf, 6 * tpf)
    mask[~block_causal_mask(6, 3, tpf)] = float("-inf")
    mask[3 * tpf :, 1 * tpf : 3 * tpf] += math.log(0.3)
    full = model.forward_block(latents, times, text_kv, attn_mask=mask)

    cache = model.new_kv_cache(1, 4, 6, capacity_frames=6)
    model.forward_block(latents[:, :, :3], times[:, :3], text_kv, cache, 0)
    out = model.forward_block(latents[:, :, 3:], times[:, 3:], text_kv, cache, 3, cache_bias=((1, 3), math.log(0.3)))
    assert (out - full[:, :, 3:]).abs().max().item() <= 1e-5
    unbiased = model.forward_block(latents[:, :, 3:], times[:, 3:], text_kv, cache, 3)
    assert (unbiased - out).abs().max().item() > 1e-4


def test_rope_offset_moves_the_block(model, text):
    _, text_kv = text
    x = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    t = torch.full((1, 3), 500.0)
    at0 = model.forward_block(x, t, text_kv, model.new_kv_cache(1, 4, 6, 30), 0)
    cache = model.new_kv_cache(1, 4, 6, 30)
    # The same block alone at frame 24: no earlier frames are attended (end == its own slots only when
    # the cache before it is empty), so only RoPE differs. Write zeros for 0..23 would change attention,
    # so compare relative-position invariance instead: a block attending only to itself is invariant
    # to a shift of all its positions.
    at24 = model.forward_block(x, t, text_kv, None, 24)
    assert (at0 - at24).abs().max().item() <= 1e-5


def test_errors_name_the_problem(model, text):
    _, text_kv = text
    cache = model.new_kv_cache(1, 4, 6, capacity_frames=6)
    x = torch.randn(1, 16, 3, 4, 6)
    with pytest.raises(ValueError, match="holds 6 latent frames"):
        model.forward_block(x, torch.zeros(1, 3), text_kv, cache, start_frame=6)
    with pytest.raises(ValueError, match="tokens/frame"):
        model.forward_block(torch.randn(1, 16, 3, 6, 6), torch.zeros(1, 3), text_kv, cache, 0)
    with pytest.raises(ValueError, match="divisible by the patch"):
        model.forward_block(torch.randn(1, 16, 3, 5, 6), torch.zeros(1, 3), text_kv)
    with pytest.raises(ValueError, match=r"\[B, L, 4096\]"):
        model.encode_text(torch.zeros(1, 512, 768))
    with pytest.raises(ValueError, match="16 latent channels|expects 16"):
        model.forward_block(torch.randn(1, 48, 3, 4, 6), torch.zeros(1, 3), text_kv)


def test_cross_attention_attends_to_padding(model):
    """Reference behaviour: the zero padding rows take part (they are nonzero after the text MLP)."""
    ctx = text_context()
    x = torch.randn(1, 16, 3, 4, 6)
    full = model.forward_block(x, torch.full((1, 3), 500.0), model.encode_text(ctx))
    truncated = model.forward_block(x, torch.full((1, 3), 500.0), model.encode_text(ctx[:, :7]))
    assert (full - truncated).abs().max().item() > 1e-4


def test_fused_qkv_matches_unfused(text):
    ctx, _ = text
    plain, fused = tiny_wan(seed=9), tiny_wan(seed=9)
    assert fused.fuse_qkv() == 2 * 2  # self- and cross-attention of both layers
    assert not hasattr(fused.blocks[0].attn1, "to_q")  # replaced, not duplicated
    latents, times = _blocks_and_times(2)
    outs = []
    for m in (plain, fused):
        cache = m.new_kv_cache(1, 4, 6, capacity_frames=6)
        text_kv = m.encode_text(ctx)
        m.forward_block(latents[:, :, :3], times[:, :3], text_kv, cache, 0)
        outs.append(m.forward_block(latents[:, :, 3:], times[:, 3:], text_kv, cache, 3))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_compiled_forward_block_matches_eager_and_writes_the_cache(text):
    """The traced graph (aot_eager: dynamo capture + functionalized in-place cache writes, no C++ codegen,
    so it runs in seconds) must equal eager for growing KV prefixes, and keep the state dict."""
    ctx, _ = text
    eager, compiled = tiny_wan(seed=4), tiny_wan(seed=4)
    keys = set(compiled.state_dict())
    compiled.compile_forward_block(backend="aot_eager")
    assert set(compiled.state_dict()) == keys
    latents, times = _blocks_and_times(3)
    caches = []
    for m in (eager, compiled):
        cache = m.new_kv_cache(1, 4, 6, capacity_frames=9)
        text_kv = m.encode_text(ctx)
        outs = [m.forward_block(latents[:, :, f : f + 3], times[:, f : f + 3], text_kv, cache, f) for f in (0, 3, 6)]
        caches.append((cache, torch.cat(outs, dim=2)))
    (c_eager, out_eager), (c_comp, out_comp) = caches
    assert (out_eager - out_comp).abs().max().item() <= 1e-5
    assert torch.allclose(c_eager.keys, c_comp.keys, atol=1e-5) and torch.allclose(c_eager.values, c_comp.values, atol=1e-5)


def test_runtime_settings_are_the_models_own_and_passed_in(text):
    """kv_cache_dtype, block_hooks and the meta attention are per-model RuntimeSettings given through use_runtime;
    no module global: two meta models, one attending as a fused kernel allocates, the other through the real op, in
    two threads at once."""
    import threading

    from sdvg_engine.models.causal_wan import RuntimeSettings

    fused, plain = tiny_wan(seed=0), tiny_wan(seed=0)
    assert fused.use_runtime(fused_attention_on_meta=True) is fused
    assert fused.runtime == RuntimeSettings(fused_attention_on_meta=True) and plain.runtime == RuntimeSettings()
    seen = {}

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def run(name, model):
        meta = model.to("meta")
        with torch.device("meta"):
            q = torch.zeros(1, 2, 6, 8)
        with Spy() as spy:
            out = __import__("sdvg_engine.models.causal_wan", fromlist=["_attention"])._attention(
                q, q, q, fused_on_meta=meta.runtime.fused_attention_on_meta)
        seen[name] = (out.shape, spy.ops)

    threads = [threading.Thread(target=run, args=(n, m)) for n, m in (("fused", fused), ("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["fused"] == (torch.Size([1, 2, 6, 8]), {"empty"})  # the output alone, as a fused kernel allocates
    assert seen["plain"][0] == torch.Size([1, 2, 6, 8]) and seen["plain"][1] - {"empty"}  # the real op's work
    model = tiny_wan(seed=0)
    model.use_runtime(kv_cache_dtype=torch.float16)
    assert model.kv_cache_dtype == torch.float16 and model.new_kv_cache(1, 4, 6, 3).geometry.dtype == torch.float16
    model.kv_cache_dtype = None  # the old assignment still works, through use_runtime
    assert model.runtime.kv_cache_dtype is None
    with pytest.raises(ValueError, match=r"unknown runtime settings \['kv_dtype'\]"):
        model.use_runtime(kv_dtype="fp8")
