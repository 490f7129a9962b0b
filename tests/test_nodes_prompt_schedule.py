"""SDVG Prompt Schedule / SDVG Prompt Switch and the sampler's prompt_schedule input, on tiny real models (no ComfyUI).

The sampler's positive + reward_prompt open the video (frame 0); the schedule holds the later prompts with their start
frames. Runs are 33 frames: 3 blocks starting at frames 0, 9 and 21.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pack root, for `nodes`

from nodes import logic, schema  # noqa: E402
from node_fixtures import (  # noqa: E402
    DRAFTER_FILE, EMBEDDINGS_FILE, PROMPTS, REWARD_FILE, TARGET_FILE, FakeComfyVAE, StandInCLIP, prompt_context,
    write_tiny_models,
)

W, H, FRAMES = 48, 32, 33  # 3 blocks: frames 0, 9, 21
SWITCH_TEXT = "a blue ball bouncing on a wooden floor"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    write_tiny_models(root)
    return logic.Services({name: [str(root / name)] for name in ("diffusion_models", "sdvg_reward", "sdvg_embeddings")})


@pytest.fixture(scope="module")
def stack(services):
    drafter = logic.load_model_node(DRAFTER_FILE, "fp32", "auto", "auto", role="drafter", services=services)
    target = logic.load_model_node(TARGET_FILE, "fp32", "cpu", "auto", role="target", services=services)
    positive, prompt = logic.load_embeddings_node(EMBEDDINGS_FILE, 0, services=services)
    # tau -inf in fixed mode keeps every scored draft: the only target blocks are the ones made without a draft
    router = logic.build_router(REWARD_FILE, -math.inf, "min", "center", 0.0, services=services, tau_mode="fixed")
    return dict(drafter=drafter, target=target, router=router, positive=positive, reward_prompt=prompt,
                vae=FakeComfyVAE())


def sample(stack, services, **kw):
    args = dict(stack, width=W, height=H, length=FRAMES, seed=7, services=services, replay=False)
    args.update(kw)
    return logic.run_sampler(**args)


def schedule_of(text: str, services, **settings) -> logic.SDVGSchedule:
    values = dict(text=text, target_after_switch=True, switch_routing="reset", clip=StandInCLIP(prompt_context))
    values.update(settings)
    return logic.run_node("SDVGPromptSchedule", services, **values).outputs[0]


def switch_of(text: str, start_frame: int, services, schedule=None) -> logic.SDVGSchedule:
    conditioning = [[prompt_context(text), {"pooled_output": None}]]  # what CLIPTextEncode makes of the text
    return logic.run_node("SDVGPromptSwitch", services, conditioning=conditioning, start_frame=start_frame,
                          reward_prompt=text, **({} if schedule is None else {"schedule": schedule})).outputs[0]


# ------------------------------------------------------------------------------------------------------- sampler
def test_a_switch_makes_its_block_the_targets_and_the_report_lists_both_prompts(stack, services):
    plain = sample(stack, services)
    assert json.loads(plain.report)["decisions"] == ["target", "draft", "draft"]

    out = sample(stack, services, prompt_schedule=schedule_of(f"21: {SWITCH_TEXT}", services))
    report = json.loads(out.report)
    assert report["decisions"] == ["target", "draft", "target"]  # block 2 (frame 21) opens the new prompt
    assert [b["drafted"] for b in report["blocks"]] == [False, True, False]
    assert report["settings"]["prompt_schedule"] == [
        {"first_block": 0, "first_frame": 0, "prompt": PROMPTS[0]},
        {"first_block": 2, "first_frame": 21, "prompt": SWITCH_TEXT}]
    assert (report["settings"]["target_after_switch"], report["settings"]["switch_routing"]) == (True, "reset")
    # the frames before the switch are the one-prompt run's; the prompt changes the rest
    assert torch.equal(out.frames[:21], plain.frames[:21]) and not torch.equal(out.frames[21:], plain.frames[21:])
    assert "2 prompts: switches at frame 21" in logic.sampler_summary(out.report)
    assert "prompts" not in logic.sampler_summary(plain.report)

    # the schedule node's settings reach the run: with target_after_switch off the router decides block 2
    off = sample(stack, services, prompt_schedule=schedule_of(f"21: {SWITCH_TEXT}", services,
                                                              target_after_switch=False, switch_routing="carry"))
    report = json.loads(off.report)
    assert report["decisions"] == ["target", "draft", "draft"] and len(report["settings"]["prompt_schedule"]) == 2
    assert (report["settings"]["target_after_switch"], report["settings"]["switch_routing"]) == (False, "carry")


def test_the_sampler_refuses_switches_its_video_cannot_hold(stack, services):
    """Checked against the sampler's length, before any model runs; the message names the input and the fix."""
    beyond = schedule_of(f"33: {SWITCH_TEXT}", services)  # a block start of longer videos
    with pytest.raises(ValueError, match=r"^prompt_schedule \(SDVG Prompt Schedule line `33: a blue ball.*`\): starts "
                                         r"at frame 33, beyond the 33-frame video .*; raise the sampler's length to at "
                                         r"least 45 or move the switch earlier$"):
        sample(stack, services, prompt_schedule=beyond)
    with pytest.raises(ValueError, match=r"^prompt_schedule \(SDVG Prompt Switch at start_frame 45\): starts at frame "
                                         r"45, beyond the 33-frame video .*at least 57"):
        sample(stack, services, prompt_schedule=switch_of(SWITCH_TEXT, 45, services))
    # a switch without its text in a mode that scores drafts
    empty = logic.run_node("SDVGPromptSwitch", services, conditioning=[[prompt_context("x"), {}]], start_frame=21,
                           reward_prompt=" ").outputs[0]
    with pytest.raises(ValueError, match=r"prompt_schedule \(SDVG Prompt Switch at start_frame 21\): the reward "
                                         r"prompt is empty, and mode 'sdvg' scores drafts"):
        sample(stack, services, prompt_schedule=empty)
    # a conditioning the models cannot read, named as the switch
    narrow = logic.run_node("SDVGPromptSwitch", services, conditioning=[[torch.zeros(1, 512, 768), {}]],
                            start_frame=21, reward_prompt="x").outputs[0]
    with pytest.raises(ValueError, match=r"prompt_schedule \(SDVG Prompt Switch at start_frame 21\): the text "
                                         r"encoding is 768 wide.*CLIPLoader with type 'wan'"):
        sample(stack, services, prompt_schedule=narrow)
    with pytest.raises(ValueError, match="prompt_schedule: expected the output of SDVG Prompt Schedule or SDVG "
                                         "Prompt Switch, got dict"):
        sample(stack, services, prompt_schedule={"21": "a blue ball"})


# --------------------------------------------------------------------------------------------------------- nodes
@pytest.mark.parametrize("text, match", [
    ("0: a blue ball", r"SDVG Prompt Schedule text line 1: starts at frame 0, which the opening prompt \(given "
                       r"separately\) holds"),
    ("21: a blue ball\n30: a green ball", r"SDVG Prompt Schedule text line 2: frame 30 is not the start of a block; "
                                          r"prompts change between blocks: use 21 or 33"),
    ("45: a blue ball\n21: a green ball", r"line 2: frame 21 comes before the previous entry's frame 45"),
    ("a blue ball", r"line 1: expected `frame: prompt`"),
    ("", r"SDVG Prompt Schedule: holds no switches; write `frame: prompt` lines"),
])
def test_the_schedule_node_refuses_bad_lines(services, text, match):
    with pytest.raises(ValueError, match=match):
        schedule_of(text, services)


def test_the_switch_node_refuses_frame_0_and_frames_between_blocks(services):
    with pytest.raises(ValueError, match=r"SDVG Prompt Switch: start_frame 0 is the opening prompt's \(the sampler's "
                                         r"positive and reward_prompt\): a switch starts at a later block, e\.g\. 9, "
                                         r"21 or 33"):
        switch_of(SWITCH_TEXT, 0, services)
    with pytest.raises(ValueError, match=r"SDVG Prompt Switch: start_frame: frame 30 is not the start of a block; "
                                         r"prompts change between blocks: use 21 or 33"):
        switch_of(SWITCH_TEXT, 30, services)
    # the V3 class's validate_inputs (queue time) gives the same messages and passes a linked value
    assert logic.start_frame_problem(21) is None and logic.start_frame_problem(None) is None
    assert "is not the start of a block" in logic.start_frame_problem(30)
    assert "outside every video" in logic.start_frame_problem(schema.MAX_LENGTH)
    # two switches at one frame
    with pytest.raises(ValueError, match=r"two prompt switches start at frame 21 \(SDVG Prompt Switch at start_frame "
                                         r"21 and SDVG Prompt Schedule line `21: a green ball`\)"):
        schedule_of("21: a green ball", services, schedule=switch_of(SWITCH_TEXT, 21, services))
    # the lines need a text encoder; settings are set by one schedule node
    with pytest.raises(ValueError, match="connect a clip"):
        schedule_of("21: a green ball", services, clip=None)
    with pytest.raises(ValueError, match="comes from another SDVG Prompt Schedule node"):
        schedule_of("45: a red ball", services, schedule=schedule_of("21: a green ball", services))


def test_the_multiline_and_the_chained_forms_give_the_same_schedule(services):
    lines = schedule_of(f"# the opening prompt is the sampler's\n21: {SWITCH_TEXT}\n45: a green ball rolls away",
                        services)
    # chained in either order: the switches are put in frame order
    chained = switch_of(SWITCH_TEXT, 21, services, schedule=switch_of("a green ball rolls away", 45, services))
    for schedule in (lines, chained):
        assert schedule.frames == (21, 45)
        assert [s.reward_prompt for s in schedule.switches] == [SWITCH_TEXT, "a green ball rolls away"]
    for a, b in zip(lines.switches, chained.switches):
        assert torch.equal(a.conditioning[0][0], b.conditioning[0][0])
    # the sampler makes the same engine schedule of both (the chain with the engine's default settings)
    from nodes.prompt_schedule import engine_schedule

    opening = prompt_context(PROMPTS[0])
    made = [engine_schedule(s, opening, PROMPTS[0], length=57, frames_per_block=3, text_dim=4096, needs_prompt=True,
                            mode="sdvg") for s in (lines, chained)]
    assert [(b, p) for b, _, p in made[0]] == [(b, p) for b, _, p in made[1]] == [
        (0, PROMPTS[0]), (2, SWITCH_TEXT), (4, "a green ball rolls away")]
    assert all(torch.equal(x[1], y[1]) for x, y in zip(*made))
    assert lines.options() == {"target_after_switch": True, "switch_routing": "reset"} and chained.options() == {}
    # an SDVG Prompt Schedule at the end of a chain adds its lines and sets the settings
    ended = schedule_of("", services, schedule=chained, switch_routing="carry")
    assert ended.frames == (21, 45) and ended.options()["switch_routing"] == "carry"


def test_saved_workflows_without_the_schedule_input_load_unchanged(monkeypatch, services):
    """prompt_schedule is a socket appended after every existing input: a sampler saved before it keeps its widget
    values in place and runs with no schedule (run_node fills the default)."""
    sampler = schema.SAMPLER
    assert sampler.inputs[-1].name == "prompt_schedule" and sampler.inputs[-1].optional
    assert not sampler.inputs[-1].is_widget  # no widgets_values entry: saved positions unchanged
    api = json.loads((Path(__file__).resolve().parents[1] / "tests" / "api_workflows" /
                      "sdvg_text_to_video.json").read_text())
    inputs = next(n["inputs"] for n in api.values() if n["class_type"] == "SDVGSpeculativeSampler")
    assert "prompt_schedule" not in inputs
    from types import SimpleNamespace

    seen = {}

    def run_sampler(**kw):  # what the node hands the sampler's work
        seen.update(kw)
        return SimpleNamespace(frames=None, mask=None, latent=None, fps=None, report="{}", plot=None)

    monkeypatch.setattr(logic, "run_sampler", run_sampler)
    widgets = {k: v for k, v in inputs.items() if not isinstance(v, list)}
    logic.run_node("SDVGSpeculativeSampler", services, **widgets, drafter=None, target=None, positive=None, vae=None,
                   reward_prompt="x")
    assert seen["prompt_schedule"] is None and seen["advanced_options"] is None
    assert {k: seen[k] for k in widgets if k != "reward_prompt"} == {k: v for k, v in widgets.items()
                                                                      if k != "reward_prompt"}


def test_the_score_plot_marks_each_switch():
    """A purple line at the left edge of each switch's first block (between the old prompt's last block and it);
    none in a one-prompt run."""
    import numpy as np

    from sdvg_engine.score_view import BOX, SWITCH, WIDTH, draw_score_plot, score_view

    blocks = [{"index": b, "source": "draft" if b % 2 else "target",
               "decision": {"block_score": 0.1 * b, "tau": 0.0} if b % 2 else None} for b in range(7)]
    schedule = [{"first_block": 0, "first_frame": 0, "prompt": "a"},
                {"first_block": 2, "first_frame": 21, "prompt": "b"},
                {"first_block": 5, "first_frame": 57, "prompt": "c"}]
    report = {"settings": {"mode": "sdvg", "tau_mode": "fixed", "tau": 0.0, "prompt_schedule": schedule},
              "blocks": blocks}
    assert score_view(report).switches == ((2, 21), (5, 57))
    image = draw_score_plot(report)
    columns = np.nonzero((image == np.array(SWITCH, dtype=np.uint8)).all(-1).sum(0) > 100)[0]  # vertical lines
    left, right = BOX[0], BOX[1]
    expected = [round(left + b * (right - left) / 7) for b in (2, 5)]
    assert all(any(abs(c - x) <= 1 for c in columns) for x in expected) and len(columns) <= 4, (columns, expected)
    one = {**report, "settings": {**report["settings"], "prompt_schedule": schedule[:1]}}
    assert not (draw_score_plot(one) == np.array(SWITCH, dtype=np.uint8)).all(-1).any()
    assert WIDTH == image.shape[1]


def test_the_shipped_workflow_switches_its_prompt(services):
    """workflows/sdvg_prompt_schedule.json (its API copy) in the tests' ComfyUI executor at 33 frames: the opening
    prompt from the text node, the schedule node's line at frame 21 encoded with the same CLIP, block 2 made by the
    target."""
    from comfy_executor import Executor
    from workflow_checks import node_of, sized_api_workflow

    prompt = sized_api_workflow("sdvg_prompt_schedule", W, H, FRAMES, seed=3)
    line = prompt[node_of(prompt, "SDVGPromptSchedule")]["inputs"]["text"].splitlines()[-1]
    result = Executor(services.folders, encode_text=prompt_context).queue(prompt)
    assert result.status == "success", result.error
    sampler = node_of(prompt, "SDVGSpeculativeSampler")
    report = json.loads(result.outputs[sampler][4])
    opening = prompt[node_of(prompt, "PrimitiveStringMultiline")]["inputs"]["value"]
    assert report["settings"]["prompt_schedule"] == [{"first_block": 0, "first_frame": 0, "prompt": opening},
                                                     {"first_block": 2, "first_frame": 21,
                                                      "prompt": line.split(":", 1)[1].strip()}]
    # the shipped switch settings are the engine's defaults: the router decides the switch block like any other
    assert (report["settings"]["target_after_switch"], report["settings"]["switch_routing"]) == (False, "carry")
    assert report["blocks"][2]["drafted"]
    assert "switches at frame 21" in result.ui[sampler]
