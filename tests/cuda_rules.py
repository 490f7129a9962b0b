"""CUDA's rules on the CPU: what a CUDA kernel refuses that the CPU run forgives, checked in front of the CPU.

A CPU run never calls ``torch._scaled_mm`` on its own (ComfyUI switches fp8 matmuls on only for fp8-capable GPUs,
``comfy.model_management.supports_fp8_compute``). :func:`cuda_scaled_mm` replaces it with a function that first
applies the checks of PyTorch's CUDA kernel (``_scaled_mm_out_cuda`` and ``_scaled_tensorwise_tensorwise`` in
``aten/src/ATen/native/cuda/Blas.cpp``, same messages) and then computes what the kernel computes, in float32 on the
CPU: ``(mat1 * scale_a) @ (mat2 * scale_b) + bias`` in ``out_dtype``. Tests then switch ComfyUI's fp8 compute on
(:func:`fp8_card`) so that ComfyUI's ops take the path an RTX 40xx / H100 takes.

Only tensor-wise scaling (one float32 scale per operand, what ComfyUI's scaled-fp8 and fp8 ops pass) is emulated;
row-wise and block scales are refused by name so that a test meeting one says so instead of passing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE = {torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half",
          torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2"}


def _name(dtype) -> str:
    return _DTYPE.get(dtype, str(dtype))


def check_scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                    use_fast_accum=False, *, v2: bool = False) -> torch.dtype:
    """Raise what CUDA's ``torch._scaled_mm`` raises for these arguments (RuntimeError / ValueError with its message);
    return the output dtype. ``v2``: the checks of ``torch.nn.functional.scaled_mm`` (``_scaled_mm_cuda_v2_out``):
    the same messages, all raised as ValueError (``TORCH_CHECK_VALUE``)."""
    out = out_dtype or mat1.dtype
    error = ValueError if v2 else RuntimeError
    if mat1.dim() != 2:
        raise error("mat1 must be a matrix")
    if mat2.dim() != 2:
        raise error("mat2 must be a matrix")
    if mat1.shape[1] != mat2.shape[0]:
        raise error(f"mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} and "
                    f"{mat2.shape[0]}x{mat2.shape[1]})")
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        raise NotImplementedError("cuda_rules emulates tensor-wise scaling only (row-wise / block scales given)")
    if scale_result is not None and (scale_result.numel() != 1 or scale_result.dtype != torch.float32):
        raise error("scale_result must be a float scalar")
    if bias is not None and bias.numel() != mat2.shape[1]:
        raise error(f"Bias must be size {mat2.shape[1]} but got {bias.numel()}")
    if mat1.shape[1] % 16:
        raise error(f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: "
                    f"({mat1.shape[0]}x{mat1.shape[1]}).")
    if mat2.shape[0] % 16 or mat2.shape[1] % 16:
        raise error(f"mat2 shape ({mat2.shape[0]}x{mat2.shape[1]}) must be divisible by 16")
    if mat1.dtype not in _FP8:
        raise error(f"Expected mat1 to be Float8 or Float4_x2 matrix got {_name(mat1.dtype)}")
    if mat2.dtype not in _FP8:
        raise error(f"Expected mat2 to be Float8 or Float4_x2 matrix got {_name(mat2.dtype)}")
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
    if bias is not None:
        if out == torch.float32:
            raise error("Bias is not supported when out_dtype is set to Float32")
        if bias.dtype not in (torch.bfloat16, torch.float16):
            raise error(f"Bias must be BFloat16 or Half, but got {_name(bias.dtype)}")
        if out == torch.bfloat16 and bias.dtype != torch.bfloat16:
            raise error(f"Bias must be BFloat16 to compute {_name(out)} output, but got {_name(bias.dtype)}")
        if out == torch.float16 and bias.dtype != torch.float16:
            raise error(f"Bias must be Float16 to compute {_name(out)} output, but got {_name(bias.dtype)}")
    if scale_a.dtype != torch.float32:
        raise ValueError("scale_a must have 1 Float element")
    if scale_b.dtype != torch.float32:
        raise ValueError("scale_b must have 1 Float element")
    # cuBLASLt's layouts: mat1 row-major, mat2 column-major (ComfyUI passes weight.t())
    if mat1.shape[0] > 1 and mat1.stride(1) != 1:
        raise error("mat1 must be row-major (cuBLASLt fp8 gemm: 'TN' layout only)")
    if mat2.shape[1] > 1 and mat2.stride(0) != 1:
        raise error("mat2 must be column-major (cuBLASLt fp8 gemm: 'TN' layout only)")
    return out


@dataclass
class ScaledMMLog:
    """What the emulated kernel was called with: one ``(mat1 shape, mat2 shape, out dtype, bias dtype)`` per call
    that passed CUDA's checks, and one ``(same, message)`` per call CUDA would have refused (``refused``: kept even
    where the caller catches the error, as ComfyUI 0.3.64's ``fp8_ops`` does before falling back to a slow cast)."""

    calls: list = field(default_factory=list)
    refused: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.calls)


@contextlib.contextmanager
def cuda_scaled_mm(emulate: bool = True):
    """``torch._scaled_mm`` (and ``torch.nn.functional.scaled_mm``, its public successor) under CUDA's checks,
    computed on the CPU; yields the :class:`ScaledMMLog`. ``emulate=False`` (on a real GPU): the real kernels run,
    and every call is logged."""
    log = ScaledMMLog()
    real = torch._scaled_mm
    real_v2 = getattr(torch.nn.functional, "scaled_mm", None)

    def logged(kernel):
        def call(mat_a, mat_b, *args, **kwargs):
            log.calls.append((tuple(mat_a.shape), tuple(mat_b.shape), None, None))
            return kernel(mat_a, mat_b, *args, **kwargs)
        return call

    def scaled_mm(mat1, mat2, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None,
                  use_fast_accum=False):
        if scale_a is None or scale_b is None:
            raise TypeError("_scaled_mm() missing required argument 'scale_a' / 'scale_b' (torch >= 2.5)")
        return emulate(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)

    def emulate(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, v2=False):
        call = (tuple(mat1.shape), tuple(mat2.shape), out_dtype or mat1.dtype, None if bias is None else bias.dtype)
        try:
            out = check_scaled_mm(mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, v2=v2)
        except (RuntimeError, ValueError) as refusal:
            log.refused.append((*call, str(refusal)))
            raise
        log.calls.append(call)
        result = (mat1.float() * scale_a.float()) @ (mat2.float() * scale_b.float())
        if bias is not None:
            result = result + bias.float()
        return result.to(out)

    def scaled_mm_v2(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
                     bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        # torch >= 2.10's public API (comfy-kitchen's fp8 linear, ComfyUI >= 0.4 with mixed-precision ops)
        if isinstance(scale_a, (list, tuple)) or isinstance(scale_b, (list, tuple)) or contraction_dim:
            raise NotImplementedError("cuda_rules emulates single tensor-wise scales only")
        if "TensorWise" not in str(scale_recipe_a) or "TensorWise" not in str(scale_recipe_b):
            raise NotImplementedError(f"cuda_rules emulates tensor-wise scaling only, got {scale_recipe_a}, "
                                      f"{scale_recipe_b}")
        return emulate(mat_a, mat_b, scale_a, scale_b, bias, None, output_dtype, use_fast_accum, v2=True)

    torch._scaled_mm = scaled_mm if emulate else logged(real)
    if real_v2 is not None:
        torch.nn.functional.scaled_mm = scaled_mm_v2 if emulate else logged(real_v2)
    try:
        yield log
    finally:
        torch._scaled_mm = real
        if real_v2 is not None:
            torch.nn.functional.scaled_mm = real_v2


@contextlib.contextmanager
def fp8_card(model_management):
    """ComfyUI's loader answering as on an fp8-capable NVIDIA card (RTX 40xx / 50xx, L40S, H100), while models load
    (ComfyUI picks the ops class and the compute dtype then): fp8 compute on (``supports_fp8_compute``, which switches
    on ``torch._scaled_mm`` in scaled-fp8 / fp8 ops) and bf16 supported (``should_use_bf16``: the compute dtype of
    fp8 and scaled-fp8 weights is bf16 there, float32 on ``--cpu``)."""
    saved = {name: getattr(model_management, name) for name in ("supports_fp8_compute", "should_use_bf16")}
    model_management.supports_fp8_compute = lambda device=None: True
    model_management.should_use_bf16 = lambda *args, **kwargs: True
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model_management, name, value)
