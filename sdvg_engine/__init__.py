"""SDVG engine: speculative decoding for block-autoregressive video diffusion.

Nothing in this package imports ComfyUI; `nodes/` adapts it.
"""
