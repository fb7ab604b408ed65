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

The launch (kernel, persistent grid, route block size) comes from the bundle's
resolution table: the build planned every M of the spec's problems and recorded the
decision (runtime/resolution.py), so weights whose shape no problem of the bundle has
are refused with the nearest built shapes named.  Small M reads the routes directly
(no packing); otherwise `pack_routes` groups them by expert first.  A layer whose GEMMs share the routing (FC1 and
FC2) can pack once with `pack_gemm_routes` and pass `routes=` to each GEMM.  The whole persistent grid must be co-resident
(split-K slices wait on each other): checked with the occupancy API on the
first use of each kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cuda.bindings import driver

from ...bundle import Bundle, LoadedKernel, check_cu, current_stream_handle
from ...errors import BadInputError, BundleError, LaunchError
from ...resolution import GEMM, Entry, GemmFacts, Launch, gemm_variant
from ...tensors import INT32_MAX, check_apart, check_rank, check_tensor
from ...weights import PackedNvfp4
from ...workspace import capturing as capturing_on
from ..route_pack import (
    _pack_routes, direct_route_ids, max_packed_route_slots, route_pack_elements_used, route_pack_workspace_elements,
)


@dataclass
class GemmWorkspace:
    """Buffers one GEMM launch needs; allocate once (e.g. for the largest M) to capture CUDA graphs.

    `locks` and the first word of `route_pack` (the multi-CTA route packing's grid-barrier word) must be zero
    before the first launch (`allocate` zeroes them); every launch leaves the locks zero and the barrier word's
    low 31 bits zero (the barrier flips its top bit).
    """

    c_tmp: torch.Tensor  # float32 split-K partials
    locks: torch.Tensor  # int32 split-K turn counters
    route_indices: torch.Tensor  # int32 packed route slots
    block_experts: torch.Tensor  # int32 expert per packed block
    route_count: torch.Tensor  # int32[1]
    route_pack: torch.Tensor  # int32 scratch of the multi-CTA route packing
    captured: bool = False  # a CUDA graph launched on it (an implicit one is then never freed)

    @classmethod
    def allocate(cls, sizes: dict, routes: int, num_experts: int, device,
                 at_least: "GemmWorkspace | None" = None) -> "GemmWorkspace":
        """Buffers of the given sizes (a resolution launch's or workspace's `sizes`) for `routes` routes,
        each at least as large as in `at_least` (when growing one)."""
        def size(wanted: int, name: str) -> int:
            return max(wanted, 4, at_least and getattr(at_least, name).numel() or 0)

        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            c_tmp=torch.empty(size(sizes["c_tmp_floats"], "c_tmp"), dtype=torch.float32, device=device),
            locks=torch.zeros(size(sizes["lock_slots"], "locks"), **i32),
            route_indices=torch.empty(size(sizes["route_slots"], "route_indices"), **i32),
            block_experts=torch.empty(size(sizes["route_blocks"], "block_experts"), **i32),
            route_count=torch.zeros(1, **i32),
            route_pack=torch.zeros(size(route_pack_workspace_elements(routes, num_experts), "route_pack"), **i32),
        )

    @classmethod
    def for_tokens(cls, bundle: Bundle, max_tokens: int, top_k: int, *weights: PackedNvfp4) -> "GemmWorkspace":
        """One workspace for every GEMM over these weights with up to max_tokens tokens (e.g. FC1 and
        FC2 of a layer, the largest M a server runs): sizes from the bundle's resolution table."""
        ws = None
        for w in weights:
            entry = gemm_entry(bundle, w, top_k)
            ws = cls.allocate(entry.workspace(max_tokens).sizes, max_tokens * top_k, w.num_experts, bundle.device,
                              at_least=ws)
        if ws is None:
            raise BadInputError("GemmWorkspace.for_tokens needs at least one PackedNvfp4")
        return ws

    def check(self, device: torch.device) -> None:
        """BadInputError unless every buffer is a contiguous tensor of its dtype on `device` (a workspace a caller
        built or allocated for another bundle; what `allocate` makes always is).  The locks' zeros cannot be
        checked without a sync: a workspace's locks must come zeroed (`allocate` does)."""
        for name, dtype in (("c_tmp", torch.float32), ("locks", torch.int32), ("route_indices", torch.int32),
                            ("block_experts", torch.int32), ("route_count", torch.int32), ("route_pack", torch.int32)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device or not t.is_contiguous():
                given = (t.dtype, str(t.device), t.is_contiguous()) if isinstance(t, torch.Tensor) else type(t)
                raise BadInputError(f"workspace.{name} must be a contiguous {dtype} tensor on {device} (the bundle's "
                                    f"device), got {given}; use GemmWorkspace.for_tokens of this bundle")
        if self.route_count.numel() < 1:
            raise BadInputError("workspace.route_count must hold one int32")

    def fits(self, launch: Launch, m: int, top_k: int, num_experts: int) -> bool:
        """Whether an m-token launch fits: the launch's split-K buffers (one size over its token range) and
        the route tables of m tokens themselves (a launch's recorded sizes are its range's largest M's, which
        a workspace for a smaller max_tokens need not hold)."""
        sizes, routes = launch.sizes, m * top_k
        slots = 0 if launch.direct else max_packed_route_slots(routes, launch.route_block, num_experts)
        return (
            self.c_tmp.numel() >= sizes["c_tmp_floats"]
            and self.locks.numel() >= sizes["lock_slots"]
            and self.route_indices.numel() >= slots
            and self.block_experts.numel() >= (slots // launch.route_block if slots else 0)
            and self.route_pack.numel() >= route_pack_elements_used(routes, num_experts)
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
    launch = gemm_entry(bundle, weights, top_k).launch(m)
    if workspace is None:
        workspace = GemmWorkspace.allocate(launch.sizes, m * top_k, weights.num_experts, bundle.device)
    else:
        _check_callers_workspace(workspace, bundle.device, launch, m, top_k, weights.num_experts)
    return _routes(bundle, launch, topk_ids, weights.num_experts, workspace)


def gemm_entry(bundle: Bundle, weights: PackedNvfp4, top_k: int) -> Entry:
    """The resolution-table entry of GEMMs over these weights with top_k routes per token."""
    facts = GemmFacts(dtype=weights.dtype, n=weights.n, k=weights.k, top_k=top_k, num_experts=weights.num_experts,
                      layout=weights.layout, scale_format=weights.scale_format)
    return bundle.resolution.find(GEMM, facts)


def _routes(bundle: Bundle, launch: Launch, topk_ids: torch.Tensor, num_experts: int,
            workspace: GemmWorkspace) -> GemmRoutes:
    if launch.direct:
        ids = direct_route_ids(topk_ids, num_experts)  # int64 ids: narrowed into new tensors (allocates)
        indices = block_experts = count = ids
    else:
        block = launch.route_block
        slots = max_packed_route_slots(topk_ids.numel(), block, num_experts)  # what this M can fill
        indices, block_experts, count = _pack_routes(  # the GemmWorkspace's own route-pack scratch: no zeroing
            bundle, topk_ids, num_experts, block, None, workspace.route_indices[:slots],
            workspace.block_experts[: slots // block], workspace.route_count, workspace.route_pack, own_workspace=True,
        )
    return GemmRoutes(topk_ids.data_ptr(), tuple(topk_ids.shape), num_experts, launch.route_block, indices,
                      block_experts, count)


def _check_callers_workspace(workspace, device: torch.device, launch: Launch, m: int, top_k: int,
                             num_experts: int) -> None:
    """A `workspace=` a caller passed: a GemmWorkspace of dense tensors on the bundle's device, large enough."""
    if not isinstance(workspace, GemmWorkspace):
        raise BadInputError(f"workspace must be a GemmWorkspace (GemmWorkspace.for_tokens), got {type(workspace).__name__}")
    workspace.check(device)
    if not workspace.fits(launch, m, top_k, num_experts):
        raise BadInputError(f"workspace is too small for M={m}; allocate it with GemmWorkspace.for_tokens for the "
                            "largest M")


def _check_routes(routes, topk_ids: torch.Tensor, num_experts: int, launch: Launch) -> None:
    if not isinstance(routes, GemmRoutes):
        raise BadInputError(f"routes must come from pack_gemm_routes, got {type(routes).__name__}")
    if routes.ids_ptr != topk_ids.data_ptr() or routes.shape != tuple(topk_ids.shape):
        raise BadInputError(f"routes were packed from another topk_ids (shape {routes.shape}); pack these ids")
    if routes.num_experts != num_experts:
        raise BadInputError(f"routes were packed for {routes.num_experts} experts, the weights have {num_experts}")
    if routes.block_size != launch.route_block:
        raise BadInputError(
            f"routes were packed with block size {routes.block_size or 'direct'}, this GEMM's launch at "
            f"M={topk_ids.shape[0]} uses {launch.route_block or 'direct'}: pack them with pack_gemm_routes for "
            "these weights"
        )


class PersistentLaunch:
    """A kernel of the resolution table (GEMM or fused MoE) whose co-residency has been checked.

    Where its CTAs wait on each other (split-K turns, grid barriers: the spec's `waits_on_grid`), a
    grid with CTAs that are not resident at once would deadlock: refuse the kernel instead (the micro
    kernel, FusedSpec.micro, is the one whose CTAs never wait: any grid runs).  Built once per kernel
    (`persistent_launch` caches it on the bundle).
    """

    def __init__(self, bundle: Bundle, digest: str):
        from .. import FAMILIES  # the kernels package imports this module

        self.kernel: LoadedKernel = bundle.kernel_by_digest(digest)
        key = self.kernel.record.key
        family = FAMILIES.get(key.family)
        if family is None:
            raise BundleError(f"kernel {key.describe()}: family {key.family!r} is unknown to this runtime (a newer "
                              "cuteaot built the bundle?); rebuild it")
        self.spec = family.from_facts(key.facts)
        record = self.kernel.record
        if self.spec.key() != key or tuple(record.block) != (self.spec.threads, 1, 1) \
                or record.dynamic_smem_bytes != self.spec.dynamic_smem_bytes:
            raise BundleError(
                f"kernel {key.describe()} was built as {self.spec.key().describe()} with block {tuple(record.block)} "
                f"and {record.dynamic_smem_bytes} B of shared memory; this runtime launches it as version "
                f"{self.spec.key().version}, block ({self.spec.threads}, 1, 1), {self.spec.dynamic_smem_bytes} B: "
                "the bundle was built by another version of cuteaot; rebuild it")
        self.kernel.bind(self.spec.SIGNATURE)
        self.waits = self.spec.waits_on_grid
        if self.waits:
            self.kernel.mark_waits_on_grid()  # launched cooperatively where layers run concurrently (bundle.py)
        resident = check_cu(
            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.kernel.function, self.kernel.block[0], self.kernel.record.dynamic_smem_bytes
            ),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        if self.waits and resident < self.spec.blocks_per_sm:
            raise LaunchError(
                f"{key.describe()}: only {resident} CTAs per SM fit on {bundle.profile.name} "
                f"({self.kernel.record.registers} registers, {self.kernel.record.dynamic_smem_bytes} B shared), "
                f"the plan needs {self.spec.blocks_per_sm}; a persistent grid that is not co-resident can deadlock "
                "in its split-K waits or grid barriers. Rebuild the bundle for this device profile."
            )
        self.capacity = resident * bundle.profile.sm_count  # CTAs resident at once on the (matched) GPU

    def check_grid(self, grid_x: int) -> None:
        """A grid of this kernel fits the GPU at once where its CTAs wait on each other; any grid otherwise."""
        if grid_x < 1 or (self.waits and grid_x > self.capacity):
            raise BundleError(f"the resolution table launches {self.spec.key().describe()} with {grid_x} CTAs; "
                              f"{self.capacity} fit this GPU at once: the bundle's table is corrupt; rebuild it")


def persistent_launch(bundle: Bundle, digest: str) -> PersistentLaunch:
    """The checked launch of a table kernel, built on first use and cached on the bundle."""
    return bundle.plans.kernels.get(digest, lambda: PersistentLaunch(bundle, digest))


def check_stored_sizes(kernel: PersistentLaunch, spec, weights: PackedNvfp4, name: str) -> None:
    """`spec` (a GEMM of `kernel`) reads `name` at the stored sizes this runtime packs them to.  A bundle
    built by a runtime that pads otherwise (before 2026-12-02 sizes were padded to multiples of 128)
    is refused here instead of misreading the weights."""
    if (spec.n, spec.k) != (weights.n_stored, weights.k_stored):
        raise BundleError(
            f"kernel {kernel.spec.key().describe()} reads {name} stored as N={spec.n} x K={spec.k}, but this "
            f"runtime stores them as {weights.n_stored} x {weights.k_stored} (logical {weights.n} x {weights.k}): "
            "the bundle was built by another version of cuteaot; rebuild it"
        )


def _resolve_gemm(bundle: Bundle, weights: PackedNvfp4, top_k: int, m: int, variant: str):
    """The table's launch for this M and the checked kernel of this operand variant."""
    launch = gemm_entry(bundle, weights, top_k).launch(m)
    kernel = persistent_launch(bundle, launch.kernel(variant))
    kernel.check_grid(launch.grid_x)
    check_stored_sizes(kernel, kernel.spec, weights, "the weights")
    return launch, kernel


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
    `workspace` that fits (GemmWorkspace.for_tokens for the largest M) are given and
    topk_ids is int32 (int64 ids are converted, which allocates).  `routes` (from
    `pack_gemm_routes` on the same topk_ids) skips the route packing.
    """
    check_rank(topk_ids, "topk_ids", 2, "(M, top_k)")
    m, top_k = topk_ids.shape
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise BadInputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(weights, PackedNvfp4):
        raise BadInputError(f"weights must be a PackedNvfp4 (runtime/weights.py), got {type(weights).__name__}")
    if weights.bias is not None:
        raise BadInputError("w4a16_moe_gemm adds no bias (the standalone GEMMs have no bias variant): use MoeLayer, "
                            "whose kernels add the weights' biases, or prepare the weights without bias= and add it")
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
    else:
        check_tensor(out, "out", dtype=dtype, shape=(m * top_k, weights.n), device=device)
        check_apart(out, "out", a=a, topk_ids=topk_ids, topk_weights=topk_weights if mul_topk_weights else None)
    if m == 0:
        return out

    # the weights' layout is part of the kernel's key: packed, NF3 and stored weights of one shape differ
    cache_key = ("w4a16_moe_gemm", m, top_k, weights.n, weights.k, weights.num_experts, weights.dtype,
                 weights.layout, weights.scale_format, a_per_route, mul_topk_weights, epilogue)
    launch, kernel = bundle.plans.gemm_calls.get(cache_key, lambda: _resolve_gemm(
        bundle, weights, top_k, m, gemm_variant(a_per_route, mul_topk_weights, epilogue)))

    stream = current_stream_handle(bundle.device_index)
    if workspace is None:
        # One workspace per stream, grown on demand: launches on a stream are ordered, so they
        # can share it, and the locks stay zero between launches.
        workspace = bundle.gemm_workspaces.get(stream)
        capturing = capturing_on(bundle.device)  # the bundle's device's stream, whichever device is current
        if workspace is None or not workspace.fits(launch, m, top_k, weights.num_experts):
            if capturing:
                raise BadInputError("w4a16_moe_gemm under CUDA-graph capture needs a preallocated workspace "
                                    "(GemmWorkspace.for_tokens)")
            if workspace is not None and workspace.captured:  # a graph replays on it: it must outlive the graph
                bundle.captured_gemm_workspaces.append(workspace)
            workspace = bundle.gemm_workspaces[stream] = GemmWorkspace.allocate(
                launch.sizes, m * top_k, weights.num_experts, device, at_least=workspace
            )
            if len(bundle.gemm_workspaces) > 1:  # GEMMs on several streams may run at once: cooperative grids
                bundle.launch_state.concurrent = True
        if capturing:
            workspace.captured = True
    else:
        _check_callers_workspace(workspace, device, launch, m, top_k, weights.num_experts)

    if routes is None:
        routes = _routes(bundle, launch, topk_ids, weights.num_experts, workspace)
    else:
        _check_routes(routes, topk_ids, weights.num_experts, launch)
    tokens = m * top_k if a_per_route else m
    tw = topk_weights if mul_topk_weights else workspace.c_tmp
    kernel.kernel.launch(
        launch.grid_x, stream,
        a=a.data_ptr(), qweight=weights.qweight.data_ptr(), out=out.data_ptr(), scales=weights.scales.data_ptr(),
        global_scale=weights.global_scale.data_ptr(), route_indices=routes.route_indices.data_ptr(),
        block_experts=routes.block_experts.data_ptr(), route_count=routes.route_count.data_ptr(),
        topk_weights=tw.data_ptr(), bias=workspace.c_tmp.data_ptr(),  # GEMM tables build no bias variant
        c_tmp=workspace.c_tmp.data_ptr(), locks=workspace.locks.data_ptr(),
        tokens=tokens, num_experts=weights.num_experts,
    )
    return out
