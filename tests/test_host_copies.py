"""Where the replay recording's device -> host copies happen: a block's decoded frames are copied by the VAE's worker
right after the decode (SpeculativePipeline._decode), not by the main thread when the block is finished."""

import threading

import pytest
import torch

import sdvg_engine.pipeline as pipeline_module
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline
from test_workers import assert_same


def _spy(monkeypatch):
    """Record, for every decoded-frames tensor handed to memo._cpu, the thread of its first request."""
    first, real = {}, pipeline_module._cpu

    def spy(value, copies=None):
        if isinstance(value, torch.Tensor) and value.ndim == 5 and value.shape[1] == 3 and copies is not None:
            first.setdefault(value.untyped_storage().data_ptr(), threading.current_thread().name)
        return real(value, copies)

    monkeypatch.setattr(pipeline_module, "_cpu", spy)
    return first


@pytest.mark.parametrize("workers, thread", [(2, "sdvg-side"), (1, "MainThread")])
def test_frames_cross_to_the_host_on_the_vae_worker(monkeypatch, workers, thread):
    pipe = tiny_pipeline(tau=0.0)
    reference = pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=45, width=WIDTH, height=HEIGHT, seed=3,
                              options=SDVGOptions(), workers=workers)
    first = _spy(monkeypatch)
    pipe.memo = ReplayMemo()
    result = pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=45, width=WIDTH, height=HEIGHT, seed=3,
                           options=SDVGOptions(), workers=workers)
    assert result.report["replay"]["kept_for_replay"] and result.report["replay"]["recorded_blocks"] == 4
    assert first and set(first.values()) == {thread}  # 2 workers: the VAE's lane; 1 worker: the one lazy lane
    # only kept blocks cross to the host, each once: a rejected draft's frames never do
    assert any(b.drafted and b.source == "target" for b in result.blocks)
    assert len(first) == len(result.blocks)
    assert_same(reference, result)  # outputs unchanged
