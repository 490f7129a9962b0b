"""A cancel is never lost: any exception from the caller's ``before_call`` stops the run, with any number of workers,
whichever worker saw it. The hook here is ComfyUI's one-shot flag (cleared by the check that raises), which a
persistent ``CancelToken`` cannot imitate: a dropped task that swallowed the exception would leave nothing behind.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from comfy_executor import InterruptProcessingException, OneShotInterrupt
from sdvg_engine.memo import ReplayMemo
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline
from test_workers import assert_same, sdvg_threads

PROMPT = "a red ball rolling on grass"
FRAMES = 57  # 5 blocks


def generate(pipe, flag: OneShotInterrupt, workers, seed=5, gate=None, on_block=None):
    def before_call(component, kind):
        if gate is not None:
            gate()
        flag.throw_if_interrupted()

    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed,
                         before_call=before_call, on_block=on_block, workers=workers)


def seen_first_by(thread_name: str, flag: OneShotInterrupt):
    """A scheduling gate: other worker threads wait while the flag is set, so ``thread_name`` sees it first."""
    def gate():
        deadline = time.time() + 10
        while threading.current_thread().name != thread_name and flag.is_set and time.time() < deadline:
            time.sleep(0.001)
    return gate


def then_usable(pipe, workers, tau):
    """After the cancel, the same pipeline gives what a fresh one gives."""
    fresh = generate(tiny_pipeline(tau=tau), OneShotInterrupt(), 1, seed=6)
    assert_same(generate(pipe, OneShotInterrupt(), workers, seed=6), fresh)
    assert not sdvg_threads()


# (1 worker, tau=-inf) never runs the target after block 0: there is no target work to click during.
@pytest.mark.parametrize("workers, tau", [(1, math.inf), (2, math.inf), (2, -math.inf)])
def test_cancel_while_the_target_works(workers, tau):
    """With 2 workers the target regenerates block b beside its verification; tau=-inf keeps the draft and drops
    that speculation, which must not take the cancel with it."""
    pipe, flag = tiny_pipeline(tau=tau), OneShotInterrupt()
    target = pipe.target.model
    forward_block, state = target.forward_block, {"armed": False, "fired": False}

    def click(*args, **kwargs):
        if state["armed"] and not state["fired"]:
            state["fired"] = True
            flag.set()
        return forward_block(*args, **kwargs)

    target.forward_block = click
    gate = seen_first_by("sdvg-lead", flag) if workers == 2 else None
    with pytest.raises(InterruptProcessingException):
        generate(pipe, flag, workers, gate=gate, on_block=lambda r: state.update(armed=True))
    del target.forward_block
    assert state["fired"] and flag.raised_on == ["sdvg-lead" if workers == 2 else "MainThread"]
    then_usable(pipe, workers, tau)


@pytest.mark.parametrize("workers", [1, 2])
def test_cancel_during_a_decode(workers):
    pipe, flag = tiny_pipeline(tau=-math.inf), OneShotInterrupt()
    decode_block, calls = pipe.vae.decode_block, []

    def click(latents):
        calls.append(1)
        if len(calls) == 3:  # block 2's decode
            flag.set()
        return decode_block(latents)

    pipe.vae.decode_block = click
    gate = seen_first_by("sdvg-side", flag) if workers == 2 else None
    with pytest.raises(InterruptProcessingException):
        generate(pipe, flag, workers, gate=gate)
    del pipe.vae.decode_block
    assert len(calls) < 5 and flag.raised_on == ["sdvg-side" if workers == 2 else "MainThread"]
    then_usable(pipe, workers, -math.inf)


@pytest.mark.parametrize("workers", [1, 2])
def test_cancel_during_replay(workers):
    """A run that is all replay makes no model call; a cancel between its blocks still stops it."""
    pipe, flag = tiny_pipeline(tau=-math.inf), OneShotInterrupt()
    pipe.memo = ReplayMemo()
    first = generate(pipe, flag, workers)
    records = []

    def on_block(record):
        records.append(record)
        if record.index == 1:
            flag.set()

    with pytest.raises(InterruptProcessingException):
        generate(pipe, flag, workers, on_block=on_block)
    assert [r.replayed for r in records] == [True, True]
    assert_same(generate(pipe, OneShotInterrupt(), workers), first)  # the memo still serves the next run


def test_cancel_seen_at_the_start_of_a_dropped_speculation():
    """The interrupt is seen by the speculating target's very first check, the one before its timed call (not one of
    the model's own calls): the speculation is then dropped (tau=-inf keeps every draft), and the run must still stop
    (found in a real ComfyUI, where the run completed after the Cancel)."""
    pipe, flag, state = tiny_pipeline(tau=-math.inf), OneShotInterrupt(), {"armed": False, "fired": False}

    def before_call(component, kind):
        if (state["armed"] and not state["fired"] and component == "target" and kind == "call"
                and threading.current_thread().name != "MainThread"):
            state["fired"] = True
            flag.set()
        flag.throw_if_interrupted()

    with pytest.raises(InterruptProcessingException):
        pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                      before_call=before_call, on_block=lambda r: state.update(armed=True), workers=2)
    assert state["fired"] and flag.raised_on and flag.raised_on[0] != "MainThread"
    then_usable(pipe, 2, -math.inf)
