"""The sampler node across executions: replay when only the router's tau settings change, presets, workers."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`

from nodes import logic  # noqa: E402
from test_nodes import DRAFTER_FILE, REWARD_FILE, folders, models_dir, sample, services, stack  # noqa: E402,F401


def router(folders, tau, **kw):
    return logic.build_router(REWARD_FILE, tau, "min", "center", 0.0, services=logic.Services(folders), **kw)


def replay_of(out) -> dict:
    return json.loads(out.report)["replay"]


def same(a, b):
    assert torch.equal(a.frames, b.frames) and torch.equal(a.mask, b.mask)
    assert torch.equal(a.latent["samples"], b.latent["samples"])
    assert json.loads(a.report)["decisions"] == json.loads(b.report)["decisions"]


def test_changing_only_tau_replays_and_equals_a_fresh_run(stack, folders, services):
    logic.clear_replay_memo()
    first = sample(stack, router(folders, -math.inf), services)
    scores = json.loads(first.report)["draft_scores"][1:]
    tau = sorted(scores)[1]  # flips the lowest-scoring draft
    replayed = sample(stack, router(folders, tau), services)
    fresh = sample(stack, router(folders, tau), services, replay=False)
    same(replayed, fresh)
    info = replay_of(replayed)
    expected = 1 + next(i for i, s in enumerate(scores) if s < tau)  # blocks before the first flipped draft
    assert info["replayed_blocks"] == expected
    # what a replay saves: each replayed block's seconds in the run that made it, less its re-decode now (an exact
    # account, not a timing: under load a re-decode can take as long as the block it replaces)
    made = [sum(b["seconds"].values()) for b in json.loads(first.report)["blocks"][:expected]]
    redone = [sum(b["seconds"].values()) for b in json.loads(replayed.report)["blocks"][:expected]]
    assert all(m > 0 for m in made)
    assert info["seconds_saved"] == pytest.approx(sum(max(0.0, m - r) for m, r in zip(made, redone)), abs=1e-5)
    assert replay_of(fresh) == {"enabled": False, "replayed_blocks": 0, "seconds_saved": 0.0, "kept_for_replay": False, "recorded_blocks": 0, "recording_bytes": 0,
                                "memo_bytes": 0}
    # tau inside the free interval of the last run: nothing changes, nothing runs.
    free = json.loads(replayed.report)["free_tau_interval"]
    again = sample(stack, router(folders, free["up_to"]), services)
    assert replay_of(again)["replayed_blocks"] == 4
    same(again, replayed)
    # The adaptive mode is a tau setting too: it replays from the same recordings.
    adaptive = sample(stack, router(folders, 0.0, tau_mode="accept_rate", accept_rate=0.5), services)
    same(adaptive, sample(stack, router(folders, 0.0, tau_mode="accept_rate", accept_rate=0.5), services, replay=False))
    assert replay_of(adaptive)["replayed_blocks"] >= 1


def test_other_inputs_and_new_models_never_replay(stack, folders, services):
    logic.clear_replay_memo()
    sample(stack, router(folders, -math.inf), services)
    assert replay_of(sample(stack, router(folders, 0.0), services, seed=8))["replayed_blocks"] == 0
    assert replay_of(sample(stack, router(folders, 0.0), services, preset="native"))["replayed_blocks"] == 0
    assert len(logic.REPLAY_MEMO) >= 1
    other = dict(stack, drafter=logic.load_model_node(DRAFTER_FILE, "fp32", "auto", "auto", role="drafter",
                                                      services=logic.Services(folders)))
    out = sample(other, router(folders, 0.0), services)
    assert replay_of(out)["replayed_blocks"] == 0
    assert len(logic.REPLAY_MEMO) == 1  # the old models' recordings were released


def test_preset_and_workers_inputs(stack, folders, services):
    ref = sample(stack, router(folders, 0.0), services, replay=False)
    settings = json.loads(ref.report)["settings"]
    assert settings["preset"] == "reference"
    assert (settings["drafter_context"], settings["target_context"]) == ("recompute_window", "recompute_window")
    assert (settings["drafter_schedule"], settings["target_schedule"]) == ("krea", "krea")
    native = json.loads(sample(stack, router(folders, 0.0), services, replay=False, preset="native").report)["settings"]
    assert native["drafter_context"] == "global_cache" and native["drafter_schedule"] == "self_forcing"
    two = sample(stack, router(folders, 0.0), services, replay=False, workers="2")
    same(two, ref)
    assert json.loads(two.report)["settings"]["workers"]["parallel"]
    with pytest.raises(ValueError, match="preset must be one of"):
        sample(stack, router(folders, 0.0), services, preset="paper")
    with pytest.raises(ValueError, match="workers must be one of"):
        sample(stack, router(folders, 0.0), services, workers="3")
