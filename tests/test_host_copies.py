"""Where the replay recording's device -> host copies happen: a block's decoded frames are copied by the VAE's worker
right after the decode (SpeculativePipeline._decode), not by the main thread when the block is finished."""

import math
import threading

import pytest
import torch

import sdvg_engine.pipeline as pipeline_module
from sdvg_engine.memo import ReplayMemo
from sdvg_engine.pipeline import SDVGOptions
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline
from test_workers import assert_same


def _spy(monkeypatch):
    """Record every request of a decoded-frames tensor handed to memo._cpu for the recording: (storage, thread)."""
    calls, real = [], pipeline_module._cpu

    def spy(value, copies=None):
        if isinstance(value, torch.Tensor) and value.ndim == 5 and value.shape[1] == 3 and copies is not None:
            calls.append((value.untyped_storage().data_ptr(), threading.current_thread().name))
        return real(value, copies)

    monkeypatch.setattr(pipeline_module, "_cpu", spy)
    return calls


@pytest.fixture(scope="module")
def tau():
    """A tau between the two lowest draft scores: some drafts kept, some rejected."""
    result = tiny_pipeline(tau=-math.inf).generate(prompt_embeds(1), prompt="a red ball", num_frames=45, width=WIDTH,
                                                   height=HEIGHT, seed=3, options=SDVGOptions())
    scores = sorted(b.decision.block_score for b in result.blocks if b.decision is not None)
    return (scores[0] + scores[1]) / 2


@pytest.mark.parametrize("workers, thread", [(2, "sdvg-side"), (1, "MainThread")])
def test_frames_cross_to_the_host_on_the_vae_worker(monkeypatch, tau, workers, thread):
    pipe = tiny_pipeline(tau=tau)
    reference = pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=45, width=WIDTH, height=HEIGHT, seed=3,
                              options=SDVGOptions(), workers=workers)
    calls = _spy(monkeypatch)
    pipe.memo = ReplayMemo()
    result = pipe.generate(prompt_embeds(1), prompt="a red ball", num_frames=45, width=WIDTH, height=HEIGHT, seed=3,
                           options=SDVGOptions(), workers=workers)
    assert result.report["replay"]["kept_for_replay"] and result.report["replay"]["recorded_blocks"] == 4
    sources = [(b.drafted, b.source) for b in result.blocks]
    assert (True, "draft") in sources and (True, "target") in sources  # kept drafts and rejected ones
    # 2 workers: every request on the VAE's lane (kept drafts included; the main thread, which finishes blocks, never
    # copies); 1 worker: the one lazy lane runs on the caller's thread
    assert calls and {t for _, t in calls} == {thread}
    # only kept blocks cross to the host, each once: a rejected draft's frames never do
    assert len(calls) == len({ptr for ptr, _ in calls}) == len(result.blocks)
    assert_same(reference, result)  # outputs unchanged
