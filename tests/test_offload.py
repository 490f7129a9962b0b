"""Block weight streaming (sdvg_engine/offload.py): same numbers as a resident model, and clear refusals.

On the CPU the streamer runs with CPU as both devices and the blocks offloaded to safetensors files
(diffusers' disk offload): an offloaded block's tensors are then placeholders, which these tests fill
with NaN, so a block used without being loaded back would poison the output.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.models.loading import _FP32_PATTERNS, quantize_blocks_fp8, save_checkpoint
from sdvg_engine.offload import BlockStreamer, ResidentPart, check_offload_device, enable_block_offload
from sdvg_engine.sampling import SeededNoise
from wan_fixtures import text_context, tiny_wan

H, W = 4, 6


def _poison_when_offloaded(streamer: BlockStreamer, log: list) -> None:
    """Spy on every group copy (they still run): log it, and fill an offloaded block's placeholders with NaN."""
    for i, group in enumerate(streamer.groups):
        onload, offload = group.onload_, group.offload_

        def on(i=i, onload=onload):
            log.append(("on", i))
            onload()

        def off(i=i, group=group, offload=offload):
            log.append(("off", i))
            offload()
            with torch.no_grad():
                for m in group.modules:
                    for t in list(m.parameters()) + list(m.buffers()):
                        if t.is_floating_point():
                            t.data.fill_(float("nan"))

        group.onload_, group.offload_ = on, off
        off()  # the blocks start offloaded: poison them now
    log.clear()


def _offloaded(model, tmp_path, log):
    streamer = enable_block_offload(model, "cpu", offload_device="cpu", use_stream=False, disk_path=str(tmp_path))
    _poison_when_offloaded(streamer, log)
    return streamer


def _three_blocks(gen: CausalGenerator, seed: int = 5) -> list[torch.Tensor]:
    noise = SeededNoise(seed)
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=3)
    out = []
    for b in range(3):
        lat = gen.generate_block(b, noise).latents
        px = torch.rand(1, 3, 9 if b == 0 else 12, 8 * H, 8 * W, generator=torch.Generator().manual_seed(b)) * 2 - 1
        gen.commit_block(b, lat, px)
        out.append(lat)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-weights", "fp8-weights"])
def test_offloaded_generation_is_bit_identical(tmp_path, fp8):
    resident = tiny_wan(seed=3, num_layers=3)
    for name, p in resident.named_parameters():  # as loaded: bf16, modulation / time embedding / norms in fp32
        p.data = p.data.to(torch.float32 if any(k in name for k in _FP32_PATTERNS) else torch.bfloat16)
    if fp8:
        quantize_blocks_fp8(resident)
    streamed = copy.deepcopy(resident)
    log = []
    streamer = _offloaded(streamed, tmp_path, log)
    want = _three_blocks(CausalGenerator(resident, schedule="self_forcing", context=GlobalCache(21)))
    got = _three_blocks(CausalGenerator(streamed, schedule="self_forcing", context=GlobalCache(21)))
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # encode_text + 3 blocks x 4 denoise calls + the commits of blocks 0 and 1 (a global cache commits
    # lazily, at the next block); each call: load 0, prefetch 1, drop 0, prefetch 2, drop 1, drop 2
    per_call = [("on", 0), ("on", 1), ("off", 0), ("on", 2), ("off", 1), ("off", 2)]
    assert log == per_call * (1 + 3 * 4 + 2)
    assert streamer.loaded == set() and streamer.onloads == streamer.offloads == 3 * 15


def test_offloaded_recompute_window_with_cache_bias_matches(tmp_path):
    """The target's scheme (recompute window, attention bias, krea schedule) through the streamer."""
    from sdvg_fixtures import tiny_vae

    vae = tiny_vae()
    resident = tiny_wan(seed=4)
    streamed = copy.deepcopy(resident)
    _offloaded(streamed, tmp_path, [])
    runs = []
    for model in (resident, streamed):
        gen = CausalGenerator(model, schedule="krea", context=RecomputeWindow(3, attention_bias=0.3, anchor_encoder=vae))
        runs.append(_three_blocks(gen))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_interrupted_call_leaves_no_block_loaded(tmp_path):
    model = tiny_wan(seed=2, num_layers=3)
    log = []
    streamer = _offloaded(model, tmp_path, log)
    gen = CausalGenerator(model, schedule="self_forcing", context=GlobalCache(21))
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=1)
    ffn = model.blocks[1].ffn
    original = ffn.forward

    def boom(x):
        raise KeyboardInterrupt("stop")

    ffn.forward = boom
    with pytest.raises(KeyboardInterrupt):
        gen.generate_block(0, SeededNoise(0))
    assert streamer.loaded == {1, 2}  # block 1 in use, block 2 prefetched
    ffn.forward = original
    ResidentPart(model, streamer).to("cpu")  # what ComfyUI's unload does to the handle
    assert streamer.loaded == set()
    # and the next call runs normally (block 0 reloads the leftovers' state cleanly)
    reference = tiny_wan(seed=2, num_layers=3)
    want = _three_blocks(CausalGenerator(reference, schedule="self_forcing", context=GlobalCache(21)))
    got = _three_blocks(CausalGenerator(model, schedule="self_forcing", context=GlobalCache(21)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_resident_part_holds_everything_but_the_blocks():
    model = tiny_wan(seed=0)
    streamer = BlockStreamer([])
    part = ResidentPart(model, streamer)
    names = {n for n, _ in part.named_parameters()}
    expected = {n for n, _ in model.named_parameters() if not n.startswith("blocks.")}
    assert names == expected and expected
    shared = dict(part.named_parameters())
    assert all(shared[n] is p for n, p in model.named_parameters() if n in shared)


def test_refusals_say_what_offload_means(tmp_path):
    with pytest.raises(ValueError, match=r"streams the target's transformer blocks from CPU RAM to a CUDA GPU.*'cpu'.*"
                                         r"nothing to offload. Use offload 'none'"):
        check_offload_device("cpu", "the target")
    model = tiny_wan(seed=0)
    with pytest.raises(ValueError, match="use_stream needs a CUDA device, got 'cpu'"):
        enable_block_offload(model, "cpu", use_stream=True)
    enable_block_offload(model, "cpu", use_stream=False)
    with pytest.raises(ValueError, match="already streams its blocks"):
        enable_block_offload(model, "cpu", use_stream=False)
    with pytest.raises(RuntimeError, match="streams its blocks from CPU memory"):
        model.compile_forward_block()
    meta = tiny_wan(seed=0).to("meta")
    with pytest.raises(ValueError, match=r"blocks must be on the offload device 'cpu'.*blocks\.0\..* is on meta"):
        enable_block_offload(meta, "cpu", use_stream=False)


def test_load_generator_refuses_offload_on_cpu(tmp_path):
    from sdvg_engine.loaders import load_generator

    path = tmp_path / "tiny.safetensors"
    save_checkpoint(tiny_wan(seed=1), path)
    with pytest.raises(ValueError, match="streams the target's transformer blocks from CPU RAM to a CUDA GPU"):
        load_generator(path, name="target", dtype="fp32", device="cpu", offload="blocks")
    with pytest.raises(ValueError, match=r"offload must be 'none' or 'blocks' \(or a bool\), got 'sideways'"):
        load_generator(path, dtype="fp32", offload="sideways")
    gen = load_generator(path, dtype="fp32", kv_dtype="fp8")
    assert gen.model.kv_cache_dtype == torch.float8_e4m3fn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streamed_matches_resident():
    resident = tiny_wan(seed=3, num_layers=3).to(torch.bfloat16)
    streamed = copy.deepcopy(resident)
    resident = resident.to("cuda")
    enable_block_offload(streamed, "cuda")
    assert streamed.device.type == "cuda" and streamed.blocks[0].ffn.net[2].weight.device.type == "cpu"
    want = _three_blocks(CausalGenerator(resident, schedule="self_forcing", context=GlobalCache(21)))
    got = _three_blocks(CausalGenerator(streamed, schedule="self_forcing", context=GlobalCache(21)))
    for a, b in zip(want, got):
        assert torch.equal(a.cpu(), b.cpu())


# ------------------------------------------------------------------------------------------- ComfyUI adapter (logic)
def _node_stack(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`
    from node_fixtures import DRAFTER_FILE, EMBEDDINGS_FILE, TARGET_FILE, write_tiny_models
    from nodes import logic

    write_tiny_models(tmp_path)
    folders = {name: [str(tmp_path / name)] for name in ("diffusion_models", "sdvg_reward", "sdvg_embeddings")}
    return logic, folders, DRAFTER_FILE, TARGET_FILE, EMBEDDINGS_FILE


def test_loader_node_refuses_offload_on_cpu(tmp_path):
    logic, folders, _, target_file, _ = _node_stack(tmp_path)
    svc = logic.Services(folders)
    with pytest.raises(ValueError, match="streams the target's transformer blocks from CPU RAM to a CUDA GPU, but the "
                                         "target runs on 'cpu'"):
        logic.load_model_node(target_file, "fp8", "cpu", "auto", role="target", services=svc, offload="blocks")
    with pytest.raises(ValueError, match=r"offload must be one of \('none', 'blocks'\), got 'all'"):
        logic.load_model_node(target_file, "fp8", "cpu", "auto", role="target", services=svc, offload="all")


def test_offloaded_models_load_run_interrupt_and_unload_through_the_node_logic(tmp_path, monkeypatch):
    """The node path with the streamer on CPU->CPU (the CUDA guard bypassed): the memory manager gets only the
    resident part, a run matches the resident models exactly, an interrupt leaves no block loaded, unload works."""
    from node_fixtures import FakeComfyVAE

    logic, folders, drafter_file, target_file, embeddings_file = _node_stack(tmp_path)
    from nodes import loaders

    monkeypatch.setattr(loaders, "check_offload_device", lambda device, what: device)
    svc = logic.Services(folders)
    positive, prompt = logic.load_embeddings_node(embeddings_file, 0, services=svc)
    runs = {}
    for offload in ("none", "blocks"):
        drafter = logic.load_model_node(drafter_file, "fp32", "cpu", "auto", role="drafter", services=svc, offload=offload)
        target = logic.load_model_node(target_file, "fp8", "cpu", "auto", role="target", services=svc, offload=offload)
        out = logic.run_sampler(drafter=drafter, target=target, router=None, positive=positive, vae=FakeComfyVAE(),
                                reward_prompt=prompt, width=48, height=32, length=21, seed=3, mode="random",
                                random_accept_prob=0.5, services=svc)
        runs[offload] = (out, drafter, target)
    assert torch.equal(runs["none"][0].frames, runs["blocks"][0].frames)
    _, drafter, target = runs["blocks"]
    assert isinstance(target.holder.module, ResidentPart) and target.describe()["offload"] == "blocks"
    managed = {n for n, _ in target.holder.named_parameters()}
    assert managed and not any(".blocks." in n for n in managed)  # the memory manager never moves the blocks
    streamer = target.model.block_hooks
    assert streamer.loaded == set() and streamer.onloads > 0

    class Interrupting(logic.Services):
        calls = 0

        def check_interrupt(self):
            Interrupting.calls += 1
            if Interrupting.calls > 3:
                raise KeyboardInterrupt("interrupted by the test")

    with pytest.raises(KeyboardInterrupt):
        logic.run_sampler(drafter=drafter, target=target, router=None, positive=positive, vae=FakeComfyVAE(),
                          reward_prompt=prompt, width=48, height=32, length=21, seed=3, mode="random",
                          random_accept_prob=0.5, services=Interrupting(folders))
    assert streamer.loaded == set()
    target.patcher.model.to("cpu")  # unload through the handle the memory manager holds
    assert streamer.loaded == set() and target.model.device.type == "cpu"


def test_loader_node_kv_dtype_reaches_the_cache(tmp_path):
    logic, folders, drafter_file, _, embeddings_file = _node_stack(tmp_path)
    svc = logic.Services(folders)
    model = logic.load_model_node(drafter_file, "fp32", "cpu", "auto", role="drafter", services=svc, kv_dtype="fp8")
    assert model.describe()["kv_dtype"] == "fp8" and "offload" not in model.describe()
    gen = model.new_generator()
    gen.start(text_context(), latent_height=H, latent_width=W, num_blocks=1)
    assert gen.kv_cache.keys.dtype == torch.float8_e4m3fn and gen.kv_cache.geometry.compute_dtype == torch.float32
    with pytest.raises(ValueError, match=r"kv_dtype must be one of \('auto', 'fp8'\), got 'int4'"):
        logic.load_model_node(drafter_file, "fp32", "cpu", "auto", role="drafter", services=svc, kv_dtype="int4")
