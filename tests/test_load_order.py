"""Load order and room (issue 37): ComfyUI's real ``load_models_gpu`` on real-size models and simulated cards.

The 1.3B drafter and the 14B target are ComfyUI's own ``WanModel`` at real size, built on the meta device (shapes and
dtypes, no values) and detected the way Load Diffusion Model detects a checkpoint (``model_config_from_unet``); the
pack's converted VAE and ImageReward are ``WholeModulePatcher``s of their real sizes. The card is simulated: ComfyUI's
``get_free_memory`` / ``get_total_memory`` answer for a fake device whose used bytes are the models' resident
weights (``loaded_size()``), with ComfyUI's NORMAL_VRAM state and its minimum weight ratio of NVIDIA (0) or of other
devices (0.4). Per card size, the settings of the memory plan (``plan_memory``; the sampler's default preset) give the
room the run reserves (``run_memory_components``, what ``run_memory_required`` counts).

The criteria: the drafter stays fully resident whenever the plan keeps it resident (every card but 16 GB), the VAE
and the reward are loaded whole, the free memory after the load never falls below the room the run allocates, and
the result does not depend on the order ComfyUI iterates a call's models (a ``set`` in 0.3.64 and the LTS fork: every
order is tried; 0.33.0 iterates the list reversed).

Needs a ComfyUI checkout and its Python (skipped otherwise)::

    COMFYUI_PATH=.e2e/ComfyUI .e2e/venv/bin/python -m pytest -q -p no:xdist tests/test_load_order.py

``COMFYUI_PATH=... python tests/test_load_order.py`` prints the before/after table for that ComfyUI
(docs/dev/memory.md, "Load order").
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script too (python tests/test_load_order.py)
from comfyui_in_process import comfyui_or_skip  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMFYUI_PATH, mm = comfyui_or_skip(__file__)  # --cpu

import comfy.model_detection  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
from comfy.ldm.wan.model import WanModel  # noqa: E402

from nodes import comfy_nodes, logic  # noqa: E402
from node_fixtures import DRAFTER_FILE, REWARD_FILE, TARGET_FILE, FakeComfyVAE, write_tiny_models  # noqa: E402
from sdvg_engine.comfy_bridge import ModuleHolder  # noqa: E402
from sdvg_engine.models.causal_wan import wan_config  # noqa: E402
from sdvg_engine.offload import IMAGE_REWARD_PARAMS, WAN_VAE_PARAMS, plan_memory, run_memory_components  # noqa: E402
from wan_fixtures import text_context  # noqa: E402

GiB = 2**30
META = torch.device("meta")
CARDS = (16, 24, 48, 80)
#: ComfyUI's MIN_WEIGHT_MEMORY_RATIO: 0 on NVIDIA, 0.4 on every other device
KINDS = {"NVIDIA": 0.0, "ratio 0.4": 0.4}
#: what run_sampler hands ComfyServices.load_run (checked by the first test): load priority, first = most important
ROLES = ("vae", "reward", "drafter", "target")
#: the order run_sampler used before issue 37 (one load_models_gpu call), for the table's "before" rows
OLD_ROLES = ("drafter", "target", "vae", "reward")
DRAFTER, TARGET = "Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B"
_LOAD_SOURCE = inspect.getsource(getattr(mm, "_load_models_gpu", mm.load_models_gpu))
#: 0.3.64 and the LTS fork put a call's models in a set (the order changes from start to start); 0.33.0 keeps the
#: list's order, reversed
SET_ORDER = "models_temp = set()" in _LOAD_SOURCE


# ============================================================================================== the patcher order
class _Stop(Exception):
    pass


def test_run_sampler_hands_load_run_the_models_in_load_priority(tmp_path):
    """The VAE and the reward (loaded whole) first, then the drafter, then the target: the one that gets what is
    left. A run without the reward (no scored drafts) or without one DiT keeps the same order."""
    write_tiny_models(tmp_path)
    svc = logic.Services({name: [str(tmp_path / name)] for name in ("diffusion_models", "sdvg_reward")})
    drafter = logic.load_model_node(DRAFTER_FILE, "fp32", "cpu", "auto", role="drafter", services=svc)
    target = logic.load_model_node(TARGET_FILE, "fp32", "cpu", "auto", role="target", services=svc)
    router = logic.build_router(REWARD_FILE, -0.25, "min", "center", 0.0, services=svc)
    vae = FakeComfyVAE()
    vae_patcher = logic.streaming_vae(vae, svc)[1]  # the conversion (and its patcher) is cached per VAE
    handed = []

    class Recording(logic.Services):
        def load_run(self, patchers, memory_required=0):
            handed.append(list(patchers))
            raise _Stop  # the order is all this test needs: no generation

    for mode in ("sdvg", "first_block_only", "target_only", "draft_only"):
        with pytest.raises(_Stop):
            logic.run_sampler(drafter=drafter, target=target, router=router, positive=[[text_context(), {}]], vae=vae,
                              reward_prompt="a prompt", width=48, height=32, length=9, mode=mode,
                              services=Recording(svc.folders))
    assert vae_patcher is not None
    assert handed == [[vae_patcher, router.patcher, drafter.patcher, target.patcher],
                      [vae_patcher, drafter.patcher, target.patcher],
                      [vae_patcher, target.patcher],
                      [vae_patcher, drafter.patcher]]


# ============================================================================================ real-size models
def comfy_wan(name: str, weight_dtype: torch.dtype):
    """ComfyUI's MODEL of the real-size Wan2.1 ``name`` on the meta device: the state dict of a meta ``WanModel``
    detected by ComfyUI (as Load Diffusion Model does), stored in ``weight_dtype`` (fp8: computed in bf16)."""
    cfg = wan_config(name)
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    layout = WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=dim, ffn_dim=cfg["ffn_dim"],
                      freq_dim=256, text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=cfg["num_layers"],
                      device=META, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    sd = layout.state_dict()
    config = comfy.model_detection.model_config_from_unet(sd, "")
    config.set_inference_dtype(weight_dtype, None if weight_dtype == torch.bfloat16 else torch.bfloat16)
    model = config.get_model(sd, "", device=META)
    assert type(model.diffusion_model).__name__ == "WanModel" and len(model.diffusion_model.blocks) == cfg["num_layers"]
    return comfy.model_patcher.ModelPatcher(model, load_device=META, offload_device=META)


def whole(params: int, dtype: torch.dtype):
    """The pack's own model of ``params`` parameters as the sampler wraps it (``WholeModulePatcher``: loaded whole)."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.empty(params, dtype=dtype, device=META), requires_grad=False)
    return comfy_nodes.ComfyServices().wrap(ModuleHolder(module, device=META), META, META)


def text_encoder():
    """A 6.3 GiB fp8 stand-in for UMT5-XXL: ComfyUI ops ComfyUI can load partly, loaded before the sampler runs."""
    layers = torch.nn.ModuleList(comfy.ops.disable_weight_init.Linear(4096, 68608, bias=False, device=META,
                                                                        dtype=torch.float8_e4m3fn) for _ in range(24))
    return comfy.model_patcher.ModelPatcher(ModuleHolder(layers, device=META), load_device=META, offload_device=META)


@functools.lru_cache(maxsize=None)
def card_case(card: int) -> tuple:
    """``(plan, models, room)`` for a ``card`` GB card: the plan's settings (target fp8 unless 80 GB, KV dtype, VAE
    dtype; the sampler's default preset ``reference``: both DiTs on the 6-frame recompute window) and the room the
    run asks ComfyUI for at 832x480. Built once per card; :func:`simulate` unloads them before each use."""
    plan = plan_memory(card)
    vae_dtype = torch.float32 if plan.vae_dtype == "fp32" else torch.bfloat16
    models = {"drafter": comfy_wan(DRAFTER, torch.bfloat16),
              "target": comfy_wan(TARGET, torch.float8_e4m3fn if plan.fp8_target else torch.bfloat16),
              "vae": whole(WAN_VAE_PARAMS, vae_dtype), "reward": whole(IMAGE_REWARD_PARAMS, torch.float16)}
    terms = run_memory_components([(role, wan_config(name), 6, plan.kv_dtype, 2)
                                   for role, name in (("drafter", DRAFTER), ("target", TARGET))],
                                  width=832, height=480, vae_dtype=plan.vae_dtype)
    return plan, models, int(sum(terms.values()))


@pytest.fixture(scope="module", autouse=True)
def _drop_models_at_the_end():
    yield
    card_case.cache_clear()  # ModelPatcher.__del__ at interpreter exit would meet ComfyUI half torn down
    gc.collect()


# ============================================================================================= the simulated card
class FakeCard:
    """``get_free_memory`` / ``get_total_memory`` of one device whose used bytes are the resident weights of
    ``patchers``; records each model's lowest residency while ``watch`` is on."""

    def __init__(self, total: int, patchers: dict):
        self.total, self.patchers, self.lowest = total, patchers, {}

    def used(self) -> int:
        return sum(p.loaded_size() for p in self.patchers.values())

    def free(self, dev=None, torch_free_too=False):
        if dev is not None and torch.device(dev).type == "cpu":
            free = 512 * GiB
        else:
            free = self.total - self.used()
            for name, p in self.patchers.items():
                if name in self.lowest:
                    self.lowest[name] = min(self.lowest[name], p.loaded_size())
        return (free, 0) if torch_free_too else free

    def total_memory(self, dev=None, torch_total_too=False):
        return (self.total, self.total) if torch_total_too else self.total


def ordered_set(rank: dict):
    """A ``set`` for ``load_models_gpu`` that iterates its models in the order ``rank`` (patcher id -> position)
    gives: one of the orders a real set may take."""

    class OrderedSet(dict):
        def __init__(self, items=()):
            super().__init__((x, None) for x in items)

        def add(self, item):
            self[item] = None

        def __iter__(self):
            return iter(sorted(dict.__iter__(self), key=lambda x: rank.get(id(x), len(rank))))

    return OrderedSet


def simulate(monkeypatch, card: int, ratio: float, load, order=None, runs: int = 2) -> list:
    """Load one run's models on a simulated ``card`` GB device after a text encoder, ``runs`` times (the second run
    finds the first one's models loaded). ``load(models, room)`` does the loading; ``order``: the roles in the order
    a set iterates them (0.3.64 / LTS). Returns per run: resident bytes per model, free bytes, room, and the lowest
    residency of the models during that run."""
    plan, models, room = card_case(card)
    for p in models.values():  # unloaded, as a fresh start finds them
        p.detach(unpatch_all=True)
        assert p.loaded_size() == 0
    te = text_encoder()
    fake = FakeCard(card * GiB, {**models, "text encoder": te})
    monkeypatch.setattr(mm, "current_loaded_models", [])
    monkeypatch.setattr(mm, "get_free_memory", fake.free)
    monkeypatch.setattr(mm, "get_total_memory", fake.total_memory)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    monkeypatch.setattr(mm, "lowvram_available", True)
    monkeypatch.setattr(mm, "MIN_WEIGHT_MEMORY_RATIO", ratio)
    monkeypatch.setattr(mm, "DISABLE_SMART_MEMORY", False)
    if hasattr(mm, "get_free_ram"):  # the LTS fork also frees RAM for the models it loads
        monkeypatch.setattr(mm, "get_free_ram", lambda: 512 * GiB)
    if SET_ORDER and order is not None:
        monkeypatch.setattr(mm, "set", ordered_set({id(models[r]): i for i, r in enumerate(order)}), raising=False)
    # 0.33.0 gives a ComfyUI op's meta weight zeros on the default device as it loads it: on the meta device here
    with META:
        mm.load_models_gpu([te])  # CLIPTextEncode ran before the sampler
    out = []
    for _ in range(runs):
        fake.lowest = {name: p.loaded_size() for name, p in models.items()}
        with META:
            load(models, room)
        loaded = [m.model for m in mm.current_loaded_models]
        out.append(dict(plan=plan, room=room, free=fake.free(), lowest=dict(fake.lowest),
                        resident={k: p.loaded_size() for k, p in models.items()},
                        size={k: p.model_size() for k, p in models.items()},
                        listed={k: any(m is p for m in loaded) for k, p in models.items()}))
    return out


def load_now(models, room):
    """Today's product: ComfyServices.load_run with the models in run_sampler's order."""
    comfy_nodes.ComfyServices().load_run([models[r] for r in ROLES], memory_required=room)


def load_before(models, room):
    """The product before issue 37: one load_models_gpu call with every model (run_sampler's old order)."""
    mm.load_models_gpu([models[r] for r in OLD_ROLES], memory_required=room, force_full_load=False)


def orders():
    return list(itertools.permutations(ROLES)) if SET_ORDER else [None]


# ================================================================================================== the criteria
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("card", CARDS)
def test_drafter_vae_and_reward_first_the_target_gets_what_is_left(monkeypatch, card, kind):
    results = set()
    for order in orders():
        with monkeypatch.context() as m:
            first, second = simulate(m, card, KINDS[kind], load_now, order)
        for run in (first, second):
            where = f"{card} GB {kind}, set order {order}, {'first' if run is first else 'second'} run"
            size, resident = run["size"], run["resident"]
            assert run["free"] >= run["room"], f"{where}: {run['free'] / GiB:.2f} GiB free < {run['room'] / GiB:.2f}"
            assert resident["vae"] == size["vae"] and resident["reward"] == size["reward"], where
            assert all(run["listed"].values()), f"{where}: not all in ComfyUI's loaded models: {run['listed']}"
            assert resident["target"] > 0, where
            if run["plan"].offload != "both":  # the plan keeps the drafter resident: so must ComfyUI
                assert resident["drafter"] == size["drafter"], \
                    f"{where}: drafter {resident['drafter'] / GiB:.2f} of {size['drafter'] / GiB:.2f} GiB"
        # The second run finds the first one's models loaded and ends where the first one did. Where the target fits
        # whole (48 and 80 GB) nothing moves; where it does not, ComfyUI's first step of loading it asks for 1.1 x its
        # offloaded part beside the room, more than the card has without the others: it unloads them, and the run's
        # next calls load them again (one call for the whole run did the same).
        assert second["resident"] == first["resident"], f"{card} GB {kind} {order}"
        if first["resident"]["target"] == first["size"]["target"]:
            assert second["lowest"] == first["size"], f"{card} GB {kind} {order}: a model was unloaded"
        results.add(tuple(tuple(sorted(run["resident"].items())) for run in (first, second)))
    assert len(results) == 1, f"{card} GB {kind}: the result depends on the set order: {results}"


# ======================================================================================================= the table
def _row(results) -> str:
    """Table cells for one or more (set-order) results: drafter, target, free vs room (worst case first)."""
    runs = [r[0] for r in results]
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    drafter = sorted({g(r["resident"]["drafter"]) for r in runs}, key=float)
    target = sorted({g(r["resident"]["target"]) for r in runs}, key=float)
    margin = [r["free"] - r["room"] for r in runs]
    size = runs[0]["size"]
    short = sum(m < 0 for m in margin)
    partial = sum(r["resident"]["drafter"] < size["drafter"] for r in runs)
    span = lambda v: v[0] if len(v) == 1 else f"{v[0]}–{v[-1]}"  # noqa: E731
    orders_note = f" ({partial}/{len(runs)} orders partial)" if len(runs) > 1 and partial else ""
    room_note = f" ({short}/{len(runs)} orders short)" if len(runs) > 1 and short else ""
    return (f"{span(drafter)} of {g(size['drafter'])}{orders_note} | {span(target)} of {g(size['target'])} | "
            f"{g(min(r['free'] for r in runs))} vs {g(runs[0]['room'])} (worst {min(margin) / GiB:+.2f}){room_note}")


def print_table() -> None:
    version = "unknown"
    for module in ("comfyui_version", "comfy"):  # upstream: comfyui_version.py; the LTS fork: comfy.__version__
        try:
            version = getattr(__import__(module), "__version__", None) or version
        except ImportError:
            continue
        if version != "unknown":
            break
    print(f"ComfyUI {version} ({'set order: all 24 orders' if SET_ORDER else 'list order, reversed'})")
    print("| card | device | code | drafter resident GiB | target resident GiB | free GiB vs room GiB |")
    print("|---|---|---|---|---|---|")

    class Patch:  # a monkeypatch for use outside pytest
        def __enter__(self):
            self.mp = pytest.MonkeyPatch()
            return self.mp

        def __exit__(self, *exc):
            self.mp.undo()

    for card in CARDS:
        for kind, ratio in KINDS.items():
            for label, load, which in (("before", load_before, OLD_ROLES), ("after", load_now, ROLES)):
                results = []
                for order in orders():
                    with Patch() as mp:
                        results.append(simulate(mp, card, ratio, load, order, runs=1))
                print(f"| {card} GB | {kind} | {label} | {_row(results)} |")


if __name__ == "__main__":
    print_table()
