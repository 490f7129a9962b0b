"""The score plot tells the truth in every tau mode: read back from the image.

In each mode a rejected draft's red cross lies on the rejecting side of its own threshold segment and a kept draft's
green dot on the keeping side (above the blue line for the reward routers, below it for random's ``u < p``). The
reports are built from the router's own ``RouteDecision.to_dict`` with scores chosen so that the raw block score and
the compared quantity disagree (a high score with a negative margin, a per-block quantile above a kept score ...):
the plot of raw scores against ``settings.tau`` put those markers on the wrong side.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sdvg_engine.router import RewardRouter, RouteDecision
from sdvg_engine.score_view import BAND, BOX, KEPT, NOT_SCORED, REJECTED, THRESHOLD, draw_score_plot, score_view
from sdvg_fixtures import HEIGHT, WIDTH, prompt_embeds, shared_parts, tiny_pipeline


def decision(accept, score, *, tau=None, reference=None, mode="fixed", p=None) -> dict:
    return RouteDecision(accept=accept, block_score=score, frame_scores=[score], reward_score=score,
                         temporal_score=None, frames_scored=1, tau=tau, reference_score=reference,
                         tau_mode=mode, accept_prob=p).to_dict()


def report(settings: dict, decisions: list[dict | None], free=None) -> dict:
    blocks = [{"index": i, "source": "draft" if d is not None and d["accept"] else "target", "decision": d}
              for i, d in enumerate(decisions)]
    rep = {"settings": settings, "blocks": blocks,
           "acceptance": {"accepted_blocks": sum(b["source"] == "draft" for b in blocks),
                          "drafted_blocks": sum(d is not None for d in decisions)}}
    if free is not None:
        rep["free_tau_interval"] = free
    return rep


def margin_report(mode):
    # block 1: a high score (1.5) under a higher reference (2.0): margin -0.5 < -0.25, rejected;
    # block 2: a low score (-1.0) over a lower reference (-1.2): margin 0.2, kept.
    return report({"mode": "sdvg", "tau": -0.25, "tau_mode": mode},
                  [None, decision(False, 1.5, tau=-0.25, reference=2.0, mode=mode),
                   decision(True, -1.0, tau=-0.25, reference=-1.2, mode=mode)],
                  free={"above": -0.5, "up_to": 0.2})


CASES = {
    "fixed": report({"mode": "sdvg", "tau": -0.7, "tau_mode": "fixed"},
                    [None, decision(False, -1.5, tau=-0.7), decision(True, -0.2, tau=-0.7)],
                    free={"above": -1.5, "up_to": -0.2}),
    "relative": margin_report("relative"),
    "anchor": margin_report("anchor"),
    "baseline": margin_report("baseline"),
    # accept_rate: each block its own running quantile; settings.tau (unused in this mode) sits far below.
    "accept_rate": report({"mode": "sdvg", "tau": -3.0, "tau_mode": "accept_rate"},
                          [None, decision(False, 0.5, tau=0.9, mode="accept_rate"),
                           decision(True, 0.0, tau=-0.5, mode="accept_rate"),
                           decision(True, 0.35, tau=0.3, mode="accept_rate")]),
    # random: keep when u < p, so a kept draft lies BELOW the line.
    "random": report({"mode": "random", "tau": None, "random_accept_prob": 0.73},
                     [None, decision(False, 0.9, mode="random", p=0.73), decision(True, 0.2, mode="random", p=0.73)]),
}


def blobs(image: np.ndarray, colour) -> list[tuple[float, float]]:
    """Centroids (x, y) of the groups of pixels of exactly ``colour`` (one marker per block column)."""
    ys, xs = np.nonzero((image == np.array(colour, dtype=np.uint8)).all(axis=2))
    return _group(xs, ys)


def _group(xs, ys) -> list[tuple[float, float]]:
    groups: list[list[tuple[int, int]]] = []
    for x, y in sorted(zip(xs.tolist(), ys.tolist())):
        if groups and x - groups[-1][-1][0] <= 2:
            groups[-1].append((x, y))
        else:
            groups.append([(x, y)])
    return [(float(np.mean([p[0] for p in g])), float(np.mean([p[1] for p in g]))) for g in groups]


def column_of(image: np.ndarray, x: float, n_blocks: int) -> int:
    left, right, _, _ = BOX
    return int((x - left) // ((right - left) / n_blocks))


def threshold_row(image: np.ndarray, block: int, n_blocks: int) -> float:
    """The row of the blue threshold segment over ``block``'s column (read away from the marker at its centre)."""
    left, right, top, bottom = BOX
    width = (right - left) / n_blocks
    x = int(left + block * width + 0.15 * width)
    inside = image[top + 1:bottom, x]  # the plot box only: labels in the threshold's colour sit outside it
    rows = top + 1 + np.nonzero((inside == np.array(THRESHOLD, dtype=np.uint8)).all(axis=1))[0]
    assert len(rows), f"no threshold line over block {block}"
    return float(rows.mean())


def side_check(image: np.ndarray, rep: dict) -> list[tuple[int, str, float, float]]:
    """(block, kind, marker row, threshold row) for every kept and rejected marker found in the image."""
    n = len(rep["blocks"])
    found = []
    for kind, colour in (("kept", KEPT), ("rejected", REJECTED)):
        for x, y in blobs(image, colour):
            block = column_of(image, x, n)
            found.append((block, kind, y, threshold_row(image, block, n)))
    return sorted(found)


@pytest.mark.parametrize("mode", list(CASES))
def test_each_marker_is_on_its_side_of_its_threshold(mode):
    rep = CASES[mode]
    image = draw_score_plot(rep)
    assert image.shape == (360, 640, 3) and image.dtype == np.uint8
    found = side_check(image, rep)
    expected = [(b["index"], "kept" if b["source"] == "draft" else "rejected") for b in rep["blocks"] if b["decision"]]
    assert [(block, kind) for block, kind, _, _ in found] == expected
    keep_below = mode == "random"  # u < p keeps
    for block, kind, marker_y, line_y in found:
        above = marker_y < line_y - 3  # image rows grow downwards; markers are 11 px tall, the line 2 px
        below = marker_y > line_y + 3
        if kind == "kept":
            assert (below if keep_below else above), (mode, block, kind, marker_y, line_y)
        else:
            assert (above if keep_below else below), (mode, block, kind, marker_y, line_y)
    # block 0 (the target's, never drafted) is a grey square on the axis
    assert (image == np.array(NOT_SCORED, dtype=np.uint8)).all(axis=2).any()


def test_accept_rate_draws_each_blocks_own_threshold():
    rep = CASES["accept_rate"]
    image = draw_score_plot(rep)
    rows = [threshold_row(image, b, 4) for b in (1, 2, 3)]
    # thresholds 0.9, -0.5, 0.3: three different heights, in that order (higher value = smaller row)
    assert rows[0] < rows[2] < rows[1]


@pytest.mark.parametrize("mode, band", [("fixed", True), ("relative", True), ("anchor", True), ("baseline", True),
                                        ("accept_rate", False), ("random", False)])
def test_free_tau_band_where_the_report_defines_it(mode, band):
    rep = dict(CASES[mode])
    rep.setdefault("free_tau_interval", {"above": 0.1, "up_to": 0.2})  # ignored where thresholds move or are p
    image = draw_score_plot(rep)
    shaded = (image == np.array(BAND, dtype=np.uint8)).all(axis=2)
    assert shaded.any() == band
    if band:
        view = score_view(rep)
        # the band spans exactly the rows between the interval's ends, which are the rejected and kept markers here
        ys = np.nonzero(shaded.any(axis=1))[0]
        marks = {kind: y for _, kind, y, _ in side_check(image, rep)}
        assert view.band == (rep["free_tau_interval"]["above"], rep["free_tau_interval"]["up_to"])
        assert ys.min() == pytest.approx(marks["kept"], abs=7) and ys.max() == pytest.approx(marks["rejected"], abs=7)


def test_report_without_compared_entries_is_read_like_the_router():
    """Reports written before decisions carried ``compared``: the margin is derived from reference_score."""
    rep = margin_report("relative")
    for b in rep["blocks"]:
        if b["decision"]:
            del b["decision"]["compared"]
    view = score_view(rep)
    assert [(p.value, p.threshold) for p in view.points[1:]] == [(pytest.approx(-0.5), -0.25), (pytest.approx(0.2), -0.25)]
    assert view.quantity == "score - last committed block"
    assert side_check(draw_score_plot(rep), rep) == side_check(draw_score_plot(margin_report("relative")),
                                                                margin_report("relative"))


def test_edge_cases():
    assert draw_score_plot({"settings": {"mode": "target_only"}, "blocks": []}).shape == (360, 640, 3)
    nan = report({"mode": "sdvg", "tau": "inf", "tau_mode": "fixed"}, [decision(False, math.nan, tau=math.inf)])
    image = draw_score_plot(nan)  # a NaN score is drawn as not scored; an infinite tau draws no line
    assert not (image == np.array(THRESHOLD, dtype=np.uint8)).all(axis=2).any()


def test_a_real_relative_run_is_plotted_by_its_margins():
    """A real tiny pipeline in relative mode: the plot's sides follow the router's decisions."""
    from sdvg_engine.pipeline import SDVGOptions

    pipe = tiny_pipeline()
    seen = None
    for tau in (0.0, -0.02, 0.02, -0.05, 0.05):
        pipe.router = RewardRouter(shared_parts()["scorer"], tau=tau, tau_mode="relative")
        result = pipe.generate(prompt_embeds(), prompt="a red ball", num_frames=57, width=WIDTH, height=HEIGHT,
                               seed=5, options=SDVGOptions())
        seen = {b["source"] for b in result.report["blocks"][1:]}
        if seen == {"draft", "target"}:
            break
    assert seen == {"draft", "target"}, "no tau gave both a kept and a rejected draft"
    rep = result.report
    image = draw_score_plot(rep)
    found = side_check(image, rep)
    assert {kind for _, kind, _, _ in found} == {"kept", "rejected"}
    for block, kind, marker_y, line_y in found:
        assert (marker_y < line_y) == (kind == "kept"), (block, kind)
    plot = torch.from_numpy(image)
    assert plot.shape == (360, 640, 3)
