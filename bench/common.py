"""Shared pieces of the benchmark scripts (not part of the installed package)."""

from __future__ import annotations

import torch

from sdvg_engine.router import RewardRouter


class ForcedRouter(RewardRouter):
    """Scores every draft for real (so its cost is paid), then forces the decision from a fixed pattern."""

    def __init__(self, scorer, pattern):
        super().__init__(scorer, tau=0.0)
        self.pattern, self.calls = list(pattern), 0

    def judge(self, frames, prompt, *, previous_features=None, tau=None):
        decision, scores = super().judge(frames, prompt, previous_features=previous_features, tau=tau)
        decision.accept = bool(self.pattern[self.calls % len(self.pattern)]) if self.pattern else False
        self.calls += 1
        return decision, scores


def accept_pattern(accepted: int, drafted: int) -> list[bool]:
    """``accepted`` of ``drafted`` blocks accepted, spread evenly (rejects are not all at the end)."""
    return [((i + 1) * accepted) // drafted > (i * accepted) // drafted for i in range(drafted)]


def text_context(dim: int = 4096, device="cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.zeros(1, 512, dim)
    ctx[:, :12] = torch.randn(1, 12, dim, generator=g) * 0.2
    return ctx.to(device)
