"""Route packing: group the top-k routes by (local) expert, padded to the GEMM's M-block.

The grouped GEMMs read their A rows through an index list, one expert per block
of `b` rows.  This module owns that list's contract, the kernels' specialization
facts and signature, the launch plan and the public `pack_routes`.

Inputs
    topk_ids    (M, top_k) int32 | int64, contiguous: the expert of each route.
                Route r = token * top_k + k (the flattened index).
    expert_map  optional (num_experts,) int32: global expert -> local expert, or -1
                when the expert lives on another GPU (expert parallelism).  Local ids
                must be < num_experts (a rank never holds more experts than exist).
    b           block size, one of ALLOWED_BLOCK_SIZES (the GEMM's M-block).

Outputs (int32; preallocate them for CUDA-graph capture)
    packed_route_indices  (capacity_slots,)  experts in increasing order; within an
                expert, its routes in increasing route index, then the sentinel
                M * top_k up to the next multiple of b.  Every slot at or past the
                packed count also holds the sentinel.
    block_expert_ids      (capacity_blocks,) the expert of each block of b slots;
                -1 for every block at or past the packed count.
    packed_route_count    (1,)  number of packed slots, a multiple of b.

    e.g. b = 4, top_k = 2, topk_ids = [[2, 0], [2, 1], [0, 2]]  (routes 0..5, sentinel 6)
         packed_route_indices = [1 4 6 6 | 3 6 6 6 | 0 2 5 6 | 6 6 6 6 ...]
         block_expert_ids     = [0 | 1 | 2 | -1 ...],  packed_route_count = [12]

Routes whose expert maps to -1 are dropped.  Ids outside [0, num_experts) (and
mapped ids outside it) are dropped on the device too: checking them on the host
would need a device-to-host copy, i.e. a sync, on the serving path.

The order within an expert is fixed by the route index, not by which thread ran
first, so the output is bitwise reproducible (CUDA-graph replay equals eager).

Kernels (all 512 threads; `threads` and `max_experts` are part of the key):
    single    one CTA does everything (routes <= SINGLE_CTA_MAX_ROUTES; decode).
    multi     one launch of one CTA per chunk: CTA c counts the routes of chunk c per
              expert into workspace counts[c, e]; every CTA meets at a grid barrier
              (barrier words at the start of the workspace); then each CTA reads every
              chunk's counts for its own first slot per expert, writes chunk c's routes
              in order and fills its share of block_expert_ids / the sentinels.  (Until
              2026-12-02 these were three launches, count / scan / scatter: ~11 us of
              latency from 8192 routes up, docs/benchmarks.md.)
The grids depend only on M * top_k: capture once per token count, replay freely.

The multi stage's barrier word (the workspace's first) must have its low 31 bits zero at launch:
every launch leaves it so (the barrier flips only its top bit), `route_pack_workspace` and the layer's
workspaces allocate it zeroed, and `pack_routes` zeroes it in a workspace the caller passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch

from ..abi import Pointee, Signature, i32, ptr
from ..bundle import Bundle, LoadedKernel, current_stream_handle, registered_bundle
from ..errors import BadInputError, BundleError
from ..keys import SpecKey
from ..tensors import INT32_MAX, check_apart, check_rank

ALLOWED_BLOCK_SIZES = (8, 16, 32, 48, 64, 128, 256)  # the GEMM's route block sizes (128, 256: wgmma only)
THREADS = 512  # threads per CTA: one per expert in the scan
WARPS = THREADS // 32
MAX_EXPERTS = 512  # per-warp counts live in shared memory: WARPS x MAX_EXPERTS int32
# Shared memory of every route-pack kernel (one storage layout for all stages):
# per-warp counts, expert ends, expert fill marks, per-warp scan sums.
SMEM_BYTES = 4 * (WARPS * MAX_EXPERTS + 2 * MAX_EXPERTS + WARPS)
# Above this many routes, the multi-CTA stage.  The single stage holds up to 4096 routes in
# registers (8 per thread).  Measured alone on the H200 (benchmarks/route_pack_stages.py, E = 128,
# top-8, docs/benchmarks.md): single 6.3 / 7.3 / 8.3 / 10.9 us at 512 / 1024 / 2048 / 4096 routes,
# multi with 512-route chunks 8.9 / 8.7 / 8.3 / 8.3 (2048-route chunks: 9.2-10.7).
SINGLE_CTA_MAX_ROUTES = 2048
MULTI_MIN_CHUNK = 512  # routes per CTA on the multi-CTA path (one step a warp), at least ...
# ... and at most this many CTAs.  They meet at a grid barrier, so all must be co-resident: at 86
# registers a 512-thread CTA takes most of an SM's register file (one CTA an SM), and the smallest
# profile (GB10) has 48 SMs (tests/test_route_pack.py checks the cap against every profile).
MULTI_MAX_CTAS = 32
# The most chunks the multi stage's kernel reads the counts of (one round of predicated loads); the
# planner never exceeds MULTI_MAX_CTAS.
MULTI_MAX_CHUNKS = 64
assert MULTI_MAX_CTAS <= MULTI_MAX_CHUNKS
BARRIER_WORDS = 2  # the multi stage's grid barrier (its word, then one unused) opens its workspace


class RouteStage(str, Enum):
    SINGLE = "single"
    MULTI = "multi"


class IdsDType(str, Enum):
    INT32 = "int32"
    INT64 = "int64"

    @property
    def torch(self) -> torch.dtype:
        return torch.int32 if self is IdsDType.INT32 else torch.int64

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "IdsDType":
        if dtype == torch.int32:
            return cls.INT32
        if dtype == torch.int64:
            return cls.INT64
        raise BadInputError(f"topk_ids must be int32 or int64, got {dtype}")


@dataclass(frozen=True)
class RoutePackSpec(SpecKey):
    """One route-pack kernel: its stage and, for stages that read topk_ids, their dtype.

    Every stage takes the same parameters (a stage ignores those it does not use),
    so the signature is declared once for the family.  Pointers are only element-aligned:
    the buffers may be slices of a larger workspace.
    """

    FAMILY = "moe_route_pack"
    VERSION = 2  # 2: one multi-CTA stage with a grid barrier instead of count / scan / scatter
    SIGNATURE = Signature(
        (
            ptr("topk_ids", Pointee.IDS, "(routes,) int32|int64 expert per route (flattened (M, top_k))", align=None),
            ptr("expert_map", Pointee.I32, "(num_experts,) int32 global -> local expert, -1 = not here; "
                "any valid pointer when has_expert_map = 0", align=None),
            ptr("packed_route_indices", Pointee.I32, "(capacity_slots,) int32 out", align=None),
            ptr("block_expert_ids", Pointee.I32, "(capacity_blocks,) int32 out", align=None),
            ptr("packed_route_count", Pointee.I32, "(1,) int32 out", align=None),
            ptr("workspace", Pointee.I32, "(2 + num_chunks * num_experts,) int32 scratch of the multi stage, "
                "zero before its first launch", align=None),
            i32("routes", "M * top_k; also the sentinel"),
            i32("num_experts", "1 <= num_experts <= max_experts"),
            i32("has_expert_map", "0 or 1"),
            i32("block_size", "one of ALLOWED_BLOCK_SIZES"),
            i32("capacity_slots", "length of packed_route_indices"),
            i32("capacity_blocks", "length of block_expert_ids"),
            i32("chunk_routes", "routes per CTA (the single stage: routes)"),
            i32("num_chunks", "CTAs of the multi stage's grid (1 for single)"),
        )
    )
    CONSTANT_FACTS = {"threads": THREADS, "max_experts": MAX_EXPERTS}

    stage: RouteStage
    ids_dtype: IdsDType

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", RouteStage(self.stage))
        if self.ids_dtype is None:
            raise BadInputError(f"the {self.stage.value} stage needs ids_dtype (int32 or int64)")
        object.__setattr__(self, "ids_dtype", IdsDType(self.ids_dtype))


def route_pack_specs() -> list[RoutePackSpec]:
    """Every route-pack kernel a bundle needs to serve any problem (4 kernels per arch)."""
    return [RoutePackSpec(stage, ids) for ids in IdsDType for stage in RouteStage]


# -- planning (host arithmetic only) --------------------------------------------------


def max_packed_route_slots(routes: int, block_size: int, num_experts: int) -> int:
    """Slots that can hold any packing of `routes` routes into blocks of `block_size`.

    At most min(num_experts, routes) experts are non-empty and each pads by at most
    block_size - 1, so routes + groups * (block_size - 1) slots, rounded up to a whole
    block.  (The true maximum is a multiple of block_size below that sum, so rounding up
    is conservative by at most one block; buffers sized by it suffice.)
    """
    if not isinstance(routes, int) or routes < 0:
        raise BadInputError(f"routes must be a non-negative int, got {routes!r}")
    for name, value in (("block_size", block_size), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInputError(f"{name} must be a positive int, got {value!r}")
    slots = routes + min(num_experts, routes) * (block_size - 1)
    return -(-slots // block_size) * block_size


def direct_route_ids(topk_ids: torch.Tensor, num_experts: int, *, wide: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """topk_ids as the int32 the direct-route kernels read, every out-of-range id kept out of range.

    int32 ids are returned as they are.  int64 ids are pinned to [-1, num_experts] first (`wide`,
    int64, their shape) and then narrowed (`out`, int32): a plain cast would wrap ids >= 2^31
    (e.g. 2^32 + 3 -> 3) into valid experts, while -1 and num_experts are dropped by the kernels
    like the originals.  Buffers not given are allocated; with both given nothing is.
    """
    if topk_ids.dtype == torch.int32:
        return topk_ids
    wide = torch.empty_like(topk_ids) if wide is None else wide
    torch.clamp(topk_ids, -1, num_experts, out=wide)
    out = torch.empty(topk_ids.shape, dtype=torch.int32, device=topk_ids.device) if out is None else out
    return out.copy_(wide)


@dataclass(frozen=True)
class RouteChunking:
    """How the routes are split across CTAs; depends only on the route count."""

    single: bool
    chunk_routes: int
    num_chunks: int

    @classmethod
    def for_routes(cls, routes: int) -> "RouteChunking":
        if routes <= SINGLE_CTA_MAX_ROUTES:
            return cls(True, routes, 1)
        chunk = max(MULTI_MIN_CHUNK, -(-routes // MULTI_MAX_CTAS))
        chunk = -(-chunk // THREADS) * THREADS  # whole warp iterations
        return cls(False, chunk, -(-routes // chunk))


def route_pack_workspace_elements(routes: int, num_experts: int) -> int:
    """int32 elements of workspace `pack_routes` needs for every count of up to `routes` routes; 0 where all
    of them take the single-CTA path.

    Layout: the grid barrier's BARRIER_WORDS (its word, low 31 bits zero between launches; unused),
    then each chunk's counts [num_chunks, num_experts].  The barrier words come first, so a
    workspace sized for many routes serves fewer from its start.  The chunk count does not grow with the
    route count (12288 routes take 24 chunks of 512, 16384 take 32, 24576 take 24 of 1024), so this is the
    most chunks any count up to `routes` takes: at most one per MULTI_MIN_CHUNK routes, and MULTI_MAX_CTAS.
    """
    if RouteChunking.for_routes(routes).single:
        return 0
    return BARRIER_WORDS + min(MULTI_MAX_CTAS, -(-routes // MULTI_MIN_CHUNK)) * num_experts


def route_pack_elements_used(routes: int, num_experts: int) -> int:
    """int32 elements of the workspace that packing exactly `routes` routes uses (at most
    `route_pack_workspace_elements(routes, ...)`)."""
    chunking = RouteChunking.for_routes(routes)
    return 0 if chunking.single else BARRIER_WORDS + chunking.num_chunks * num_experts


def route_pack_workspace(routes: int, num_experts: int, device) -> torch.Tensor:
    """A zeroed workspace for up to `routes` routes (its barrier word must start at zero)."""
    return torch.zeros(route_pack_workspace_elements(routes, num_experts), dtype=torch.int32, device=device)


# -- argument checks -------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    tokens: int
    top_k: int
    routes: int
    num_experts: int
    block_size: int
    capacity_slots: int  # minimum lengths of the outputs
    capacity_blocks: int
    workspace: int


def _check_problem(topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map) -> _Problem:
    check_rank(topk_ids, "topk_ids", 2, "(tokens, top_k)")
    IdsDType.from_torch(topk_ids.dtype)
    if not topk_ids.is_contiguous():
        raise BadInputError(f"topk_ids must be contiguous (row-major), got strides {topk_ids.stride()}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise BadInputError(
            f"num_experts must be an int in [1, {MAX_EXPERTS}] (the kernels' shared-memory tables), got {num_experts!r}"
        )
    if block_size not in ALLOWED_BLOCK_SIZES or isinstance(block_size, bool):
        raise BadInputError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {block_size!r}")
    tokens, top_k = topk_ids.shape
    routes = tokens * top_k
    slots = max_packed_route_slots(routes, block_size, num_experts)
    if slots + block_size + RouteChunking.for_routes(routes).chunk_routes > INT32_MAX:
        raise BadInputError(
            f"{tokens} tokens x top_k {top_k} = {routes} routes need {slots} packed slots; "
            f"slot indices are int32, so at most about {INT32_MAX} are supported"
        )
    if expert_map is not None:
        check_rank(expert_map, "expert_map", 1, f"({num_experts},) global -> local expert")
        if expert_map.dtype != torch.int32:
            raise BadInputError(f"expert_map must be int32, got {expert_map.dtype}")
        if expert_map.shape[0] != num_experts:
            raise BadInputError(
                f"expert_map must have shape ({num_experts},) (one entry per global expert), "
                f"got {tuple(expert_map.shape)}"
            )
        if not expert_map.is_contiguous():
            raise BadInputError("expert_map must be contiguous")
    workspace = route_pack_elements_used(routes, num_experts)
    return _Problem(tokens, top_k, routes, num_experts, block_size, slots, slots // block_size, workspace)


def _check_buffer(t, name: str, min_len: int, what: str, exact: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise BadInputError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise BadInputError(f"{name} must be a contiguous 1-D tensor ({what}), got shape {tuple(t.shape)} "
                            f"strides {t.stride()}")
    if (t.shape[0] != min_len) if exact else (t.shape[0] < min_len):
        need = f"exactly {min_len}" if exact else f"at least {min_len}"
        raise BadInputError(f"{name} must hold {need} elements ({what}), got {t.shape[0]}")
    if t.shape[0] > INT32_MAX:
        raise BadInputError(f"{name} has {t.shape[0]} elements; at most {INT32_MAX} are supported")


def _check_outputs(p: _Problem, packed, block_ids, count, workspace) -> None:
    _check_buffer(packed, "packed_route_indices", p.capacity_slots,
                  f"max_packed_route_slots({p.routes}, {p.block_size}, {p.num_experts})")
    _check_buffer(block_ids, "block_expert_ids", p.capacity_blocks, f"{p.capacity_slots} slots / {p.block_size}")
    if (block_ids.shape[0] + 1) * p.block_size > INT32_MAX:
        raise BadInputError(
            f"block_expert_ids has {block_ids.shape[0]} blocks of {p.block_size} slots; slot indices are int32, "
            f"so at most {INT32_MAX // p.block_size - 1} blocks are supported"
        )
    _check_buffer(count, "packed_route_count", 1, "the packed slot count", exact=True)
    _check_buffer(workspace, "workspace", p.workspace,
                  f"route_pack_elements_used({p.routes}, {p.num_experts}); allocate route_pack_workspace_elements of "
                  "the largest route count")


def _check_apart(topk_ids: torch.Tensor, expert_map, packed, block_ids, count, workspace) -> None:
    """No output shares memory with the ids, the expert map or another output (the kernels write the outputs
    while other CTAs still read the ids)."""
    outputs = (("packed_route_indices", packed), ("block_expert_ids", block_ids), ("packed_route_count", count),
               ("workspace", workspace))
    for i, (name, t) in enumerate(outputs):
        check_apart(t, name, topk_ids=topk_ids, expert_map=expert_map, **dict(outputs[i + 1:]))


def _check_devices(device: torch.device, tensors: dict) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise BadInputError(f"{name} must be on {device} (the bundle's device), got {t.device}")


# -- launch --------------------------------------------------------------------------


class _RoutePackPlan:
    """The kernels of one topk_ids dtype, resolved once per bundle; launches one packing."""

    def __init__(self, bundle: Bundle, ids_dtype: IdsDType):
        self.bundle = bundle
        self.ids_dtype = ids_dtype
        self._kernels: dict[RouteStage, LoadedKernel] = {}

    def kernel(self, stage: RouteStage) -> LoadedKernel:
        found = self._kernels.get(stage)
        if found is None:
            spec = RoutePackSpec(stage, self.ids_dtype)
            found = self.bundle.kernel(spec.key())
            found.bind(RoutePackSpec.SIGNATURE)
            if tuple(found.block) != (THREADS, 1, 1):
                raise BundleError(
                    f"{spec.key().describe()} was built with block {tuple(found.block)}, but this runtime "
                    f"plans for ({THREADS}, 1, 1); rebuild the bundle"
                )
            if stage is RouteStage.MULTI:  # its CTAs meet at a grid barrier
                found.mark_waits_on_grid()
            self._kernels[stage] = found
        return found

    def __call__(self, p: _Problem, ids, expert_map, packed, block_ids, count, workspace) -> None:
        chunking = RouteChunking.for_routes(p.routes)
        ids_ptr = ids.data_ptr()
        args = dict(  # every stage takes the same parameters (RoutePackSpec.SIGNATURE)
            topk_ids=ids_ptr,
            expert_map=ids_ptr if expert_map is None else expert_map.data_ptr(),
            packed_route_indices=packed.data_ptr(),
            block_expert_ids=block_ids.data_ptr(),
            packed_route_count=count.data_ptr(),
            workspace=ids_ptr if chunking.single else workspace.data_ptr(),
            routes=p.routes,
            num_experts=p.num_experts,
            has_expert_map=0 if expert_map is None else 1,
            block_size=p.block_size,
            capacity_slots=packed.shape[0],
            capacity_blocks=block_ids.shape[0],
            chunk_routes=chunking.chunk_routes,
            num_chunks=chunking.num_chunks,
        )
        stream = current_stream_handle(self.bundle.device_index)
        stage = RouteStage.SINGLE if chunking.single else RouteStage.MULTI
        self.kernel(stage).launch(chunking.num_chunks, stream, **args)


class PreparedRoutePack:
    """pack_routes for one (token count, top_k, ids dtype, block size, expert map, output buffers),
    checked once when built; a call passes only the ids, whose shape, dtype, device and contiguity
    the caller guarantees to be those of the `topk_ids` it was built with (MoeLayer checks them per
    call).  Every other argument is packed into the launches once (bundle.PreparedLaunch)."""

    def __init__(self, bundle: Bundle, topk_ids: torch.Tensor, num_experts: int, block_size: int, *,
                 expert_map: torch.Tensor | None, packed: torch.Tensor, block_ids: torch.Tensor,
                 count: torch.Tensor, workspace: torch.Tensor):
        p = _check_problem(topk_ids, num_experts, block_size, expert_map)
        _check_devices(bundle.device, {"topk_ids": topk_ids, "expert_map": expert_map, "packed_route_indices": packed,
                                       "block_expert_ids": block_ids, "packed_route_count": count,
                                       "workspace": workspace})
        _check_outputs(p, packed, block_ids, count, workspace)
        plan = bundle.plans.route_pack.get(("moe_route_pack", topk_ids.dtype),
                                           lambda: _RoutePackPlan(bundle, IdsDType.from_torch(topk_ids.dtype)))
        chunking = RouteChunking.for_routes(p.routes)
        unread = packed.data_ptr()  # a valid address for the pointers this launch does not read
        constants = dict(
            expert_map=unread if expert_map is None else expert_map.data_ptr(),
            packed_route_indices=packed.data_ptr(), block_expert_ids=block_ids.data_ptr(),
            packed_route_count=count.data_ptr(), workspace=unread if chunking.single else workspace.data_ptr(),
            routes=p.routes, num_experts=p.num_experts, has_expert_map=0 if expert_map is None else 1,
            block_size=p.block_size, capacity_slots=packed.shape[0], capacity_blocks=block_ids.shape[0],
            chunk_routes=chunking.chunk_routes, num_chunks=chunking.num_chunks,
        )
        stage = RouteStage.SINGLE if chunking.single else RouteStage.MULTI
        self._launch = plan.kernel(stage).prepare(("topk_ids",), **constants)
        self._grid = chunking.num_chunks
        self.outputs = (packed, block_ids, count)

    def __call__(self, topk_ids: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._launch.launch(self._grid, stream, topk_ids.data_ptr())
        return self.outputs


def _new_outputs(p: _Problem, device: torch.device, packed, block_ids, count, workspace):
    new = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
    return (
        new(p.capacity_slots) if packed is None else packed,
        new(p.capacity_blocks) if block_ids is None else block_ids,
        new(1) if count is None else count,
        torch.zeros(p.workspace, dtype=torch.int32, device=device) if workspace is None else workspace,
    )


def pack_routes(
    bundle: Bundle,
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    *,
    expert_map: torch.Tensor | None = None,
    packed_route_indices: torch.Tensor | None = None,
    block_expert_ids: torch.Tensor | None = None,
    packed_route_count: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the routes of `topk_ids` by expert, padded to `block_size`; see the module doc.

    Returns (packed_route_indices, block_expert_ids, packed_route_count), allocating the
    ones not given.  Output lengths: at least `max_packed_route_slots(M * top_k,
    block_size, num_experts)` slots and that / block_size blocks; `workspace` (int32) at
    least `route_pack_workspace_elements(M * top_k, num_experts)` (its barrier word is zeroed here
    before the multi stage runs).  Launches on torch's
    current stream without any host sync; CUDA-graph capturable when every buffer is given.
    """
    return _pack_routes(bundle, topk_ids, num_experts, block_size, expert_map, packed_route_indices,
                        block_expert_ids, packed_route_count, workspace, own_workspace=False)


def _pack_routes(bundle: Bundle, topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map,
                 packed_route_indices, block_expert_ids, packed_route_count, workspace, *, own_workspace: bool):
    """pack_routes; `own_workspace`: `workspace` is one of cuteaot's (GemmWorkspace.route_pack), zeroed when
    allocated and only ever written by route packing, so its barrier word's count bits are already zero."""
    p = _check_problem(topk_ids, num_experts, block_size, expert_map)
    device = bundle.device
    _check_devices(device, {"topk_ids": topk_ids, "expert_map": expert_map, "packed_route_indices":
                            packed_route_indices, "block_expert_ids": block_expert_ids,
                            "packed_route_count": packed_route_count, "workspace": workspace})
    packed, block_ids, count, ws = _new_outputs(
        p, device, packed_route_indices, block_expert_ids, packed_route_count, workspace
    )
    if torch.compiler.is_compiling():
        torch.ops.cuteaot.pack_routes(topk_ids, num_experts, block_size, expert_map, packed, block_ids, count, ws,
                                      bundle.id)
        return packed, block_ids, count
    _check_outputs(p, packed, block_ids, count, ws)
    _check_apart(topk_ids, expert_map, packed, block_ids, count, ws)
    if workspace is not None and p.workspace and not own_workspace:
        # a caller's workspace: whatever it holds, the multi stage's barrier word must start at zero (one
        # small fill; cuteaot's own workspaces were zeroed when allocated and every launch leaves it so)
        workspace[:1].zero_()
    cache_key = ("moe_route_pack", topk_ids.dtype)
    plan = bundle.plans.route_pack.get(cache_key, lambda: _RoutePackPlan(bundle, IdsDType.from_torch(topk_ids.dtype)))
    plan(p, topk_ids, expert_map, packed, block_ids, count, ws)
    return packed, block_ids, count


@torch.library.custom_op(
    "cuteaot::pack_routes",
    mutates_args=("packed_route_indices", "block_expert_ids", "packed_route_count", "workspace"),
)
def _pack_routes_op(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: Optional[torch.Tensor],
    packed_route_indices: torch.Tensor,
    block_expert_ids: torch.Tensor,
    packed_route_count: torch.Tensor,
    workspace: torch.Tensor,
    bundle_id: str,
) -> None:
    pack_routes(
        registered_bundle(bundle_id), topk_ids, num_experts, block_size, expert_map=expert_map,
        packed_route_indices=packed_route_indices, block_expert_ids=block_expert_ids,
        packed_route_count=packed_route_count, workspace=workspace,
    )


@_pack_routes_op.register_fake
def _pack_routes_fake(topk_ids, num_experts, block_size, expert_map, packed_route_indices, block_expert_ids,
                      packed_route_count, workspace, bundle_id) -> None:
    p = _check_problem(topk_ids, num_experts, block_size, expert_map)
    _check_outputs(p, packed_route_indices, block_expert_ids, packed_route_count, workspace)
