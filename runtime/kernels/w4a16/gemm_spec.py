"""Compile-time facts and shared-memory geometry of one W4A16 grouped MoE GEMM kernel.

The kernel (codegen/kernels/w4a16/gemm.py, mainloop.py, epilogue.py, wgmma.py; ported from the seed's
`W4A16GemmKernel`) computes, for every packed route block of `moe_block_size`
rows routed to expert e,

    out[route, :] = ((A[route // top_k, :] @ W_e^T) * global_scale[e] (+ bias[e])) (* topk_weight[route])

with W_e the NVFP4 weights in the packed layout of docs/layouts.md.  A is
(tokens, K) for FC1 (top_k > 1) or (routes, K) for FC2 (top_k = 1); out is
(routes, N).  Everything the kernel bakes in is a field here; everything else
(token count, grid size, buffers) is a launch argument, so one kernel serves
every token count whose plan picks the same tile.

Geometry is plain arithmetic shared by codegen (shared-memory offsets) and the
runtime (dynamic shared-memory bytes, scratch sizes).  Units follow the seed:
"int4" = 16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ...abi import Pointee, Signature, i32, ptr
from ...errors import BadInputError
from ...keys import SpecKey
from .geometry import (
    ALLOWED_MOE_BLOCK_SIZES,
    STAGES,
    PRODUCER_THREADS,
    WGMMA_BLOCK_SIZES,
    WGMMA_WS_BLOCKS,
    WGMMA_WS_TILE,
    tile_count,
    wgmma_out_row_bytes,
    wgmma_threads,
    wgmma_ws_layout,
    wgmma_tiles,
    ScaleFormat,
    TileConfig,
    cta_m_blocks,
    route_metadata_bytes,
    wgmma_shared_memory_footprint,
    wgmma_stage_parts,
)
from ...nf3 import NF3_BLOCK_K, NF3_COLUMN_BYTES
from ...types import DType, WeightFormat
from ...weights import MODELOPT_SCALE_EXPONENT
from ..activation import ActivationSpec

# (layout, scale_format) pairs the GEMM decodes: NVFP4 (MXFP4 is packed into it), NF3, and NVFP4 as
# ModelOpt stores it
WEIGHT_FORMATS = (("packed", "e4m3_k16"), ("nf3", "e4m3_k32"), ("modelopt", "e4m3_k16"))


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


class Routes(str, Enum):
    """How a CTA finds the rows of its M-block."""

    PACKED = "packed"  # packed_route_indices / block_expert_ids from pack_routes
    DIRECT = "direct"  # no packing: route r = its own 8-row block, expert = topk_ids[r] (small M);
    # the ids are raw router output here, so the kernel bounds-checks them against num_experts


def modelopt_scale_exponent(dtype: DType) -> int:
    """The scale_exponent fact of a modelopt kernel this runtime serves (weights.MODELOPT_SCALE_EXPONENT)."""
    return MODELOPT_SCALE_EXPONENT[DType(dtype)]


def check_modelopt_scale_exponent(given: object, dtype: DType) -> None:
    want = modelopt_scale_exponent(dtype)
    if given != want:
        raise BadInputError(
            f"this modelopt kernel decodes its scales as s * 2**{given} (scale_exponent), this runtime prepares "
            f"the global scales for s * 2**{want} ({DType(dtype).value}): the bundle was built with another "
            "version of cuteaot; rebuild it")


def stored_w13_facts(weights: WeightFormat, intermediate_size: int, gated: bool) -> dict:
    """FC1's GemmSpec facts for W13 read as stored (modelopt): [gate | up] from the stored row order
    (n_rotation = I when the up rows come first) and one global scale per half; {} for other layouts."""
    if weights.layout != "modelopt":
        return {}
    return dict(n_rotation=intermediate_size if weights.up_first else None,
                split_global_scale=True if gated else None)


class Mainloop(str, Enum):
    """Which tensor-core loop computes a tile."""

    MMA_SYNC = "mma_sync"  # the seed's m16n8k16 loop, every target, every block size
    # sm_90a only: warpgroup MMA with the dequantised weights as the register A operand and the
    # gathered activations as the shared-memory B operand (codegen/kernels/w4a16/wgmma.py);
    # 64-row blocks, 256 x 64 or 128 x 64 tiles, one warpgroup per CTA.
    WGMMA = "wgmma"




class Epilogue(str, Enum):
    NONE = "none"
    RELU2 = "relu2"  # out = relu(x)**2, for non-gated FC1
    # Gated FC1: a tile computes the gate and the up columns of the same tile_n / 2
    # outputs (the first half of its weight slabs from the gate half of W13, the second from the up
    # half) and writes the activation of the pair, so out is (routes, N / 2): the activation kernel
    # between the GEMMs, and the round trip of the (routes, N) product through HBM, go away.
    SILU = "silu"
    SWIGLUOAI = "swigluoai"

    @property
    def is_gated(self) -> bool:
        return self in (Epilogue.SILU, Epilogue.SWIGLUOAI)


@dataclass(frozen=True)
class GemmSpec(SpecKey):
    FAMILY = "w4a16_moe_gemm"
    VERSION = 2  # 2: the bias parameter(s) joined the ABI
    # The kernel's parameters, in order (16-byte aligned pointers); the runtime launches by these names.
    SIGNATURE = Signature(
        (
            ptr("a", Pointee.ELEM, "(rows, K) dtype row-major activations"),
            ptr("qweight", Pointee.I32, "(E, K/16, 2N) int32 packed FP4 weights (docs/layouts.md); "
                "modelopt: (E, N, K/2) uint8 as stored"),
            ptr("out", Pointee.ELEM, "(routes, N) dtype row-major output, row = route index"),
            ptr("scales", Pointee.U8, "(E, K/16, N) uint8 S0E5M3 block scales, permuted; modelopt: "
                "(E, N, K/16) e4m3 as stored"),
            ptr("global_scale", Pointee.F32, "(E,) float32, decode compensation folded in; (E, 2) "
                "[gate, up] with split_global_scale"),
            ptr("route_indices", Pointee.I32, "int32 packed route indices, or flat topk_ids (direct)"),
            ptr("block_experts", Pointee.I32, "int32 expert per packed block (-1 = empty)"),
            ptr("route_count", Pointee.I32, "int32[1] packed slot count"),
            ptr("topk_weights", Pointee.F32, "(routes,) float32 router weights (read if mul_topk_weights)"),
            ptr("bias", Pointee.ELEM, "(E, n_out) dtype per-expert bias, added before the router weight "
                "and relu2 (read if bias)"),
            ptr("c_tmp", Pointee.F32, "float32 split-K partials, lock_slots * 16*m_blocks * tile_n"),
            ptr("locks", Pointee.I32, "int32[lock_slots] split-K turn counters, zero between launches"),
            i32("tokens", "M, the number of token rows routed (routes = M * top_k)"),
            i32("num_experts", "E, experts in the weights: a route or block whose expert "
                "is outside [0, E) is skipped (masked routes, e.g. -1, never index the weights)"),
        )
    )

    dtype: DType
    n: int
    k: int
    top_k: int
    tile_n: int
    tile_k: int
    moe_block_size: int
    blocks_per_sm: int
    mul_topk_weights: bool = False
    routes: Routes = Routes.PACKED
    epilogue: Epilogue = Epilogue.NONE
    layout: str = "packed"
    scale_format: str = "e4m3_k16"
    stages: int = STAGES
    # 8-row blocks: when every output tile fits in the grid, give each CTA one whole tile (the
    # seed's choice, made for the fused kernel's barriers) instead of splitting K over the grid.
    whole_tiles_m8: bool = True
    # Logical sizes when the stored weights are zero-padded (runtime/weights.stored_dims): A rows
    # are k_in wide and out rows n_out wide; None = not padded.  Both are multiples of 8.
    n_out: int | None = None
    k_in: int | None = None
    # Fused top-k sum (FC2 of the fused kernel or of a layer run as two GEMMs, any loop): 0 = off;
    # else `out` is (tokens / sum_topk, N) and each route's row is added with red.add into
    # out[route // sum_topk] (zeroed beforehand).
    sum_topk: int = 0
    mainloop: Mainloop = Mainloop.MMA_SYNC
    # Per-expert bias (gpt-oss): bias[e, :n_out] added to each output row before the router weight
    # and relu2, in float32 on the rounded product (one extra rounding to dtype).
    bias: bool = False
    # The gated epilogue's activation parameters (ActivationSpec's); None for the other epilogues.
    fast_math: bool | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    swiglu_limit: float | None = None
    # The modelopt layout (weights read as ModelOpt stores them): output column c of the GEMM reads
    # stored weight row (c + n_rotation) % n (W13 stored up rows first, "w31": n_rotation = I), and
    # with split_global_scale the global scale is (E, 2), one per half of N ([gate | up]).
    n_rotation: int | None = None
    split_global_scale: bool | None = None
    # The modelopt layout: the exponent of its scale decode (s * 2**scale_exponent), the runtime's
    # MODELOPT_SCALE_EXPONENT[dtype] when built; the weights' global scale undoes it, so a kernel built
    # with another one is refused (`modelopt_scale_exponent`).  None for the other layouts.
    scale_exponent: int | None = None
    # The wgmma loop with a producer warpgroup (codegen/kernels/w4a16/wgmma_ws.py): True, or None for the
    # loop whose warpgroups copy their own stages.
    producer_warp: bool | None = None
    # The block size of the route packing this GEMM reads, when it is a multiple of its own (a layer's FC2
    # on 128-row blocks after an FC1 on 256-row ones): route block b's expert is block_experts[b // ratio],
    # and blocks that hold only padding are skipped.  None: the packing's blocks are this GEMM's.
    packing_block: int | None = None

    # added after keys existed: left out of the key while None, so those keys keep their digests
    KEY_OMITS_NONE = frozenset({"fast_math", "swiglu_alpha", "swiglu_beta", "swiglu_limit", "n_rotation",
                                "split_global_scale", "scale_exponent", "producer_warp", "packing_block"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "mainloop", Mainloop(self.mainloop))
        object.__setattr__(self, "routes", Routes(self.routes))
        object.__setattr__(self, "epilogue", Epilogue(self.epilogue))
        if (self.layout, self.scale_format) not in WEIGHT_FORMATS:
            raise BadInputError(
                f"layout/scale_format must be one of {[f'{a}/{b}' for a, b in WEIGHT_FORMATS]}, "
                f"got {self.layout!r}/{self.scale_format!r}"
            )
        if self.nf3 and (self.dtype is not DType.BF16 or self.mainloop is not Mainloop.MMA_SYNC):
            raise BadInputError(f"NF3 weights are decoded by the mma.sync loop for bf16 activations, got "
                                f"{self.dtype.value} / {self.mainloop.value}")
        for name in ("n", "k", "top_k", "tile_n", "tile_k", "moe_block_size", "blocks_per_sm"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise BadInputError(f"{name} must be a positive int, got {v!r}")
        sizes = ALLOWED_MOE_BLOCK_SIZES if self.mainloop is Mainloop.MMA_SYNC else WGMMA_BLOCK_SIZES
        if self.moe_block_size not in sizes:
            raise BadInputError(
                f"moe_block_size must be one of {sizes} for mainloop={self.mainloop.value}, got {self.moe_block_size}"
            )
        if self.tile_n % 64 or self.tile_k % 64:
            raise BadInputError(f"tile_n and tile_k must be multiples of 64, got {self.tile_n}x{self.tile_k}")
        TileConfig(self.tile_k, self.tile_n)  # validates the thread count (128 or 256)
        if self.n % 64 or self.k % 64:
            raise BadInputError(f"N={self.n} and K={self.k} must be multiples of 64 (whole slabs and k-tiles)")
        # part tiles: the packed layout masks both sizes, the stored one (modelopt) its N rows, NF3 neither
        if ((self.n_tail or self.k_tail) and (self.nf3 or self.producer_warp)
                or self.k_tail and self.modelopt):
            raise BadInputError(
                f"N={self.n}, K={self.k} end in part tiles of {self.tile_n}x{self.tile_k}: the packed layout masks "
                f"both, the modelopt layout N only, and neither with a producer warpgroup; got layout "
                f"{self.layout}, producer_warp {self.producer_warp}"
            )
        self._check_modelopt()
        for name, stored in (("n_out", self.n), ("k_in", self.k)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 < v < stored or v % 8):
                raise BadInputError(f"{name} must be None or a multiple of 8 in (0, {stored}), got {v!r}")
        if self.routes is not Routes.PACKED and self.moe_block_size != 8:
            raise BadInputError(f"routes={self.routes.value} uses 8-row blocks, got moe_block_size {self.moe_block_size}")
        if self.packing_block is not None and not (
                type(self.packing_block) is int and self.routes is Routes.PACKED
                and self.packing_block % self.moe_block_size == 0 and _power_of_two(self.packing_ratio)
                and self.packing_ratio > 1):
            raise BadInputError(f"packing_block must be None or a power-of-two multiple (> 1) of moe_block_size "
                                f"{self.moe_block_size} with packed routes, got {self.packing_block!r}")
        if not isinstance(self.stages, int) or not 3 <= self.stages <= 12:
            raise BadInputError(f"stages must be an int in [3, 12], got {self.stages!r}")
        if not isinstance(self.sum_topk, int) or self.sum_topk < 0:
            raise BadInputError(f"sum_topk must be a non-negative int, got {self.sum_topk!r}")
        if self.sum_topk and (self.top_k != 1 or self.epilogue is not Epilogue.NONE):
            raise BadInputError("sum_topk (fused top-k sum) needs top_k=1 (route rows) and no epilogue")
        if not 1 <= self.blocks_per_sm <= 8:
            raise BadInputError(f"blocks_per_sm must be in [1, 8], got {self.blocks_per_sm}")
        if self.mainloop is Mainloop.WGMMA:
            wanted = (True, Routes.PACKED)
            given = (self.tile in wgmma_tiles(self.moe_block_size), self.routes)
            if given != wanted:
                raise BadInputError(
                    f"mainloop=wgmma implements tiles {[f'{t.tile_n}x{t.tile_k}' for t in wgmma_tiles(self.moe_block_size)]} "
                    f"for {self.moe_block_size}-row blocks and packed routes; got tile "
                    f"{self.tile_n}x{self.tile_k}, routes {self.routes.value}"
                )

        if self.producer_warp is not None:
            wanted = (True, Mainloop.WGMMA, "packed", True, WGMMA_WS_TILE)
            given = (self.producer_warp, self.mainloop, self.layout, self.moe_block_size in WGMMA_WS_BLOCKS, self.tile)
            if given != wanted:
                raise BadInputError(
                    f"producer_warp must be None or True, for the wgmma loop on packed weights, "
                    f"{WGMMA_WS_BLOCKS}-row blocks and the {WGMMA_WS_TILE.tile_n}-wide tile; got {self.producer_warp!r}, "
                    f"mainloop {self.mainloop.value}, layout {self.layout}, {self.moe_block_size}-row blocks, "
                    f"tile {self.tile_n}x{self.tile_k}")

        act_facts = (self.fast_math, self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit)
        if self.epilogue.is_gated:
            if self.n_out is not None or self.n % 128 or self.tile_n % 128 or self.n_tail:
                raise BadInputError(
                    f"epilogue={self.epilogue.value} (gated) needs an unpadded N and whole tiles of gate | up "
                    f"64-column slab pairs (N and tile_n multiples of 128, tile_n dividing N); got N={self.n}, "
                    f"n_out={self.n_out}, tile_n={self.tile_n}"
                )
            if not isinstance(self.fast_math, bool):
                raise BadInputError(f"epilogue={self.epilogue.value} needs fast_math True or False, got {self.fast_math!r}")
            self.activation_spec  # validates the swiglu parameters
        elif act_facts != (None, None, None, None):
            raise BadInputError(f"fast_math and swiglu_* belong to the gated epilogues, not {self.epilogue.value}")

    def _check_modelopt(self) -> None:
        if not self.modelopt:
            if (self.n_rotation, self.split_global_scale, self.scale_exponent) != (None, None, None):
                raise BadInputError("n_rotation, split_global_scale and scale_exponent belong to the modelopt "
                                    f"layout, got layout {self.layout}")
            return
        check_modelopt_scale_exponent(self.scale_exponent, self.dtype)
        wgmma = self.mainloop is Mainloop.WGMMA
        if self.n_out is not None or self.k_in is not None:
            raise BadInputError(f"modelopt weights are read as stored (unpadded); got n_out {self.n_out}, "
                                f"k_in {self.k_in}")
        # the mma.sync loop reads a tile's rows as one run from its first; the wgmma loop and gated
        # epilogues row by row
        rotation_step = 64 if wgmma or self.epilogue.is_gated else self.tile_n
        if self.n_rotation is not None and (not isinstance(self.n_rotation, int) or isinstance(self.n_rotation, bool)
                                            or not 0 < self.n_rotation < self.n or self.n_rotation % rotation_step):
            raise BadInputError(f"n_rotation must be None or a multiple of {rotation_step} in (0, {self.n}), "
                                f"got {self.n_rotation!r}")
        if self.n_tail and (self.n_rotation is not None or self.split_global_scale):
            raise BadInputError(f"a last tile past N={self.n} reads one run of unrotated rows: not with "
                                f"n_rotation {self.n_rotation} or split_global_scale")
        if self.split_global_scale not in (None, True):
            raise BadInputError(f"split_global_scale must be None or True, got {self.split_global_scale!r}")
        # each 64-column slab of a gated wgmma tile reads one half; other tiles must sit in one half
        if self.split_global_scale and self.n % (128 if self.epilogue.is_gated else 2 * self.tile_n):
            raise BadInputError(f"split_global_scale needs whole tiles in each half of N={self.n} "
                                f"(tile_n={self.tile_n})")

    # --------------------------------------------------------------- geometry

    @property
    def packing_ratio(self) -> int:
        """Route blocks of this GEMM per block of the packing it reads (packing_block; 1 without one)."""
        return 1 if self.packing_block is None else self.packing_block // self.moe_block_size

    @property
    def activation_spec(self) -> ActivationSpec:
        """The activation a gated epilogue applies (the activation kernel's spec, same math)."""
        assert self.epilogue.is_gated, self.epilogue
        given = (self.fast_math, self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit)
        spec = ActivationSpec.create(self.epilogue.value, self.dtype, self.n // 2, fast_math=self.fast_math,
                                     swiglu_alpha=self.swiglu_alpha, swiglu_beta=self.swiglu_beta,
                                     swiglu_limit=self.swiglu_limit)
        if (spec.fast_math, spec.swiglu_alpha, spec.swiglu_beta, spec.swiglu_limit) != given:
            raise BadInputError(f"epilogue={self.epilogue.value}: give the swiglu parameters ActivationSpec.create "
                                f"fills (swigluoai: alpha, beta, limit), got {given[1:]}")
        return spec

    @property
    def tile(self) -> TileConfig:
        return TileConfig(self.tile_k, self.tile_n)

    @property
    def threads(self) -> int:
        """Threads of a CTA: those that compute tiles, and the producer warpgroup if there is one."""
        return self.compute_threads + (PRODUCER_THREADS if self.producer_warp else 0)

    @property
    def compute_threads(self) -> int:
        """Threads that decode, multiply and store (every thread but the producer warpgroup)."""
        return wgmma_threads(self.moe_block_size, self.tile) if self.mainloop is Mainloop.WGMMA else self.tile.threads

    @property
    def m_blocks(self) -> int:
        """16-row MMA blocks per CTA tile (the 8-row path uses one, half filled)."""
        return cta_m_blocks(self.moe_block_size)

    @property
    def n_blocks(self) -> int:
        return self.tile.n_blocks

    @property
    def k_blocks(self) -> int:
        return self.tile.k_blocks

    @property
    def out_width(self) -> int:
        """Elements per output row: the logical N, or N / 2 after a gated epilogue."""
        return self.bias_width // 2 if self.epilogue.is_gated else self.bias_width

    @property
    def bias_width(self) -> int:
        """Elements per bias row: the logical N."""
        return self.n if self.n_out is None else self.n_out

    @property
    def a_width(self) -> int:
        """Elements per activation row (the logical K)."""
        return self.k if self.k_in is None else self.k_in

    @property
    def n_tiles(self) -> int:
        return tile_count(self.n, self.tile_n)

    @property
    def n_tail(self) -> bool:
        """The last N tile is part past N (N = 64 mod 128, runtime/weights.py; the modelopt layout's stored N):
        its weight and scale copies there are zero-filled and its outputs there not stored."""
        return self.n % self.tile_n != 0

    @property
    def k_tiles(self) -> int:
        return tile_count(self.k, self.tile_k)

    @property
    def k_tail(self) -> bool:
        """The last k-tile is part past K (K = 64 mod 128 on a 128-deep tile): its copies of weights, scales
        and activations past K are zero-filled, so they add exact zeros."""
        return self.k % self.tile_k != 0

    @property
    def n_warps(self) -> int:
        """Warps side by side along N (64 columns each)."""
        return self.n_blocks // 4

    # A (activations): one row of a stage is tile_k elements = k_blocks * 2 int4.
    @property
    def a_sh_stride(self) -> int:
        return 2 * self.k_blocks

    @property
    def a_sh_stage(self) -> int:
        return self.a_sh_stride * 16 * self.m_blocks

    @property
    def a_rows_per_iter(self) -> int:
        return self.threads // self.a_sh_stride

    @property
    def a_sh_wr_delta(self) -> int:
        return self.a_sh_stride * self.a_rows_per_iter

    @property
    def a_sh_wr_iters(self) -> int:
        return -(-self.a_sh_stage // self.a_sh_wr_delta)

    @property
    def nf3(self) -> bool:
        return self.layout == "nf3"

    @property
    def modelopt(self) -> bool:
        return self.layout == "modelopt"

    @property
    def modelopt_chunks(self) -> int:
        """16-byte chunks (32 k each) of one weight row in a modelopt stage (row = one output column)."""
        return self.tile_k // 32

    # B (weights): a 16-k row of the tile is tile_n * 16 / 8 words = tile_n / 2 int4.  NF3: a 32-k
    # row is tile_n * 12 bytes (runtime/nf3.py), 3/4 of the two 16-k rows it replaces.
    @property
    def b_sh_stride(self) -> int:
        return self.tile_n // 2

    @property
    def b_sh_stage(self) -> int:
        if self.nf3:
            return self.nf3_tile_row_int4 * (self.tile_k // NF3_BLOCK_K)
        return self.b_sh_stride * self.k_blocks

    @property
    def nf3_tile_row_int4(self) -> int:
        """int4 of a tile's slice of one 32-k NF3 row (tile_n * 12 bytes)."""
        return self.tile_n * NF3_COLUMN_BYTES // 16

    @property
    def nf3_row_int4(self) -> int:
        """int4 of one whole 32-k NF3 row of the weight (n * 12 bytes)."""
        return self.n * NF3_COLUMN_BYTES // 16

    @property
    def nf3_expert_int4(self) -> int:
        return self.k // NF3_BLOCK_K * self.nf3_row_int4

    @property
    def b_copies(self) -> int:
        """cp.async B copies per thread per stage (rounded up: NF3 stages are 1.5 copies a thread)."""
        return -(-self.b_sh_stage // self.threads)

    @property
    def b_sh_wr_iters(self) -> int:
        """16-k rows each thread consumes per stage (NVFP4: = cp.async B copies per thread per stage).

        Always 2: (tile_n/2 * tile_k/16) / (tile_n * tile_k / 64); the main loop relies on it (an
        NF3 thread's two rows are one 32-k row: one scale row).
        """
        rows = self.b_sh_stride * self.k_blocks // self.threads
        assert rows == 2, rows
        return rows

    # Scales: one byte per column per 16-k row: tile_n / 16 int4 per row.
    @property
    def s_sh_stride(self) -> int:
        return self.tile_n // 16

    @property
    def s_sh_stage(self) -> int:
        return self.tile_k // ScaleFormat(self.scale_format).group_size * self.s_sh_stride

    # Shared-memory map (int4 offsets).  Route metadata first, then one region
    # reused by the B pipeline and the epilogue reduction, then scales, then A.
    @property
    def sh_route_off(self) -> int:
        return 0

    @property
    def sh_rd_route_off(self) -> int:
        return self.moe_block_size // 4

    @property
    def sh_topk_off(self) -> int:
        return self.moe_block_size // 2

    @property
    def sh_valid_count_off(self) -> int:
        # no longer written (the count comes from a popc barrier); kept so the shared-memory
        # footprints stay the ones the planner's tables were measured with
        return self.moe_block_size // 2 + self.moe_block_size // 2

    @property
    def sh_b_off(self) -> int:
        return self.sh_valid_count_off + 1

    @property
    def sh_red_off(self) -> int:
        return self.sh_b_off

    @property
    def sh_s_off(self) -> int:
        red = (2 * self.n_blocks + 1) * 16 * self.m_blocks
        b = self.stages * self.b_sh_stage
        return self.sh_b_off + max(red, b)

    @property
    def sh_a_off(self) -> int:
        return self.sh_s_off + self.stages * self.s_sh_stage

    @property
    def shared_bytes(self) -> int:
        if self.producer_warp:
            return self.ws_layout.footprint
        if self.mainloop is Mainloop.WGMMA:
            # route metadata, slack to align the stages to a swizzle atom, the stages
            assert 16 * self.sh_b_off == route_metadata_bytes(self.moe_block_size)
            return wgmma_shared_memory_footprint(self.moe_block_size, self.tile, self.stages)
        return 16 * (self.sh_a_off + self.stages * self.a_sh_stage)

    # wgmma stages (bytes, from the aligned base): all activation stages, then all weight
    # stages, then all scale stages.  The epilogue stages the output tile over them.
    @property
    def wg_stage_base(self) -> int:
        """Bytes from the dynamic shared base to the first stage before aligning it."""
        return 16 * self.sh_b_off

    @property
    def wg_x_stage_bytes(self) -> int:
        return wgmma_stage_parts(self.moe_block_size, self.tile)[0]

    @property
    def wg_w_stage_bytes(self) -> int:
        return wgmma_stage_parts(self.moe_block_size, self.tile)[1]

    @property
    def wg_s_stage_bytes(self) -> int:
        return wgmma_stage_parts(self.moe_block_size, self.tile)[2]

    @property
    def ws_layout(self):
        """The producer-warpgroup kernel's shared-memory offsets (geometry.WgmmaWsLayout)."""
        assert self.producer_warp
        return wgmma_ws_layout(self.moe_block_size, self.tile, self.stages)

    @property
    def wg_out_row_bytes(self) -> int:
        """Bytes per staged output row in the epilogue (+16 against bank conflicts)."""
        return wgmma_out_row_bytes(self.tile)

    @property
    def waits_on_grid(self) -> bool:
        """Its CTAs wait on each other (split-K turns), so its grid must be resident at once."""
        return True

    @property
    def dynamic_smem_bytes(self) -> int:
        """Shared memory requested at launch (the manifest records it; all of it is dynamic)."""
        return self.shared_bytes
