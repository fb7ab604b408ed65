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


def conforms(t: object, dtype: torch.dtype, shape: tuple[int, ...], device_index: int, align: int = 16) -> bool:
    """check_tensor's conditions as one cheap predicate, for per-call fast paths: True if they all
    hold (a CUDA tensor on `device_index`); when False, check_tensor names what is wrong."""
    try:  # `t.dtype is dtype` holds for torch tensors only: no isinstance test needed
        return (t.dtype is dtype and t.shape == shape and t.get_device() == device_index and t.is_contiguous()
                and not t.data_ptr() % align)
    except (AttributeError, TypeError):
        return False


def check_rank(t: object, name: str, rank: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise BadInputError(f"{name} must be {rank}-D {what}, got shape {tuple(t.shape)}")
    return t

