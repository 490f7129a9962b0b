"""Mode ``schedule`` (issue 24): which blocks the target makes is decided before drafting, from the options alone.

No drafter call and no decode of a draft on a target block, no reward model, and outputs bit-identical to a run in
which the same decisions come from a router that forces them after drafting (what the sdvg loop would do)."""

from __future__ import annotations

import pytest

from sdvg_engine.pipeline import SDVGOptions
from sdvg_fixtures import HEIGHT, WIDTH, ForcedRouter as Forced, prompt_embeds, shared_parts, tiny_pipeline

PROMPT = "a red ball rolling on grass"
FRAMES = 69  # 6 blocks


def by_hand(every: int, blocks: int = 6) -> list[str]:
    """Block 0 and blocks every, 2*every, ... by the target, the rest the drafter's."""
    return ["target" if b == 0 or (every and b % every == 0) else "draft" for b in range(blocks)]


@pytest.mark.parametrize("every", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2])
def test_schedule_decides_before_drafting(every, workers):
    pipe = tiny_pipeline()
    pipe.router = None  # no reward model needed
    result = pipe.generate(prompt_embeds(), prompt="", num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=3,
                           options=SDVGOptions(mode="schedule", schedule_every=every), workers=workers)
    expected = by_hand(every)
    assert [b.source for b in result.blocks] == expected
    assert [b.drafted for b in result.blocks] == [s == "draft" for s in expected]  # never drafted on a target block
    steps = pipe.drafter.schedule.num_steps
    assert pipe.drafter.calls.get("denoise", 0) == steps * expected.count("draft")
    assert result.report["schedule"]["speculative_target_blocks"] == 0
    assert all(b.decision is None for b in result.blocks)  # nothing scored
    # the same decisions forced after drafting and scoring: the same video, bit for bit
    forced = tiny_pipeline()
    forced.router = Forced(shared_parts()["scorer"], [s == "draft" for s in expected])
    reference = forced.generate(prompt_embeds(), prompt=PROMPT, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=3,
                                workers=1)
    assert [b.source for b in reference.blocks] == expected
    assert_same_video(result, reference)


def assert_same_video(a, b):
    import torch

    assert torch.equal(a.frames, b.frames) and torch.equal(a.latents, b.latents)
    assert torch.equal(a.acceptance_mask, b.acceptance_mask)


def test_schedule_every_is_validated():
    with pytest.raises(ValueError, match="schedule_every must be a whole number >= 0"):
        SDVGOptions(mode="schedule", schedule_every=-1).validate(None)
    with pytest.raises(ValueError, match="schedule_every"):
        SDVGOptions(mode="schedule", schedule_every=1.5).validate(None)
