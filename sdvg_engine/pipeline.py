"""The SDVG speculative loop: draft -> decode -> score -> route -> commit or regenerate.

Per block (see :meth:`SpeculativePipeline.stream`, the whole loop on one screen):

1. Block 0 (with ``force_first_block``), every block in ``target_only`` mode, and the blocks that ``schedule`` and
   ``random`` give the target (both decide before drafting): the target generates it; the drafter never runs on it
   (the reference code drafts block 0 and throws it away).
2. Otherwise the drafter generates the block from the block's noise, the VAE state is snapshotted,
   the draft is decoded and scored per frame, and the router decides.
3. Accept: the draft latents become context for both models and its decoded frames are kept.
4. Reject: the VAE is restored (the snapshot is held only until the verdict), the target regenerates the block from the
   *same* noise (or, with ``refine_from_step=k``, continues from the drafter's state after k steps), the result is
   decoded, and both models take the target's block as context.
5. The reference modes (``tau_mode`` relative / anchor / baseline) compare a draft with a reference built from the
   committed blocks' scores, so the target blocks a later reference reads are scored too
   (:meth:`SpeculativePipeline._reference_score`).

Both models' context updates are lazy (see :mod:`sdvg_engine.context`), so an accepted draft costs
the target nothing until the target next has to generate.

What a run holds is :class:`sdvg_engine.run.Run`; its report and result are built by :mod:`sdvg_engine.report`.
Where and when each step runs is not this module's business: steps are submitted to
:mod:`sdvg_engine.workers` (one lazy lane = exactly the order above; with a worker of its own the target
regenerates a block speculatively while its draft is verified, and decodes overlap the next block), and a
run that differs from an earlier one only in tau starts with the blocks :mod:`sdvg_engine.memo` can replay.
Every schedule gives bit-identical outputs.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from .cascade import cascades, first_frames, settled_by_first_frames
from .generator import BlockSample, CausalGenerator
from .memo import RecordedBlock, ReplayMemo, _cpu
from .options import MODES, CancelToken, GenerationCancelled, NonFiniteOutputError, SDVGOptions  # noqa: F401 (public here too)
from .replay_key import model_identity as _model_identity, weights_fingerprint as _weights_fingerprint  # noqa: F401 (older imports)
from .report import BlockRecord, Lap, SDVGResult, build_result, free_tau_interval  # noqa: F401 (public here too)
from .router import RandomRouter, RewardRouter, RouteDecision, TauState, temporal_consistency  # noqa: F401
from .sampling import SeededNoise  # noqa: F401 (imported from here by earlier releases' callers)
from .run import TEXT_LEN, pad_text, video_frames_to_latent_frames  # noqa: F401 (public here too)
from .run import Run, all_finite, check_parts, check_run_hooks, compact, start_run, to_host
from .sampling import NoiseSource
from .workers import wait


def unit_frames(pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels ``[1, 3, T, H, W]`` in [-1, 1] -> frames ``[T, 3, H, W]`` in 0..1 (what the reward takes)."""
    return ((pixels[0].transpose(0, 1).float() + 1.0) / 2.0).clamp(0, 1)


class SpeculativePipeline:
    """Drafter + target + streaming VAE (+ router): generates videos block by block.

    Args:
        drafter, target: :class:`CausalGenerator` objects (their own schedules and context schemes).
        vae: a :class:`sdvg_engine.vae.StreamingWanVAE` (anything with ``reset``, ``decode_block``,
            ``snapshot``, ``restore``).
        router: a :class:`RewardRouter` for ``sdvg`` mode (may be ``None`` for the other modes).
    """

    def __init__(self, drafter: CausalGenerator, target: CausalGenerator, vae, router: RewardRouter | None = None):
        check_parts(drafter, target, vae, router)  # before anything reads them
        self.drafter, self.target, self.vae, self.router = drafter, target, vae, router
        drafter.name, target.name = "drafter", "target"
        #: the preset the models were loaded with (:func:`sdvg_engine.load_pipeline` sets it; None = configured by hand)
        self.preset: str | None = None
        #: default worker layout of a run (see :func:`sdvg_engine.workers.plan_lanes`); ``generate(workers=)`` overrides
        self.workers: int | str = "auto"
        #: a :class:`ReplayMemo` to reuse earlier runs that differ only in tau (``None``: off)
        self.memo: ReplayMemo | None = None
        #: the current (or last) run; a new run abandons an unfinished one
        self._run: Run | None = None
        # A recompute-window model re-encodes its anchor frame with the pipeline's VAE.
        for gen in (drafter, target):
            if hasattr(gen.context, "anchor_encoder") and gen.context.anchor_encoder is None:
                gen.context.anchor_encoder = vae

    # ---- the loop -------------------------------------------------------------------------------------
    def stream(self, prompt_embeds: torch.Tensor | None = None, *, prompt: str = "", num_frames: int = 81, width: int = 832,
               height: int = 480, seed: int = 42, options: SDVGOptions | None = None,
               noise: NoiseSource | None = None, cancel: CancelToken | None = None,
               before_call: Callable[[str, str], None] | None = None, tau_state: TauState | None = None,
               workers: int | str | None = None, prompt_schedule=None) -> Iterator[BlockRecord]:
        """Yield one :class:`BlockRecord` per block, in block order, as soon as it is final. See :meth:`generate`."""
        run = start_run(self, prompt_embeds, prompt, num_frames, width, height, seed, options, noise, cancel,
                        before_call, tau_state, self.workers if workers is None else workers, prompt_schedule)
        with run.workers:
            yield from self._replay(run)  # the blocks an earlier run made with the same inputs and decisions
            previous = None
            for b in range(run.first_block, run.num_blocks):
                run.enter_block(b, self.router)  # a prompt switch may restart the routing state
                if run.target_makes(b):
                    block = self._target_block(run, b, drafted=False, decision=run.decided_before_drafting(b))
                else:
                    draft = run.submit("drafter", self._draft, run, b)
                    decoded = run.submit("vae", self._decode_draft, run, draft, run.host_copies)
                    fallback = self._speculate_target(run, b, draft)  # regenerates beside the verification
                    if previous is not None:
                        yield self._finish_block(run, previous)  # its decode ran beside this block's draft
                        previous = None
                    decision, features = self._route(run, b, decoded)
                    if decision is None or decision.accept:
                        if fallback is not None:
                            fallback.drop()
                        kept = run.submit("vae", self._keep_draft, decoded, run.host_copies)
                        block = self._commit(run, b, draft, decoded, kept, source="draft", drafted=True,
                                             decision=decision, draft_features=features)
                    else:
                        run.submit("vae", self._restore, decoded)
                        block = self._target_block(run, b, drafted=True, decision=decision, draft=draft, fallback=fallback)
                if previous is not None:
                    yield self._finish_block(run, previous)
                previous = block
            if previous is not None:  # None when every block was replayed
                yield self._finish_block(run, previous)
            run.workers.finish()

    def generate(self, prompt_embeds: torch.Tensor | None = None, *, prompt: str = "", num_frames: int = 81, width: int = 832,
                 height: int = 480, seed: int = 42, options: SDVGOptions | None = None,
                 noise: NoiseSource | None = None, cancel: CancelToken | None = None,
                 before_call: Callable[[str, str], None] | None = None,
                 on_block: Callable[[BlockRecord], None] | None = None, tau_state: TauState | None = None,
                 workers: int | str | None = None, prompt_schedule=None) -> SDVGResult:
        """Generate one video.

        Args:
            prompt_embeds: UMT5-XXL context ``[1, L, 4096]`` (zero padded; padded to 512 if shorter).
            prompt: the prompt text, for the reward model (and the key of ``random`` mode's decisions).
            prompt_schedule: instead of ``prompt_embeds`` and ``prompt``, the prompt of each part of the video:
                ``[(first_block, prompt_embeds, reward_prompt), ...]``, the first at block 0 (see
                :mod:`sdvg_engine.prompt_schedule`; ``options.target_after_switch`` and ``options.switch_routing``
                say who makes the block after a switch and what the router compares there).
            num_frames: video frames, ``12n - 3`` (81 = 7 blocks of 3 latent frames).
            width, height: pixels, multiples of 16.
            seed: noise seed in ``0 .. 2**64 - 1``; block ``b`` uses noise keyed by ``(seed, b, step)``.
            options: :class:`SDVGOptions` (mode, hybrid, cascade ...).
            noise: explicit noise source (overrides ``seed``; such a run is never replayed from the memo).
            cancel: a :class:`CancelToken`; checked before every model, VAE and reward call.
            before_call: ``f(component, kind)`` called before every model call (raise to cancel). With several
                workers it is called from their threads.
            on_block: called with each :class:`BlockRecord` as soon as its block is final.
            tau_state: the running scores of an adaptive threshold (``tau_mode="accept_rate"``) to continue from,
                e.g. carried across the videos of a benchmark; default: a fresh one per video.
            workers: ``1`` (sequential), ``"auto"`` (one worker per device when the models sit on several) or ``2``
                (CPU threads: the target beside the drafter side); default: the pipeline's :attr:`workers`.
                Every choice gives bit-identical outputs; see :mod:`sdvg_engine.workers`.
        """
        check_run_hooks(on_block=on_block)
        started = time.perf_counter()
        for record in self.stream(prompt_embeds, prompt=prompt, num_frames=num_frames, width=width, height=height,
                                  seed=seed, options=options, noise=noise, cancel=cancel, before_call=before_call,
                                  tau_state=tau_state, workers=workers, prompt_schedule=prompt_schedule):
            if on_block is not None:
                on_block(record)
        return self._finish(time.perf_counter() - started)

    # ---- making a block -----------------------------------------------------------------------------
    def _draft(self, run: Run, b: int) -> BlockSample:
        return self._timed(run, "drafter", lambda: self.drafter.generate_block(b, run.noise))

    def _target_sample(self, run: Run, b: int, draft: BlockSample | None) -> BlockSample:
        """The target's block ``b``: from the block's noise, or (hybrid) from the drafter's state after k steps."""
        refine = run.options.refine_from_step
        if draft is not None and refine is not None:
            state = draft.states[refine - draft.first_step]
            first = self.target.step_index(self.drafter.schedule.timesteps[refine])
            return self._timed(run, "target", lambda: self.target.generate_block(b, run.noise, first_step=first, start_latents=state))
        return self._timed(run, "target", lambda: self.target.generate_block(b, run.noise))

    def _speculate_target(self, run: Run, b: int, draft: Future):
        """With a worker of its own, the target regenerates block ``b`` while its draft is decoded and scored
        (its context is final: block ``b - 1`` is committed). Dropped on accept, used on reject."""
        if not run.workers.speculates or run.options.keeps_every_draft:  # nothing to regenerate
            return None
        needs_draft = run.options.refine_from_step is not None
        return run.workers.speculate("target", self.target, self._target_sample, run, b, draft if needs_draft else None)

    def _target_block(self, run: Run, b: int, *, drafted: bool, decision: RouteDecision | None = None, draft=None,
                      fallback=None) -> "_Block":
        sample = fallback.future if fallback is not None else run.submit("target", self._target_sample, run, b, draft)
        decoded = run.submit("vae", self._decode, run, sample, run.host_copies)
        return self._commit(run, b, sample, decoded, decoded, source="target", drafted=drafted, decision=decision)

    # ---- decoding -----------------------------------------------------------------------------------
    def _decode(self, run: Run, sample: BlockSample, host_copies: dict | None = None) -> "_Decoded":
        """Decode a block that will be kept; its :class:`Lap` is what an all-target run would pay for this block too.

        ``host_copies``: the recording's copy table (taken when the task was submitted): the frames cross to the host
        here, on the VAE's worker right after the decode, never on the main thread."""
        with self._measure(run, "vae") as lap:
            pixels = self.vae.decode_block(sample.latents)
        return _Decoded(None, pixels, lap, None if host_copies is None else _cpu(pixels, host_copies))

    def _decode_draft(self, run: Run, sample: BlockSample, host_copies: dict | None) -> "_Decoded":
        """Decode a draft; where the router may reject it, keep the VAE state from before it to roll back to (its
        frames then cross to the host only once it is kept: :meth:`_keep_draft`)."""
        if run.options.keeps_every_draft:  # nothing to roll back
            return self._decode(run, sample, host_copies)
        before = _Rollback(self.vae.snapshot())
        return self._decode(run, sample)._replace(vae_before=before)

    def _restore(self, decoded: "_Decoded") -> None:
        self.vae.restore(decoded.vae_before.take())

    @staticmethod
    def _keep_draft(decoded: "_Decoded", host_copies: dict | None) -> "_Decoded":
        """A kept draft needs no rollback: let its snapshot go now, not when its block is finished (a snapshot holds a
        whole decode cache, 3.5 GiB at 832x480 in fp32). Its frames cross to the host now, on the VAE's worker (a
        rejected draft's never do); the block is finished from what this returns."""
        if decoded.vae_before is not None:
            decoded.vae_before.take()
        if host_copies is None or decoded.host is not None:
            return decoded
        return decoded._replace(host=_cpu(decoded.pixels, host_copies))

    # ---- routing ------------------------------------------------------------------------------------
    def _route(self, run: Run, b: int, decoded: Future) -> tuple[RouteDecision | None, torch.Tensor | None]:
        """The router's verdict on a decoded draft (``None``: accepted without scoring) and the scored draft's
        last-frame features (the next seam term if it is kept; ``None`` when not scored on every frame)."""
        if run.random_router is not None:
            return run.random_router.decide_block(b), None  # drawn before drafting: this block was given to the drafter
        if not run.options.scores_drafts:
            return None, None
        # What the score reads is handed over now (the seam features and the committed blocks' scores so far), never
        # read from the run later on the reward's worker.
        return run.workers.result(run.submit("reward", self._score_draft, run, decoded, run.tau_state,
                                             run.previous_features, tuple(run.committed_scores), run.features_of(b)))

    def _score_draft(self, run: Run, decoded: "_Decoded", tau_state, previous, committed, prompt):
        frames = unit_frames(decoded.pixels)
        tau = self.router.block_tau(tau_state)
        reference = self.router.reference_of([wait(s) for s in committed]) if self.router.uses_reference else None
        decision, features = self._timed(run, "reward", lambda: self._score(run, frames, tau, previous, reference, prompt))
        tau_state.observe(decision.block_score)
        return decision, features

    def _score(self, run: Run, frames: torch.Tensor, tau: float, previous, reference, prompt):
        """Score a draft's ``frames`` against ``prompt`` (the reward's features of its segment's prompt) and decide."""
        router, opts = self.router, run.options
        if not cascades(opts, frames.shape[0]):
            # Only the reference modes take a reference, so routers written against the older judge() keep working.
            relative = {"reference": reference} if getattr(router, "uses_reference", False) else {}
            decision, scores = router.judge(frames, prompt, previous_features=previous, tau=tau, **relative)
            return decision, scores.image_features[-1]
        first = torch.tensor(first_frames(frames.shape[0], opts.cascade_frames))
        partial = router.score_frames(frames[first], prompt).scores
        if settled_by_first_frames(float(partial.min()), tau, opts.cascade_margin):
            return router.decide(partial, tau=tau), None
        rest = torch.tensor([i for i in range(frames.shape[0]) if i not in set(first.tolist())])
        remaining = router.score_frames(frames[rest], prompt).scores
        # Frame scores in time order (the minimum does not care; readers of the report do).
        order = torch.cat([first, rest]).argsort()
        return router.decide(torch.cat([partial, remaining])[order], tau=tau), None

    # ---- committing a block -------------------------------------------------------------------------
    def _commit(self, run: Run, b: int, sample, decoded, finished, *, source: str, drafted: bool,
                decision: RouteDecision | None, draft_features=None) -> "_Block":
        """Make block ``b`` context for both models (on their own workers) and move the routing state past it; the
        frames are collected by :meth:`_finish_block` from ``finished`` (the decode, or a kept draft's release)."""
        contexts = {gen.name: run.submit(gen.name, self._commit_to, gen, b, sample,
                                         decoded if gen.context.needs_pixels else None) for gen in run.active}
        committed = run.committed_scores
        if run.prompt_features is not None and self.router.uses_reference:
            committed = committed + [self._reference_score(run, b, source, decision, decoded)]
        if draft_features is not None:
            seam = draft_features
        elif run.prompt_features is not None and b + 1 < run.num_blocks:
            # The next draft's seam term needs this block's last frame (scored only in sdvg mode). Also with the
            # temporal weight at 0: the reported temporal score must span the seam to the frame right before the draft
            # (one frame through the reward's image tower; without it the report used no seam or a stale one).
            seam = run.submit("reward", self._seam_features, run, decoded, run.features_of(b))
        else:
            seam = None
        run.advance(seam, committed)
        return _Block(index=b, source=source, drafted=drafted, decision=decision, sample=sample, decoded=finished,
                      contexts_after=contexts, previous_features_after=seam, reference_after=tuple(committed))

    def _reference_score(self, run: Run, b: int, source: str, decision, decoded):
        """The reference modes (relative, anchor, baseline: :meth:`RewardRouter.reference_of`): the block score of
        committed block ``b``. An accepted draft's is its own decision's score; a target block (block 0 or a
        regenerated one) is scored here, with the router's settings, only when a later draft's reference reads it
        (:meth:`RewardRouter.needs_committed_score`; a Future of it); ``None`` otherwise."""
        if source == "draft":
            return decision.block_score
        if b + 1 < run.num_blocks and self.router.needs_committed_score(run.routing_index(b)):
            return run.submit("reward", self._score_committed, run, decoded, run.previous_features, run.features_of(b))
        return None

    def _score_committed(self, run: Run, decoded: "_Decoded", previous_features, prompt) -> float:
        """The block score of a committed target block (what relative routing compares the next draft with), against
        ``prompt`` (its segment's reward prompt features)."""
        frames = unit_frames(decoded.pixels)
        scores = self._timed(run, "reward", lambda: self.router.score_frames(frames, prompt))
        return self.router.block_score(scores.scores, temporal_consistency(scores.image_features, wait(previous_features)))

    @staticmethod
    def _commit_to(gen: CausalGenerator, b: int, sample: BlockSample, decoded) -> tuple:
        gen.commit_block(b, sample.latents, None if decoded is None else decoded.pixels)
        return gen.context.snapshot()  # the state a replay restores to resume after this block

    def _seam_features(self, run: Run, decoded: "_Decoded", prompt):
        """The image features of a committed block's last frame (what the next draft's seam term compares with; they
        do not depend on ``prompt``, the reward's one forward takes one)."""
        last = unit_frames(decoded.pixels[:, :, -1:])
        return self._timed(run, "reward", lambda: self.router.score_frames(last, prompt).image_features[-1])

    # ---- a final block ------------------------------------------------------------------------------
    def _finish_block(self, run: Run, block: "_Block") -> BlockRecord:
        """Wait for a committed block's frames; check, record and time it (in block order)."""
        sample, decoded = _checked_outputs(run, block)
        copies = run.host_copies
        latents = _cpu(sample.latents.float(), copies) if copies is not None else to_host(sample.latents.float())
        record = run.append_block(block.index, block.source, block.drafted, block.decision, latents,
                                  _video_frames(decoded.pixels), decode=decoded.lap)
        record.seconds = run.take_block_seconds()
        if copies is not None:  # past the memo's cap: no host copies for nothing
            run.record(RecordedBlock(
                index=block.index, source=block.source, drafted=block.drafted, decision=block.decision,
                latents=latents, num_frames=decoded.pixels.shape[2], pixels=decoded.host,
                contexts_after={name: _cpu(run.workers.result(f), copies) for name, f in block.contexts_after.items()},
                previous_features_after=compact(_cpu(_result(run, block.previous_features_after))),
                seconds=sum(record.seconds.values()),
                reference_after=tuple(_result(run, s) for s in block.reference_after)), self.memo.max_bytes)
        return record

    # ---- replay ---------------------------------------------------------------------------------------
    def _replay(self, run: Run) -> Iterator[BlockRecord]:
        """Restore the state after the last reusable block of an earlier run and yield its blocks' records."""
        plan = run.replay_plan
        if plan is None:
            return
        blocks = plan.recording.blocks[: plan.reuse]
        last = blocks[-1]
        for gen in run.active:
            gen.context.restore(last.contexts_after[gen.name])
        run.advance(last.previous_features_after, last.reference_after or ())
        # The VAE's decode cache is a pure function of the latents decoded since reset(), so a run that goes on after
        # the prefix decodes the reused latents again, which rebuilds it bit for bit (nothing of the VAE is recorded).
        # A run replayed whole needs no VAE state: it takes the recorded frames.
        whole = plan.reuse == run.num_blocks and all(b.pixels is not None for b in blocks)
        for block, decision in zip(blocks, plan.decisions):
            run.check_cancel("replay", "block")  # a sweep whose rest is replay still stops on a cancel
            if whole:
                pixels, lap = block.pixels, Lap()
            else:
                with self._measure(run, "vae") as lap:
                    pixels = self.vae.decode_block(block.latents)
            record = run.append_block(block.index, block.source, block.drafted, decision, block.latents,
                                      _video_frames(pixels), replayed=True, decode=lap)
            # The re-decode is this block's own cost, not the next fresh block's (nor part of what a replay saves).
            record.seconds = run.take_block_seconds()
            if run.tau_state is not None and run.resets_routing_at(block.index):
                run.tau_state = self.router.new_tau_state()  # as the run that made it did at this prompt switch
            if run.tau_state is not None and block.drafted and decision is not None:
                run.tau_state.observe(decision.block_score)  # the caller's state, if carried, sees the replayed drafts too
            run.replayed_seconds += max(0.0, block.seconds - lap.seconds)
            if run.recording is not None:
                run.record(dataclasses.replace(block, decision=decision), self.memo.max_bytes)
            yield record

    # ---- timing -------------------------------------------------------------------------------------
    def _timed(self, run: Run, component: str, fn):
        """Run ``fn`` as one call of ``component`` (a cancel point), timed on that component's device."""
        with self._measure(run, component):
            return fn()

    @contextmanager
    def _measure(self, run: Run, component: str):
        """A cancel point, then the body timed as one call of ``component`` on its device; yields the :class:`Lap`.

        A model's cancel point goes through that model's own hook (``gen.before_call``, :func:`start_run` sets it to
        ``run.check_cancel``): a speculation guards that hook, so an interrupt seen here by speculative work that is
        dropped later still stops the run (ComfyUI's flag clears as it raises; nothing else would see it again)."""
        gen = getattr(self, component) if component in ("drafter", "target") else None
        check = gen.before_call if gen is not None and gen.before_call is not None else run.check_cancel
        check(component, "call")
        with run.timer.measure(component, self._device(component)) as lap:
            yield lap

    def _device(self, component: str) -> torch.device:
        if component in ("drafter", "target"):
            return getattr(self, component).model.device
        if component == "vae":
            return torch.device(self.vae.device)
        return torch.device(self.router.scorer.device) if self.router is not None else torch.device("cpu")

    # ---- the result ---------------------------------------------------------------------------------
    def _finish(self, wall: float) -> SDVGResult:
        run = self._run
        recording, run.recording, run.replay_plan = run.recording, None, None  # released: the memo keeps its own
        if recording is not None:
            recording.host_copies.clear()
        stored = self.memo.store(recording) if recording is not None else False
        return build_result(self, run, wall, recording=recording, stored=stored)


@dataclass
class _Block:
    """A committed block whose frames may still be decoding (on another worker)."""

    index: int
    source: str
    drafted: bool
    decision: RouteDecision | None
    sample: Future  # of the block's BlockSample
    decoded: Future  # of its _Decoded, once its frames are on the host where the run records (_keep_draft, _decode)
    contexts_after: dict  # generator name -> Future of its context snapshot after this commit
    previous_features_after: object  # seam features after this block (a tensor, None or a Future)
    reference_after: tuple = ()  # reference modes: the committed blocks' scores up to this one (floats, None, Futures)


class _Rollback:
    """The VAE state before a draft's decode, held only until the router's verdict (:meth:`take` hands it over once)."""

    def __init__(self, state):
        self.state = state

    def take(self):
        state, self.state = self.state, None
        return state


class _Decoded(NamedTuple):
    """A decoded block: the VAE state before it (a :class:`_Rollback`, drafts the router may reject), its pixels
    ``[B, 3, T, H, W]`` in [-1, 1], the decode's :class:`Lap`, and the pixels' host copy for the recording (made on
    the VAE's worker; ``None`` when the run records nothing or the draft is not kept yet)."""

    vae_before: object
    pixels: torch.Tensor
    lap: Lap
    host: torch.Tensor | None = None


def _checked_outputs(run: Run, block: _Block) -> tuple[BlockSample, _Decoded]:
    """A committed block's sample and decode, once both are done; a non-finite one stops the run here."""
    sample = run.workers.result(block.sample)
    decoded = run.workers.result(block.decoded)
    finite_latents = all_finite(sample.latents)
    if not finite_latents or not all_finite(decoded.pixels):
        model = "drafter" if block.source == "draft" else "target"
        raise NonFiniteOutputError(
            f"block {block.index}: the {model}'s output is not finite (NaN or inf) in "
            f"{'its decoded frames' if finite_latents else 'its latents'}; nothing of this "
            "block is kept. Check the weights (a corrupt or wrongly quantized checkpoint), the dtype (try bf16 or "
            "fp32) and the prompt embeddings.")
    return sample, decoded


def _result(run: Run, value):
    return run.workers.result(value) if isinstance(value, Future) else value


def _video_frames(pixels: torch.Tensor) -> torch.Tensor:
    """A block's output frames ``[T, H, W, 3]`` in 0..1, on the host (meta in the dry run)."""
    return to_host(unit_frames(pixels).permute(0, 2, 3, 1))
