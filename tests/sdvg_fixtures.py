"""A complete tiny SDVG stack: two real-architecture Wan DiTs, a real (tiny) Wan VAE and ImageReward."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan

from sdvg_engine.context import GlobalCache, RecomputeWindow
from sdvg_engine.generator import CausalGenerator
from sdvg_engine.pipeline import SpeculativePipeline
from sdvg_engine.reward import build_tiny_image_reward
from sdvg_engine.router import RewardRouter
from sdvg_engine.vae import StreamingWanVAE
from wan_fixtures import tiny_wan

WIDTH, HEIGHT = 48, 32  # latent 6 x 4


def tiny_vae(seed: int = 0) -> StreamingWanVAE:
    torch.manual_seed(seed)
    return StreamingWanVAE(AutoencoderKLWan(base_dim=8, z_dim=16).eval().requires_grad_(False))


_SHARED = {}


def shared_parts():
    """Models are read-only in use; build them once per test session."""
    if not _SHARED:
        _SHARED.update(drafter=tiny_wan(seed=1), target=tiny_wan(seed=2), vae=tiny_vae(), scorer=build_tiny_image_reward(seed=0))
    return _SHARED


def tiny_pipeline(*, tau: float = 0.0, aggregation: str = "min", target_scheme: str = "global_cache",
                  target_schedule: str = "self_forcing", temporal_weight: float = 0.0) -> SpeculativePipeline:
    parts = shared_parts()
    drafter = CausalGenerator(parts["drafter"], schedule="self_forcing", context=GlobalCache(21))
    if target_scheme == "global_cache":
        target_context = GlobalCache(21)
    else:
        target_context = RecomputeWindow(3, anchor_encoder=parts["vae"])
    target = CausalGenerator(parts["target"], schedule=target_schedule, context=target_context)
    router = RewardRouter(parts["scorer"], tau=tau, aggregation=aggregation, temporal_weight=temporal_weight)
    return SpeculativePipeline(drafter, target, parts["vae"], router)


class ForcedRouter(RewardRouter):
    """Scores each draft for real, then keeps it exactly when ``keep[b]`` says so (block 0 is never drafted: the
    k-th judged draft is block k)."""

    def __init__(self, scorer, keep):
        super().__init__(scorer, tau=0.0)
        self.keep, self.seen = keep, 0

    def judge(self, frames, prompt, *, previous_features=None, tau=None):
        decision, scores = super().judge(frames, prompt, previous_features=previous_features, tau=tau)
        self.seen += 1
        decision.accept = self.keep[self.seen]
        return decision, scores


class CountingScorer:
    """The real tiny scorer, counting the frames of each call."""

    def __init__(self, scorer):
        self.scorer, self.calls, self.device = scorer, [], scorer.device

    def score_frames(self, frames, prompt, **kw):
        self.calls.append(int(frames.shape[0]))
        return self.scorer.score_frames(frames, prompt, **kw)

    def encode_prompt(self, prompt):
        return self.scorer.encode_prompt(prompt)


def prompt_embeds(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.zeros(1, 512, 4096)
    ctx[:, :6] = torch.randn(1, 6, 4096, generator=g) * 0.2
    return ctx


def write_checkpoint_files(root):
    """Tiny drafter/target/VAE/reward files and a prompt-embeddings file, as users would have them."""
    from sdvg_engine.models.loading import save_checkpoint
    from sdvg_engine.reward import save_image_reward
    from sdvg_engine.text_encoder import save_prompt_embeddings

    parts = shared_parts()
    save_checkpoint(parts["drafter"], root / "drafter.safetensors", context_scheme="global_cache")
    save_checkpoint(parts["target"], root / "target.safetensors", context_scheme="global_cache")
    parts["vae"].vae.save_pretrained(root / "vae")
    save_image_reward(parts["scorer"], root / "ImageReward.safetensors")
    save_prompt_embeddings(root / "embeds.safetensors", ["a red ball", "a blue cube"], [prompt_embeds(1), prompt_embeds(2)])
    return root


def generate_argv(files, out, *extra):
    """``sdvg generate`` on :func:`write_checkpoint_files`' files: a 9-frame target_only CPU run into ``out``."""
    return ["generate", "--drafter", str(files / "drafter.safetensors"), "--target", str(files / "target.safetensors"),
            "--vae", str(files / "vae"), "--context-file", str(files / "embeds.safetensors"), "--mode", "target_only",
            "--frames", "9", "--width", str(WIDTH), "--height", str(HEIGHT), "--dtype", "fp32", "--device", "cpu",
            "--format", "webp", "--out", str(out), *extra]


