"""Compile-time facts of one fused W4A16 MoE kernel: FC1 -> activation -> FC2 in one launch.

The kernel (codegen/kernels/w4a16/fused.py, ported from the seed's
`W4A16FusedMoeKernel`) is a persistent grid that runs

    [pack_experts: pack the routes]  [decode, topk_sum: zero out]  FC1 GEMM  |barrier|  activation  |barrier|
    [expert_map: zero FC2 rows |barrier|]  [amax]  FC2 GEMM

where the two GEMMs are the grouped GEMM of gemm_spec.py, specialised by
`fc1_gemm` / `fc2_gemm` below, and |barrier| is a grid barrier
(`codegen/kernels/common.grid_barrier`) on the first word of `locks`.  Every CTA of the grid must be resident
at once (the runtime checks it with the occupancy API before the first launch).

With `gated_epilogue`, FC1's epilogue applies the gated activation and writes `activated`
itself: the activation pass and its barrier go away.

Buffers (row = route = token * top_k + k; widths are the logical sizes):
    fc1_out   (routes, 2I | I)   FC1 output (gated: [gate | up])
    activated (routes, I)        activation output = FC2 input (relu2: FC1 writes it directly)
    fc2_out   (routes, H)        FC2 output rows (packed path; may alias fc1_out), or
              (M, H)             the final output, summed over top-k in the kernel (decode, topk_sum)

With `pack_experts` (packed routes, at most PACK_MAX_ROUTES of them) the kernel packs the routes itself:
`route_indices` is the (M, top_k) int32 topk_ids, and every CTA groups them by expert into its own shared
memory (the layout and order of `runtime/kernels/route_pack.py`: experts in increasing order, each one's
routes in increasing route index, padded to the block with the sentinel M * top_k) before FC1, so no
route-pack launch runs before the layer; `block_experts` and `route_count` are not read.

Expert ids are bounds-checked on the device against the `num_experts` argument: a
decode route (raw topk_ids) or a packed block whose expert is outside [0, E) is
skipped by both GEMMs, so a dropped decode route adds nothing to the output and a
dropped packed route's FC2 row is left unwritten (the top-k sum skips it by id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ...abi import Pointee, Signature, i32, ptr
from ...errors import BadInputError
from ...keys import SpecKey
from ...types import Activation, DType, WeightFormat
from .geometry import BARRIER_WORDS, TileConfig, fused_gemm_dims
from ...weights import STORED_N_MULTIPLE as STORED_MULTIPLE
from ..activation import ActivationSpec
from .gemm_spec import Epilogue, GemmSpec, Mainloop, Routes, check_modelopt_scale_exponent, stored_w13_facts


@dataclass(frozen=True)
class FusedSpec(SpecKey):
    FAMILY = "w4a16_fused_moe"
    VERSION = 2  # 2: the bias parameter(s) joined the ABI
    # NVFP4 kernels: the keys they had before NF3 (and kernels without the facts added since)
    KEY_OMITS_NONE = frozenset({"weights", "scale_exponent", "gated_epilogue", "topk_sum", "pack_experts", "micro"})
    # The kernel's parameters, in order (16-byte aligned pointers); the runtime launches by these names.
    SIGNATURE = Signature(
        (
            ptr("a", Pointee.ELEM, "(M, H) dtype hidden states"),
            ptr("w13", Pointee.I32, "(E, H/16, 2*N1) int32 packed FC1 weights; modelopt: (E, N1, H/2) uint8"),
            ptr("w2", Pointee.I32, "(E, I/16, 2*H) int32 packed FC2 weights; modelopt: (E, H, I/2) uint8"),
            ptr("fc1_out", Pointee.ELEM, "(routes, fc1 width) dtype FC1 output"),
            ptr("activated", Pointee.ELEM, "(routes, I) dtype activation output"),
            ptr("fc2_out", Pointee.ELEM, "(routes, H) dtype FC2 rows, or (M, H) output when decode or topk_sum"),
            ptr("w13_scales", Pointee.U8, "FC1 uint8 S0E5M3 block scales, permuted; modelopt: e4m3 as stored"),
            ptr("w2_scales", Pointee.U8, "FC2 uint8 S0E5M3 block scales, permuted; modelopt: e4m3 as stored"),
            ptr("w13_global_scale", Pointee.F32, "(E,) float32; modelopt gated: (E, 2) [gate, up]"),
            ptr("w2_global_scale", Pointee.F32, "(E,) float32"),
            ptr("route_indices", Pointee.I32, "int32 packed route slots, or flat topk_ids (decode, pack_experts)"),
            ptr("block_experts", Pointee.I32, "int32 expert per packed block (-1 = none/remote)"),
            ptr("route_count", Pointee.I32, "int32[1] packed slot count"),
            ptr("topk_weights", Pointee.F32, "(M, top_k) float32 router weights"),
            ptr("w13_bias", Pointee.ELEM, "(E, fc1 width) dtype FC1 bias, [gate | up] (read if bias)"),
            ptr("w2_bias", Pointee.ELEM, "(E, H) dtype FC2 bias (read if bias)"),
            ptr("c_tmp", Pointee.F32, "float32 split-K partials (shared by FC1 and FC2)"),
            ptr("locks", Pointee.I32, "int32: barrier words then split-K lock slots (micro: a counter, then the "
                "(M, H) float32 output sums); zero between launches"),
            ptr("amax", Pointee.F32, "(layers, E, 2) float32 activation maxima (read if collect_amax)"),
            i32("layer", "layer index into amax"),
            i32("tokens", "M"),
            i32("num_experts", "E, experts in the weights: routes (decode) and blocks whose "
                "expert is outside [0, E) are skipped"),
        )
    )

    dtype: DType
    hidden_size: int  # logical H
    intermediate_size: int  # logical I (per tensor-parallel shard)
    top_k: int
    activation: Activation
    fc1_tile_n: int
    fc1_tile_k: int
    fc2_tile_n: int
    fc2_tile_k: int
    moe_block_size: int
    blocks_per_sm: int
    decode: bool = False  # direct routes + top-k sum folded into FC2 (small M)
    router_weight_on_input: bool = False  # router weight applied to FC1's output rows instead of FC2's
    expert_map: bool = False  # some experts are remote: zero FC2 rows before FC2
    collect_amax: bool = False  # calibration: max |FC1 input| and |FC2 input| per expert into amax
    fast_math: bool = True
    swiglu_alpha: Optional[float] = None
    swiglu_beta: Optional[float] = None
    swiglu_limit: Optional[float] = None
    whole_tiles_m8: bool = True
    amax_experts: int = 0  # collect_amax: experts in the weights (rows of the amax table); else 0
    mainloop: Mainloop = Mainloop.MMA_SYNC  # both GEMM phases (wgmma: sm_90a, 64/128-row blocks)
    bias: bool = False  # per-expert biases in FC1's and FC2's epilogues (gpt-oss)
    # both GEMMs' weight format (NF3: mma.sync loop, bf16); None = NVFP4, kept out of the key so
    # that the NVFP4 kernels keep the digests they had before NF3 existed
    weights: Optional[WeightFormat] = None
    # the modelopt layouts: the exponent of the scale decode (GemmSpec.scale_exponent); None otherwise
    scale_exponent: Optional[int] = None
    # True: FC1's epilogue applies the gated activation to gate and up columns staged in one tile
    # (GemmSpec's gated epilogues; any weight format, unpadded FC1 N) and writes `activated`, so
    # the kernel runs no activation pass and one grid barrier fewer.  None: the activation pass.
    gated_epilogue: Optional[bool] = None
    # True: packed routes whose FC2 adds each route's row, times its router weight, into its token's
    # output row with red.add (the decode regime's top-k sum; the output is zeroed in the prologue), so
    # no top-k sum kernel runs after the layer.  None: FC2 writes route rows for that kernel.
    topk_sum: Optional[bool] = None
    # The expert count E of the routing when the kernel packs the (at most PACK_MAX_ROUTES) routes itself,
    # into shared memory, from topk_ids (see the module doc); None: it reads a route packing from memory.
    pack_experts: Optional[int] = None
    # True (decode only): the barrier-free small-M kernel (codegen/kernels/w4a16/micro.py).  A CTA's work item is
    # one route's FC1 tile, activated, then FC2 over the tile's slice of K into every output column: each item
    # adds a partial of its token's output row into float32 sums in `locks` (MICRO_SUMS_WORD on), and the CTA
    # that finishes last turns the sums into `fc2_out` and zeroes them.  No grid barrier, no co-residency.
    # None: the persistent kernel above.
    micro: Optional[bool] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        weights = None if self.weights is None else WeightFormat(self.weights)
        object.__setattr__(self, "weights", None if weights is WeightFormat.NVFP4 else weights)
        object.__setattr__(self, "activation", Activation(self.activation))
        object.__setattr__(self, "mainloop", Mainloop(self.mainloop))
        if self.decode and (self.expert_map or self.collect_amax or self.moe_block_size != 8):
            raise BadInputError("decode (direct routes, fused top-k sum) needs 8-row blocks, no expert_map, no amax")
        if self.topk_sum not in (None, True) or (
                self.topk_sum and (self.decode or self.expert_map or self.collect_amax)):
            raise BadInputError(f"topk_sum must be None, or True for packed routes without expert_map or amax "
                                f"(decode sums its routes already); got {self.topk_sum!r}")
        if self.bias and self.router_weight_on_input:
            raise BadInputError("bias with router_weight_on_input is not defined: the router weight would "
                                "scale FC1's bias but not FC2's")
        if (self.amax_experts > 0) != self.collect_amax:
            raise BadInputError("amax_experts is the amax table's expert count: set exactly when collect_amax")
        if (self.mainloop is Mainloop.MMA_SYNC
                and self.fc1_tile_n * self.fc1_tile_k != self.fc2_tile_n * self.fc2_tile_k):
            raise BadInputError("FC1 and FC2 tiles must use the same CTA size (tile_n * tile_k / 64 threads)")
        for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise BadInputError(f"{name} must be finite, got {v}")
        self.activation_spec  # validates I and the swiglu parameters
        if self.gated_epilogue not in (None, True) or (self.gated_epilogue and not self.gated):
            raise BadInputError(f"gated_epilogue must be None, or True for a gated activation; got "
                                f"{self.gated_epilogue!r} with {self.activation.value}")
        if self.weight_format.layout != "modelopt" and self.scale_exponent is not None:
            raise BadInputError(f"scale_exponent belongs to the modelopt layouts, got weights {self.weight_format.value}")
        if self.weight_format.layout == "modelopt":
            check_modelopt_scale_exponent(self.scale_exponent, self.dtype)
            if self.weight_format.up_first and not self.gated:
                raise BadInputError(f"{self.weight_format.value} (W13 stored up rows first) needs a gated activation "
                                    f"(gate and up halves), got {self.activation.value}")
            dims = fused_gemm_dims(self.hidden_size, self.intermediate_size, self.gated)
            logical = ((self.fc1_width, self.hidden_size), (self.hidden_size, self.intermediate_size))
            if dims != logical:
                raise BadInputError(
                    f"{self.weight_format.value} weights are read as stored, without the zero padding other layouts "
                    f"get: hidden_size={self.hidden_size} and intermediate_size={self.intermediate_size} must be "
                    f"multiples of {STORED_MULTIPLE}")
        if self.pack_experts is not None and (
                not isinstance(self.pack_experts, int) or not 1 <= self.pack_experts <= PACK_MAX_EXPERTS
                or self.decode or self.expert_map or self.collect_amax):
            raise BadInputError(f"pack_experts must be None, or 1..{PACK_MAX_EXPERTS} experts for packed routes "
                                f"without expert_map or amax; got {self.pack_experts!r}")
        self.fc1_gemm, self.fc2_gemm  # validate the tiles against the stored sizes
        if self.micro not in (None, True):
            raise BadInputError(f"micro must be None or True, got {self.micro!r}")
        if self.micro:
            self._check_micro()

    def _check_micro(self) -> None:
        """What the micro kernel serves: decode, NVFP4 packed (MXFP4 packs into it) or read as stored (modelopt,
        modelopt_w31), without an input-side router weight, FC1 writing the activation itself, logical sizes
        equal to the stored ones, 64-column output slabs."""
        why = []
        if not self.decode:
            why.append("decode (direct routes)")
        if self.weight_format.layout not in ("packed", "modelopt"):
            why.append(f"NVFP4 weights, packed or read as stored (got {self.weight_format.value})")
        if self.router_weight_on_input:
            why.append("the router weight on FC2's output")
        if self.mainloop is not Mainloop.MMA_SYNC:
            why.append("the mma.sync loop")
        if self.gated and not self.gated_epilogue:
            why.append("a gated activation applied in FC1's epilogue (gated_epilogue)")
        dims = fused_gemm_dims(self.hidden_size, self.intermediate_size, self.gated)
        if dims != ((self.fc1_width, self.hidden_size), (self.hidden_size, self.intermediate_size)):
            why.append("hidden_size and intermediate_size stored unpadded")
        if self.hidden_size % 64 or self.intermediate_size % self.micro_slice:
            why.append(f"hidden_size a multiple of 64 and intermediate_size of the FC1 tile's {self.micro_slice} "
                       f"activated columns")
        if why:
            raise BadInputError("micro needs " + "; ".join(why))

    # --------------------------------------------------------------- parts

    @property
    def weight_format(self) -> WeightFormat:
        return WeightFormat.NVFP4 if self.weights is None else self.weights

    @property
    def gated(self) -> bool:
        return self.activation.is_gated

    @property
    def nf3(self) -> bool:
        return self.weight_format is WeightFormat.NF3

    @property
    def activation_spec(self) -> ActivationSpec:
        return ActivationSpec(self.activation, self.dtype, self.intermediate_size, self.fast_math,
                              self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit)

    def _gemm(self, n, k, logical_n, logical_k, tile_n, tile_k, **facts) -> GemmSpec:
        return GemmSpec(
            dtype=self.dtype, n=n, k=k, n_out=None if logical_n == n else logical_n,
            k_in=None if logical_k == k else logical_k, tile_n=tile_n, tile_k=tile_k,
            moe_block_size=self.moe_block_size, blocks_per_sm=self.blocks_per_sm,
            routes=Routes.DIRECT if self.decode else Routes.PACKED, whole_tiles_m8=self.whole_tiles_m8,
            mainloop=self.mainloop, bias=self.bias, layout=self.weight_format.layout,
            scale_format=self.weight_format.scale_format, scale_exponent=self.scale_exponent, **facts,
        )

    @property
    def fc1_width(self) -> int:
        return self.activation.fc1_width(self.intermediate_size)

    @property
    def fc1_gemm(self) -> GemmSpec:
        (n1, k1), _ = fused_gemm_dims(self.hidden_size, self.intermediate_size, self.gated, self.nf3)
        epilogue, activation = (Epilogue.NONE if self.gated else Epilogue.RELU2), {}
        if self.gated_epilogue:
            epilogue = Epilogue(self.activation.value)
            activation = dict(fast_math=self.fast_math, swiglu_alpha=self.swiglu_alpha,
                              swiglu_beta=self.swiglu_beta, swiglu_limit=self.swiglu_limit)
        return self._gemm(n1, k1, self.fc1_width, self.hidden_size, self.fc1_tile_n, self.fc1_tile_k,
                          top_k=self.top_k, mul_topk_weights=self.router_weight_on_input, epilogue=epilogue,
                          **stored_w13_facts(self.weight_format, self.intermediate_size, self.gated), **activation)

    @property
    def fc2_gemm(self) -> GemmSpec:
        _, (n2, k2) = fused_gemm_dims(self.hidden_size, self.intermediate_size, self.gated, self.nf3)
        return self._gemm(n2, k2, self.hidden_size, self.intermediate_size, self.fc2_tile_n, self.fc2_tile_k,
                          top_k=1, mul_topk_weights=not self.router_weight_on_input, epilogue=Epilogue.NONE,
                          sum_topk=self.top_k if self.sums_topk else 0)

    @property
    def sums_topk(self) -> bool:
        """FC2 adds the routes' rows into the (M, H) output itself (decode, or packed with topk_sum)."""
        return self.decode or bool(self.topk_sum)

    @property
    def fc1_tile(self) -> TileConfig:
        return TileConfig(self.fc1_tile_k, self.fc1_tile_n)

    @property
    def threads(self) -> int:
        return self.fc1_gemm.threads

    @property
    def gemm_shared_bytes(self) -> int:
        """The GEMM phases' arena (stages, staged routes, epilogue), at the start of shared memory."""
        return max(self.fc1_gemm.shared_bytes, self.fc2_gemm.shared_bytes)

    @property
    def pack_layout(self) -> Optional["RoutePackLayout"]:
        """Where the in-kernel route packing lives in shared memory (after the GEMM arena); None without it."""
        if self.pack_experts is None:
            return None
        return RoutePackLayout(-(-self.gemm_shared_bytes // 16) * 16, self.pack_experts, self.moe_block_size,
                               self.threads // 32)

    @property
    def shared_bytes(self) -> int:
        layout = self.pack_layout
        return self.gemm_shared_bytes if layout is None else layout.end

    @property
    def waits_on_grid(self) -> bool:
        """Its CTAs wait on each other (grid barriers, split-K turns), so its grid must be resident at once; the
        micro kernel's never do."""
        return not self.micro

    @property
    def dynamic_smem_bytes(self) -> int:
        return self.shared_bytes

    @property
    def barrier_words(self) -> int:
        return BARRIER_WORDS

    @property
    def micro_slice(self) -> int:
        """micro: the activated columns one FC1 tile yields, FC2's slice of K per work item."""
        return self.fc1_tile_n // 2 if self.gated else self.fc1_tile_n


# micro (FusedSpec.micro): in `locks`, the word of the finished-CTA counter and the first word of the (M, H) float32
# output sums (16-byte aligned), both after the grid-barrier words the kernel does not use (the plan sizes them).
MICRO_COUNTER_WORD = BARRIER_WORDS
MICRO_SUMS_WORD = -(-(BARRIER_WORDS + 1) // 4) * 4


# The most routes (M * top_k) and experts a kernel with pack_experts packs: its shared-memory tables hold them.
PACK_MAX_ROUTES = 1024
PACK_MAX_EXPERTS = 512


@dataclass(frozen=True)
class RoutePackLayout:
    """The in-kernel route packing's shared-memory tables (byte offsets), from `base`:

        hist    (warps, experts) int32  each warp's route count per expert, then its first slot per expert
        slots   (capacity,) int32       the packed route indices (route_pack.py's packed_route_indices)
        blocks  (capacity / block,)     the expert of each block (only blocks below the count are written)
        count   (1,) int32              the packed slot count, a multiple of the block
        sums    (warps,) int32          the scan's per-warp totals
    """

    base: int
    experts: int
    block: int
    warps: int

    @property
    def capacity(self) -> int:
        """Slots for PACK_MAX_ROUTES routes, each expert's padded to whole blocks."""
        return PACK_MAX_ROUTES + self.experts * (self.block - 1)

    @property
    def hist(self) -> int:
        return self.base

    @property
    def slots(self) -> int:
        return self.hist + 4 * self.warps * self.experts

    @property
    def blocks(self) -> int:
        return self.slots + 4 * self.capacity

    @property
    def count(self) -> int:
        return self.blocks + 4 * (self.capacity // self.block + 1)

    @property
    def sums(self) -> int:
        return self.count + 4

    @property
    def end(self) -> int:
        return -(-(self.sums + 4 * self.warps) // 16) * 16
