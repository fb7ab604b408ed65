"""NVFP4 weights served as ModelOpt stores them (the "modelopt" layout): no repacking, no second copy.

`prepare_w13_modelopt` / `prepare_w2_modelopt` wrap a checkpoint's stacked tensors for the kernels
without copying them: the code bytes (E, N, K/2) u8 and the e4m3 block scales (E, N, K/16), viewed
as bytes, are the very tensors given; the only new tensor is the per-expert float32 global scale
(E floats, or E pairs for W13), with the decode's power-of-two offset folded in.

The kernels decode these bytes where they lie (docs/layouts.md, "NVFP4 read as stored"): in the
mma.sync loop each lane takes 4 consecutive bytes of a weight row (k = 8t .. 8t+7 of a 32-k slice)
and the activations are read with the same k permutation; in the warpgroup-MMA loop (large M) each
lane takes the bytes of its fragment's k pairs in the stored order.  No byte needs moving.  The
price is a costlier decode than the packed layout's (per 8 weights 10 integer-ALU instructions
against 7 in the mma.sync loop, 20 in the wgmma loop): measured on the H200, 1.12-1.75x the packed
layer's time at M <= 256, 1.14-1.44x above (docs/benchmarks.md).

W13 may be stored gate rows first ("w13", `WeightFormat.MODELOPT`) or up rows first ("w31",
`MODELOPT_W31`): the kernels read the halves where they are.  The two projections keep their own
global scales ((E, 2) `weight_scale_2`, indexed gate, up): a tile never straddles the halves, so
nothing is re-rounded (the packed layout folds the smaller scale into the block scales instead).
Logical sizes are the stored ones (no zero padding is possible): N and K multiples of 64, like the
packed layout's stored sizes.  Where N is 64 (mod 128) (Nemotron-3-Nano's I = 1856, a tensor-parallel
shard's I / tp = 192) no 128-wide tile divides it: the last tile's rows past N are zero-filled, nothing
read, and its outputs there not stored; where K is, the k-tiles are 64 deep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import BadInputError
from .types import DType, WeightFormat
from .weights import (
    FP4_DECODE_EXPONENT, MODELOPT_SCALE_EXPONENT, STORED_K_MULTIPLE, STORED_N_MULTIPLE, PackedNvfp4, W13Order,
    _check_bias, _check_dtype, _check_global_2, _check_modelopt, _global_scale, _w13_order,
)

# The decodes yield w * 2**FP4_DECODE_EXPONENT and s * 2**MODELOPT_SCALE_EXPONENT; the global scale undoes both.
MODELOPT_COMPENSATION = {
    dt: 2.0 ** -(exponent + MODELOPT_SCALE_EXPONENT[dt]) for dt, exponent in FP4_DECODE_EXPONENT.items()
}  # bf16: 2**111, fp16: 2**14


@dataclass(frozen=True, repr=False)  # __repr__: shapes, not tensor dumps
class ModelOptNvfp4(PackedNvfp4):
    """NVFP4 weights of E experts exactly as a ModelOpt checkpoint stores them.

    qweight: (E, N, K/2) u8, the checkpoint's `weight` (two codes a byte, low nibble = even k)
    scales: (E, N, K/16) u8, the checkpoint's `weight_scale` (e4m3fn) viewed as bytes
    global_scale: (E,) f32, or (E, 2) (gate, up) for W13 of a gated activation; compensation included
    """

    layout: ClassVar[str] = "modelopt"
    up_first: bool = False  # W13 stored up rows first (w31)

    @property
    def weights(self) -> WeightFormat:  # the layer fact: W13's row order is part of the format
        return WeightFormat.MODELOPT_W31 if self.up_first else WeightFormat.MODELOPT

    @property
    def n_stored(self) -> int:
        return self.n

    @property
    def k_stored(self) -> int:
        return self.k

    def _qweight_shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.n, self.k // 2)

    def _expected_tensors(self) -> dict[str, tuple[object, torch.dtype, tuple[int, ...]]]:
        e = self.num_experts
        pairs = isinstance(self.global_scale, torch.Tensor) and self.global_scale.dim() == 2
        return {
            "qweight": (self.qweight, torch.uint8, self._qweight_shape()),
            "scales": (self.scales, torch.uint8, (e, self.n, self.k // 16)),
            "global_scale": (self.global_scale, torch.float32, (e, 2) if pairs else (e,)),
        }

    def __post_init__(self):
        cls = type(self).__name__
        if self.n % STORED_N_MULTIPLE or self.k % STORED_K_MULTIPLE:
            raise BadInputError(
                f"{cls} is read as stored, without zero padding: N and K must be multiples of "
                f"{STORED_N_MULTIPLE}, got N={self.n}, K={self.k} (prepare_w13 / prepare_w2 pack other sizes)")
        super().__post_init__()  # dtypes and shapes (_expected_tensors), dtype, bias, one device
        if self.up_first and self.global_scale.dim() != 2:
            raise BadInputError(f"{cls}: a W13 stored up rows first carries (gate, up) global scales, (E, 2)")


def prepare_w13_modelopt(
    weight: torch.Tensor,  # (E, 2I, H/2) u8, or (E, I, H/2) for relu2
    weight_scale: torch.Tensor,  # (E, 2I, H/16) e4m3fn
    weight_scale_2: torch.Tensor,  # (E,), (E, 1) or (E, 2) = (gate, up) f32
    dtype: DType | str | torch.dtype,
    *,
    order: W13Order | str = W13Order.GATE_UP,
    gated: bool = True,
    bias: torch.Tensor | None = None,  # (E, 2I) in the stored row order
) -> ModelOptNvfp4:
    """The fused gate/up projection as stored: `order` "gate_up" (ModelOpt's w13) or "up_gate" (w31).

    No copy of the weight or its block scales is made (they must stay alive and unchanged while
    layers use them).  `gated=False` for relu2 layers, whose W13 is one projection (N = I).  An (E, 2)
    `weight_scale_2` is indexed by projection (gate, up) whatever the order; both are kept exactly.
    """
    row_order = _w13_order(order)
    if row_order is W13Order.INTERLEAVED:
        raise BadInputError("interleaved gate/up rows (gpt-oss) cannot be read as stored; use prepare_w13 "
                            "(or prepare_w13_mxfp4), which reorders them")
    elem = _check_dtype(dtype)
    e, n, k = _check_modelopt(weight, weight_scale, "w13_")
    if not gated and row_order is not W13Order.GATE_UP:
        raise BadInputError("a relu2 W13 is one projection: order applies to gated (gate | up) weights only")
    if gated and n % 2:
        raise BadInputError(f"w13_weight has {n} rows; [gate | up] needs an even count (2 * I)")
    global_2 = _check_global_2(weight_scale_2, e, weight.device, "w13_weight_scale_2", pair=gated,
                               pair_hint="(E, 2) gate/up pairs are for gated=True: a relu2 W13 has one per expert")
    if gated and global_2.dim() == 1:
        global_2 = torch.stack((global_2, global_2), dim=1)
    bias = _check_bias(bias, "w13_bias", e, n, elem, weight.device, row_order)  # [gate | up], copied (small)
    return ModelOptNvfp4(qweight=weight, scales=weight_scale.view(torch.uint8),
                         global_scale=_global_scale(global_2, elem, "w13_", MODELOPT_COMPENSATION), num_experts=e,
                         n=n, k=k, dtype=elem, bias=bias, up_first=row_order is W13Order.UP_GATE)


def prepare_w2_modelopt(
    weight: torch.Tensor,  # (E, H, I/2) u8
    weight_scale: torch.Tensor,  # (E, H, I/16) e4m3fn
    weight_scale_2: torch.Tensor,  # (E,) or (E, 1) f32
    dtype: DType | str | torch.dtype,
    *,
    bias: torch.Tensor | None = None,  # (E, H)
) -> ModelOptNvfp4:
    """The down projection as stored (N = H, K = I); no copy of the weight or its block scales."""
    elem = _check_dtype(dtype)
    e, n, k = _check_modelopt(weight, weight_scale, "w2_")
    global_2 = _check_global_2(weight_scale_2, e, weight.device, "w2_weight_scale_2", pair=False)
    bias = _check_bias(bias, "w2_bias", e, n, elem, weight.device)
    return ModelOptNvfp4(qweight=weight, scales=weight_scale.view(torch.uint8),
                         global_scale=_global_scale(global_2, elem, "w2_", MODELOPT_COMPENSATION), num_experts=e,
                         n=n, k=k, dtype=elem, bias=bias)
