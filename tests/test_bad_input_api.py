"""Bad input at the pipeline's Python API (issue 30's matrix): each row gets a ValueError that names the argument and
the value it got (and the fix), before any model runs, instead of a traceback from deep inside or silent acceptance.
The pipeline stays usable afterwards."""

from __future__ import annotations

import pytest
import torch

from sdvg_engine.generator import CausalGenerator
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline

PROMPT = "a red ball rolling on grass"
GOOD = dict(prompt=PROMPT, num_frames=9, width=WIDTH, height=HEIGHT, seed=5)

# row -> (the keyword arguments that differ from GOOD, what the message must say: the argument and the value)
ROWS = {
    "num_frames-float": ({"num_frames": 21.0}, ["num_frames", "21.0", "whole number"]),
    "width-string": ({"width": "48"}, ["width", "'48'", "whole number"]),
    "prompt-none": ({"prompt": None}, ["prompt", "None", "string"]),
    "embeds-meta": ({"prompt_embeds": "meta"}, ["prompt_embeds", "meta device"]),
    "embeds-list": ({"prompt_embeds": "list"}, ["prompt_embeds", "list", "torch.Tensor"]),
    "options-dict": ({"options": {"mode": "sdvg"}}, ["options", "dict", "SDVGOptions(**"]),
    "seed-bool": ({"seed": True}, ["seed", "True", "bool"]),
    "seed-2**64+1": ({"seed": 2**64 + 1}, ["seed", str(2**64 + 1), "0..18446744073709551615"]),
    "seed-2**200": ({"seed": 2**200}, ["seed", str(2**200)[:20], "0..18446744073709551615"]),
    # hooks of the wrong kind (they failed deep inside the run: AttributeError / TypeError)
    "cancel-string": ({"cancel": "x"}, ["cancel", "str", "CancelToken"]),
    "noise-string": ({"noise": "x"}, ["noise", "str", "initial() and step()"]),
    "before_call-string": ({"before_call": "x"}, ["before_call", "str", "function"]),
    "tau_state-string": ({"tau_state": "x"}, ["tau_state", "str", "TauState"]),
}


def _call(pipe, entry: str, **changes):
    kwargs = {**GOOD, **changes}
    embeds = kwargs.pop("prompt_embeds", None)
    if embeds == "meta":
        embeds = torch.empty(1, 512, 4096, device="meta")
    elif embeds == "list":
        embeds = prompt_embeds().tolist()
    else:
        embeds = prompt_embeds()
    if entry == "generate":
        return pipe.generate(embeds, **kwargs)
    return next(pipe.stream(embeds, **kwargs))


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline(tau=0.0)


@pytest.mark.parametrize("entry", ["generate", "stream"])
@pytest.mark.parametrize("row", list(ROWS))
def test_bad_run_arguments_are_named(pipe, row, entry, monkeypatch):
    changes, words = ROWS[row]
    calls = []
    monkeypatch.setattr(pipe.drafter.model, "forward_block", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(pipe.target.model, "forward_block", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError) as err:
        _call(pipe, entry, **changes)
    message = str(err.value)
    for word in words:
        assert word in message, (row, message)
    assert not calls  # refused before any model call


def test_the_pipeline_runs_after_refusals(pipe):
    for changes, _ in ROWS.values():
        with pytest.raises(ValueError):
            _call(pipe, "generate", **changes)
    assert _call(pipe, "generate").frames.shape[0] == 9
    assert _call(pipe, "generate", seed=2**64 - 1).frames.shape[0] == 9  # the largest seed is fine


def test_a_pipeline_without_a_vae_is_refused():
    parts = shared_parts()
    with pytest.raises(ValueError, match=r"vae must be a StreamingWanVAE .*got NoneType.*load_wan_vae"):
        SpeculativePipeline(CausalGenerator(parts["drafter"]), CausalGenerator(parts["target"]), None)


def test_a_scorer_given_as_the_router_is_refused():
    parts = shared_parts()
    with pytest.raises(ValueError, match=r"router must be a RewardRouter .*got ImageRewardScorer.*RewardRouter\(scorer"):
        SpeculativePipeline(CausalGenerator(parts["drafter"]), CausalGenerator(parts["target"]), parts["vae"],
                            parts["scorer"])


def test_options_as_a_dict_names_the_fix(pipe):
    with pytest.raises(ValueError, match=r"options must be an SDVGOptions, got dict"):
        pipe.generate(prompt_embeds(), options={"mode": "target_only"}, **GOOD)
    assert pipe.generate(prompt_embeds(), options=SDVGOptions(mode="target_only"), **GOOD).frames.shape[0] == 9


def test_on_block_of_the_wrong_kind_is_refused_before_any_model_call(pipe, monkeypatch):
    calls = []
    monkeypatch.setattr(pipe.drafter.model, "forward_block", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(pipe.target.model, "forward_block", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="on_block must be a function .*got str"):
        pipe.generate(prompt_embeds(), on_block="x", **GOOD)
    assert not calls
