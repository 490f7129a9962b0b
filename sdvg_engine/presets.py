"""Named configurations of the two models: which context scheme and which schedule each one runs.

* ``reference`` (the default of the CLI, :func:`sdvg_engine.load_pipeline` and the nodes): the configuration
  of the SDVG reference code (``yuezhouhu/spec-video-gen``, ``configs/self_forcing_server_14b.yaml``): **both**
  models on Krea's recompute window (before every block the cache is rebuilt at t=0 from [re-encoded anchor
  frame, last 2 latent frames]) and **both** on the 5-call list [1000, 937.5, 833.33, 625, 0]. This is what the
  paper's acceptance rates and speedups were measured with, and it has no length limit (105 frames and beyond).
* ``native``: each model as its weights were distilled: the Self-Forcing drafter on its growing global cache
  with 4 calls, the Krea 14B target on the recompute window with 5 calls (what the checkpoint says).

Explicit per-model settings (``context_scheme=``, ``schedule=`` other than ``"auto"``) always win over the preset;
:attr:`CausalGenerator.settings_source` records where each setting came from, and the report prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKPOINT = "checkpoint"  # "take what the checkpoint was trained with"
PRESETS = ("reference", "native")
DEFAULT_PRESET = "reference"
ROLES = ("drafter", "target")


@dataclass(frozen=True)
class ModelRecipe:
    """How one model runs under a preset; :data:`CHECKPOINT` means the checkpoint's own choice."""

    context_scheme: str
    schedule: str


_RECIPES = {
    "reference": {"drafter": ModelRecipe("recompute_window", "krea"), "target": ModelRecipe("recompute_window", "krea")},
    "native": {"drafter": ModelRecipe(CHECKPOINT, CHECKPOINT), "target": ModelRecipe(CHECKPOINT, CHECKPOINT)},
}


def check_preset(preset: str) -> str:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r} "
                         "('reference' = the paper's configuration, 'native' = each model as distilled)")
    return preset


def recipe(preset: str, role: str) -> ModelRecipe:
    """The recipe of ``role`` (``drafter`` / ``target``) under ``preset``."""
    check_preset(preset)
    if role not in ROLES:
        raise ValueError(f"a preset configures a 'drafter' or a 'target', got role {role!r} (pass name='drafter' or 'target')")
    return _RECIPES[preset][role]


def resolve(preset: str | None, role: str, *, context_scheme: str, schedule: str, checkpoint_context: str,
            checkpoint_schedule: str) -> tuple[str, str, dict]:
    """``(context_scheme, schedule, source)`` for one model.

    ``context_scheme`` / ``schedule``: the caller's request (``"auto"`` = follow the preset, or the checkpoint when
    ``preset`` is ``None``). ``source`` says, per setting, ``"explicit"``, ``"preset"`` or ``"checkpoint"``.
    """
    wanted = recipe(preset, role) if preset is not None else ModelRecipe(CHECKPOINT, CHECKPOINT)
    chosen, source = {}, {"preset": preset}
    for key, requested, own in (("context_scheme", context_scheme, checkpoint_context), ("schedule", schedule, checkpoint_schedule)):
        if requested != "auto":
            chosen[key], source[key] = requested, "explicit"
        elif getattr(wanted, key) != CHECKPOINT:
            chosen[key], source[key] = getattr(wanted, key), "preset"
        else:
            chosen[key], source[key] = own, "checkpoint"
    return chosen["context_scheme"], chosen["schedule"], source
