"""Every mode gives bit for bit the outputs it gave before the engine loop was restructured (issue 30).

``tests/data/golden_outputs.json`` holds, per case, sha256 digests of the frames, latents and acceptance mask and the
decisions of a run made by the code before the restructuring (``b824488``/``36a6c62``), on both presets and every
mode, with 1 and 2 workers (which must agree with each other too). Tiny real-architecture models, 45 frames (4 blocks).

Regenerate (only when an output change is intended, and say why in the commit):
``.venv/bin/python tests/test_bit_identical.py --capture``.

The digests are bytes of float computations: another torch version (or another CPU's kernels) may legitimately
round differently, so a torch version other than the recorded one skips the comparison instead of failing. CPUs:
the first recording (``cases``, 2026-12-04) did not note its CPU; ``machines`` holds the recordings of other CPUs by
:func:`machine`, made from a commit that still passed on the first one. A run compares with its own CPU's recording
where there is one, else it must equal one of the recordings. A new kind of CPU is added with
``.venv/bin/python tests/test_bit_identical.py --capture-machine`` (the recorded thresholds are kept).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from sdvg_engine.context import GlobalCache, RecomputeWindow  # noqa: E402
from sdvg_engine.generator import CausalGenerator  # noqa: E402
from sdvg_engine.memo import ReplayMemo  # noqa: E402
from sdvg_engine.pipeline import SDVGOptions, SpeculativePipeline  # noqa: E402
from sdvg_engine.router import RewardRouter  # noqa: E402
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "golden_outputs.json"
PROMPT = "a red ball rolling on grass"
FRAMES, SEED = 45, 7
PRESETS = ("reference", "native")

# What each preset runs (sdvg_engine/presets.py), with the tiny models: "reference" = both models on the recompute
# window with the 5-call krea list; "native" = each model as its checkpoint says: the Self-Forcing drafter on its
# global cache with 4 calls, the Krea target on the recompute window with 5 calls.
def build(preset: str, tau: float, tau_mode: str = "fixed") -> SpeculativePipeline:
    parts = shared_parts()
    if preset == "reference":
        drafter = CausalGenerator(parts["drafter"], schedule="krea", context=RecomputeWindow(3))
    else:
        drafter = CausalGenerator(parts["drafter"], schedule="self_forcing", context=GlobalCache(21))
    target = CausalGenerator(parts["target"], schedule="krea", context=RecomputeWindow(3))
    pipe = SpeculativePipeline(drafter, target, parts["vae"], RewardRouter(parts["scorer"], tau=tau, tau_mode=tau_mode))
    pipe.preset = preset
    return pipe


# case id -> (SDVGOptions fields, tau mode of the router). "replay": an sdvg run at another tau first, with a memo,
# then the case's run (replays the shared prefix).
CASES = {
    "sdvg": ({}, "fixed"),
    "sdvg_relative": ({}, "relative"),
    "target_only": ({"mode": "target_only"}, "fixed"),
    "draft_only": ({"mode": "draft_only"}, "fixed"),
    "first_block_only": ({"mode": "first_block_only"}, "fixed"),
    "random": ({"mode": "random", "random_accept_prob": 0.5}, "fixed"),
    "schedule": ({"mode": "schedule", "schedule_every": 2}, "fixed"),
    "schedule_veto": ({"mode": "schedule", "schedule_every": 2, "schedule_veto": True}, "fixed"),
    "hybrid": ({"refine_from_step": 2}, "fixed"),
    "cascade": ({"cascade": True, "cascade_frames": 2, "cascade_margin": 0.5}, "fixed"),
    "replay": ({}, "fixed"),
    "replay_relative": ({}, "relative"),
}


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def _num(x):
    return None if x is None else (float(x).hex() if math.isfinite(x) else str(x))


def digest(result) -> dict:
    decisions = []
    for r in result.blocks:
        d = r.decision
        decisions.append([r.source, r.drafted] + ([] if d is None else [
            bool(d.accept), _num(d.block_score), [_num(s) for s in d.frame_scores], int(d.frames_scored),
            _num(d.reference_score)]))
    return {"frames": _sha(result.frames), "latents": _sha(result.latents), "mask": _sha(result.acceptance_mask),
            "shapes": [list(result.frames.shape), list(result.latents.shape)], "decisions": decisions}


def generate(pipe, workers, scheduled=False, **options):
    """The case's run; ``scheduled``: the same prompt as a one-entry prompt schedule (issue 39: bit-identical)."""
    prompts = {"prompt_schedule": [(0, prompt_embeds(1), PROMPT)]} if scheduled else {
        "prompt_embeds": prompt_embeds(1), "prompt": PROMPT}
    return pipe.generate(**prompts, num_frames=FRAMES, width=WIDTH, height=HEIGHT, seed=SEED,
                         options=SDVGOptions(**options), workers=workers)


def run_case(case: str, preset: str, workers: int, taus: dict, scheduled: bool = False) -> dict:
    options, tau_mode = CASES[case]
    tau = taus[f"{preset}/{tau_mode}"]
    pipe = build(preset, tau, tau_mode)
    if case.startswith("replay"):
        pipe.memo = ReplayMemo()
        pipe.router.tau = taus[f"{preset}/{tau_mode}/replay_first"]
        generate(pipe, workers, scheduled, **options)
        pipe.router.tau = tau
        result = generate(pipe, workers, scheduled, **options)
        out = digest(result)
        out["replayed_blocks"] = result.report["replay"]["replayed_blocks"]
        return out
    return digest(generate(pipe, workers, scheduled, **options))


def _split_taus() -> dict:
    """Thresholds that split each preset's drafts into accepts and rejects (measured once, at capture): the midpoint
    of the two lowest compared values, and for the replay cases a first tau that changes the last decision only."""
    taus = {}
    for preset in PRESETS:
        for mode in ("fixed", "relative"):
            result = generate(build(preset, -math.inf, mode), 1)
            values = sorted(d.block_score - (d.reference_score or 0.0) for d in (r.decision for r in result.blocks)
                            if d is not None)
            taus[f"{preset}/{mode}"] = (values[0] + values[1]) / 2
            taus[f"{preset}/{mode}/replay_first"] = (values[1] + values[2]) / 2
    return taus


def _record(taus: dict) -> dict:
    """Every case's outputs with 1 worker, refused unless 2 workers give the same."""
    torch.set_num_threads(1)
    cases = {}
    for preset in PRESETS:
        for case in CASES:
            one = run_case(case, preset, 1, taus)
            if one != run_case(case, preset, 2, taus):
                raise SystemExit(f"{preset}/{case}: 1 and 2 workers differ; fix that first")
            cases[f"{preset}/{case}"] = one
    return cases


def capture() -> None:
    torch.set_num_threads(1)  # before the thresholds are measured too
    taus = _split_taus()
    cases = _record(taus)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "frames": FRAMES, "seed": SEED, "prompt": PROMPT,
                                  "taus": taus, "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {GOLDEN}")


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def machine() -> str:
    """The CPU features that pick PyTorch's CPU kernels: ATen's capability level and the matrix / low-precision
    extensions oneDNN and MKL dispatch on."""
    flags = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        pass
    extras = sorted(flags & {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx512_bf16", "avx512_vnni",
                             "avx_vnni"})
    return "+".join([torch.backends.cpu.get_cpu_capability(), *extras])


def capture_machine() -> None:
    """Add this CPU's outputs under ``machines``, with the recorded thresholds (the decisions must stay the same)."""
    golden = _golden()
    cases = _record(golden["taus"])
    for key, out in cases.items():
        if [d[:3] for d in out["decisions"]] != [d[:3] for d in golden["cases"][key]["decisions"]]:
            raise SystemExit(f"{key}: other decisions than the first recording's on this CPU")
    golden.setdefault("machines", {})[machine()] = {"torch": torch.__version__, "cases": cases}
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {len(cases)} cases for {machine()} to {GOLDEN}")


# Every case on both presets with the prompt given as before, and as a one-entry prompt schedule (which must change
# nothing) on the native preset, whose drafter holds the global cache (the scheme a schedule's switch re-caches).
RUNS = [pytest.param(case, preset, False, id=f"{case}-{preset}") for case in CASES for preset in PRESETS] + [
    pytest.param(case, "native", True, id=f"{case}-native-one_entry_schedule") for case in CASES]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case,preset,scheduled", RUNS)
def test_outputs_equal_the_recorded_ones(case, preset, scheduled, workers):
    golden = _golden()
    if golden["torch"] != torch.__version__:
        pytest.skip(f"golden outputs were recorded with torch {golden['torch']}, this is {torch.__version__}: "
                    "float results may round differently (recapture with --capture on a known-good commit)")
    key = f"{preset}/{case}"
    own = golden.get("machines", {}).get(machine())
    recordings = [own["cases"]] if own else [golden["cases"], *(m["cases"] for m in golden.get("machines", {}).values())]
    got = run_case(case, preset, workers, golden["taus"], scheduled)
    expected = next((r[key] for r in recordings if r[key] == got), recordings[0][key])
    if got != expected:
        wrong = [k for k in expected if got.get(k) != expected[k]]
        pytest.fail(f"{preset}/{case} with {workers} worker(s): {', '.join(wrong)} differ from the outputs recorded "
                    f"before the restructuring (tests/data/golden_outputs.json). The engine loop must give "
                    f"bit-identical outputs.\nexpected decisions {expected['decisions']}\n"
                    f"got      decisions {got['decisions']}")


def test_the_golden_cases_exercise_what_they_name():
    """The recorded runs really mix accepts and rejects, replay a prefix, and differ between the presets."""
    cases = _golden()["cases"]
    for preset in PRESETS:
        for case in ("sdvg", "sdvg_relative", "schedule_veto", "hybrid"):
            sources = [d[0] for d in cases[f"{preset}/{case}"]["decisions"] if d[1]]
            assert "draft" in sources and "target" in sources, (preset, case, sources)
        assert 0 < cases[f"{preset}/replay"]["replayed_blocks"] < 4
        assert 0 < cases[f"{preset}/replay_relative"]["replayed_blocks"] < 4
    assert cases["reference/sdvg"]["frames"] != cases["native/sdvg"]["frames"]


if __name__ == "__main__" and "--capture-machine" in sys.argv:
    capture_machine()
elif __name__ == "__main__" and "--capture" in sys.argv:
    capture()
