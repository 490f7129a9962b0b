"""The embedded toy world: a procedural video world, tiny trained models of the real classes, and a demo.

``world`` renders captioned clips and scores them with a ground-truth metric; ``text`` embeds captions;
``models`` builds/loads the shipped tiny VAE, drafter, target and reward model; ``demo`` runs SDVG on them.
"""

from .text import embed_caption
from .world import Scene, all_scenes, clip_metrics, render

__all__ = ["Scene", "all_scenes", "clip_metrics", "embed_caption", "render"]
