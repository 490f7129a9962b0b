"""bench/cost_model.py: analytic FLOPs against FlopCounterMode, and the schedule simulator against hand-computed times."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import cost_model as cm  # noqa: E402
from sdvg_engine.models.causal_wan import wan_config  # noqa: E402
from wan_fixtures import text_context, tiny_wan  # noqa: E402


@pytest.mark.parametrize("context_frames", [0, 3])
def test_analytic_dit_flops_equal_flop_counter_on_a_tiny_model(context_frames):
    model = tiny_wan()
    text_kv = model.encode_text(text_context(length=40))
    h, w, frames = 4, 6, 3  # 6 tokens per latent frame
    cache = model.new_kv_cache(1, h, w, context_frames + frames)
    x = torch.randn(1, 16, frames, h, w)
    # The math backend decomposes attention into bmm, which FlopCounterMode counts on the CPU.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.forward_block(x, torch.full((1, frames), 500.0), text_kv, cache, context_frames)
    tokens = frames * 6
    expected = cm.dit_flops(dict(model.config), tokens, tokens + context_frames * 6, frames, text_tokens=40)
    assert counter.get_total_flops() == expected


def test_real_size_meta_count_equals_closed_form_for_both_models():
    # 14B target, recompute window: 4680 block tokens attend to 3 context frames + the block (9360 keys).
    target = cm.dit_call_cost(cm.TARGET, 3)
    assert target.flops == cm.dit_flops(wan_config(cm.TARGET), 4680, 9360, 3)
    assert round(target.flops / 1e12, 2) == 149.74
    # 1.3B drafter, global cache at block 6: 18 cached frames + the block = 21 frames.
    drafter = cm.dit_call_cost(cm.DRAFTER, 18)
    assert drafter.flops == cm.dit_flops(wan_config(cm.DRAFTER), 4680, 21 * 1560, 3)
    # Bytes: at least the bf16 weights of the block layers, and more with a longer cache.
    assert target.bytes > 2 * 40 * (4 * 5120**2 + 2 * 5120**2 + 2 * 5120 * 13824)
    assert cm.dit_call_cost(cm.DRAFTER, 6).bytes > cm.dit_call_cost(cm.DRAFTER, 3).bytes


def test_a_prompt_switch_prices_the_text_encode_and_the_global_cache_re_cache():
    """Text K/V of one prompt: the text MLP (4096 -> D -> D) and every layer's K and V projections over 512 rows; the
    Self-Forcing drafter re-runs the commit passes of the blocks before the switch but the last one."""
    for name in (cm.TARGET, cm.DRAFTER):
        cfg = wan_config(name)
        d, layers = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["num_layers"]
        assert cm.text_encode_cost(name).flops == 2 * 512 * (4096 * d + d * d) + layers * 4 * 512 * d * d
    gpu = cm.GPUS["H200"]
    price = cm.switch_seconds(gpu, 3)
    assert price["target"]["recache_s"] == 0.0 and price["drafter"]["extra_calls"] == 2
    passes = [cm.roofline_seconds(c.flops, c.bytes, gpu, cm.EFFICIENCY["dit"])
              for c in (cm.dit_call_cost(cm.DRAFTER, 0), cm.dit_call_cost(cm.DRAFTER, 3))]
    assert price["drafter"]["recache_s"] == pytest.approx(sum(passes))
    assert cm.switch_seconds(gpu, 1)["drafter"]["recache_s"] == 0.0


def test_byte_counter_counts_inputs_and_outputs_and_fused_attention():
    with torch.device("meta"):
        x, w, b = torch.zeros(4, 8), torch.zeros(16, 8), torch.zeros(16)
        q = k = v = torch.zeros(1, 2, 10, 8)
    # addmm reads bias, input and weight (the transpose is a view) and writes a 4x16 output, all float32.
    assert cm.count_cost(lambda: torch.nn.functional.linear(x, w, b)) == cm.Cost(2 * 4 * 8 * 16, (16 + 32 + 128 + 64) * 4)
    # Attention is one fused kernel: q, k, v in, one output; the scores matrix is never materialised.
    cost = cm.count_cost(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert cost == cm.Cost(2 * 2 * (2 * 10 * 10 * 8), 4 * 160 * 4)


def test_roofline_takes_the_slower_of_compute_and_memory():
    gpu = cm.GPU("test", bf16_tflops=100.0, mem_gbps=1000.0)
    eff = cm.Efficiency(mfu=0.5, bw=0.5)
    assert cm.roofline_seconds(50e12, 1e9, gpu, eff) == pytest.approx(1.0)       # compute: 50 / (100 * 0.5)
    assert cm.roofline_seconds(1e12, 1000e9, gpu, eff) == pytest.approx(2.0)     # memory: 1000 / (1000 * 0.5)


def test_paper_acceptance_conversion():
    # 73.1% of 9 blocks with block 0 a reject = 6.58 of the 8 drafted blocks.
    assert cm.drafted_accept_prob(0.731) == pytest.approx(0.731 * 9 / 8)
    assert cm.drafted_accept_prob(0.95) == 1.0


# Hand-sized times: per block the target does 3 s of context + 5 x 4 s, the drafter 0.5 s + 4 x 1 s.
TIMES = {"draft_call": 1.0, "draft_context": 0.5, "target_call": 4.0, "target_context": 3.0, "decode": 2.0, "score": 0.5}


def opts(**kw):
    return cm.ScheduleOptions(blocks=3, **kw)


def test_overlapped_all_rejected_is_target_time_plus_hidden_verification():
    # Target: 20 (block 0) + 23 + 23, then the last block's decode (2). The drafter side per block
    # (0.5 + 4 + decode of the previous block 2 + decode 2 + score 0.5 = 9 s) hides under the target's 23 s.
    t = cm.overlapped_time(TIMES, [False, False, False], opts())
    assert t == 68.0
    assert cm.target_only_time(TIMES, opts(), workers=2) == 68.0
    res = cm.simulate_schedule(TIMES, 0.0, "overlapped", opts=opts(), sequences=5)
    assert res["seconds"] == 68.0 and res["speedup"] == 1.0


def test_overlapped_all_accepted_is_drafter_bound():
    # 20 (target block 0) + 2 (its decode) + 2 x (0.5 + 4 + 2 + 0.5) on GPU1.
    t, info = cm.overlapped_time(TIMES, [False, True, True], opts(), detail=True)
    assert t == 36.0
    # The target regenerates each block speculatively and stops at the call boundary after the decision:
    # block 1 runs 20..31 (decision at 29, call 27..31 finishes), block 2 runs 31..38 (decision at 36).
    assert info["dropped"] == 18.0
    # Busy seconds count until the video is done (36): GPU0 never idles, GPU1 idles while block 0 is generated.
    assert info["busy"] == {"gpu0": 36.0, "gpu1": 36.0 - 20.0}


def test_overlapped_hybrid_waits_for_the_drafters_state():
    # Block 1 rejected: the target's context runs 20..23, its 2 hybrid calls wait for the drafter's state after
    # 0.5 + 3 steps (23.5) and end at 31.5, after the decision (29). Block 2 (accepted) is drafted 31.5..36 on the
    # shared GPU1, then the target's block 1 is decoded 36..38, the draft 38..40 and scored by 40.5.
    assert cm.overlapped_time(TIMES, [False, False, True], opts(hybrid_k=3)) == 40.5


def test_overlapped_speculative_draft_on_its_own_worker():
    place = {"target": "gpu0", "draft": "gpu1", "decode": "gpu2", "score": "gpu2"}
    # All accepted: the drafter runs ahead (draft 1 at 20..24.5, draft 2 at 24.5..29); the VAE/reward worker
    # decodes block 0 at 20..22, draft 1 at 24.5..26.5 (scored by 27), draft 2 at 29..31, scored by 31.5.
    assert cm.overlapped_time(TIMES, [False, True, True], opts(placement=place)) == 31.5
    # Block 1 rejected at 27: the speculative draft of block 2 (context 24.5..25, calls 25..26, 26..27) is dropped
    # (2.5 s); block 2 is accepted at 50, so the target's speculative work on it (43..50, 7 s) is dropped too.
    _, info = cm.overlapped_time(TIMES, [False, False, True], opts(placement=place), detail=True)
    assert info["dropped"] == pytest.approx(2.5 + 7.0)


def test_sequential_schedules_by_hand():
    # This project's: block 0 = 20 + 2; block 1 accepted = 0.5 + 4 + 2 + 0.5; block 2 rejected adds 3 + 20 + 2.
    assert cm.sequential_time(TIMES, [False, True, False], opts()) == 61.0
    # Hybrid k=3: the rejected block costs 3 + 2 x 4 + 2 instead.
    assert cm.sequential_time(TIMES, [False, True, False], opts(hybrid_k=3)) == 49.0
    # The reference: drafts block 0 too (5 + 2 + 0.5), both contexts rebuilt every block (3 + 0.5).
    ref = opts(draft_steps=5)
    assert cm.sequential_time(TIMES, [False, True, False], ref, reference=True) == 29.5 + 11.0 + 33.0
    assert cm.target_only_time(TIMES, ref) == 22.0 + 25.0 + 25.0
    # Decided before drafting (schedule, random): block 0 = 22; the kept draft 0.5 + 4 + 2 (no score); the target
    # block 3 + 20 + 2 (no draft, no draft decode, no score).
    assert cm.sequential_time(TIMES, [False, True, False], opts(verify=False)) == 22.0 + 6.5 + 25.0


def test_simulated_expectation_matches_the_closed_form_for_sequential():
    p, n = 0.8, 4000
    res = cm.simulate_schedule(TIMES, p, "sequential", opts=opts(), sequences=n, seed=1)
    expected = 22.0 + 2 * (7.0 + (1 - p) * 25.0)
    assert res["seconds"] == pytest.approx(expected, rel=0.01)
    assert res["target_only_seconds"] == 72.0


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"missing \['score'\]"):
        cm.simulate_schedule({k: v for k, v in TIMES.items() if k != "score"}, 0.5, "sequential", opts=opts())
    with pytest.raises(ValueError, match="target needs its own worker"):
        cm.overlapped_time(TIMES, [False] * 3, opts(placement={"target": "gpu0", "draft": "gpu0", "decode": "gpu1", "score": "gpu1"}))
    with pytest.raises(ValueError, match="unknown schedule 'fast'"):
        cm.simulate_schedule(TIMES, 0.5, "fast", opts=opts())
    with pytest.raises(ValueError, match="accept_rate must be in"):
        cm.simulate_schedule(TIMES, 1.2, "sequential", opts=opts())
    with pytest.raises(ValueError, match=r"times\['decode'\] has 2 entries"):
        cm.simulate_schedule({**TIMES, "decode": [1.0, 1.0]}, 0.5, "sequential", opts=opts())


def test_cli_json(capsys):
    result = cm.main(["--json", "--gpus", "H200", "--sequences", "20"])
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == set(result) >= {"components", "projection", "calibration"}
    rows = printed["projection"]["H200"]["rows"]
    assert [r["label"] for r in rows][:3] == ["(a) reference", "(b) sequential, drafter global cache",
                                              "(b) sequential, drafter recompute window"]
    assert all(len(r["results"]) == 4 and r["results"][0]["speedup"] > 1.0 for r in rows)
    paper = printed["calibration"]["derived"]["target-only video s"][1]
    assert paper == 97.0


def test_cli_projects_given_times(tmp_path, capsys):
    path = tmp_path / "times.json"
    path.write_text(json.dumps(TIMES))
    result = cm.main(["--times", str(path), "--blocks", "3", "--rates", "0", "1", "--rates-per-drafted",
                      "--sequences", "5", "--json"])
    assert json.loads(capsys.readouterr().out)["rows"] == result["rows"]
    speedups = {r["label"]: [x["speedup"] for x in r["results"]] for r in result["rows"]}
    # Hand values from the tests above: overlapped 68 / 68 s and 68 / 36 s; sequential: target-only 72 s against
    # all rejected 22 + 2 x (7 + 25) = 86 s and all accepted 22 + 2 x 7 = 36 s.
    assert speedups["(c) overlapped 2 workers"] == [1.0, 68.0 / 36.0]
    assert speedups["(b) sequential"] == [72.0 / 86.0, 2.0]
    path.write_text(json.dumps({"draft_call": 1.0}))
    with pytest.raises(SystemExit, match=r"times.json: times is missing \['draft_context', 'target_call'"):
        cm.main(["--times", str(path), "--blocks", "3"])
