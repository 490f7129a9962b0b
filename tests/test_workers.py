"""The overlapped schedule (several workers) gives bit-identical outputs to the sequential one, and leaves no
thread or state behind after a run, an error or a cancel."""

import math
import threading
import time

import pytest
import torch

from sdvg_engine.pipeline import CancelToken, GenerationCancelled, SDVGOptions
from sdvg_engine.workers import Workers, plan_lanes
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, tiny_pipeline

PROMPT = "a red ball rolling on grass"
FRAMES = 45  # 4 blocks


def run(pipe, workers, mode="sdvg", seed=5, **opts):
    return pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed,
                         options=SDVGOptions(mode=mode, **opts), workers=workers)


def sdvg_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sdvg-")]


def assert_same(a, b):
    assert torch.equal(a.frames, b.frames)
    assert torch.equal(a.latents, b.latents)
    assert torch.equal(a.acceptance_mask, b.acceptance_mask)
    assert [r.source for r in a.blocks] == [r.source for r in b.blocks]
    assert [r.decision.to_dict() if r.decision else None for r in a.blocks] == \
        [r.decision.to_dict() if r.decision else None for r in b.blocks]


@pytest.fixture(scope="module")
def scores():
    """The three drafts' scores when every draft is kept, to place tau between them."""
    result = run(tiny_pipeline(tau=-math.inf), 1)
    return sorted(b.decision.block_score for b in result.blocks[1:])


CASES = [
    ("sdvg", {}), ("random", {"random_accept_prob": 0.5}), ("first_block_only", {}), ("draft_only", {}),
    ("target_only", {}), ("sdvg", {"refine_from_step": 2}), ("sdvg", {"cascade": True, "cascade_frames": 2}),
]


@pytest.mark.parametrize("scheme", ["global_cache", "recompute_window"])
@pytest.mark.parametrize("mode,opts", CASES, ids=[f"{m}-{'-'.join(o) or 'plain'}" for m, o in CASES])
def test_two_workers_equal_one(scores, scheme, mode, opts):
    tau = (scores[0] + scores[1]) / 2  # a mix of accepts and rejects
    sequential = run(tiny_pipeline(tau=tau, target_scheme=scheme), 1, mode, **opts)
    overlapped = run(tiny_pipeline(tau=tau, target_scheme=scheme), 2, mode, **opts)
    assert_same(sequential, overlapped)
    assert overlapped.report["settings"]["workers"]["parallel"]
    assert not sdvg_threads()
    if mode == "sdvg" and not opts:
        assert [r.source for r in sequential.blocks].count("draft") in (1, 2)  # the tau really splits the drafts
        schedule = overlapped.report["schedule"]
        assert schedule["speculative_target_blocks"] == 3  # every drafted block had the target working beside it
        assert schedule["dropped_speculative_blocks"] == [r.source for r in overlapped.blocks].count("draft")


@pytest.mark.parametrize("tau", [-math.inf, math.inf])
def test_extreme_taus_with_two_workers(tau):
    assert_same(run(tiny_pipeline(tau=tau), 1), run(tiny_pipeline(tau=tau), 2))


def test_every_tau_of_a_sweep_is_identical(scores):
    taus = [scores[0] - 1, (scores[0] + scores[1]) / 2, (scores[1] + scores[2]) / 2, scores[2] + 1]
    for tau in taus:
        assert_same(run(tiny_pipeline(tau=tau), 1), run(tiny_pipeline(tau=tau), 2))


def test_cancel_during_speculation_then_rerun_equals_fresh(scores):
    tau = (scores[1] + scores[2]) / 2
    pipe = tiny_pipeline(tau=tau)
    fresh = run(tiny_pipeline(tau=tau), 1)
    token = CancelToken()
    seen = []

    def before_call(component, kind):
        seen.append((threading.current_thread().name, component, kind))
        # Cancel while the target works speculatively on block 2 (beside the draft's verification).
        if component == "target" and kind == "denoise" and sum(1 for s in seen if s[1:] == ("target", "denoise")) == 10:
            token.cancel()

    with pytest.raises(GenerationCancelled):
        pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                      options=SDVGOptions(), cancel=token, before_call=before_call, workers=2)
    assert any(name.startswith("sdvg-") for name, _, _ in seen)  # the work really ran on worker threads
    assert not sdvg_threads()
    assert_same(run(pipe, 2), fresh)
    assert_same(run(pipe, 1), fresh)


def test_an_error_on_one_worker_stops_the_others_and_the_pipeline_stays_usable(scores):
    pipe = tiny_pipeline(tau=(scores[0] + scores[1]) / 2)
    fresh = run(tiny_pipeline(tau=(scores[0] + scores[1]) / 2), 1)
    calls = []

    def before_call(component, kind):
        calls.append(component)
        if component == "vae" and calls.count("vae") == 3:
            raise RuntimeError("decoder failed")

    with pytest.raises(RuntimeError, match="decoder failed"):
        pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                      before_call=before_call, workers=2)
    assert not sdvg_threads()
    assert_same(run(pipe, 2), fresh)


def test_lane_plans():
    cpu = {c: torch.device("cpu") for c in ("drafter", "target", "vae", "reward")}
    assert set(plan_lanes("sdvg", cpu, 1).values()) == {"main"}
    assert set(plan_lanes("sdvg", cpu, "auto").values()) == {"main"}
    two = plan_lanes("sdvg", cpu, 2)
    assert two["target"] != two["drafter"] == two["vae"] == two["reward"]
    draft_only = plan_lanes("draft_only", cpu, 2)
    assert draft_only["drafter"] != draft_only["vae"]
    gpus = {"drafter": torch.device("cuda:1"), "target": torch.device("cuda:0"), "vae": torch.device("cuda:1"),
            "reward": torch.device("cuda:1")}
    auto = plan_lanes("sdvg", gpus, "auto")
    assert auto["target"] == "cuda:0" and auto["drafter"] == auto["vae"] == auto["reward"] == "cuda:1"
    with Workers(auto) as parallel, Workers(plan_lanes("sdvg", gpus, 1)) as sequential:
        assert parallel.speculates and parallel.parallel and not sequential.speculates
    assert not sdvg_threads()
    with pytest.raises(ValueError, match="workers must be"):
        plan_lanes("sdvg", cpu, 0)


def test_lazy_lane_runs_tasks_in_order_only_when_needed():
    order = []
    with Workers({c: "main" for c in ("drafter", "target", "vae", "reward")}) as workers:
        a = workers.submit("drafter", lambda: order.append("a") or 1)
        b = workers.submit("vae", lambda x: order.append("b") or x + 1, a)
        c = workers.submit("target", lambda: order.append("c"))
        assert order == []
        assert workers.result(b) == 2 and order == ["a", "b"]
        workers.finish()
    assert order == ["a", "b", "c"]


def test_a_slow_target_still_busy_with_a_dropped_block_does_not_spoil_the_next():
    """The target keeps working on a dropped speculation while the next one is queued (a slow target): the next
    speculation must not inherit the dropped one's stop signal (it would come back empty on a reject)."""
    import time

    def slow_target(component, kind):
        if component == "target":
            time.sleep(0.15)

    seed, tau = 4, -3.0  # accept block 1, reject block 2: a reject right after a dropped speculation
    kwargs = dict(prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=seed, before_call=slow_target)
    sequential = tiny_pipeline(tau=tau).generate(prompt_embeds(), workers=1, **kwargs)
    assert [b.source for b in sequential.blocks][1:3] == ["draft", "target"]
    overlapped = tiny_pipeline(tau=tau).generate(prompt_embeds(), workers=2, **kwargs)
    assert_same(sequential, overlapped)
    assert overlapped.report["schedule"]["dropped_speculative_blocks"] >= 1


def test_a_failure_in_dropped_speculation_does_not_fail_the_run(monkeypatch):
    """The sequential schedule never runs the target on an accepted block; the overlapped one must not fail because
    its dropped speculative work did (an error inside the model's computation; an error from the caller's hook is a
    stop request instead, see test_cancel.py). The fault is injected where the generator calls the model
    (``forward_block``; a forward pre-hook would never fire), in denoising calls only (t > 0: the speculative
    regenerations; the target's context passes run at t = 0), and the verdict is slowed so the speculation runs."""
    state = {"armed": False, "fired": 0}

    def slow_verdict(component, kind):
        if component == "reward" and state["armed"]:
            time.sleep(0.2)

    kwargs = dict(prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5, before_call=slow_verdict,
                  on_block=lambda r: state.update(armed=True))  # block 0 is the target's own: fail only afterwards
    sequential = tiny_pipeline(tau=-math.inf).generate(prompt_embeds(), workers=1, **kwargs)
    state["armed"] = False
    pipe = tiny_pipeline(tau=-math.inf)
    real = pipe.target.model.forward_block

    def failing_forward_block(latents, timesteps, *args, **kw):
        if state["armed"] and bool((timesteps > 0).any()):
            state["fired"] += 1
            raise RuntimeError("target out of memory (simulated)")
        return real(latents, timesteps, *args, **kw)

    monkeypatch.setattr(pipe.target.model, "forward_block", failing_forward_block)
    overlapped = pipe.generate(prompt_embeds(), workers=2, **kwargs)
    assert state["fired"] >= 1  # the fault really hit the dropped speculation
    assert_same(sequential, overlapped)
    assert overlapped.report["schedule"]["dropped_speculative_blocks"] >= 1
    assert not sdvg_threads()


def test_the_first_error_is_what_the_caller_sees():
    """A worker stopped because another failed raises StoppedByOtherWorker; waiting on it gives the first error."""
    import time

    from sdvg_engine.workers import StoppedByOtherWorker

    with pytest.raises(MemoryError, match="target out of memory"):
        with Workers({"target": "lead", "drafter": "side", "vae": "side", "reward": "side"}) as workers:
            def target_fails():
                raise MemoryError("target out of memory (simulated)")

            def independent_decode():
                time.sleep(0.2)  # its model call comes after the target's failure
                if workers.failed.is_set():
                    raise StoppedByOtherWorker("stopped: another worker failed")
                return "pixels"

            workers.submit("target", target_fails)
            workers.result(workers.submit("vae", independent_decode))
    assert not sdvg_threads()


def test_an_abandoned_stream_is_stopped_by_the_next_run():
    pipe = tiny_pipeline(tau=0.0)
    stream = pipe.stream(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5, workers=2)
    next(stream)  # block 0, then left unfinished with work queued on both workers
    result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5, workers=2)
    assert_same(result, tiny_pipeline(tau=0.0).generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH,
                                                        height=HEIGHT, seed=5, workers=1))
    stream.close()
    assert not sdvg_threads()


@pytest.mark.parametrize("workers", [1, 2])
def test_resuming_an_abandoned_stream_says_why(workers):
    """It used to hang forever with 2 workers (its tasks went to lanes whose threads had exited) and raise an empty
    CancelledError with 1."""
    from sdvg_engine.workers import StreamAbandoned

    pipe = tiny_pipeline(tau=0.0)
    kwargs = dict(prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5, workers=workers)
    stream = pipe.stream(prompt_embeds(), **kwargs)
    next(stream)
    pipe.generate(prompt_embeds(), **kwargs)  # a newer run abandons the stream
    done = {}

    def resume():
        try:
            next(stream)
        except BaseException as e:  # the test reads what was raised
            done["error"] = e

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "resuming the abandoned stream hangs"
    assert isinstance(done.get("error"), StreamAbandoned) and "a newer run started" in str(done["error"])
    assert not sdvg_threads()


def test_speculation_that_finished_before_the_verdict_counts_as_dropped_seconds():
    """Each dropped speculation's time is wasted work whether it was stopped midway or had already finished (the
    report said 0.0 s for 12 finished target calls)."""
    def slow(component, kind):
        time.sleep(0.02 if component == "target" else 0.25 if component == "reward" else 0.0)

    result = tiny_pipeline(tau=-math.inf).generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH,
                                                   height=HEIGHT, seed=5, before_call=slow, workers=2)
    schedule = result.report["schedule"]
    assert schedule["dropped_speculative_blocks"] == 3  # blocks 1-3 kept: every speculation dropped
    # each speculation ran its 4 denoising calls (>= 0.02 s each) before the 0.25 s verdict
    assert schedule["dropped_speculative_seconds"] >= 3 * 4 * 0.02


@pytest.mark.parametrize("mode", ["target_only", "draft_only", "first_block_only", "schedule"])
def test_two_workers_never_speculate_where_no_draft_is_judged(mode):
    """Only sdvg and random judge a draft after drafting it; in every other mode a speculative target block could only
    be thrown away (a seeded bug doing it kept the outputs equal with 4x the target calls)."""
    runs = {}
    for workers in (1, 2):
        pipe = tiny_pipeline(tau=0.0)
        result = pipe.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=5,
                               options=SDVGOptions(mode=mode, schedule_every=2), workers=workers)
        runs[workers] = (result, dict(pipe.target.calls), dict(pipe.drafter.calls))
    (one, target_one, drafter_one), (two, target_two, drafter_two) = runs[1], runs[2]
    assert_same(one, two)
    assert two.report["schedule"]["speculative_target_blocks"] == 0
    assert target_two == target_one and drafter_two == drafter_one
