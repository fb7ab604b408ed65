"""The serving API: one fused W4A16 MoE layer, built once, called every step.

    layer = MoeLayer(bundle, w13, w2, top_k=8, activation="silu")   # prepare_w13 / prepare_w2 weights
    layer.reserve(streams=[s1, s2])                                  # optional: concurrent streams
    out = layer(hidden_states, topk_weights, topk_ids)               # (M, H), same dtype as the input

A call validates its inputs, picks the launch plan of its token count (cached),
and launches on torch's current stream:

* M <= 2 (no expert_map, no calibration, not deterministic): one fused kernel; routes
  read straight from topk_ids, the top-k sum folded into FC2 (red.add into the zeroed
  output).
* otherwise: route packing, the fused kernel (FC2 rows per route), the top-k sum.

Memory is reserved before serving, never by a call (runtime/workspace.py): building a
layer reserves the buffers of `max_tokens` tokens (default: the bundle's largest token
bucket; larger calls run in chunks), shared by every layer of the same shape;
`reserve(streams)` gives streams that run layers concurrently their own.  So calls can be
captured in CUDA graphs in any style (torch.cuda.graph with shared pools,
torch.compile's "reduce-overhead").  Every launch leaves the barrier/lock words at zero.
`run_w4a16_moe` is the functional form; the `cuteaot::moe_layer` torch custom op makes a
layer usable under torch.compile.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch

from .bundle import Bundle, PreparedLaunch, RecordedLaunch, ZeroFill, current_stream_handle, recording_launches
from .errors import BadInputError, BundleError, UnknownSpecializationError
from .kernels.w4a16.gemm import PersistentLaunch, check_stored_sizes, persistent_launch
from .kernels.w4a16.gemm_spec import Epilogue
from .kernels.w4a16.fused_spec import PACK_MAX_ROUTES
from .kernels.w4a16.geometry import BARRIER_WORDS
from .kernels.route_pack import (
    MAX_EXPERTS, IdsDType, PreparedRoutePack, direct_route_ids, max_packed_route_slots, route_pack_workspace,
    route_pack_elements_used,
)
from .resolution import MOE_LAYER, Entry, Launch, MoeLayerFacts
from .kernels.activation import moe_activation
from .kernels.topk_sum import PreparedTopkSum, TopKSumSpec
from .tensors import check_apart, check_rank, check_tensor, conforms
from .types import Activation
from .weights import PackedNvfp4
from .workspace import WorkspaceShape, capturing

__all__ = ["BoundMoeCall", "MoeLayer", "MoeWorkspace", "run_w4a16_moe"]


@dataclass
class MoeWorkspace:
    """Every buffer a layer's launches need for up to `max_tokens` tokens (no allocation per call)."""

    max_tokens: int
    fc13: torch.Tensor  # FC1 output rows, reused for FC2 output rows (routes x max(fc1 width, H))
    activated: torch.Tensor  # routes x I
    c_tmp: torch.Tensor  # float32 split-K partials
    locks: torch.Tensor  # int32 barrier words (low 31 bits of the first zero between launches) + lock slots (zero)
    route_indices: torch.Tensor
    block_experts: torch.Tensor
    route_count: torch.Tensor
    route_pack: torch.Tensor
    ids64: torch.Tensor  # int64 topk_ids with out-of-range values pinned to -1 / E ...
    ids32: torch.Tensor  # ... then narrowed for the direct-route (decode) kernel
    # the addresses every fused launch passes, read once (a data_ptr() per launch costs more than the rest)
    fc13_address: int = dataclasses.field(init=False)
    c_tmp_address: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.fc13_address, self.c_tmp_address = self.fc13.data_ptr(), self.c_tmp.data_ptr()

    @classmethod
    def allocate(cls, shape: WorkspaceShape, device: torch.device) -> "MoeWorkspace":
        routes = shape.routes
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            max_tokens=shape.max_tokens,
            fc13=torch.empty(routes * max(shape.fc1_width, shape.hidden_size), dtype=shape.dtype.torch, device=device),
            activated=torch.empty(routes * shape.intermediate_size, dtype=shape.dtype.torch, device=device),
            c_tmp=torch.empty(max(shape.c_tmp_floats, 1), dtype=torch.float32, device=device),
            locks=torch.zeros(shape.lock_words, **i32),
            route_indices=torch.empty(shape.route_slots, **i32),
            block_experts=torch.empty(shape.route_blocks, **i32),
            route_count=torch.zeros(1, **i32),
            route_pack=route_pack_workspace(routes, shape.route_experts, device),  # zeroed: a grid barrier's word
            ids64=torch.empty(routes, dtype=torch.int64, device=device),
            ids32=torch.empty(routes, **i32),
        )

    @property
    def split_k_locks(self) -> torch.Tensor:
        """The split-K lock slots a standalone GEMM launch uses: after the fused kernel's grid-barrier
        words (whose first word's top bit flips at every barrier), so the two kinds of launch can share them."""
        return self.locks[BARRIER_WORDS:]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class _PackedSteps:
    """The prepared launches around the GEMMs of one token count on the packed path."""

    ws: MoeWorkspace  # held: the cache key's id(ws) stays unique while the entry lives
    route_pack: PreparedRoutePack | None  # None where the fused kernel packs the routes itself (pack_experts)
    topk_sum: PreparedTopkSum | None  # None where the fused kernel sums the routes itself (topk_sum)


@dataclass(frozen=True)
class Resolved:
    """An m-token call's launch: the resolution table's decision and its checked kernels by role
    ("fused", or "fc1" and "fc2" for a layer run as two grouped-GEMM launches)."""

    launch: Launch  # grid, route handling and kernels the build chose for this M
    kernels: Mapping[str, PersistentLaunch]
    decode: bool = dataclasses.field(init=False)  # direct routes, top-k sum folded into FC2 (small M)
    # two launches whose FC1 writes the gate | up product, not the activation (its epilogue is plain:
    # 2I zero-padded, or no gated epilogue on the target), so the activation kernel runs between them
    activation_launch: bool = dataclasses.field(init=False)
    # FC2 adds each route's row into the (M, H) output (decode; packed routes with FusedSpec.topk_sum,
    # or GemmSpec.sum_topk when split): no top-k sum kernel after it
    sums_topk: bool = dataclasses.field(init=False)
    # the fused kernel packs the routes from topk_ids itself (FusedSpec.pack_experts): no route-pack launch
    packs_routes: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        specs = self.specs
        object.__setattr__(self, "decode", self.launch.direct)  # read several times per call
        object.__setattr__(self, "activation_launch", self.launch.split and specs["fc1"].epilogue is Epilogue.NONE)
        object.__setattr__(self, "sums_topk", _sums_topk(self.launch, specs))
        object.__setattr__(self, "packs_routes", _packs_routes(self.launch, specs))

    @property
    def specs(self) -> dict:
        """The kernels' specs by role."""
        return {role: kernel.spec for role, kernel in self.kernels.items()}

    def describe(self) -> str:
        return describe_launch(self.launch, self.specs)


def _sums_topk(launch: Launch, specs: Mapping[str, object]) -> bool:
    """FC2 adds each route's row into the (M, H) output itself: no top-k sum kernel after it."""
    return specs["fc2"].sum_topk > 0 if launch.split else specs["fused"].sums_topk


def _packs_routes(launch: Launch, specs: Mapping[str, object]) -> bool:
    """The fused kernel packs the routes from topk_ids itself: no route-pack launch before it."""
    return not launch.split and specs["fused"].pack_experts is not None


def describe_launch(launch: Launch, specs: Mapping[str, object]) -> str:
    """One line for a MoE layer launch of the resolution table, from its kernels' specs by role: the path
    (decode / micro / packed route blocks / split into two GEMMs, what FC2 sums, who packs), main loop, tiles and
    grid (`Resolved.describe`, `cuteaot inspect --plans`)."""
    if launch.split:
        f1, f2 = specs["fc1"], specs["fc2"]
        act = f"+{f1.epilogue.value}" if f1.epilogue.is_gated else ""
        summed = " +sum" if _sums_topk(launch, specs) else ""
        return (f"split b{launch.route_block}{summed} {f1.mainloop.value} fc1{act} {f1.tile_n}x{f1.tile_k} "
                f"fc2 {f2.tile_n}x{f2.tile_k} grid {launch.grid('fc1')}/{launch.grid('fc2')}")
    f = specs["fused"]
    if f.micro:  # the barrier-free small-M kernel: FC1 tiles, each with FC2 over its slice of K
        act = f"+{f.activation.value}" if f.gated_epilogue else ""
        return (f"micro {f.mainloop.value} fc1{act} {f.fc1_tile_n}x{f.fc1_tile_k} fc2 slice {f.micro_slice} "
                f"grid {launch.grid_x}")
    path = "decode" if launch.direct else f"packed b{launch.route_block}"
    path += " +sum" if not launch.direct and _sums_topk(launch, specs) else ""
    path += " +pack" if _packs_routes(launch, specs) else ""
    act = f"+{f.activation.value}" if f.gated_epilogue else ""
    return (f"{path} {f.mainloop.value} fc1{act} {f.fc1_tile_n}x{f.fc1_tile_k} fc2 {f.fc2_tile_n}x{f.fc2_tile_k} "
            f"grid {launch.grid_x}")


_LAYERS: "weakref.WeakValueDictionary[str, MoeLayer]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


class MoeLayer:
    """A fused W4A16 MoE layer bound to one bundle, one device and one set of prepared weights.

    w13: prepare_w13(...) (N = 2I gate|up for silu/swigluoai, N = I for relu2; K = H)
    w2:  prepare_w2(...)  (N = H, K = I)
        or their _mxfp4 / _nf3 / _modelopt forms; both of one format (the layer's `weights` fact; NF3
        layers need the bundle's `weights: nf3` kernels, layers read as ModelOpt stores them its
        `weights: modelopt` or `modelopt_w31` ones; experts of two formats a HybridMoeLayer).
        Biases given to prepare_w13 / prepare_w2 (`PackedNvfp4.bias`, gpt-oss) are added in the
        GEMM epilogues, before the activation and the router weight; the bundle must hold the
        layer's `bias: true` kernels.
    expert_map: optional (global experts,) int32 on the device: global id -> local
        weight index, -1 for experts held by other ranks; their routes contribute 0.
    router_weight_on_input: scale FC1's rows by the router weight (= weighting the
        input, FC1 being linear) instead of FC2's.
    max_tokens: tokens one launch serves (workspace capacity; above the bundle's largest launch, that
        one's); larger calls run in chunks.
    deterministic: bit-identical results run to run, eager or replayed, on any stream: M <= 2
        takes the packed path instead of summing the top-k rows with bf16 atomics.
    validate_ids: also check topk_ids on the host (one device sync per call; skipped under
        capture): ids outside [-1, E) are refused, -1 stays a masked route.  Without it, routes
        whose id is outside [0, E) (e.g. -1 for masked routes) are dropped by the kernels and
        contribute 0.
    accumulate: add the layer's output into `out` (which every call must then pass) instead of
        overwriting it: the top-k sum starts from out's rows (one float32 add, one rounding).
        For layers with an expert_map, which take the packed path at every M (the later parts of
        a HybridMoeLayer); the bundle needs the accumulating top-k sums (built with expert_map).

    Building the layer resolves its kernels for every token bucket of the bundle (so options
    the bundle cannot serve fail here, naming the nearest built kernels) and reserves its
    workspace; see runtime/workspace.py for how layers and streams share workspaces.
    """

    def __init__(self, bundle: Bundle, w13: PackedNvfp4, w2: PackedNvfp4, *, top_k: int,
                 activation: Activation | str = "silu", swiglu_alpha: float | None = None,
                 swiglu_beta: float | None = None, swiglu_limit: float | None = None, fast_math: bool = True,
                 router_weight_on_input: bool = False, expert_map: torch.Tensor | None = None,
                 max_tokens: int | None = None, deterministic: bool = False, validate_ids: bool = False,
                 accumulate: bool = False):
        try:
            self.activation = Activation(activation)
        except ValueError:
            raise BadInputError(f"activation must be one of {[a.value for a in Activation]}, got {activation!r}") from None
        self._check_weights(bundle, w13, w2)
        inter = w2.k
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise BadInputError(f"top_k must be a positive int, got {top_k!r}")
        self.bundle, self.device, self.dtype = bundle, bundle.device, w13.dtype
        self.torch_dtype: torch.dtype = w13.dtype.torch
        self.device_index: int = bundle.device_index
        self.w13, self.w2 = w13, w2
        self.hidden_size, self.intermediate_size, self.top_k = w13.k, inter, top_k
        self._row_bytes = self.hidden_size * self.torch_dtype.itemsize  # of hidden_states and out
        self.fc1_width = w13.n
        self.num_experts = w13.num_experts
        self.expert_map = expert_map
        if expert_map is not None:
            self._check_expert_map(expert_map)
        self.accumulate = self._check_accumulate(accumulate)
        self.route_experts = self.num_experts if expert_map is None else expert_map.shape[0]
        if self.route_experts > MAX_EXPERTS:
            raise BadInputError(f"at most {MAX_EXPERTS} experts are supported, got {self.route_experts}")
        if top_k > self.route_experts:
            raise BadInputError(f"top_k={top_k} exceeds the {self.route_experts} experts")
        self.deterministic = bool(deterministic)
        self.w13_bias, self.w2_bias = self._biases(w13, w2)
        # the bias pointers every launch passes, resolved once; kernels built without bias never
        # read theirs, so the weights' own global scale stands in as a valid address
        self._bias13_ptr, self._bias2_ptr = (b.data_ptr() if b is not None else w.global_scale.data_ptr()
                                             for b, w in ((self.w13_bias, w13), (self.w2_bias, w2)))
        self.facts = MoeLayerFacts(
            dtype=self.dtype, hidden_size=self.hidden_size, intermediate_size=inter, num_experts=self.route_experts,
            top_k=top_k, activation=self.activation, fast_math=fast_math, swiglu_alpha=swiglu_alpha,
            swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit, router_weight_on_input=router_weight_on_input,
            expert_map=expert_map is not None, deterministic=deterministic, bias=self.w13_bias is not None,
            weights=w13.weights,
        )
        # the build's decisions for this layer: options the bundle cannot serve fail here, naming the nearest
        self.entry: Entry = bundle.resolution.find(MOE_LAYER, self.facts)
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise BadInputError(f"max_tokens must be a positive int, got {max_tokens!r}")
        # calls above the bundle's largest launch run in chunks of it whatever max_tokens says: a
        # serving engine's step size (e.g. 8192) needs no more memory than that
        self.max_tokens = self.entry.max_tokens if max_tokens is None else min(max_tokens, self.entry.max_tokens)
        self.validate_ids = validate_ids
        self.calibration_tokens = 0  # tokens a calibration launch serves (0: the bundle has no calibration kernels)
        self._amax_rows: int | None = None  # experts the calibration kernels index activation_amax by
        self._resolved: dict[tuple[int, bool], Resolved] = {}
        self._prepared: dict[tuple[int, int], tuple[MoeWorkspace, PreparedLaunch]] = {}
        self._steps: dict[tuple, _PackedSteps] = {}
        self._last_workspace: tuple = (None, -1, None)  # (stream, pool generation, workspace) of the last call
        self._check_launches(self.entry, self.max_tokens)  # every kernel it can launch, loaded and checked now
        self.shape = self._workspace_shape()
        pool = bundle.workspaces
        pool.acquire(self.shape, self._allocate_workspace)
        weakref.finalize(self, pool.release, self.shape)  # the last layer of a shape frees its workspaces
        self.id = f"moe-layer-{next(_IDS)}"
        _LAYERS[self.id] = self

    def _check_weights(self, bundle: Bundle, w13: PackedNvfp4, w2: PackedNvfp4) -> None:
        for name, w in (("w13", w13), ("w2", w2)):
            if not isinstance(w, PackedNvfp4):
                raise BadInputError(f"{name} must be prepared weights (prepare_{name}, prepare_{name}_mxfp4, "
                                    f"prepare_{name}_nf3 or prepare_{name}_modelopt), got {type(w).__name__}")
            if w.device != bundle.device:
                raise BadInputError(f"{name} is on {w.device}, the bundle on {bundle.device}")
        if w13.layout != w2.layout:
            raise BadInputError(f"w13 holds {w13.weights.value} weights and w2 {w2.weights.value}; a layer has one "
                                "format (the NVFP4/NF3 hybrid is two layers with complementary expert maps)")
        if w13.layout == "modelopt" and (w13.global_scale.dim() == 2) != self.activation.is_gated:
            raise BadInputError(f"w13 was prepared for a {'gated' if w13.global_scale.dim() == 2 else 'relu2'} "
                                f"activation, the layer's is {self.activation.value}: pass "
                                f"prepare_w13_modelopt(..., gated={self.activation.is_gated})")
        if w13.dtype != w2.dtype:
            raise BadInputError(f"w13 was prepared for {w13.dtype.value}, w2 for {w2.dtype.value}")
        if w13.num_experts != w2.num_experts:
            raise BadInputError(f"w13 has {w13.num_experts} experts, w2 {w2.num_experts}")
        if w13.n != self.activation.fc1_width(w2.k) or w13.k != w2.n:
            raise BadInputError(
                f"w13 is {w13.n}x{w13.k} and w2 {w2.n}x{w2.k} (N x K); {self.activation.value} needs "
                f"w13 = {'2I' if self.activation.is_gated else 'I'} x H and w2 = H x I"
            )

    def _check_stored_sizes(self, role: str, kernel: PersistentLaunch) -> None:
        """The kernel's GEMMs read w13 and w2 at the sizes they are stored at (a stale bundle fails here)."""
        spec = kernel.spec
        if role == "fused":
            gemms = ((spec.fc1_gemm, self.w13, "w13"), (spec.fc2_gemm, self.w2, "w2"))
        else:
            gemms = ((spec, self.w13, "w13") if role == "fc1" else (spec, self.w2, "w2"),)
        for gemm, weights, name in gemms:
            check_stored_sizes(kernel, gemm, weights, name)

    @staticmethod
    def _biases(w13: PackedNvfp4, w2: PackedNvfp4) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The weights' biases for the kernels, or (None, None): a missing one of a pair is zeros."""
        if w13.bias is None and w2.bias is None:
            return None, None
        pair = [w.bias if w.bias is not None else torch.zeros((w.num_experts, w.n), dtype=w.dtype.torch,
                                                               device=w.device) for w in (w13, w2)]
        for name, b in zip(("w13.bias", "w2.bias"), pair):
            if b.data_ptr() % 16:
                raise BadInputError(f"{name} must start 16-byte aligned (the kernels read it in 16-byte "
                                    f"vectors), got address {b.data_ptr():#x}; pass a fresh .clone()")
        return pair[0], pair[1]

    def _check_packing(self, kernel: PersistentLaunch, m: int) -> None:
        """A kernel that packs the routes in shared memory holds PACK_MAX_ROUTES routes of pack_experts experts."""
        experts = kernel.spec.pack_experts
        if m * self.top_k > PACK_MAX_ROUTES or experts != self.route_experts or self.expert_map is not None:
            raise BundleError(f"the bundle's fused kernel for {m} tokens packs at most {PACK_MAX_ROUTES} routes of "
                              f"{experts} experts itself; this layer routes {m} x {self.top_k} onto "
                              f"{self.route_experts}{' through an expert map' if self.expert_map is not None else ''}:"
                              f" rebuild the bundle")

    def _check_accumulate(self, accumulate: object) -> bool:
        if not isinstance(accumulate, bool):
            raise BadInputError(f"accumulate must be True or False, got {accumulate!r}")
        if accumulate:
            if self.expert_map is None:
                raise BadInputError("accumulate=True adds through the packed path's top-k sum, which only layers "
                                    "with an expert_map take at every M (decode writes the output directly)")
            for ids in IdsDType:  # refused now, not at the first call that needs it
                self.bundle.kernel(TopKSumSpec(self.dtype, self.top_k, self.hidden_size, ids, True).key())
        return accumulate

    def _check_expert_map(self, expert_map: torch.Tensor) -> None:
        check_rank(expert_map, "expert_map", 1, "(global experts,) int32")
        check_tensor(expert_map, "expert_map", dtype=torch.int32, shape=tuple(expert_map.shape),
                     device=self.device, align=4)
        if expert_map.numel() == 0:
            raise BadInputError("expert_map is empty: it maps each global expert id to a local one (or -1)")
        lo, hi = (int(v) for v in torch.aminmax(expert_map))
        if lo < -1 or hi >= self.num_experts:
            raise BadInputError(f"expert_map values must be -1 or local expert ids < {self.num_experts}, "
                                f"got range [{lo}, {hi}]")

    def _check_launches(self, entry: Entry, tokens: int) -> list[tuple[str, PersistentLaunch]]:
        """Every kernel `entry` launches for up to `tokens` tokens: loaded, co-residency checked, its grids
        fitting the GPU and its stored weight sizes this runtime's (once per layer and table); returns
        them as (role, kernel)."""
        checked = []
        for launch in entry.launches:
            if launch.m_min <= tokens:
                for role, digest in launch.kernels.items():
                    kernel = persistent_launch(self.bundle, digest)
                    kernel.check_grid(launch.grid(role))
                    self._check_stored_sizes(role, kernel)
                    checked.append((role, kernel))
        return checked

    def _entry(self, calibration: bool) -> Entry:
        """The table entry of plain calls, or of calibration calls (activation_amax given)."""
        if not calibration:
            return self.entry
        return self.bundle.resolution.find(MOE_LAYER, dataclasses.replace(self.facts, calibration=True))

    def _workspace_shape(self) -> WorkspaceShape:
        """Buffer sizes for max_tokens tokens: the table's, of calibration calls too where the bundle has them."""
        sizes = dict(self.entry.workspace(self.max_tokens).sizes)
        try:
            entry = self._entry(True)
        except UnknownSpecializationError:
            calibration = {}
        else:  # calibration calls run in chunks of at most its table's largest launch
            self.calibration_tokens = min(self.max_tokens, entry.max_tokens)
            calibration = entry.workspace(self.calibration_tokens).sizes
        for name, value in calibration.items():
            sizes[name] = max(sizes.get(name, 0), value)
        return WorkspaceShape(self.hidden_size, self.intermediate_size, self.fc1_width, self.top_k,
                              self.route_experts, self.dtype, self.max_tokens, **sizes)

    def _allocate_workspace(self) -> MoeWorkspace:
        return MoeWorkspace.allocate(self.shape, self.device)

    # ------------------------------------------------------------------ resolution

    def resolve(self, m: int, collect_amax: bool = False) -> Resolved:
        """The table's launch of an m-token call and its checked kernel (cached)."""
        r = self._resolved.get((m, collect_amax))
        if r is None:
            if collect_amax:  # the calibration table's kernels: checked on first use, not when the layer was built
                self._check_calibration()
            launch = self._entry(collect_amax).launch(m)
            kernels = {role: persistent_launch(self.bundle, digest) for role, digest in launch.kernels.items()}
            r = Resolved(launch, kernels)
            if r.packs_routes:
                self._check_packing(r.kernels["fused"], m)
            self._resolved[(m, collect_amax)] = r
        return r

    # ------------------------------------------------------------------ memory

    def reserve(self, streams: Iterable[torch.cuda.Stream]) -> None:
        """Give each stream its own workspace so that layers of this shape may run on them concurrently.

        Call before capturing CUDA graphs (it allocates; under capture it raises CaptureError).
        Streams without a reservation share the shape's default workspace, which is right
        whenever they do not run layers of this shape at the same time.  From then on the bundle's
        kernels whose CTAs wait on each other launch as cooperative grids (unless
        set_cooperative_launch(False)), so that concurrent layers cannot deadlock each other.
        """
        streams = list(streams)
        for stream in streams:
            if not isinstance(stream, torch.cuda.Stream):
                raise BadInputError(f"reserve takes torch.cuda.Stream objects, got {type(stream).__name__}")
            if stream.device != self.device:
                raise BadInputError(f"stream is on {stream.device}, the layer on {self.device}")
        for stream in streams:
            self.bundle.workspaces.reserve(self.shape, stream.cuda_stream, self._allocate_workspace)
        if streams:
            self.bundle.launch_state.concurrent = True

    def workspace(self, stream: int | None = None) -> MoeWorkspace:
        """The workspace a call on `stream` (a raw cudaStream_t; default torch's current one) uses."""
        stream = current_stream_handle(self.device.index) if stream is None else stream
        return self.bundle.workspaces.get(self.shape, stream)

    # ------------------------------------------------------------------ call

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 out: torch.Tensor | None = None, activation_amax: torch.Tensor | None = None,
                 layer_idx: int | None = None) -> torch.Tensor:
        """(M, H) output = sum_k w_k * FC2_e(act(FC1_e(x))) over each token's top-k experts e
        (FC_e(x) = x W_e^T + b_e when the weights carry biases)."""
        if out is None and self.accumulate:
            raise BadInputError("this layer was built with accumulate=True: it adds into `out`, so pass out=")
        if torch.compiler.is_compiling():
            if out is None:
                out = torch.empty_like(hidden_states)
            torch.ops.cuteaot.moe_layer(hidden_states, topk_weights, topk_ids, out, activation_amax,
                                        -1 if layer_idx is None else layer_idx, self.id)
            return out
        m = self._check(hidden_states, topk_weights, topk_ids, out, activation_amax, layer_idx)
        if out is None:
            out = torch.empty((m, self.hidden_size), dtype=self.torch_dtype, device=self.device)
        if m == 0:
            return out
        stream = current_stream_handle(self.device_index)
        pool, last = self.bundle.workspaces, self._last_workspace
        if last[0] == stream and last[1] == pool.generation:  # the previous call's stream: no pool lookup
            ws = last[2]
        else:
            ws = pool.get(self.shape, stream)
            self._last_workspace = (stream, pool.generation, ws)
        chunk = self.max_tokens if activation_amax is None else self.calibration_tokens
        if m <= chunk:  # one launch sequence: no slicing (a view costs as much as a launch)
            self._launch(m, hidden_states, topk_weights, topk_ids, out, activation_amax, layer_idx, ws, stream)
            return out
        for start in range(0, m, chunk):
            stop = min(m, start + chunk)
            self._launch(stop - start, hidden_states[start:stop], topk_weights[start:stop], topk_ids[start:stop],
                         out[start:stop], activation_amax, layer_idx, ws, stream)
        return out

    def _launch(self, m: int, x, topk_weights, topk_ids, out, amax, layer_idx, ws: MoeWorkspace, stream: int) -> None:
        """One launch sequence of m <= max_tokens tokens (x's rows)."""
        r = self.resolve(m, amax is not None)
        routes = m * self.top_k
        if r.decode or r.packs_routes:  # int64 ids are narrowed through the workspace: a call never allocates
            ids = topk_ids
            if ids.dtype is not torch.int32:
                ids = direct_route_ids(topk_ids, self.route_experts, wide=ws.ids64[:routes].view(m, self.top_k),
                                       out=ws.ids32[:routes].view(m, self.top_k))
            route_indices = block_experts = route_count = ids
            if not r.sums_topk:
                steps = self._packed_steps(ws, m, r.launch.route_block, topk_ids, out, pack=False)
        else:
            steps = self._packed_steps(ws, m, r.launch.route_block, topk_ids, out, r.sums_topk)
            route_indices, block_experts, route_count = steps.route_pack(topk_ids, stream)
        if r.launch.split:
            self._launch_split(r, m, x, topk_weights, route_indices, block_experts, route_count, out, ws, stream)
        else:
            self._launch_fused(r, m, x, topk_weights, route_indices, block_experts, route_count, out, amax,
                               layer_idx, ws, stream)
        if not r.sums_topk:
            # routes dropped by the packing (ids outside [0, E)) have no FC2 row: skip them by id
            steps.topk_sum(out, topk_ids, stream)

    _STEPS_CACHE = 64  # token counts whose packed-path launches a layer keeps prepared

    def _packed_steps(self, ws: MoeWorkspace, m: int, block: int, topk_ids: torch.Tensor,
                      out: torch.Tensor, summed: bool = False, pack: bool = True) -> "_PackedSteps":
        """The route packing (none where the fused kernel packs: not `pack`) and top-k sum (none where it
        sums: `summed`) of an m-token call on the packed path, with the workspace slices they read and
        write packed in: prepared (and checked) once per (workspace, M, ids dtype), kept for the most
        recent token counts.  A call's own inputs were checked by _check."""
        key = (id(ws), m, block, topk_ids.dtype, summed, pack)
        found = self._steps.get(key)
        if found is not None and found.ws is ws:
            return found
        routes = m * self.top_k
        slots = max_packed_route_slots(routes, block, self.route_experts)  # what this M can fill
        fc2 = ws.fc13[: routes * self.hidden_size].view(m, self.top_k, self.hidden_size)
        steps = _PackedSteps(
            ws,
            PreparedRoutePack(self.bundle, topk_ids, self.route_experts, block, expert_map=self.expert_map,
                              packed=ws.route_indices[:slots], block_ids=ws.block_experts[: slots // block],
                              count=ws.route_count,
                              workspace=ws.route_pack[: route_pack_elements_used(routes, self.route_experts)])
            if pack else None,
            None if summed else PreparedTopkSum(self.bundle, fc2, out, topk_ids, self.route_experts,
                                                accumulate=self.accumulate),
        )
        if len(self._steps) >= self._STEPS_CACHE:
            try:  # the oldest; two threads (streams) may evict at once: the loser finds it gone
                self._steps.pop(next(iter(self._steps)), None)
            except RuntimeError:  # ("dictionary changed size during iteration": the other thread's insert)
                pass
        self._steps[key] = steps
        return steps

    # the fused kernel's arguments that change between calls; every other one is fixed per workspace
    _FUSED_VARIABLES = ("a", "fc2_out", "route_indices", "block_experts", "route_count", "topk_weights", "amax",
                        "layer", "tokens")

    def _prepared_fused(self, kernel: PersistentLaunch, ws: MoeWorkspace) -> PreparedLaunch:
        """The fused kernel's launch with the weight and workspace pointers packed in (cached)."""
        key = (id(kernel), id(ws))
        found = self._prepared.get(key)
        if found is not None and found[0] is ws:
            return found[1]
        prepared = kernel.kernel.prepare(
            self._FUSED_VARIABLES,
            w13=self.w13.qweight.data_ptr(), w2=self.w2.qweight.data_ptr(), fc1_out=ws.fc13_address,
            activated=ws.activated.data_ptr(), w13_scales=self.w13.scales.data_ptr(),
            w2_scales=self.w2.scales.data_ptr(), w13_global_scale=self.w13.global_scale.data_ptr(),
            w2_global_scale=self.w2.global_scale.data_ptr(), w13_bias=self._bias13_ptr, w2_bias=self._bias2_ptr,
            c_tmp=ws.c_tmp_address, locks=ws.locks.data_ptr(), num_experts=self.num_experts,
        )
        self._prepared[key] = (ws, prepared)  # holds ws, so its id is not reused while the entry lives
        return prepared

    def _launch_fused(self, r, m, x, topk_weights, route_indices, block_experts, route_count, out, amax, layer_idx,
                      ws: MoeWorkspace, stream: int) -> None:
        routes = route_indices.data_ptr()
        self._prepared_fused(r.kernels["fused"], ws).launch(
            r.launch.grid_x, stream,
            x.data_ptr(), out.data_ptr() if r.sums_topk else ws.fc13_address,
            routes, routes if block_experts is route_indices else block_experts.data_ptr(),
            routes if route_count is route_indices else route_count.data_ptr(), topk_weights.data_ptr(),
            ws.c_tmp_address if amax is None else amax.data_ptr(), 0 if layer_idx is None else layer_idx, m,
        )

    def _launch_split(self, r, m, x, topk_weights, route_indices, block_experts, route_count, out,
                      ws: MoeWorkspace, stream: int) -> None:
        """FC1 and FC2 as grouped-GEMM launches on the packed routes; the activation in FC1's epilogue, or
        (zero-padded N, other archs) its own launch between them.  Where FC2 sums the routes itself
        (r.sums_topk) the output is zeroed first and FC2 adds into it."""
        if r.sums_topk:
            ZeroFill(out.data_ptr(), m * self.hidden_size * out.element_size() // 4).issue(stream)
        routes, on_input = m * self.top_k, self.facts.router_weight_on_input
        routing = dict(route_indices=route_indices.data_ptr(), block_experts=block_experts.data_ptr(),
                       route_count=route_count.data_ptr(), c_tmp=ws.c_tmp_address,
                       locks=ws.split_k_locks.data_ptr(),
                       num_experts=self.num_experts)
        weight = topk_weights.data_ptr()
        fc1_out = ws.fc13 if r.activation_launch else ws.activated  # relu2, gated epilogues: the activation
        r.kernels["fc1"].kernel.launch(
            r.launch.grid("fc1"), stream, a=x.data_ptr(), qweight=self.w13.qweight.data_ptr(),
            out=fc1_out.data_ptr(), scales=self.w13.scales.data_ptr(), global_scale=self.w13.global_scale.data_ptr(),
            topk_weights=weight if on_input else ws.c_tmp_address, bias=self._bias13_ptr,
            tokens=m, **routing,
        )
        if r.activation_launch:
            f = self.facts
            moe_activation(self.bundle, ws.fc13[: routes * self.fc1_width].view(routes, self.fc1_width),
                           ws.activated[: routes * self.intermediate_size].view(routes, self.intermediate_size),
                           activation=f.activation.value, fast_math=f.fast_math, swiglu_alpha=f.swiglu_alpha,
                           swiglu_beta=f.swiglu_beta, swiglu_limit=f.swiglu_limit)
        r.kernels["fc2"].kernel.launch(
            r.launch.grid("fc2"), stream, a=ws.activated.data_ptr(), qweight=self.w2.qweight.data_ptr(),
            out=out.data_ptr() if r.sums_topk else ws.fc13_address, scales=self.w2.scales.data_ptr(),
            global_scale=self.w2.global_scale.data_ptr(),
            topk_weights=ws.c_tmp_address if on_input else weight, bias=self._bias2_ptr,
            tokens=routes, **routing,
        )

    # ------------------------------------------------------------------ bound calls

    def bind(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             out: torch.Tensor) -> "BoundMoeCall":
        """A call on these static buffers with every check and lookup done now: it only launches.

        For eager serving loops that refill fixed input buffers in place each step: the returned
        callable issues this call's kernel launches (one to five, pre-packed) on the stream that is
        current now and does nothing else, so its host cost is that of the bare launches.  Needs
        int32 topk_ids, `out`, and at most max_tokens tokens (one launch sequence); no calibration.
        Nothing is launched by `bind` itself.  Under CUDA-graph capture or torch.compile call the
        layer instead.
        """
        if torch.compiler.is_compiling():
            raise BadInputError("bind() is for eager serving loops; under torch.compile call the layer itself")
        if not isinstance(out, torch.Tensor):
            raise BadInputError(f"bind() needs the output buffer `out` ({tuple(hidden_states.shape)}), got {out!r}")
        m = self._check(hidden_states, topk_weights, topk_ids, out, None, None)
        if topk_ids.dtype != torch.int32:
            raise BadInputError(f"bind() needs int32 topk_ids (a bound call runs no conversion), got {topk_ids.dtype}")
        if not 1 <= m <= self.max_tokens:
            raise BadInputError(f"bind() serves 1..max_tokens={self.max_tokens} tokens in one launch sequence, got {m}")
        stream = current_stream_handle(self.device.index)
        ws = self.workspace(stream)
        with recording_launches() as launches:
            self._launch(m, hidden_states, topk_weights, topk_ids, out, None, None, ws, stream)
        return BoundMoeCall(self, tuple(launches), stream, (hidden_states, topk_weights, topk_ids, out), ws)

    # ------------------------------------------------------------------ validation

    def _check(self, x, topk_weights, topk_ids, out, amax, layer_idx) -> int:
        """M of a valid call; BadInputError naming the problem otherwise."""
        try:  # the common call, in one cheap expression; anything else takes the checks that explain
            m, ids_dtype = x.shape[0], topk_ids.dtype
        except (AttributeError, IndexError, TypeError):
            m, ids_dtype = None, None
        if (m is not None and amax is None and layer_idx is None and not self.validate_ids
                and (ids_dtype is torch.int32 or ids_dtype is torch.int64)):
            rows, routes, device, dtype = (m, self.hidden_size), (m, self.top_k), self.device_index, self.torch_dtype
            if (conforms(x, dtype, rows, device) and conforms(topk_ids, ids_dtype, routes, device)
                    and conforms(topk_weights, torch.float32, routes, device)):
                px, pw, pi = x.data_ptr(), topk_weights.data_ptr(), topk_ids.data_ptr()
                if not (px & 15 or (pw | pi) & 3):  # 16-byte rows, 4-byte routing words
                    if out is None:
                        return m
                    if conforms(out, dtype, rows, device):
                        # out spans [po, end), x as many bytes; no input may reach into it (check_apart)
                        po, n = out.data_ptr(), m * self._row_bytes
                        end, r = po + n, m * self.top_k
                        if (not po & 15 and (end <= px or px + n <= po) and (end <= pw or pw + 4 * r <= po)
                                and (end <= pi or pi + r * topk_ids.itemsize <= po)):
                            return m
        return self._check_explained(x, topk_weights, topk_ids, out, amax, layer_idx)

    def _check_explained(self, x, topk_weights, topk_ids, out, amax, layer_idx) -> int:
        check_rank(x, "hidden_states", 2, f"(M, {self.hidden_size})")
        m = x.shape[0]
        dt = self.dtype.torch
        check_tensor(x, "hidden_states", dtype=dt, shape=(m, self.hidden_size), device=self.device)
        check_rank(topk_ids, "topk_ids", 2, f"(M, {self.top_k})")
        if topk_ids.shape[1] != self.top_k:
            raise BadInputError(f"topk_ids has top_k={topk_ids.shape[1]}, the layer was built for top_k={self.top_k}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise BadInputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        check_tensor(topk_ids, "topk_ids", dtype=topk_ids.dtype, shape=(m, self.top_k), device=self.device, align=4)
        check_tensor(topk_weights, "topk_weights", dtype=torch.float32, shape=(m, self.top_k), device=self.device,
                     align=4)
        if out is not None:
            check_tensor(out, "out", dtype=dt, shape=(m, self.hidden_size), device=self.device)
            check_apart(out, "out", hidden_states=x, topk_weights=topk_weights, topk_ids=topk_ids)
        if amax is not None:
            check_rank(amax, "activation_amax", 3, f"(layers, {self.num_experts}, 2) float32")
            check_tensor(amax, "activation_amax", dtype=torch.float32,
                         shape=(amax.shape[0], self.num_experts, 2), device=self.device, align=4)
            if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < amax.shape[0]:
                raise BadInputError(f"layer_idx must be an int in [0, {amax.shape[0]}) with activation_amax, "
                                    f"got {layer_idx!r}")
            check_apart(amax, "activation_amax", hidden_states=x, topk_weights=topk_weights, topk_ids=topk_ids,
                        out=out)
            self._check_calibration()
        elif layer_idx is not None:
            raise BadInputError("layer_idx is only used with activation_amax (calibration)")
        if self.validate_ids and m and not capturing(self.device):
            lo, hi = (int(v) for v in torch.aminmax(topk_ids))
            if lo < -1 or hi >= self.route_experts:
                raise BadInputError(f"topk_ids must be in [-1, {self.route_experts}) (-1 = masked route, "
                                    f"{self.route_experts} experts), got [{lo}, {hi}]")
        return m

    def _check_calibration(self) -> None:
        """Calibration kernels exist for this layer (checked as the plain ones were at construction, once),
        and index activation_amax by its expert count."""
        if self._amax_rows is None:
            entry = self._entry(True)  # raises UnknownSpecializationError, naming what the bundle has
            rows = {kernel.spec.amax_experts for role, kernel in self._check_launches(entry, self.calibration_tokens)
                    if role == "fused"}
            if len(rows) != 1:
                raise BundleError(f"this bundle's calibration kernels disagree on activation_amax's rows ({sorted(rows)})"
                                  ": its table is corrupt; rebuild it")
            self._amax_rows = rows.pop()
        if self._amax_rows != self.num_experts:
            raise BadInputError(
                f"this bundle's calibration kernels index activation_amax by {self._amax_rows} experts (the "
                f"expert map's length), the layer holds {self.num_experts}: calibrate without expert parallelism")


class BoundMoeCall:
    """`MoeLayer.bind`'s result: `call()` launches the layer on its bound buffers and returns `out`.

    The launches carry the bound tensors' addresses: refill the buffers in place, never resize them (their
    storages are held, so a resized buffer is not written, and no freed memory is).  A `reserve()` that
    gives the bound stream its own workspace after `bind` is refused at the next call: bind again.  It
    launches on the stream current at `bind`, whatever stream is current at the call: to capture it in a
    CUDA graph, capture on that stream (a capture on another one would not record its launches)."""

    __slots__ = ("layer", "launches", "stream", "buffers", "storages", "out", "ws", "pool", "generation")

    def __init__(self, layer: MoeLayer, launches: tuple[RecordedLaunch | ZeroFill, ...], stream: int, buffers: tuple,
                 ws: MoeWorkspace):
        self.layer = layer  # keeps the layer, and with it the workspace, alive
        self.launches, self.stream, self.buffers = launches, stream, buffers  # the bound tensors stay alive too
        self.storages = tuple(t.untyped_storage() for t in buffers)  # ... and the memory the launches address
        self.out = buffers[-1]
        self.ws, self.pool = ws, layer.bundle.workspaces
        self.generation = self.pool.generation

    def __call__(self) -> torch.Tensor:
        if self.pool.generation != self.generation:  # a workspace was added or dropped somewhere: is ours still it?
            self._check_workspace()
        for launch in self.launches:
            launch.launch(self.stream)
        return self.out

    def _check_workspace(self) -> None:
        if self.pool.get(self.layer.shape, self.stream) is not self.ws:
            raise BadInputError("this stream's workspace changed since bind() (reserve() gave the stream its own): "
                                "bind again, so that the call uses the stream's workspace")
        self.generation = self.pool.generation

    def __repr__(self) -> str:
        names = ", ".join("memset" if isinstance(launch, ZeroFill) else launch.kernel.record.key.family
                          for launch in self.launches)
        return f"BoundMoeCall({self.layer.id}, M={self.out.shape[0]}, launches=[{names}])"


def run_w4a16_moe(bundle: Bundle, hidden_states: torch.Tensor, w13: PackedNvfp4, w2: PackedNvfp4,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "silu",
                  swiglu_alpha: float | None = None, swiglu_beta: float | None = None,
                  swiglu_limit: float | None = None, fast_math: bool = True, router_weight_on_input: bool = False,
                  expert_map: torch.Tensor | None = None, activation_amax: torch.Tensor | None = None,
                  layer_idx: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional MoE: builds the MoeLayer of these weights and options on the first call.

    The layer is cached on `w13` itself, so it lives exactly as long as the weights do: dropping
    the weights drops the layer and, with the last layer of its shape, the workspaces.  Build the
    first call of each weight pair outside CUDA-graph capture (it reserves the workspace), and pass the
    same `expert_map` tensor every call: another one rebuilds the layer (which checks the map on the host).
    """
    check_rank(topk_ids, "topk_ids", 2, "(M, top_k)")
    if not isinstance(w13, PackedNvfp4) or not isinstance(w2, PackedNvfp4):
        raise BadInputError(f"w13 and w2 must be PackedNvfp4 (prepare_w13 / prepare_w2), got "
                            f"{type(w13).__name__} and {type(w2).__name__}")
    # one layer per options: a call with another expert_map tensor rebuilds it (a new map each call would
    # otherwise pile up layers that hold their maps for the weights' life)
    key = (bundle.id, id(w2), topk_ids.shape[1], str(activation), swiglu_alpha, swiglu_beta, swiglu_limit,
           fast_math, router_weight_on_input, expert_map is not None)
    cache = w13.functional_layers
    entry = cache.get(key)
    if entry is None or entry[0]() is not w2 or (expert_map is not None and entry[1].expert_map is not expert_map):
        layer = MoeLayer(bundle, w13, w2, top_k=topk_ids.shape[1], activation=activation, swiglu_alpha=swiglu_alpha,
                         swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit, fast_math=fast_math,
                         router_weight_on_input=router_weight_on_input, expert_map=expert_map)
        entry = cache[key] = (weakref.ref(w2), layer)
    return entry[1](hidden_states, topk_weights, topk_ids, out=out, activation_amax=activation_amax,
                    layer_idx=layer_idx)


@torch.library.custom_op("cuteaot::moe_layer", mutates_args=("out", "activation_amax"))
def _moe_layer_op(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  out: torch.Tensor, activation_amax: Optional[torch.Tensor], layer_idx: int, layer_id: str) -> None:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise BadInputError(f"no MoeLayer with id {layer_id!r} is alive in this process")
    layer(hidden_states, topk_weights, topk_ids, out=out, activation_amax=activation_amax,
          layer_idx=None if layer_idx < 0 else layer_idx)


@_moe_layer_op.register_fake
def _moe_layer_fake(hidden_states, topk_weights, topk_ids, out, activation_amax, layer_idx, layer_id) -> None:
    check_rank(hidden_states, "hidden_states", 2, "(M, H)")
    check_rank(topk_ids, "topk_ids", 2, "(M, top_k)")
    m, h = hidden_states.shape
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or topk_ids.shape[0] != m:
        raise BadInputError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                            f"must both be ({m}, top_k)")
    if tuple(out.shape) != (m, h) or out.dtype != hidden_states.dtype:
        raise BadInputError(f"out must be ({m}, {h}) {hidden_states.dtype}, got {tuple(out.shape)} {out.dtype}")
