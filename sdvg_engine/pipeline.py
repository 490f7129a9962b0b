"""The SDVG speculative loop: draft -> decode -> score -> route -> commit or regenerate.

Per block (see :meth:`SpeculativePipeline.stream`, the whole loop on one screen):

1. Block 0 (with ``force_first_block``), every block in ``target_only`` mode, and the blocks that ``schedule`` and
   ``random`` give the target (both decide before drafting): the target generates it; the drafter never runs on it
   (the reference code drafts block 0 and throws it away).
2. Otherwise the drafter generates the block from the block's noise, the VAE state is snapshotted,
   the draft is decoded and scored per frame, and the router decides.
3. Accept: the draft latents become context for both models and its decoded frames are kept.
4. Reject: the VAE is restored (the snapshot is held only until the verdict), the target regenerates the block from the *same* noise (or, with
   ``refine_from_step=k``, continues from the drafter's state after k steps), the result is decoded,
   and both models take the target's block as context.
5. The reference modes (``tau_mode`` relative / anchor / baseline) compare a draft with a reference built from the
   committed blocks' scores, so the target blocks a later reference reads are scored too
   (:meth:`SpeculativePipeline._track_reference`).

Both models' context updates are lazy (see :mod:`sdvg_engine.context`), so an accepted draft costs
the target nothing until the target next has to generate.

Where and when each step runs is not this module's business: steps are submitted to
:mod:`sdvg_engine.workers` (one lazy lane = exactly the order above; with a worker of its own the target
regenerates a block speculatively while its draft is verified, and decodes overlap the next block), and a
run that differs from an earlier one only in tau starts with the blocks :mod:`sdvg_engine.memo` can replay.
Every schedule gives bit-identical outputs.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from .generator import BlockSample, CausalGenerator
from .report import BlockRecord, ComponentTimer, Lap, build_report
from .router import RandomRouter, RewardRouter, RouteDecision, TauState, temporal_consistency
from .sampling import NoiseSource, SeededNoise
from .options import MODES, CancelToken, GenerationCancelled, NonFiniteOutputError, SDVGOptions  # noqa: F401 (public here too)
from .memo import Recording, RecordedBlock, ReplayMemo, _cpu, plan_replay
from .replay_key import replay_key
from .replay_key import model_identity as _model_identity, weights_fingerprint as _weights_fingerprint  # noqa: F401 (older imports)
from .workers import COMPONENTS, StoppedByOtherWorker, Workers, plan_lanes, wait

TEXT_LEN = 512


@dataclass
class SDVGResult:
    """Output of :meth:`SpeculativePipeline.generate`.

    frames: ``[T, H, W, 3]`` float32 in 0..1 (CPU).
    latents: ``[B, C, T_lat, h, w]`` float32, the final latents in the DiT's normalized space.
    acceptance_mask: ``[T]`` float32, 1 where the frame comes from an accepted draft.
    blocks: one :class:`BlockRecord` per block.
    report: JSON-serialisable summary (see :func:`sdvg_engine.report.build_report`).
    """

    frames: torch.Tensor
    latents: torch.Tensor
    acceptance_mask: torch.Tensor
    blocks: list[BlockRecord]
    report: dict


def video_frames_to_latent_frames(num_frames: int, frames_per_block: int = 3) -> int:
    """Wan's 1 + 4k rule, with whole blocks: valid lengths are 12n - 3 (9, 21, ..., 81) for 3-frame blocks."""
    latent = (num_frames - 1) // 4 + 1
    if num_frames < 1 or (num_frames - 1) % 4 or latent % frames_per_block:
        step = 4 * frames_per_block
        lower = max(step - 3, ((num_frames + 3) // step) * step - 3)
        raise ValueError(
            f"num_frames={num_frames} does not fill whole blocks of {frames_per_block} latent frames; "
            f"use {lower} or {lower + step} (valid: 1 + 4*(3n) - 4 = {step - 3}, {2 * step - 3}, ..., 81)"
        )
    return latent


def pad_text(prompt_embeds: torch.Tensor) -> torch.Tensor:
    """Text context ``[1, L, D]`` with zero rows appended up to ``TEXT_LEN``, as the reference pads UMT5's output."""
    if prompt_embeds.shape[1] >= TEXT_LEN:
        return prompt_embeds
    return torch.nn.functional.pad(prompt_embeds, (0, 0, 0, TEXT_LEN - prompt_embeds.shape[1]))


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
        self.drafter, self.target, self.vae, self.router = drafter, target, vae, router
        drafter.name, target.name = "drafter", "target"
        #: the preset the models were loaded with (:func:`sdvg_engine.load_pipeline` sets it; None = configured by hand)
        self.preset: str | None = None
        #: default worker layout of a run (see :func:`sdvg_engine.workers.plan_lanes`); ``generate(workers=)`` overrides
        self.workers: int | str = "auto"
        #: a :class:`ReplayMemo` to reuse earlier runs that differ only in tau (``None``: off)
        self.memo: ReplayMemo | None = None
        self._check_compatible()
        # A recompute-window model re-encodes its anchor frame with the pipeline's VAE.
        for gen in (drafter, target):
            if hasattr(gen.context, "anchor_encoder") and gen.context.anchor_encoder is None:
                gen.context.anchor_encoder = vae

    def _check_compatible(self) -> None:
        d, t = self.drafter.model.config, self.target.model.config

        def same(a, b):
            return (tuple(a) if isinstance(a, (list, tuple)) else a) == (tuple(b) if isinstance(b, (list, tuple)) else b)

        for key, what in (("in_channels", "latent channels"), ("out_channels", "output channels"),
                          ("patch_size", "patch size"), ("text_dim", "text width")):
            if not same(d[key], t[key]):
                raise ValueError(
                    f"drafter and target are not compatible: the drafter has {what} {d[key]}, the target {t[key]}. "
                    "Both must be Wan2.1 text-to-video models sharing the VAE and text encoder."
                )
        if self.drafter.frames_per_block != self.target.frames_per_block:
            raise ValueError(
                f"drafter generates {self.drafter.frames_per_block} latent frames per block, "
                f"the target {self.target.frames_per_block}; they must match"
            )
        z = getattr(self.vae, "latent_channels", d["in_channels"])
        if z != d["in_channels"]:
            raise ValueError(f"the VAE has {z} latent channels but the models use {d['in_channels']}; use the Wan2.1 VAE")

    # ---- the loop -------------------------------------------------------------------------------------
    def stream(self, prompt_embeds: torch.Tensor, *, prompt: str = "", num_frames: int = 81, width: int = 832,
               height: int = 480, seed: int = 42, options: SDVGOptions | None = None,
               noise: NoiseSource | None = None, cancel: CancelToken | None = None,
               before_call: Callable[[str, str], None] | None = None, tau_state: TauState | None = None,
               workers: int | str | None = None) -> Iterator[BlockRecord]:
        """Yield one :class:`BlockRecord` per block, in block order, as soon as it is final. See :meth:`generate`."""
        opts = options or SDVGOptions()
        run = self._begin(prompt_embeds, prompt, num_frames, width, height, seed, opts, noise, cancel, before_call,
                          tau_state, self.workers if workers is None else workers)
        with run.workers:
            yield from self._replay(run)  # the blocks an earlier run made with the same inputs and decisions
            previous = None
            for b in range(run.first_block, run.num_blocks):
                if self._target_generates(run, b):
                    block = self._target_block(run, b, drafted=False, decision=self._decided_before_drafting(run, b))
                else:
                    draft = run.submit("drafter", self._draft, run, b)
                    decoded = run.submit("vae", self._decode_draft, run, draft, _host_copies(run))
                    fallback = self._speculate_target(run, b, draft)  # regenerates beside the verification
                    if previous is not None:
                        yield self._finish_block(run, previous)  # its decode ran beside this block's draft
                        previous = None
                    decision = self._route(run, b, decoded)
                    if decision is None or decision.accept:
                        if fallback is not None:
                            fallback.drop()
                        run.submit("vae", self._keep_draft, decoded, _host_copies(run))
                        block = self._commit(run, b, draft, decoded, source="draft", drafted=True, decision=decision)
                    else:
                        run.submit("vae", self._restore, decoded)
                        block = self._target_block(run, b, drafted=True, decision=decision, draft=draft, fallback=fallback)
                if previous is not None:
                    yield self._finish_block(run, previous)
                previous = block
            if previous is not None:  # None when every block was replayed
                yield self._finish_block(run, previous)
            run.workers.finish()

    def generate(self, prompt_embeds: torch.Tensor, *, prompt: str = "", num_frames: int = 81, width: int = 832,
                 height: int = 480, seed: int = 42, options: SDVGOptions | None = None,
                 noise: NoiseSource | None = None, cancel: CancelToken | None = None,
                 before_call: Callable[[str, str], None] | None = None,
                 on_block: Callable[[BlockRecord], None] | None = None, tau_state: TauState | None = None,
                 workers: int | str | None = None) -> SDVGResult:
        """Generate one video.

        Args:
            prompt_embeds: UMT5-XXL context ``[1, L, 4096]`` (zero padded; padded to 512 if shorter).
            prompt: the prompt text, for the reward model (and the key of ``random`` mode's decisions).
            num_frames: video frames, ``12n - 3`` (81 = 7 blocks of 3 latent frames).
            width, height: pixels, multiples of 16.
            seed: noise seed; block ``b`` uses noise keyed by ``(seed, b, step)``.
            options: :class:`SDVGOptions` (mode, hybrid, cascade ...).
            noise: explicit noise source (overrides ``seed``).
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
        started = time.perf_counter()
        for record in self.stream(prompt_embeds, prompt=prompt, num_frames=num_frames, width=width, height=height,
                                  seed=seed, options=options, noise=noise, cancel=cancel, before_call=before_call,
                                  tau_state=tau_state, workers=workers):
            if on_block is not None:
                on_block(record)
        return self._finish(time.perf_counter() - started)

    # ---- steps of the loop --------------------------------------------------------------------------
    @classmethod
    def _target_generates(cls, run, b: int) -> bool:
        """Whether the target makes block ``b`` without a draft: decided before drafting, from the options (and
        random mode's draw, which needs no draft either)."""
        draw = cls._decided_before_drafting(run, b)
        return run.options.target_makes_block(b, None if draw is None else draw.accept)

    @staticmethod
    def _decided_before_drafting(run, b: int) -> RouteDecision | None:
        """The recorded decision of a block the target makes without a draft: random mode's draw (None otherwise)."""
        forced = b == 0 and run.options.force_first_block
        return run.random_router.decide_block(b) if run.options.mode == "random" and not forced else None

    def _draft(self, run, b) -> BlockSample:
        return self._timed(run, "drafter", lambda: self.drafter.generate_block(b, run.noise))

    def _target_sample(self, run, b, draft):
        """The target's block ``b``: from the block's noise, or (hybrid) from the drafter's state after k steps."""
        refine = run.options.refine_from_step
        if draft is not None and refine is not None:
            state = draft.states[refine - draft.first_step]
            first = self.target.step_index(self.drafter.schedule.timesteps[refine])
            return self._timed(run, "target", lambda: self.target.generate_block(b, run.noise, first_step=first, start_latents=state))
        return self._timed(run, "target", lambda: self.target.generate_block(b, run.noise))

    def _speculate_target(self, run, b, draft):
        """With a worker of its own, the target regenerates block ``b`` while its draft is decoded and scored
        (its context is final: block ``b - 1`` is committed). Dropped on accept, used on reject."""
        if not run.workers.speculates or not run.options.scores_drafts:  # the other modes never reject a draft
            return None
        needs_draft = run.options.refine_from_step is not None
        return run.workers.speculate("target", self.target, self._target_sample, run, b, draft if needs_draft else None)

    def _target_block(self, run, b, *, drafted: bool, decision: RouteDecision | None = None, draft=None, fallback=None):
        if fallback is not None:
            sample = fallback.future
        else:
            sample = run.submit("target", self._target_sample, run, b, draft)
        decoded = run.submit("vae", self._decode, run, sample, _host_copies(run))
        return self._commit(run, b, sample, decoded, source="target", drafted=drafted, decision=decision)

    def _decode(self, run, sample: BlockSample, host_copies: dict | None = None) -> "_Decoded":
        """Decode a block that will be kept; its :class:`Lap` is what an all-target run would pay for this block too.

        ``host_copies``: the recording's copy table (:func:`_host_copies`, taken when the task was submitted): the
        frames cross to the host here, on the VAE's worker right after the decode, not on the main thread when the
        block is finished (:meth:`_finish_block` then finds them copied)."""
        with self._measure(run, "vae") as lap:
            pixels = self.vae.decode_block(sample.latents)
        if host_copies is not None:
            _cpu(pixels, host_copies)
        return _Decoded(None, pixels, lap)

    def _decode_draft(self, run, sample: BlockSample, host_copies: dict | None) -> "_Decoded":
        """Decode a draft; where the router may reject it, keep the VAE state from before it to roll back to (its
        frames then cross to the host only once it is kept: :meth:`_keep_draft`)."""
        if not run.options.scores_drafts:  # the other modes keep every draft they make: nothing to roll back
            return self._decode(run, sample, host_copies)
        return self._snapshot_and_decode(run, sample)

    def _snapshot_and_decode(self, run, sample: BlockSample) -> "_Decoded":
        """Decode a draft, keeping the VAE state from before it, to roll back to on reject."""
        before = _Rollback(self.vae.snapshot())
        return self._decode(run, sample)._replace(vae_before=before)

    def _restore(self, decoded: "_Decoded") -> None:
        self.vae.restore(decoded.vae_before.take())

    @staticmethod
    def _keep_draft(decoded: "_Decoded", host_copies: dict | None) -> None:
        """A kept draft needs no rollback: let its snapshot go now, not when its block is finished (a snapshot holds a
        whole decode cache, 3.5 GiB at 832x480 in fp32; kept to the end of the block, two of them were alive beside the
        current cache). Its frames cross to the host now, on the VAE's worker (a rejected draft's never do)."""
        if decoded.vae_before is not None:
            decoded.vae_before.take()
        if host_copies is not None:
            _cpu(decoded.pixels, host_copies)

    def _route(self, run, b, decoded) -> RouteDecision | None:
        """The router's verdict on a decoded draft; ``None`` means accepted without scoring."""
        if run.options.mode == "random":
            return run.random_router.decide_block(b)  # drawn before drafting: this block was given to the drafter
        if not run.options.scores_drafts:
            return None
        # What the score reads is handed over now (the seam features and the committed blocks' scores so far), never
        # read from the run later on the reward's worker.
        return run.workers.result(run.submit("reward", self._score_draft, run, decoded, run.tau_state,
                                             run.previous_features, tuple(run.committed_scores)))

    def _score_draft(self, run, decoded, tau_state, previous, committed) -> RouteDecision:
        frames = unit_frames(decoded.pixels)
        tau = self.router.block_tau(tau_state)
        reference = self.router.reference_of([wait(s) for s in committed]) if self.router.uses_reference else None
        decision = self._timed(run, "reward", lambda: self._score(run, frames, tau, previous, reference))
        tau_state.observe(decision.block_score)
        return decision

    def _score(self, run, frames: torch.Tensor, tau: float, previous, reference) -> RouteDecision:
        router, opts = self.router, run.options
        if not opts.cascade or frames.shape[0] <= opts.cascade_frames:
            # Only the reference modes take a reference, so routers written against the older judge() keep working.
            relative = {"reference": reference} if getattr(router, "uses_reference", False) else {}
            decision, scores = router.judge(frames, run.prompt_features, previous_features=previous, tau=tau, **relative)
            run.draft_features = scores.image_features[-1]
            return decision
        first = torch.linspace(0, frames.shape[0] - 1, opts.cascade_frames).round().long().unique()
        partial = router.score_frames(frames[first], run.prompt_features).scores
        partial_min = float(partial.min())
        if partial_min < tau or partial_min >= tau + opts.cascade_margin:
            # Below tau: the full minimum can only be lower, so this rejection is exact.
            return router.decide(partial, tau=tau)
        rest = torch.tensor([i for i in range(frames.shape[0]) if i not in set(first.tolist())])
        remaining = router.score_frames(frames[rest], run.prompt_features).scores
        # Frame scores in time order (the minimum does not care; readers of the report do).
        order = torch.cat([first, rest]).argsort()
        return router.decide(torch.cat([partial, remaining])[order], tau=tau)

    def _commit(self, run, b, sample, decoded, *, source, drafted, decision) -> "_Block":
        """Make block ``b`` context for both models (on their own workers) and queue what the next draft's seam
        term needs; the frames are collected by :meth:`_finish_block`."""
        contexts = {}
        for gen in run.active:
            pixels = decoded if gen.context.needs_pixels else None
            contexts[gen.name] = run.submit(gen.name, self._commit_to, gen, b, sample, pixels)
        self._track_reference(run, b, source, decision, decoded)
        if source == "draft" and run.draft_features is not None:
            run.previous_features = run.draft_features
        elif run.prompt_features is not None and b + 1 < run.num_blocks:
            # The next draft's seam term needs this block's last frame (scored only in sdvg mode). Also with the
            # temporal weight at 0: the reported temporal score must span the seam to the frame right before the draft
            # (one frame through the reward's image tower; without it the report used no seam or a stale one).
            run.previous_features = run.submit("reward", self._seam_features, run, decoded)
        else:
            run.previous_features = None
        run.draft_features = None
        return _Block(index=b, source=source, drafted=drafted, decision=decision, sample=sample, decoded=decoded,
                      contexts_after=contexts, previous_features_after=run.previous_features,
                      reference_after=tuple(run.committed_scores))

    def _track_reference(self, run, b, source, decision, decoded) -> None:
        """The reference modes (relative, anchor, baseline: :meth:`RewardRouter.reference_of`): keep the block score of
        every committed block. An accepted draft's is its own decision's score; a target block (block 0 or a
        regenerated one) is scored here, with the router's settings, only when a later draft's reference reads it
        (:meth:`RewardRouter.needs_committed_score`); ``None`` otherwise."""
        if run.prompt_features is None or not self.router.uses_reference:
            return
        if source == "draft":
            score = decision.block_score
        elif b + 1 < run.num_blocks and self.router.needs_committed_score(b):
            score = run.submit("reward", self._score_committed, run, decoded, run.previous_features)
        else:
            score = None
        run.committed_scores.append(score)

    def _score_committed(self, run, decoded, previous_features) -> float:
        """The block score of a committed target block (what relative routing compares the next draft with)."""
        frames = unit_frames(decoded.pixels)
        scores = self._timed(run, "reward", lambda: self.router.score_frames(frames, run.prompt_features))
        return self.router.block_score(scores.scores, temporal_consistency(scores.image_features, wait(previous_features)))

    @staticmethod
    def _commit_to(gen, b, sample, decoded) -> tuple:
        gen.commit_block(b, sample.latents, None if decoded is None else decoded.pixels)
        return gen.context.snapshot()  # the state a replay restores to resume after this block

    def _seam_features(self, run, decoded):
        last = unit_frames(decoded.pixels[:, :, -1:])
        return self._timed(run, "reward", lambda: self.router.score_frames(last, run.prompt_features).image_features[-1])

    def _finish_block(self, run, block: "_Block") -> BlockRecord:
        """Wait for a committed block's frames and record it (in block order)."""
        sample = run.workers.result(block.sample)
        decoded = run.workers.result(block.decoded)
        finite_latents = _all_finite(sample.latents)
        if not finite_latents or not _all_finite(decoded.pixels):
            model = "drafter" if block.source == "draft" else "target"
            raise NonFiniteOutputError(
                f"block {block.index}: the {model}'s output is not finite (NaN or inf) in "
                f"{'its decoded frames' if finite_latents else 'its latents'}; nothing of this "
                "block is kept. Check the weights (a corrupt or wrongly quantized checkpoint), the dtype (try bf16 or "
                "fp32) and the prompt embeddings.")
        record = self._append_block(run, block.index, block.source, block.drafted, block.decision,
                                    _host(sample.latents.float()), decoded.pixels, decode=decoded.lap)
        now = run.timer.seconds
        record.seconds = {k: v - run.block_seconds.get(k, 0.0) for k, v in now.items() if v - run.block_seconds.get(k, 0.0) > 0}
        run.block_seconds = dict(now)
        if run.recording is not None and not run.recording_full:  # past the cap: no host copies for nothing
            self._record(run, RecordedBlock(
                index=block.index, source=block.source, drafted=block.drafted, decision=block.decision,
                latents=run.latents[-1], num_frames=decoded.pixels.shape[2],
                pixels=_cpu(decoded.pixels, run.recording.host_copies),
                contexts_after={name: _cpu(run.workers.result(f), run.recording.host_copies)
                                for name, f in block.contexts_after.items()},
                previous_features_after=_compact(_cpu(run.workers.result(block.previous_features_after)
                                             if isinstance(block.previous_features_after, Future) else block.previous_features_after)),
                seconds=sum(record.seconds.values()),
                reference_after=tuple(run.workers.result(s) if isinstance(s, Future) else s for s in block.reference_after)))
        return record

    def _record(self, run, block: RecordedBlock) -> None:
        """Add a block to the run's recording while it fits the memo's cap: a recording too large to keep whole keeps
        its longest prefix that fits (a later run still replays every block up to there)."""
        if run.recording_full:
            return
        run.recording.blocks.append(block)
        if run.recording.nbytes > self.memo.max_bytes:
            run.recording.blocks.pop()
            run.recording_full = True

    def _append_block(self, run, index, source, drafted, decision, latents, pixels, **record_fields) -> BlockRecord:
        """Add a final block's frames, latents (CPU float32) and mask to the run, and its :class:`BlockRecord`."""
        frames = _host(unit_frames(pixels).permute(0, 2, 3, 1))  # [T, H, W, 3]
        f0 = run.video_frames
        run.video_frames += frames.shape[0]
        run.latents.append(latents)
        run.mask.append(torch.full((frames.shape[0],), 1.0 if source == "draft" else 0.0))
        run.frames.append(frames)
        fpb = self.target.frames_per_block
        record = BlockRecord(index=index, source=source, drafted=drafted, decision=decision,
                             latent_frames=(index * fpb, (index + 1) * fpb), video_frames=(f0, run.video_frames),
                             frames=frames, **record_fields)
        run.records.append(record)
        return record

    # ---- replay ---------------------------------------------------------------------------------------
    def _replay(self, run) -> Iterator[BlockRecord]:
        """Restore the state after the last reusable block of an earlier run and yield its blocks' records."""
        plan = run.replay_plan
        if plan is None:
            return
        blocks = plan.recording.blocks[: plan.reuse]
        last = blocks[-1]
        for gen in run.active:
            gen.context.restore(last.contexts_after[gen.name])
        run.previous_features = last.previous_features_after
        run.committed_scores = list(last.reference_after or ())
        # The VAE's decode cache is a pure function of the latents decoded since reset(), so a run that goes on after
        # the prefix decodes the reused latents again, which rebuilds it bit for bit (nothing of the VAE is recorded).
        # A run replayed whole needs no VAE state: it takes the recorded frames.
        whole = plan.reuse == run.num_blocks and all(b.pixels is not None for b in blocks)
        for block, decision in zip(blocks, plan.decisions):
            run.check_cancel("replay", "block")  # a sweep whose rest is replay still stops on a cancel
            if whole:
                pixels, lap = block.pixels, None
            else:
                with self._measure(run, "vae") as lap:
                    pixels = self.vae.decode_block(block.latents)
            record = self._append_block(run, block.index, block.source, block.drafted, decision, block.latents,
                                        pixels, replayed=True, decode=lap if lap is not None else Lap())
            if run.tau_state is not None and block.drafted and decision is not None:
                run.tau_state.observe(decision.block_score)  # the caller's state, if carried, sees the replayed drafts too
            run.replayed_seconds += max(0.0, block.seconds - (lap.seconds if lap is not None else 0.0))
            if run.recording is not None:
                self._record(run, dataclasses.replace(block, decision=decision))
            yield record

    def _timed(self, run, component: str, fn):
        """Run ``fn`` as one call of ``component`` (a cancel point), timed on that component's device."""
        with self._measure(run, component):
            return fn()

    @contextmanager
    def _measure(self, run, component: str):
        """A cancel point, then the body timed as one call of ``component`` on its device; yields the :class:`Lap`.

        A model's cancel point goes through that model's own hook (``gen.before_call``, :meth:`_begin` sets it to
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

    # ---- setup and results --------------------------------------------------------------------------
    def _begin(self, prompt_embeds, prompt, num_frames, width, height, seed, opts, noise, cancel, before_call,
               tau_state, workers):
        previous = getattr(self, "_run", None)
        if previous is not None:  # a stream left unfinished must not keep working on the models this run resets
            previous.workers.abandon()
        opts.validate(self.router)
        if width % 16 or height % 16 or width <= 0 or height <= 0:
            raise ValueError(f"width and height must be positive multiples of 16, got {width}x{height}")
        fpb = self.target.frames_per_block
        num_blocks = video_frames_to_latent_frames(num_frames, fpb) // fpb
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != 1:
            raise ValueError(f"text context must be [1, L, {self.target.model.config.text_dim}], got {tuple(prompt_embeds.shape)}")
        if not torch.isfinite(prompt_embeds).all():
            raise ValueError("the prompt embeddings (text context) contain NaN or inf; re-encode the prompt")
        if opts.scores_drafts and not str(prompt).strip():
            raise ValueError(f"mode {opts.mode!r}{' with schedule_veto' if opts.mode == 'schedule' else ''} scores drafts "
                             "against the prompt text, but prompt is empty; pass prompt=... (the text the embeddings "
                             "were made from)")
        prompt_embeds = pad_text(prompt_embeds)
        if opts.refine_from_step is not None:
            steps = self.drafter.schedule.num_steps
            if not 1 <= opts.refine_from_step < steps:
                raise ValueError(f"refine_from_step must be in 1..{steps - 1} for the drafter's {steps}-step schedule")
            self.target.step_index(self.drafter.schedule.timesteps[opts.refine_from_step])
        devices = {c: self._device(c) for c in COMPONENTS}
        lanes = plan_lanes(opts.mode, devices, workers)
        memo_key = None
        if self.memo is not None and noise is None:
            memo_key = replay_key(self, prompt_embeds, prompt, num_frames, width, height, seed, opts, devices)

        run = _Run(options=opts, num_blocks=num_blocks, noise=noise or SeededNoise(seed), cancel=cancel,
                   before_call=before_call, prompt=prompt, seed=seed, width=width, height=height, num_frames=num_frames,
                   workers=Workers(lanes))
        run.timer.handover_sync = not run.workers.parallel
        uses_drafter = opts.uses_drafter
        uses_target = opts.uses_target
        run.active = [g for g, used in ((self.drafter, uses_drafter), (self.target, uses_target)) if used]
        try:
            for gen in (self.drafter, self.target):
                gen.before_call = run.check_cancel
                gen.calls.clear()  # a model this mode does not use must not report a previous run's calls
                gen.timer.clear()
            h, w = height // 8, width // 8
            for gen in run.active:
                gen.start(prompt_embeds, latent_height=h, latent_width=w, num_blocks=num_blocks)
            self.vae.reset()
            if opts.scores_drafts:
                run.prompt_features = self.router.scorer.encode_prompt(prompt)
                run.tau_state = tau_state if tau_state is not None else self.router.new_tau_state()
            if opts.mode == "random":
                run.random_router = RandomRouter(opts.random_accept_prob, seed, key=prompt)
            if memo_key is not None:
                run.recording = Recording(memo_key)
                run.replay_plan = plan_replay(self.memo.lookup(memo_key), self.router, opts, run.tau_state)
                run.first_block = run.replay_plan.reuse if run.replay_plan is not None else 0
        except BaseException:
            run.workers.__exit__(*sys.exc_info())
            raise
        self._run = run
        return run

    def _finish(self, wall: float) -> SDVGResult:
        run = self._run
        records = run.records
        settings = {
            **asdict(run.options), "seed": run.seed, "num_frames": run.num_frames, "width": run.width, "height": run.height,
            "prompt": run.prompt, "preset": self.preset,
            "drafter_schedule": self.drafter.schedule.name, "target_schedule": self.target.schedule.name,
            "drafter_context": self.drafter.context.name, "target_context": self.target.context.name,
            "settings_source": {g.name: dict(g.settings_source) for g in (self.drafter, self.target)},
            "workers": {"lanes": dict(run.workers.lanes), "parallel": run.workers.parallel},
        }
        if self.router is not None:
            router_settings = self.router.settings()
            tau = router_settings.get("tau", self.router.tau)
            router_settings["tau"] = tau if not isinstance(tau, float) or math.isfinite(tau) else str(tau)
            settings.update(router_settings)
        parallel_decode = run.workers.parallel and not run.workers.same_lane("target", "vae")
        report = build_report(
            settings=settings, blocks=records, wall_seconds=wall, timer=run.timer,
            calls={g.name: dict(g.calls) for g in (self.drafter, self.target)},
            model_seconds={g.name: {k: round(v, 6) for k, v in g.seconds.items()} for g in (self.drafter, self.target)},
            target_only_model_seconds=self._target_only_seconds(len(records)),
            memory={"drafter_kv_cache_bytes": self.drafter.kv_cache_bytes, "target_kv_cache_bytes": self.target.kv_cache_bytes},
            decode_hidden=parallel_decode,
        )
        report["free_tau_interval"] = free_tau_interval(records, run.options, self.router)
        report["tau_per_block"] = [None if b.decision is None or b.decision.tau is None else _json_number(b.decision.tau)
                                   for b in records]
        recording, run.recording, run.replay_plan = run.recording, None, None  # released: the memo keeps its own
        if recording is not None:
            recording.host_copies.clear()
        stored = self.memo.store(recording) if recording is not None else False
        report["replay"] = {
            "enabled": recording is not None,
            "replayed_blocks": run.first_block,
            "seconds_saved": round(run.replayed_seconds, 6),
            "kept_for_replay": stored,
            "recorded_blocks": len(recording.blocks) if stored else 0,
            "recording_bytes": recording.nbytes if stored else 0,
            "memo_bytes": self.memo.nbytes if self.memo is not None else 0,
        }
        report["schedule"] = {
            "worker_busy_seconds": run.workers.busy_seconds(),
            "critical_path_seconds": round(wall, 6),
            "speculative_target_blocks": run.workers.speculations,
            "dropped_speculative_blocks": run.workers.dropped,
            "dropped_speculative_seconds": round(run.workers.dropped_seconds, 6),
        }
        return SDVGResult(frames=torch.cat(run.frames), latents=torch.cat(run.latents, dim=2),
                          acceptance_mask=torch.cat(run.mask), blocks=records, report=report)

    def _target_only_seconds(self, num_blocks: int) -> float | None:
        """What the target's model calls of an all-target video would cost, from this run's per-call times.

        All-target = every block's full schedule + one context pass (commit or recompute) before each
        later block. Per-call times, not per-block totals: a run's target total also holds deferred
        commits of accepted drafts, dropped speculative work and, with hybrid regeneration, partial schedules.
        """
        calls, seconds = self.target.calls, self.target.seconds
        if not calls.get("denoise"):
            return None
        per_denoise = seconds["denoise"] / calls["denoise"]
        context_kinds = [k for k in ("commit", "recompute") if calls.get(k)]
        # A t=0 context pass has the shape of a denoising call; use that when none was measured.
        per_context = sum(seconds[k] for k in context_kinds) / sum(calls[k] for k in context_kinds) if context_kinds else per_denoise
        passes_per_context = 1 if self.target.context.name == "global_cache" else getattr(self.target.context, "context_frames", 3) // max(1, self.target.frames_per_block) or 1
        return per_denoise * self.target.schedule.num_steps * num_blocks + per_context * passes_per_context * (num_blocks - 1)


@dataclass
class _Block:
    """A committed block whose frames may still be decoding (on another worker)."""

    index: int
    source: str
    drafted: bool
    decision: RouteDecision | None
    sample: Future  # of the block's BlockSample
    decoded: Future  # of its _Decoded
    contexts_after: dict  # generator name -> Future of its context snapshot after this commit
    previous_features_after: object  # seam features after this block (a tensor, None or a Future)
    reference_after: tuple = ()  # reference modes: the committed blocks' scores up to this one (floats, None, Futures)


def free_tau_interval(records: list[BlockRecord], options: SDVGOptions, router) -> dict | None:
    """The range of fixed tau that changes no decision of this run: above the highest rejected draft score, up to the
    lowest accepted one (``None`` ends: unbounded). Each drafted block flips when tau crosses its own score, so moving
    tau inside the interval replays the whole run for free (see :mod:`sdvg_engine.memo`). ``None`` when no router
    decided (other modes, or an adaptive tau, whose thresholds move with the scores)."""
    if not options.scores_drafts or router is None or getattr(router, "tau_mode", "fixed") != "fixed":
        return None
    scored = [r.decision for r in records if r.decision is not None and math.isfinite(r.decision.block_score)]
    rejected = [d.block_score for d in scored if not d.accept]
    accepted = [d.block_score for d in scored if d.accept]
    return {"above": max(rejected) if rejected else None, "up_to": min(accepted) if accepted else None,
            "flip_tau_per_block": [r.decision.block_score if r.decision is not None and math.isfinite(r.decision.block_score)
                                   else None for r in records],
            "exact": not options.cascade}


class _Rollback:
    """The VAE state before a draft's decode, held only until the router's verdict (:meth:`take` hands it over once)."""

    def __init__(self, state):
        self.state = state

    def take(self):
        state, self.state = self.state, None
        return state


class _Decoded(NamedTuple):
    """A decoded block: the VAE state before it (a :class:`_Rollback`, drafts the router may reject), its pixels
    ``[B, 3, T, H, W]`` in [-1, 1], and the decode's :class:`Lap`."""

    vae_before: object
    pixels: torch.Tensor
    lap: Lap


def _json_number(x: float):
    return float(x) if math.isfinite(x) else str(x)


class _Run:
    """Mutable state of one generation (so the pipeline object itself holds no half-run state)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.timer = ComponentTimer()
        self.records, self.frames, self.latents, self.mask = [], [], [], []
        self.video_frames = 0
        self.prompt_features = None
        self.random_router = None
        self.previous_features = None  # ViT features of the last committed frame (or a Future of them)
        self.committed_scores = []  # reference modes: each committed block's score (a float, a Future or None)
        self.draft_features = None  # the scored draft's last-frame features, kept if it is accepted
        self.tau_state = None
        self.active = []
        self.recording = None  # what a later run may replay (when the pipeline has a memo)
        self.recording_full = False  # the recording reached the memo's cap: later blocks are not recorded
        self.replay_plan = None
        self.first_block = 0
        self.replayed_seconds = 0.0
        self.block_seconds = {}

    def submit(self, component: str, fn, *args):
        return self.workers.submit(component, fn, *args)

    def check_cancel(self, component: str, kind: str) -> None:
        if self.cancel is not None and self.cancel.cancelled:
            raise GenerationCancelled(f"generation cancelled before a {component} {kind}")
        if self.workers.failed.is_set():
            raise StoppedByOtherWorker(f"stopped before a {component} {kind}: another worker of this run failed "
                                       f"({self.workers.first_error!r})")
        if self.before_call is not None:
            self.before_call(component, kind)


def _host_copies(run) -> dict | None:
    """The recording's table of host copies while it still records (``None`` past the memo's cap or without a memo):
    read on the main thread when a decode is submitted, never later on the VAE's worker."""
    recording = run.recording
    return recording.host_copies if recording is not None and not run.recording_full else None


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN/inf. A meta tensor (the real-size dry run, :mod:`sdvg_engine.dry_run`) has no values
    to check: True."""
    return t.is_meta or bool(torch.isfinite(t).all())


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, where a run's results live; a meta tensor (the dry run) stays on meta, with no values to copy."""
    return t if t.is_meta else t.cpu()


def _compact(t):
    """A tensor holding only its own bytes: the seam features are the last row of a block's ``[N, 1024]`` features,
    and a view would keep all N rows in the recording (``memo.recording_bytes`` counts one row per block)."""
    if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t
