"""Argument checks shared by every runtime op; all raise BadInputError before any launch."""

from __future__ import annotations

import torch

from .errors import BadInputError

INT32_MAX = 2**31 - 1


def check_tensor(
    t: object,
    name: str,
    *,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    device: torch.device,
    align: int = 16,
) -> torch.Tensor:
    """Check dtype, shape, device, contiguity and base alignment of a kernel operand."""
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise BadInputError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise BadInputError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise BadInputError(f"{name} must be on {device} (the bundle's device), got {t.device}")
    if not t.is_contiguous():
        raise BadInputError(f"{name} must be contiguous (row-major), got strides {t.stride()}; call .contiguous()")
    if t.data_ptr() % align:
        raise BadInputError(
            f"{name} must start at a {align}-byte aligned address (kernels use {align}-byte vector access), "
            f"got {t.data_ptr():#x}; slices at odd offsets must be copied"
        )
    return t


def conforms(t: object, dtype: torch.dtype, shape: tuple[int, ...], device_index: int) -> bool:
    """check_tensor's conditions but the address's alignment, as one cheap predicate for per-call fast paths
    (which read the addresses anyway, to launch): True if they all hold (a CUDA tensor on `device_index`);
    when False, check_tensor names what is wrong."""
    try:  # `t.dtype is dtype` holds for torch tensors only: no isinstance test needed
        return t.dtype is dtype and t.shape == shape and t.get_device() == device_index and t.is_contiguous()
    except (AttributeError, TypeError):
        return False


def overlapping(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte (each spans [data_ptr, data_ptr + nbytes); callers
    checked contiguity first).  Unlike torch's own overlap test, two disjoint views of one storage
    (the halves of a buffer) are apart."""
    a0, b0, an, bn = a.data_ptr(), b.data_ptr(), a.nbytes, b.nbytes
    return 0 < an and 0 < bn and a0 < b0 + bn and b0 < a0 + an


def check_apart(out: torch.Tensor, name: str, /, **inputs: torch.Tensor | None) -> None:
    """BadInputError if the output `name` shares memory with one of the (checked, contiguous) inputs.

    Every kernel here may write its output while other CTAs still read the inputs (the fused layer
    zeroes its output before FC1 has read the hidden states), so an in-place call would return
    garbage instead of failing.
    """
    for other, t in inputs.items():
        if t is not None and overlapping(out, t):
            raise BadInputError(
                f"{name} shares memory with {other} ({name} at {out.data_ptr():#x}, {out.nbytes} bytes; {other} at "
                f"{t.data_ptr():#x}, {t.nbytes} bytes): the kernels write {name} while they still read {other}, "
                f"so in-place calls are not supported; pass a separate {name} (e.g. torch.empty_like) and copy"
            )


def check_rank(t: object, name: str, rank: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise BadInputError(f"{name} must be {rank}-D {what}, got shape {tuple(t.shape)}")
    return t

