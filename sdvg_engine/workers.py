"""Where and when the pipeline's work runs: lanes of workers, futures, and speculation that can be dropped.

The speculative loop (:meth:`SpeculativePipeline.stream`) says *what* happens to a block; this module decides
*where* each component's work runs and *when*:

* **One worker** (the default on one device): a single lazy lane. Submitting a task only queues it; a task runs
  when its result is first needed, after every task queued before it. So the order of model calls is exactly the
  order of the algorithm, as if it were written with plain calls, and nothing runs that no one asked for.
* **Several workers** (two GPUs, or ``workers=2`` on the CPU): one thread per lane, each running its tasks in the
  order they were submitted. Which component goes to which lane is :func:`plan_lanes`'s choice.

A task may wait only for futures submitted before it; with first-in-first-out lanes that rules out deadlock
(the earliest unfinished task never waits for anything unfinished).

:class:`Speculation` is work that may turn out to be unneeded (the target regenerating a block whose draft is
still being scored). Dropping it stops it at its next model call. It writes only the block's own cache slots
(or a context rebuild from committed blocks), which the commit of the accepted block overwrites; so dropped work
leaves no trace in any output.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Callable

import torch

COMPONENTS = ("drafter", "target", "vae", "reward")


class SpeculationDropped(Exception):
    """Raised inside a dropped speculative task at its next model call; never leaves this module."""


class StoppedByOtherWorker(RuntimeError):
    """Raised on a worker at its next model call after another worker's task failed. :meth:`Workers.result`
    turns it back into that first error, which is what the caller sees."""


class StreamAbandoned(RuntimeError):
    """Raised when a stream is resumed after a newer run on the same pipeline abandoned it (its workers are gone)."""


_ABANDONED = ("this generation was abandoned: a newer run started on the same pipeline and reset its models; "
              "iterate one stream at a time, or start this one again")


class _Task:
    __slots__ = ("fn", "future", "speculative")

    def __init__(self, fn: Callable, speculative: bool = False):
        self.fn, self.future, self.speculative = fn, Future(), speculative


class _Lane:
    """One worker: runs its tasks in submission order, in its own thread (or lazily in the caller's)."""

    def __init__(self, name: str, *, threaded: bool, on_error: Callable[[BaseException], None],
                 autograd_modes: tuple[bool, bool] = (False, True)):
        self.name = name
        # (inference mode, grad mode) of the thread that made the run: both are thread-local in torch, and a lane
        # thread must run as its caller does (ComfyUI runs every prompt under torch.inference_mode(); a KV cache
        # made there cannot be written in place from a thread outside it).
        self._autograd_modes = autograd_modes
        self.threaded = threaded
        self.busy_seconds = 0.0
        self._queue: deque[_Task] = deque()
        self._on_error = on_error
        self._ready = threading.Condition()
        self._closing = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._serve, name=f"sdvg-{name}", daemon=True)
            self._thread.start()

    def submit(self, task: _Task) -> None:
        with self._ready:
            self._queue.append(task)
            self._ready.notify()

    def _execute(self, task: _Task) -> None:
        started = time.perf_counter()
        try:
            task.future.set_result(task.fn())
        except BaseException as err:  # handed to whoever waits for the future; the lane keeps serving
            task.future.set_exception(err)
            # A speculative task's error matters only if its result is used (a reject): it is raised there.
            if not task.speculative:
                self._on_error(err)
        finally:
            self.busy_seconds += time.perf_counter() - started

    # --- threaded lanes
    def _serve(self) -> None:
        inference, grad = self._autograd_modes
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            self._serve_tasks()

    def _serve_tasks(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
            self._execute(task)

    # --- the lazy lane
    def run_until(self, future: Future) -> None:
        """Run queued tasks, oldest first, until ``future`` is done (lazy lane only)."""
        while not future.done() and self._queue:
            self._execute(self._queue.popleft())

    def drain(self) -> None:
        while self._queue:
            self._execute(self._queue.popleft())

    def discard(self) -> None:
        while self._queue:
            self._queue.popleft().future.cancel()

    def close(self) -> None:
        """Stop serving once the queue is empty and join the thread (idempotent)."""
        if self._thread is not None:
            with self._ready:
                self._closing = True
                self._ready.notify()
            self._thread.join()


def plan_lanes(options, devices: dict[str, torch.device], workers: int | str = "auto") -> dict[str, str]:
    """Which lane each component runs on, for a run's :class:`~sdvg_engine.options.SDVGOptions` (or its mode name).

    ``workers=1``: everything on one lane (the sequential schedule). ``"auto"``: one lane per device when the
    components sit on more than one device (e.g. target on ``cuda:0``; drafter, VAE, reward on ``cuda:1``),
    otherwise one lane. ``workers >= 2`` on one device (CPU threads): the model that makes most of the output gets
    a lane of its own (the target, or the drafter in ``draft_only`` / ``first_block_only``); the drafter side
    (drafter, VAE, reward) shares the other. More than two lanes on one device buy nothing here: the drafter side
    is a chain (draft -> decode -> score) and the target waits for its verdict.
    """
    if workers not in ("auto",) and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be 'auto' or a positive integer, got {workers!r}")
    distinct = {str(d) for d in devices.values()}
    if workers == 1 or (workers == "auto" and len(distinct) == 1):
        return {c: "main" for c in COMPONENTS}
    if len(distinct) > 1:
        return {c: str(devices[c]) for c in COMPONENTS}
    if isinstance(options, str):
        from .options import SDVGOptions

        options = SDVGOptions(mode=options)
    lead = "drafter" if options.drafter_leads else "target"
    lanes = {c: "side" for c in COMPONENTS}
    lanes[lead] = "lead"
    if lead == "drafter":
        lanes["target"] = "lead"
    return lanes


class Workers:
    """The lanes of one run. Use as a context manager: leaving it (normally, on error or on cancel) stops and
    joins every thread, so no work of this run is left running."""

    def __init__(self, lanes: dict[str, str]):
        self.lanes = dict(lanes)
        names = sorted(set(self.lanes.values()))
        self.parallel = len(names) > 1
        self.failed = threading.Event()  # any task failed: the other lanes stop at their next model call
        self.first_error: BaseException | None = None
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        self._lanes = {n: _Lane(n, threaded=self.parallel, on_error=self._fail, autograd_modes=modes) for n in names}
        self.dropped_seconds = 0.0
        self.speculations = 0
        self.dropped = 0
        self.abandoned = False
        self._lock = threading.Lock()

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self.first_error is None:
                self.first_error = err
        self.failed.set()

    @property
    def speculates(self) -> bool:
        """Whether the target has a lane apart from the verification (VAE and reward), so it can work beside it."""
        return self.lanes["target"] not in (self.lanes["vae"], self.lanes["reward"])

    def same_lane(self, a: str, b: str) -> bool:
        return self.lanes[a] == self.lanes[b]

    def submit(self, component: str, fn: Callable, *args, _speculative: bool = False, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` on ``component``'s lane; futures among ``args`` are resolved first."""
        def call():
            return fn(*(wait(a) for a in args), **{k: wait(v) for k, v in kwargs.items()})

        if self.abandoned:
            raise StreamAbandoned(_ABANDONED)
        task = _Task(call, speculative=_speculative)
        self._lanes[self.lanes[component]].submit(task)
        return task.future

    def result(self, future: Future):
        """Wait for ``future`` (running the lazy lane up to it) and return its value or raise its error; a worker
        stopped because another failed raises that other, first error (a cancel, an interrupt, out of memory ...)."""
        if self.abandoned and not future.done():
            raise StreamAbandoned(_ABANDONED)
        if not self.parallel and not future.done():
            next(iter(self._lanes.values())).run_until(future)
        try:
            return future.result()
        except CancelledError:
            if self.abandoned:
                raise StreamAbandoned(_ABANDONED) from None
            raise
        except StoppedByOtherWorker:
            if self.first_error is not None:
                raise self.first_error from None
            if self.abandoned:
                raise StreamAbandoned(_ABANDONED) from None
            raise

    def speculate(self, component: str, gen, fn: Callable, *args) -> "Speculation":
        """Queue speculative work of generator ``gen``; :meth:`Speculation.drop` stops it at its next model call."""
        spec = Speculation(self)

        def task(*values):
            if spec.dropped.is_set():
                return None
            hook = gen.before_call  # read here, on the lane: the main thread may be queueing the next speculation

            def guarded(name, kind):
                if spec.dropped.is_set():
                    raise SpeculationDropped()
                if hook is not None:
                    try:
                        hook(name, kind)
                    except BaseException as err:
                        # The caller's hook said stop (a cancel, an interrupt). It must stop the run even if this
                        # speculation is dropped later: ComfyUI's interrupt flag clears as it raises, so no other
                        # lane would ever see it again.
                        self._fail(err)
                        raise

            gen.before_call = guarded
            started = time.perf_counter()
            try:
                return fn(*values)
            except SpeculationDropped:
                return None
            finally:
                gen.before_call = hook
                spec._finished(time.perf_counter() - started)

        with self._lock:
            self.speculations += 1
        spec.future = self.submit(component, task, *args, _speculative=True)
        return spec

    def busy_seconds(self) -> dict[str, float]:
        return {name: round(lane.busy_seconds, 6) for name, lane in self._lanes.items()}

    def finish(self) -> None:
        """Run what is still queued (the lazy lane's trailing tasks), wait for every lane, and raise the run's first
        error if any task failed, a dropped speculation whose hook saw a cancel included."""
        for lane in self._lanes.values():
            if not lane.threaded:
                lane.drain()
        for lane in self._lanes.values():
            lane.close()
        if self.first_error is not None:
            raise self.first_error

    def __enter__(self) -> "Workers":
        return self

    def abandon(self) -> None:
        """Stop a run whose stream was left unfinished: its lanes stop at their next model call and are joined; the
        stream, if resumed, raises :class:`StreamAbandoned`."""
        self.abandoned = True
        self.__exit__(SpeculationDropped, None, None)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.failed.set()
            for lane in self._lanes.values():
                if not lane.threaded:
                    lane.discard()
        for lane in self._lanes.values():
            lane.close()


class Speculation:
    """A speculative task's handle: :meth:`drop` it when its result is not needed, or wait for :attr:`future`."""

    def __init__(self, workers: Workers):
        self.workers = workers
        self.dropped = threading.Event()
        self.future: Future | None = None
        self.seconds: float | None = None  # how long the task ran, once it has stopped

    def _finished(self, seconds: float) -> None:
        with self.workers._lock:
            self.seconds = seconds
            if self.dropped.is_set():  # dropped while it ran: all it did was wasted
                self.workers.dropped_seconds += seconds

    def drop(self) -> None:
        with self.workers._lock:
            self.dropped.set()
            self.workers.dropped += 1
            if self.seconds is not None:  # it finished before the verdict: wasted all the same
                self.workers.dropped_seconds += self.seconds


def wait(value):
    """The value of a future (blocking), or ``value`` itself."""
    return value.result() if isinstance(value, Future) else value
