"""Launch plan shared by the row-wise element-wise families (activation, top-k sum).

Their kernels read a source of shape (rows, *in_tail) and write `out` of shape
(rows, out_width), VECTOR elements per thread: grid = ceil(rows * out_width / VECTOR / threads).
Each family's `_launch` passes the values by its own parameter names.
"""

from __future__ import annotations

import math

import torch

from ..bundle import Bundle, current_stream_handle
from ..errors import BadInputError
from ..tensors import INT32_MAX, check_apart


class RowwisePlan:
    """A resolved kernel plus what a launch needs; built once per (bundle, spec).

    Subclasses set `in_tail` / `out_width` and implement `_launch` (the kernel's
    parameters by name) and `explain`, which runs the detailed checks (with messages)
    only when the one-pass check failed.
    """

    in_tail: tuple[int, ...]
    out_width: int
    src_name: str  # the source's name in messages

    def __init__(self, bundle: Bundle, spec, vector: int):
        self.spec = spec
        self.kernel = bundle.kernel(spec.key())
        self.kernel.bind(spec.SIGNATURE)
        self.device, self.device_index = bundle.device, bundle.device_index
        self.dtype = spec.dtype.torch
        self.threads = self.kernel.block[0]
        self.vectors_per_row = self.out_width // vector
        itemsize = self.dtype.itemsize
        self._src_row_bytes, self._out_row_bytes = math.prod(self.in_tail) * itemsize, self.out_width * itemsize

    def __call__(self, src: torch.Tensor, src_shape: torch.Size, out: torch.Tensor, **extra: int) -> None:
        """Check and launch; `extra` are the family's further parameters by name (checked by the caller)."""
        rows, dtype, dev = src_shape[0], self.dtype, self.device_index
        # One cheap pass on the hot path; the detailed checks only run to explain a failure.
        if not (
            src_shape == (rows,) + self.in_tail
            and isinstance(out, torch.Tensor)
            and out.shape == (rows, self.out_width)
            and src.dtype is dtype  # torch dtypes are singletons
            and out.dtype is dtype
            and src.get_device() == dev
            and out.get_device() == dev
            and src.is_contiguous()
            and out.is_contiguous()
            and rows <= INT32_MAX
        ):
            self._fail(src, out)
        sp, op = src.data_ptr(), out.data_ptr()
        # 16-byte vectors; out may not overlap the source (check_apart)
        if (sp | op) & 15 or (rows and sp < op + rows * self._out_row_bytes and op < sp + rows * self._src_row_bytes):
            self._fail(src, out)
        if rows:
            grid = (rows * self.vectors_per_row + self.threads - 1) // self.threads
            self._launch(grid, current_stream_handle(dev), sp, op, rows, extra)

    def _launch(self, grid: int, stream: int, src: int, out: int, rows: int, extra: dict) -> None:
        """Launch the kernel with these addresses and row count, by the family's parameter names."""
        raise NotImplementedError

    def _fail(self, src: torch.Tensor, out: torch.Tensor) -> None:
        self.explain(src, out)
        check_apart(out, "out", **{self.src_name: src})
        raise BadInputError("operands failed validation")  # unreachable unless the two checks disagree

    def explain(self, src: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError
