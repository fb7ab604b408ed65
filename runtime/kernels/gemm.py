"""`w4a16_moe_gemm`: one grouped W4A16 GEMM over routed tokens (usable as FC1 or FC2).

    a:        (M, K) token rows (FC1: each token feeds its top_k routes) or
              (M * top_k, K) route rows (FC2: `a_per_route=True`)
    weights:  PackedNvfp4 with N outputs, K inputs, E experts (runtime/weights.py)
    topk_ids: (M, top_k) int32/int64 expert of each route; a route whose id is outside [0, E)
              (e.g. -1 for a masked route) is dropped on the device: its row of `out` is not
              written (stays as it was), nothing else is affected
    out:      (M * top_k, N), row r = route r = token * top_k + k
              out[r] = a[src(r)] @ W[topk_ids[r]]^T  (* topk_weights[r] if mul_topk_weights)
                       (relu(.)**2 if epilogue="relu2")

The launch plan (route block size, tile, persistent grid) comes from
runtime/planning.py for the exact M and the bundle's device profile; it names
the kernel by key, so the bundle must have been built for this problem.  For
M <= 6 the routes are used directly (no packing); otherwise `pack_routes`
groups them by expert first.  A layer whose GEMMs share the routing (FC1 and
FC2) can pack once with `pack_gemm_routes` and pass `routes=` to each GEMM.  The whole persistent grid must be co-resident
(split-K slices wait on each other): checked with the occupancy API on the
first use of each kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cuda.bindings import driver

from ..bundle import Bundle, LoadedKernel, check_cu, current_stream_handle
from ..errors import BadInputError, LaunchError
from ..planning import GemmPlan, plan_gemm
from ..tensors import INT32_MAX, check_rank, check_tensor
from ..types import DType
from ..weights import PackedNvfp4, stored_dims
from .gemm_spec import Epilogue, GemmSpec, Mainloop, Routes
from .route_pack import pack_routes, route_pack_workspace_elements


@dataclass
class GemmWorkspace:
    """Buffers one GEMM launch needs; allocate once (e.g. for the largest M) to capture CUDA graphs.

    `locks` must be zero before the first launch; every launch leaves it zero.
    """

    c_tmp: torch.Tensor  # float32 split-K partials
    locks: torch.Tensor  # int32 split-K turn counters
    route_indices: torch.Tensor  # int32 packed route slots
    block_experts: torch.Tensor  # int32 expert per packed block
    route_count: torch.Tensor  # int32[1]
    route_pack: torch.Tensor  # int32 scratch of the multi-CTA route packing

    @classmethod
    def allocate(cls, plan: GemmPlan, m: int, top_k: int, num_experts: int, device,
                 at_least: "GemmWorkspace | None" = None) -> "GemmWorkspace":
        """Buffers for `plan` at M = m, each at least as large as in `at_least` (when growing one)."""
        def size(wanted: int, name: str) -> int:
            return max(wanted, 4, at_least and getattr(at_least, name).numel() or 0)

        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            c_tmp=torch.empty(size(plan.splitk_scratch_floats, "c_tmp"), dtype=torch.float32, device=device),
            locks=torch.zeros(size(plan.lock_slots, "locks"), **i32),
            route_indices=torch.empty(size(plan.max_route_slots, "route_indices"), **i32),
            block_experts=torch.empty(size(plan.max_route_blocks, "block_experts"), **i32),
            route_count=torch.zeros(1, **i32),
            route_pack=torch.empty(size(route_pack_workspace_elements(m * top_k, num_experts), "route_pack"), **i32),
        )

    def fits(self, plan: GemmPlan, m: int, top_k: int, num_experts: int) -> bool:
        return (
            self.c_tmp.numel() >= plan.splitk_scratch_floats
            and self.locks.numel() >= plan.lock_slots
            and self.route_indices.numel() >= plan.max_route_slots
            and self.block_experts.numel() >= plan.max_route_blocks
            and self.route_pack.numel() >= route_pack_workspace_elements(m * top_k, num_experts)
        )


@dataclass(frozen=True)
class GemmRoutes:
    """Routes of one `topk_ids` prepared for `w4a16_moe_gemm` (from `pack_gemm_routes`).

    `block_size` is the plan's route block (0 = direct top-k routes, nothing packed); a GEMM
    accepts these routes when its own plan for the same M uses the same block, which FC1 and
    FC2 of a layer usually do (it raises otherwise).
    """

    ids_ptr: int  # data_ptr of the topk_ids they were made from
    shape: tuple[int, int]  # (M, top_k)
    num_experts: int
    block_size: int
    route_indices: torch.Tensor
    block_experts: torch.Tensor
    route_count: torch.Tensor


def pack_gemm_routes(bundle: Bundle, topk_ids: torch.Tensor, weights: PackedNvfp4, *,
                     workspace: GemmWorkspace | None = None) -> GemmRoutes:
    """Pack `topk_ids` once for the GEMMs over `weights`-shaped problems at this M.

    Without a workspace the buffers are allocated here (not capturable); with one (e.g.
    GemmWorkspace.allocate for the largest M) the routes live in it, so do not hand the same
    workspace to a GEMM that packs for itself before these routes are used.
    """
    check_rank(topk_ids, "topk_ids", 2, "(M, top_k)")
    if not isinstance(weights, PackedNvfp4):
        raise BadInputError(f"weights must be a PackedNvfp4 (runtime/weights.py), got {type(weights).__name__}")
    m, top_k = topk_ids.shape
    plan = plan_for(m, weights.n, weights.k, top_k, weights.num_experts, bundle.profile)
    if workspace is None:
        workspace = GemmWorkspace.allocate(plan, m, top_k, weights.num_experts, bundle.device)
    elif not workspace.fits(plan, m, top_k, weights.num_experts):
        raise BadInputError(f"workspace is too small for M={m}; allocate it with GemmWorkspace.allocate for the largest M")
    return _routes(bundle, plan, topk_ids, weights.num_experts, workspace)


def _routes(bundle: Bundle, plan: GemmPlan, topk_ids: torch.Tensor, num_experts: int,
            workspace: GemmWorkspace) -> GemmRoutes:
    if plan.direct_topk_routes:
        ids = topk_ids if topk_ids.dtype == torch.int32 else direct_route_ids(topk_ids, num_experts)
        indices = block_experts = count = ids
        block_size = 0
    else:
        indices, block_experts, count = pack_routes(
            bundle, topk_ids, num_experts, plan.moe_block_size,
            packed_route_indices=workspace.route_indices[: plan.max_route_slots],
            block_expert_ids=workspace.block_experts[: plan.max_route_blocks],
            packed_route_count=workspace.route_count, workspace=workspace.route_pack,
        )
        block_size = plan.moe_block_size
    return GemmRoutes(topk_ids.data_ptr(), tuple(topk_ids.shape), num_experts, block_size, indices, block_experts,
                      count)


def direct_route_ids(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ids as the int32 the direct-route kernels read, every out-of-range id kept out of range.

    A plain cast would wrap ids >= 2^31 (e.g. 2^32 + 3 -> 3) into valid experts; clamping to
    [-1, num_experts] first keeps them dropped.  Two small element-wise launches (that allocate):
    int32 ids are the fast path.
    """
    return topk_ids.clamp(-1, num_experts).to(torch.int32)


def _check_routes(routes, topk_ids: torch.Tensor, num_experts: int, plan: GemmPlan) -> None:
    if not isinstance(routes, GemmRoutes):
        raise BadInputError(f"routes must come from pack_gemm_routes, got {type(routes).__name__}")
    if routes.ids_ptr != topk_ids.data_ptr() or routes.shape != tuple(topk_ids.shape):
        raise BadInputError(f"routes were packed from another topk_ids (shape {routes.shape}); pack these ids")
    if routes.num_experts != num_experts:
        raise BadInputError(f"routes were packed for {routes.num_experts} experts, the weights have {num_experts}")
    wanted = 0 if plan.direct_topk_routes else plan.moe_block_size
    if routes.block_size != wanted:
        raise BadInputError(
            f"routes were packed with block size {routes.block_size or 'direct'}, this GEMM's plan at "
            f"M={topk_ids.shape[0]} uses {wanted or 'direct'}: pack them with pack_gemm_routes for these weights"
        )


def plan_for(m: int, n: int, k: int, top_k: int, num_experts: int, profile) -> GemmPlan:
    """The launch plan for logical sizes n x k: planned on the zero-padded stored sizes."""
    n_stored, k_stored = stored_dims(n, k)
    return plan_gemm(m, n_stored, k_stored, top_k, num_experts, profile, scale_format="e4m3_k16")


def gemm_spec_for(plan: GemmPlan, dtype: DType, n: int, k: int, top_k: int, *, a_per_route: bool,
                  mul_topk_weights: bool, epilogue: Epilogue | str, layout: str = "packed",
                  scale_format: str = "e4m3_k16") -> GemmSpec:
    """The kernel specialization a plan selects for logical sizes n x k (shared with the enumeration).

    The plan must have been made for the stored sizes, `plan_for(m, n, k, ...)`.
    """
    n_stored, k_stored = stored_dims(n, k)
    return GemmSpec(
        dtype=dtype,
        n=n_stored,
        k=k_stored,
        n_out=None if n == n_stored else n,
        k_in=None if k == k_stored else k,
        top_k=1 if a_per_route else top_k,
        tile_n=plan.tile.tile_n,
        tile_k=plan.tile.tile_k,
        moe_block_size=plan.moe_block_size,
        blocks_per_sm=plan.blocks_per_sm,
        mul_topk_weights=mul_topk_weights,
        routes=Routes.DIRECT if plan.direct_topk_routes else Routes.PACKED,
        whole_tiles_m8=plan.whole_tiles_m8,
        epilogue=Epilogue(epilogue),
        layout=layout,
        scale_format=scale_format,
        mainloop=Mainloop(plan.mainloop),
    )


class PersistentLaunch:
    """A resolved persistent kernel (GEMM or fused MoE) whose co-residency has been checked.

    Its CTAs wait on each other (split-K turns, grid barriers), so a grid with CTAs that
    are not resident at once would deadlock: refuse the kernel instead.  Cached per spec.
    """

    def __init__(self, bundle: Bundle, spec):
        self.spec = spec
        self.kernel: LoadedKernel = bundle.kernel(spec.key())
        self.kernel.bind(spec.SIGNATURE)
        resident = check_cu(
            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.kernel.function, self.kernel.block[0], self.kernel.record.dynamic_smem_bytes
            ),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        if resident < spec.blocks_per_sm:
            raise LaunchError(
                f"{spec.key().describe()}: only {resident} CTAs per SM fit on {bundle.profile.name} "
                f"({self.kernel.record.registers} registers, {self.kernel.record.dynamic_smem_bytes} B shared), "
                f"the plan needs {spec.blocks_per_sm}; a persistent grid that is not co-resident can deadlock "
                "in its split-K waits or grid barriers. Rebuild the bundle for this device profile."
            )


def w4a16_moe_gemm(
    bundle: Bundle,
    a: torch.Tensor,
    weights: PackedNvfp4,
    topk_ids: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None = None,
    mul_topk_weights: bool = False,
    a_per_route: bool = False,
    epilogue: str = "none",
    out: torch.Tensor | None = None,
    workspace: GemmWorkspace | None = None,
    routes: GemmRoutes | None = None,
) -> torch.Tensor:
    """Grouped W4A16 GEMM of routed rows; returns `out` (M * top_k, N), allocated if None.

    Launches on torch's current stream.  CUDA-graph capturable when `out` and a
    `workspace` that fits (GemmWorkspace.allocate for the largest M) are given and
    topk_ids is int32 (int64 ids are converted, which allocates).  `routes` (from
    `pack_gemm_routes` on the same topk_ids) skips the route packing.
    """
    check_rank(topk_ids, "topk_ids", 2, "(M, top_k)")
    m, top_k = topk_ids.shape
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise BadInputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(weights, PackedNvfp4):
        raise BadInputError(f"weights must be a PackedNvfp4 (runtime/weights.py), got {type(weights).__name__}")
    if m * top_k > INT32_MAX // max(weights.n, 1):
        raise BadInputError(f"M * top_k = {m * top_k} routes of {weights.n} outputs exceed 32-bit indexing")
    device, dtype = bundle.device, weights.dtype.torch
    rows = m * top_k if a_per_route else m
    check_tensor(a, "a", dtype=dtype, shape=(rows, weights.k), device=device)
    check_tensor(topk_ids, "topk_ids", dtype=topk_ids.dtype, shape=(m, top_k), device=device, align=4)
    if weights.device != device:
        raise BadInputError(f"weights are on {weights.device}, the bundle on {device}")
    if mul_topk_weights:
        if topk_weights is None:
            raise BadInputError("mul_topk_weights=True needs topk_weights (M, top_k) float32")
        check_tensor(topk_weights, "topk_weights", dtype=torch.float32, shape=(m, top_k), device=device, align=4)
    if out is None:
        out = torch.empty((m * top_k, weights.n), dtype=dtype, device=device)
    check_tensor(out, "out", dtype=dtype, shape=(m * top_k, weights.n), device=device)
    if m == 0:
        return out

    cache_key = ("w4a16_moe_gemm", m, top_k, weights.n, weights.k, weights.num_experts, weights.dtype,
                 a_per_route, mul_topk_weights, epilogue)
    entry = bundle.plans.get(cache_key)
    if entry is None:
        plan = plan_for(m, weights.n, weights.k, top_k, weights.num_experts, bundle.profile)
        spec = gemm_spec_for(plan, weights.dtype, weights.n, weights.k, top_k, a_per_route=a_per_route,
                             mul_topk_weights=mul_topk_weights, epilogue=epilogue, layout=weights.layout,
                             scale_format=weights.scale_format)
        launch = bundle.plans.get(("w4a16_gemm_kernel", spec)) or PersistentLaunch(bundle, spec)
        bundle.plans[("w4a16_gemm_kernel", spec)] = launch
        entry = bundle.plans[cache_key] = (plan, launch)
    plan, launch = entry

    stream = current_stream_handle(bundle.device_index)
    if workspace is None:
        # One workspace per stream, grown on demand: launches on a stream are ordered, so they
        # can share it, and the locks stay zero between launches.
        ws_key = ("w4a16_gemm_workspace", stream)
        workspace = bundle.plans.get(ws_key)
        if workspace is None or not workspace.fits(plan, m, top_k, weights.num_experts):
            if torch.cuda.is_current_stream_capturing():
                raise BadInputError("w4a16_moe_gemm under CUDA-graph capture needs a preallocated workspace")
            workspace = bundle.plans[ws_key] = GemmWorkspace.allocate(
                plan, m, top_k, weights.num_experts, device, at_least=workspace
            )
    elif not workspace.fits(plan, m, top_k, weights.num_experts):
        raise BadInputError(f"workspace is too small for M={m}; allocate it with GemmWorkspace.allocate for the largest M")

    if routes is None:
        routes = _routes(bundle, plan, topk_ids, weights.num_experts, workspace)
    else:
        _check_routes(routes, topk_ids, weights.num_experts, plan)
    tokens = m * top_k if a_per_route else m
    tw = topk_weights if mul_topk_weights else workspace.c_tmp
    launch.kernel.launch(
        plan.grid_x, stream,
        a=a.data_ptr(), qweight=weights.qweight.data_ptr(), out=out.data_ptr(), scales=weights.scales.data_ptr(),
        global_scale=weights.global_scale.data_ptr(), route_indices=routes.route_indices.data_ptr(),
        block_experts=routes.block_experts.data_ptr(), route_count=routes.route_count.data_ptr(),
        topk_weights=tw.data_ptr(), c_tmp=workspace.c_tmp.data_ptr(), locks=workspace.locks.data_ptr(),
        tokens=tokens, num_experts=weights.num_experts,
    )
    return out
