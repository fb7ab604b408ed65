"""Peer benchmark: cuteaot's MoeLayer vs humming-kernels vs torch._grouped_mm, one process, same weights and routing.

For each model and M, three implementations of one MoE layer (out = sum_k w_k * FC2_e(act(FC1_e(x)))):

* cuteaot: `MoeLayer` on the bundle (default `generated/moe-models`): route packing, the fused
  FC1 -> activation -> FC2 kernel and the top-k sum, everything in its timed call.
* humming (`humming-kernels`, imported lazily; 0.1.19 assumed): two `HummingLayer`s with the ModelOpt
  `nvfp4` weight config and bf16 activations (W4A16), run as indexed MoE GEMMs: FC1 on token rows ->
  `humming.ops.process_input` with the model's activation as a C expression (humming takes any:
  silu, gpt-oss swigluoai with alpha 1.702 / limit 7 / +1 on up, relu2 as a unary one) -> FC2 on
  route rows -> top-k combine (router-weighted sum, one torch.bmm; humming has no combine op).
  N and K are padded to multiples of 128 by humming itself (`pad_*_to_multiple`; its SM90
  heuristics assert on N = 2880).  The tuning config of each GEMM is humming's own heuristic
  choice for that M (the config its launcher would pick from its interval table), passed
  explicitly so that the routes can be aligned to its M-block and only the kernels used are
  compiled.  humming ships no route-alignment kernel: the sorted_ids / expert_ids /
  num_tokens_padded of each M are built before timing by `align_routes` (torch ops), so humming's
  number EXCLUDES route alignment while ours includes route packing; the alignment's own time is
  in the JSON as `route_align_us`.
* torch-bf16: sort routes by expert, gather, `torch._grouped_mm` FC1, activation, `_grouped_mm`
  FC2, router weights, `index_add_` (all in the timed call), on the bf16 dequantisation of the
  same NVFP4 weights (4x the weight bytes).

Weights: random normal (std 0.05) float32 weights, quantised once per model to ModelOpt NVFP4 by
`tests.reference.nvfp4.random_nvfp4` (the runtime has no quantiser; `benchmarks/gemm.py` already
uses that reference quantiser).  cuteaot gets `prepare_w13` / `prepare_w2` of those tensors, humming
the tensors themselves, torch their dequantisation.  Routing: uniform random top-k seeded by M,
softmax router weights, the same tensors for all three.

Timing: `benchmarks.common.cold_us`.  Each implementation's call (and each side call) is captured in a
one-call CUDA graph; then, `--samples` times (default 60) and interleaving the implementations of the
row in a rotating order, the L2 flush runs (untimed), a CUDA event is recorded, the graph replays and
an event is recorded: a row's `us` is the median of its samples' event intervals, with `p10` / `p90`
beside it.  Nothing is subtracted (the flush is not inside the interval, and it takes far longer than
the host needs to enqueue the replay).  The flush reads a buffer of `--flush-mib` (default 256 MiB,
several times the H200's L2, whose size is in the JSON) with a sum, so no weights or activations of
the previous call are L2-resident (a read, not a write: clean lines leave L2 without a write-back that
would land in the timed call).  Where graph capture of an implementation fails, its call runs eagerly
between the events and the row says so in `timing`.  The JSON records the runtime's launch modes
(programmatic / cooperative) and the bundle's manifest digest.

Roofline beside every number: max(bytes / measured HBM copy bandwidth, FLOPs / measured bf16
torch.mm rate), bytes = NVFP4 codes + e4m3 scales + global scales of the experts the routing hits
(bf16 weights for the torch row) + the input and output activations; FLOPs = 2 * M * top_k *
(N1 * H + H * I).

Correctness in the same run: at one M (`--check-m`, default 64) every implementation's output
(buffer poisoned with NaN before its second call) against a float32 reference of the dequantised
weights: `tests.reference.moe.moe_reference` on `tests.reference.nvfp4.dequantize_modelopt`
(the references the GPU tests use, independent of the code under test), error
||out - ref|| / ||ref||.

Output: JSON (`--json`, default docs/results/peers-<date>.json; rows: model, M, impl, us, tflops,
rel_err, roofline, commit, error) and a markdown table on stdout for docs/benchmarks.md.
Each implementation runs in its own try/except: a failing peer records its error text in its
rows and the run goes on (a device fault that kills the CUDA context still ends every later row).
`--dry-run` builds everything it can on the CPU for tiny shapes (cuteaot's weight packing; the
humming pipeline with its two GPU ops emulated from their semantics; the torch path), checks the
humming and torch paths against the reference, prints the table and exits 1 on a mismatch, so
the script's plumbing and the route alignment are tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import math
import statistics
import subprocess
import sys
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from tests.reference.moe import moe_reference
from tests.reference.moe_elementwise import relative_error
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

REPO = Path(__file__).resolve().parents[1]
SWIGLUOAI = (1.702, 1.0, 7.0)  # alpha, beta (added to up), limit: gpt-oss
HUMMING_WEIGHT_CONFIG = {"quant_method": "modelopt", "quant_algo": "nvfp4"}  # ModelOpt NVFP4 checkpoint tensors
HUMMING_PAD = 128  # humming pads N and K to this multiple where a dimension is not one
ALIGN_SLACK_BLOCKS = 4  # spare route blocks past the aligned routes (sentinel rows), for M-multicast reads
DEQUANT_ELEMENTS = 1 << 27  # experts dequantised at a time: the reference dequantiser's temporaries are ~30 B/element
IMPLS = ("cuteaot", "humming", "torch-bf16")
MS = (1, 8, 64, 256, 1024, 4096, 16384)


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    inter: int  # per tensor-parallel shard
    experts: int
    top_k: int
    activation: str  # silu | swigluoai | relu2

    @property
    def fc1_width(self) -> int:
        return self.inter if self.activation == "relu2" else 2 * self.inter

    @property
    def weights_per_expert(self) -> int:
        return self.fc1_width * self.hidden + self.hidden * self.inter


def _by_name(*models: Model) -> dict[str, Model]:
    return {m.name: m for m in models}


def _spec_models() -> dict[str, Model]:
    """The MoE problems of specs/moe-models.yaml (Qwen3-235B at each tensor-parallel shard)."""
    models = [
        Model("qwen3-30b-a3b", 2048, 768, 128, 8, "silu"),
        *(Model(f"qwen3-235b-a22b-tp{tp}", 4096, 1536 // tp, 128, 8, "silu") for tp in (1, 2, 4, 8)),
        Model("gpt-oss-120b", 2880, 2880, 128, 4, "swigluoai"),
        Model("gpt-oss-20b", 2880, 2880, 32, 4, "swigluoai"),
        Model("glm-4.5-air", 4096, 1408, 128, 8, "silu"),
        Model("nemotron-3-nano", 2688, 1856, 128, 6, "relu2"),
        Model("mixtral-8x7b", 4096, 14336, 8, 2, "silu"),
    ]
    return _by_name(*models)


# specs/bench-unseen.yaml: real models whose shapes no measured table holds (they borrow the nearest one's)
UNSEEN_MODELS = _by_name(
    Model("olmoe-1b-7b", 2048, 1024, 64, 8, "silu"),
    Model("qwen2-57b-a14b", 3584, 2560, 64, 8, "silu"),
    Model("phi-3.5-moe", 4096, 6400, 16, 2, "silu"),
    Model("deepseek-v3-tp8", 7168, 256, 256, 8, "silu"),
    Model("deepseek-v2-lite", 2048, 1408, 64, 6, "silu"),
)
# specs/bench-edge.yaml (its bf16 problems): shapes at the edges of what the planner was tuned on
EDGE_MODELS = _by_name(
    Model("qwen3-next-80b-a3b", 2048, 512, 512, 10, "silu"),
    Model("llama-4-scout", 5120, 8192, 16, 1, "silu"),
    Model("qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, "silu"),
    Model("granite-3.0-1b-a400m", 1024, 512, 32, 8, "silu"),
    Model("minimax-m2", 3072, 1536, 256, 8, "silu"),
)
SPEC_MODELS = _spec_models()
MODELS = {**SPEC_MODELS, **UNSEEN_MODELS, **EDGE_MODELS}
# ~3 minutes of H200 time: one model per activation and shape family
DEFAULT_MODELS = ("qwen3-30b-a3b", "gpt-oss-120b", "glm-4.5-air", "nemotron-3-nano", "mixtral-8x7b")
# --dry-run: one tiny shape per activation, on the CPU
DRY_MODELS = _by_name(Model("tiny-silu", 256, 128, 8, 2, "silu"),
                      Model("tiny-swigluoai", 256, 128, 8, 2, "swigluoai"),
                      Model("tiny-relu2", 256, 128, 8, 3, "relu2"))
DRY_M = 5
DRY_TOLERANCE = 2e-2  # bf16-level error of the emulated humming and torch paths vs the float32 reference


# ---- weights and routing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelOpt:
    """One NVFP4 weight [E, N, K] in the ModelOpt checkpoint format."""

    weight: torch.Tensor  # (E, N, K/2) u8, low nibble = even k
    weight_scale: torch.Tensor  # (E, N, K/16) e4m3fn
    weight_scale_2: torch.Tensor  # (E,) f32


@dataclass(frozen=True)
class Weights:
    w13: ModelOpt  # (E, N1, H): [gate | up] rows for gated activations
    w2: ModelOpt  # (E, H, I)


def random_weights(model: Model, device: torch.device, seed: int) -> Weights:
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = ModelOpt(*random_nvfp4(model.experts, model.fc1_width, model.hidden, g))
    w2 = ModelOpt(*random_nvfp4(model.experts, model.hidden, model.inter, g))
    return Weights(w13, w2)


def dequantize(q: ModelOpt, dtype: torch.dtype, experts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(len(experts) or E, N, K) weights of the given experts, a few experts at a time."""
    rows = torch.arange(q.weight.shape[0], device=q.weight.device) if experts is None else experts
    n, k = q.weight.shape[1], 2 * q.weight.shape[2]
    out = torch.empty(rows.numel(), n, k, dtype=dtype, device=q.weight.device)
    step = max(1, DEQUANT_ELEMENTS // (n * k))
    for start in range(0, rows.numel(), step):
        idx = rows[start:start + step]
        out[start:start + step] = dequantize_modelopt(q.weight[idx], q.weight_scale[idx], q.weight_scale_2[idx])
    return out


@dataclass(frozen=True)
class Routing:
    x: torch.Tensor  # (M, H) bf16
    topk_weights: torch.Tensor  # (M, top_k) f32
    topk_ids: torch.Tensor  # (M, top_k) int32


def random_routing(model: Model, m: int, device: torch.device) -> Routing:
    """Uniform random top-k (seeded by M, as benchmarks/moe.py), softmax router weights, normal input rows."""
    g = torch.Generator().manual_seed(m)
    ids = torch.rand(m, model.experts, generator=g).topk(model.top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, model.top_k, generator=g), dim=1)
    x = torch.randn(m, model.hidden, generator=g).to(torch.bfloat16)
    return Routing(x.to(device), weights.to(device), ids.to(device))


def activation_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The layer's activation on float FC1 rows ([gate | up] for the gated ones)."""
    if activation == "relu2":
        return torch.relu(h) ** 2
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    alpha, beta, limit = SWIGLUOAI
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def reference(model: Model, weights: Weights, r: Routing) -> torch.Tensor:
    """float32 (M, H) output of the dequantised weights (only the experts the routing hits are dequantised)."""
    hit = torch.unique(r.topk_ids.long())
    index = torch.full((model.experts,), -1, dtype=torch.long, device=hit.device)
    index[hit] = torch.arange(hit.numel(), device=hit.device)
    swiglu = dict(zip(("alpha", "beta", "limit"), SWIGLUOAI)) if model.activation == "swigluoai" else {}
    out, _, _ = moe_reference(r.x.float(), dequantize(weights.w13, torch.float32, hit),
                              dequantize(weights.w2, torch.float32, hit), r.topk_weights, r.topk_ids,
                              model.activation, expert_index=index, **swiglu)
    return out


# ---- implementations -----------------------------------------------------------------------------------------------


class NotRun(Exception):
    """An implementation that this run cannot execute by design (e.g. a GPU kernel in --dry-run)."""


@dataclass(frozen=True)
class Bound:
    """One implementation bound to one routing: `run()` writes `out` (M, H); `extra` goes into its JSON row;
    `side` are other callables to time on their own (name -> fn)."""

    run: Callable[[], torch.Tensor]
    out: torch.Tensor
    extra: dict = field(default_factory=dict)
    side: dict = field(default_factory=dict)


class Cuteaot:
    name = "cuteaot"

    def __init__(self, model: Model, weights: Weights, bundle, max_tokens: int):
        from cuteaot.runtime import MoeLayer, prepare_w2, prepare_w13

        w13 = prepare_w13(weights.w13.weight, weights.w13.weight_scale, weights.w13.weight_scale_2, "bf16")
        w2 = prepare_w2(weights.w2.weight, weights.w2.weight_scale, weights.w2.weight_scale_2, "bf16")
        if bundle is None:  # --dry-run: the packing above ran on the CPU; a layer needs the GPU and the bundle
            raise NotRun("dry run: weights packed on the CPU; MoeLayer needs a GPU and the bundle")
        self.layer = MoeLayer(bundle, w13, w2, top_k=model.top_k, activation=model.activation, max_tokens=max_tokens)

    def bind(self, r: Routing) -> Bound:
        out = torch.empty_like(r.x)
        extra = {"plan": self.layer.resolve(r.x.shape[0]).describe()}
        return Bound(lambda: self.layer(r.x, r.topk_weights, r.topk_ids, out=out), out, extra)


class TorchGroupedMm:
    name = "torch-bf16"

    def __init__(self, model: Model, weights: Weights):
        self.model = model
        # (E, K, N) views of (E, N, K) storage: the K-major operand layout _grouped_mm takes
        self.w13 = dequantize(weights.w13, torch.bfloat16).transpose(1, 2)
        self.w2 = dequantize(weights.w2, torch.bfloat16).transpose(1, 2)

    def bind(self, r: Routing) -> Bound:
        out = torch.empty_like(r.x)
        return Bound(lambda: self._run(r, out), out)

    def _run(self, r: Routing, out: torch.Tensor) -> torch.Tensor:
        flat = r.topk_ids.view(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(self.model.experts, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat.long(), torch.ones_like(flat))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // self.model.top_k
        h = torch._grouped_mm(r.x[tokens], self.w13, offs=offs)
        a = activation_torch(h.float(), self.model.activation).to(torch.bfloat16)
        y = torch._grouped_mm(a, self.w2, offs=offs)
        y = y * r.topk_weights.view(-1)[order, None].to(torch.bfloat16)
        out.zero_()
        out.index_add_(0, tokens, y)
        return out


@dataclass(frozen=True)
class AlignedRoutes:
    """humming's indexed-GEMM routing (vLLM's moe_align_block_size format) for one M-block size."""

    sorted_ids: torch.Tensor  # (capacity,) int32 route ids grouped by expert, each group padded to the block
    expert_ids: torch.Tensor  # (capacity / block,) int32 expert of each block
    num_tokens_padded: torch.Tensor  # (1,) int32 routes after padding: the kernel's M extent


def align_routes(topk_ids: torch.Tensor, experts: int, block: int) -> AlignedRoutes:
    """Group the routes (flat indices into topk_ids) by expert, padding each expert's group to a multiple of
    `block` with the sentinel route id M * top_k (the kernel skips rows >= M * top_k).  Device ops only, with
    a static capacity, so it is CUDA-graph capturable."""
    flat = topk_ids.reshape(-1).long()
    routes, dev = flat.numel(), flat.device
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    by_expert = flat[order]
    slot = padded_end[by_expert] - padded[by_expert] + torch.arange(routes, device=dev) - start[by_expert]
    capacity = (math.ceil((routes + min(routes, experts) * (block - 1)) / block) + ALIGN_SLACK_BLOCKS) * block
    sorted_ids = torch.full((capacity,), routes, dtype=torch.int32, device=dev)
    sorted_ids[slot] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp(max=experts - 1).to(torch.int32)
    return AlignedRoutes(sorted_ids, expert_ids, padded_end[-1:].to(torch.int32))


def combine(fc2: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (M, H) = sum_k w[m, k] * fc2[m * top_k + k]: the top-k combine, one batched (1 x top_k) @ (top_k x H)."""
    m, top_k = topk_weights.shape
    torch.bmm(topk_weights.to(fc2.dtype).unsqueeze(1), fc2.view(m, top_k, -1), out=out.unsqueeze(1))
    return out


def _humming_activation(activation: str) -> tuple[str, str]:
    """humming's process_input activation: (type, C expression of a = gate (or the value), b = up)."""
    if activation == "relu2":
        return "unary", "fmaxf(a, 0.0f) * fmaxf(a, 0.0f)"
    if activation == "silu":
        return "binary_split", "a / (1.0f + expf(-a)) * b"
    alpha, beta, limit = SWIGLUOAI
    gate, up = f"fminf(a, {limit}f)", f"fminf(fmaxf(b, -{limit}f), {limit}f)"
    return "binary_split", f"{gate} / (1.0f + expf(-{alpha}f * {gate})) * ({up} + {beta}f)"


def _json_default(value):
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "item"):  # numpy scalars from the heuristics
        return value.item()
    raise TypeError(f"humming tuning value {value!r} ({type(value).__name__}) has no JSON form")


@dataclass(frozen=True)
class GemmPlan:
    block: int  # M-block of the kernel: the routes are aligned to it
    tuning: Optional[list]  # humming tuning_config: [[0, 2**30, config]] (None for the emulation)


class Humming:
    """humming-kernels W4A16 MoE: indexed GEMM FC1 -> process_input activation -> indexed GEMM FC2 -> combine."""

    name = "humming"
    COMPUTE = {"gemm_type": "indexed"}

    def __init__(self, model: Model, weights: Weights):
        import humming  # noqa: F401 - lazily: the benchmark imports without it

        self.model = model
        self.version = getattr(humming, "__version__", "unknown")
        self.fc1 = self._layer(model.fc1_width, model.hidden, weights.w13)
        self.fc2 = self._layer(model.hidden, model.inter, weights.w2)
        self.act_type, self.act_impl = _humming_activation(model.activation)

    @staticmethod
    def _layer(n: int, k: int, q: ModelOpt):
        from humming.layer import HummingLayer

        with torch.device(q.weight.device):
            layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(HUMMING_WEIGHT_CONFIG),
                                 num_experts=q.weight.shape[0], pad_n_to_multiple=HUMMING_PAD,
                                 pad_k_to_multiple=HUMMING_PAD, torch_dtype=torch.bfloat16)
        tensors = {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2}
        layer.load_from_tensors(tensors)
        # load_state_dict(strict=False) skips names it does not know: check every tensor arrived
        for name, t in tensors.items():
            if not torch.equal(getattr(layer, name).view(torch.uint8), t.view(torch.uint8)):
                raise RuntimeError(f"HummingLayer did not load {name} {tuple(t.shape)} {t.dtype}")
        layer.transform()
        return layer

    def _plan(self, layer, routes: int) -> GemmPlan:
        """humming's heuristic config for `routes` rows (its launcher's shape_m for an indexed GEMM): the
        config of the interval of its table that holds `routes` (humming samples each interval at
        get_shape_m_sample), fixed for all shape_m so that its M-block is known when aligning."""
        from humming.tune import get_heuristics_class, get_heuristics_config

        config = layer.humming_config
        device = layer.locks.device
        sample = getattr(get_heuristics_class(device), "get_shape_m_sample", None)
        shape_m = routes if sample is None else sample(config, routes)
        tuned = get_heuristics_config(config, shape_m=shape_m, device=device, **self.COMPUTE)
        tuned = json.loads(json.dumps(tuned, default=_json_default))
        return GemmPlan(int(tuned["block_shape"][0]), [[0, 1 << 30, tuned]])

    def prepare(self, ms: list[int]) -> None:
        """Compile the kernels of every M at once (humming builds a list of configs in parallel and keeps
        each kernel for the identical config the calls pass later), instead of one by one at first use."""
        from humming.kernel.humming import HummingKernel

        for layer in (self.fc1, self.fc2):
            configs = {json.dumps(p.tuning[0][2], sort_keys=True): p.tuning[0][2]
                       for p in (self._plan(layer, m * self.model.top_k) for m in ms)}
            intervals = [[i, i + 1, config] for i, config in enumerate(configs.values())]
            HummingKernel.prepare_kernels(layer.humming_config.to_str(), json.dumps(self.COMPUTE), intervals,
                                          layer.locks.device)

    def _gemm(self, layer, a: torch.Tensor, c: torch.Tensor, aligned: AlignedRoutes, top_k: int, plan: GemmPlan):
        layer(a, outputs=c, sorted_ids=aligned.sorted_ids, expert_ids=aligned.expert_ids,
              num_tokens_padded=aligned.num_tokens_padded, top_k=top_k, compute_config=self.COMPUTE,
              tuning_config=plan.tuning)

    def _activate(self, fc1: torch.Tensor, act: torch.Tensor):
        from humming import ops

        ops.process_input(fc1, outputs=act, activation_type=self.act_type, activation_impl=self.act_impl)

    def bind(self, r: Routing) -> Bound:
        m, (e, top_k) = r.x.shape[0], (self.model.experts, self.model.top_k)
        routes, dev, bf16 = m * top_k, r.x.device, torch.bfloat16
        p1, p2 = self._plan(self.fc1, routes), self._plan(self.fc2, routes)
        a1 = align_routes(r.topk_ids, e, p1.block)
        a2 = a1 if p2.block == p1.block else align_routes(r.topk_ids, e, p2.block)
        fc1 = torch.zeros(routes, self.model.fc1_width, dtype=bf16, device=dev)
        act = torch.zeros(routes, self.model.inter, dtype=bf16, device=dev)
        fc2 = torch.zeros(routes, self.model.hidden, dtype=bf16, device=dev)
        out = torch.empty_like(r.x)

        def run() -> torch.Tensor:
            self._gemm(self.fc1, r.x, fc1, a1, top_k, p1)
            self._activate(fc1, act)
            self._gemm(self.fc2, act, fc2, a2, 1, p2)
            return combine(fc2, r.topk_weights, out)

        blocks = sorted({p1.block, p2.block})
        extra = {"block_m": [p1.block, p2.block], "activation_impl": self.act_impl,
                 "note": "excludes route alignment (humming has no kernel for it): see route_align_us"}
        side = {"route_align_us": lambda: [align_routes(r.topk_ids, e, b) for b in blocks]}
        return Bound(run, out, extra, side)


class HummingEmulated(Humming):
    """--dry-run: the humming pipeline (alignment, buffers, combine) with its two GPU ops emulated in torch
    from their semantics (indexed GEMM: block b of sorted_ids uses expert expert_ids[b], reads input row
    id // top_k, writes output row id, skips ids >= rows; process_input: the activation), so the
    alignment and combine are checked against the reference on the CPU."""

    name = "humming"
    BLOCKS = (16, 8)  # different FC1 / FC2 blocks: both alignments are exercised

    def __init__(self, model: Model, weights: Weights):
        self.model = model
        self.version = "emulated"
        self.fc1, self.fc2 = dequantize(weights.w13, torch.float32), dequantize(weights.w2, torch.float32)
        self.act_type, self.act_impl = _humming_activation(model.activation)

    def _plan(self, layer, routes: int) -> GemmPlan:
        return GemmPlan(self.BLOCKS[0] if layer is self.fc1 else self.BLOCKS[1], None)

    def prepare(self, ms: list[int]) -> None:
        """Nothing to compile: the emulated GEMMs are torch code."""

    def _gemm(self, layer, a, c, aligned: AlignedRoutes, top_k: int, plan: GemmPlan):
        c.fill_(float("nan"))  # rows the emulated kernel fails to write stay NaN
        rows = c.shape[0]
        for b in range(int(aligned.num_tokens_padded) // plan.block):
            ids = aligned.sorted_ids[b * plan.block:(b + 1) * plan.block].long()
            ids = ids[ids < rows]
            c[ids] = (a[ids // top_k].float() @ layer[int(aligned.expert_ids[b])].T).to(c.dtype)

    def _activate(self, fc1, act):
        act.copy_(activation_torch(fc1.float(), self.model.activation))


# ---- timing, checks, rows -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Env:
    device: torch.device
    dry_run: bool
    hbm: float  # bytes/s (read + written)
    tc: float  # FLOP/s
    flush: Optional[Callable[[], object]]
    commit: Optional[str]


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _report_failure(what: str, exc: BaseException) -> str:
    print(f"FAILED {what}: {_error_text(exc)}", file=sys.stderr)
    traceback.print_exc(file=sys.stderr)
    return _error_text(exc)


def time_bound(calls: dict[str, Callable], env: Env, samples: int) -> dict[str, dict]:
    """name -> {"us", "p10", "p90", "samples", "timing"} (or {"error"}) of each call with a cold L2, all
    timed together, interleaved sample by sample (`benchmarks.common.cold_us`)."""
    from benchmarks.common import capture_or_eager, cold_us

    runners, results = {}, {}
    for name, fn in calls.items():
        try:
            runners[name], failed = capture_or_eager(fn)
            results[name] = {"timing": "graph, L2 flushed" if failed is None else
                             f"eager, L2 flushed (graph capture failed: {failed})"}
        except Exception as exc:  # noqa: BLE001 - a failing call costs its own number only
            torch.cuda.synchronize()  # a sticky device error surfaces here and fails the row instead
            results[name] = {"error": _report_failure(f"timing {name}", exc)}
    if runners:
        for name, found in cold_us(runners, env.flush, samples).items():
            results[name].update(found)
    return results


def problem_facts(model: Model, r: Routing, env: Env) -> dict:
    """Bytes, FLOPs and rooflines of one call: the NVFP4 bytes for the W4A16 rows, bf16 for torch."""
    m = r.x.shape[0]
    hit = int(torch.unique(r.topk_ids).numel())
    per = model.weights_per_expert
    nvfp4 = hit * (per // 2 + per // 16 + 2 * 4)  # e2m1 codes, e4m3 scale per 16, two f32 global scales
    bf16 = hit * per * 2
    act = 2 * m * model.hidden * 2
    flops = 2 * m * model.top_k * per

    def roof(weight_bytes):
        return max((weight_bytes + act) / env.hbm, flops / env.tc) * 1e6 if env.hbm else None

    return {"experts_hit": hit, "flops": flops, "weight_bytes": {"nvfp4": nvfp4, "bf16": bf16},
            "roofline_us": {"nvfp4": roof(nvfp4), "bf16": roof(bf16)}}


def measure(impl, r: Routing, check: Optional[torch.Tensor]) -> tuple[dict, "Bound"]:
    """One row's checks: bind, optionally check against the reference (output poisoned first); the bound
    call is timed with the other implementations' (`time_bound`)."""
    bound = impl.bind(r)
    row = dict(bound.extra)
    bound.run()  # first call: humming compiles here, outside timing and capture
    if check is not None:
        bound.out.fill_(float("nan"))
        err = relative_error(bound.run(), check)
        row["rel_err"] = err if math.isfinite(err) else None  # the JSON stays standard (no NaN tokens)
        if not math.isfinite(err):
            row["error"] = f"output is not finite (rel_err {err}) at M={r.x.shape[0]}"
    return row, bound


def _row(model: Model, m: int, impl: str, facts: dict, env: Env, result: dict) -> dict:
    kind = "bf16" if impl == "torch-bf16" else "nvfp4"
    row = {"model": model.name, "M": m, "impl": impl, "us": None, "tflops": None, "rel_err": None,
           "roofline_us": facts["roofline_us"][kind], "pct_roofline": None, "weight_bytes": facts["weight_bytes"][kind],
           "weight_format": kind, "experts_hit": facts["experts_hit"], "commit": env.commit, "error": None}
    row.update(result)
    us = row["us"]
    if us is not None and us > 0:
        row["tflops"] = facts["flops"] / us / 1e6
        row["pct_roofline"] = None if row["roofline_us"] is None else 100 * row["roofline_us"] / us
    return row


def build_impls(model: Model, weights: Weights, names: list[str], env: Env, bundle, max_tokens: int) -> dict:
    """name -> implementation object, or the error text of its construction."""
    makers = {
        "cuteaot": lambda: Cuteaot(model, weights, bundle, max_tokens),
        "humming": lambda: (HummingEmulated if env.dry_run else Humming)(model, weights),
        "torch-bf16": lambda: TorchGroupedMm(model, weights),
    }
    impls = {}
    for name in names:
        try:
            impls[name] = makers[name]()
        except NotRun as exc:
            impls[name] = f"not run: {exc}"
        except Exception as exc:  # noqa: BLE001 - one failing peer never ends the run
            impls[name] = _report_failure(f"{model.name}: building {name}", exc)
    return impls


def run_model(model: Model, ms: list[int], check_m: int, names: list[str], env: Env, bundle,
              samples: int = 60) -> list[dict]:
    weights = random_weights(model, env.device, seed=zlib.crc32(model.name.encode()))
    impls = build_impls(model, weights, names, env, bundle, max(ms + [check_m]))
    for name, impl in impls.items():
        if hasattr(impl, "prepare"):
            try:
                impl.prepare(sorted(set(ms) | {check_m}))
            except Exception as exc:  # noqa: BLE001 - not fatal: each call compiles what it needs and records failures
                _report_failure(f"{model.name}: precompiling {name} (kernels will compile at first use)", exc)
    rows = []
    for m in sorted(set(ms) | {check_m}):
        r = random_routing(model, m, env.device)
        facts = problem_facts(model, r, env)
        ref = reference(model, weights, r) if m == check_m else None
        results, calls = {}, {}
        for name, impl in impls.items():
            if isinstance(impl, str):
                results[name] = {"error": impl}
                continue
            try:
                results[name], bound = measure(impl, r, ref)
            except Exception as exc:  # noqa: BLE001 - recorded in the row, printed, the run goes on
                results[name] = {"error": _report_failure(f"{model.name} M={m} {name}", exc)}
                continue
            if m in ms and not env.dry_run:
                calls[name] = bound.run
                calls.update({f"{name}\0{side}": fn for side, fn in bound.side.items()})
        for key, found in (time_bound(calls, env, samples) if calls else {}).items():
            name, _, side = key.partition("\0")
            if not side:
                results[name].update(found)
            elif "us" in found:
                results[name][side] = found["us"]
            else:
                results[name][side + "_error"] = found.get("error")
        for name in impls:
            row = _row(model, m, name, facts, env, {**results[name], "timed": m in ms})
            rows.append(row)
            _print_row(row)
        del r, ref
    del impls, weights
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _print_row(row: dict) -> None:
    us = "—" if row["us"] is None else f"{row['us']:9.1f} us"
    err = "" if row["rel_err"] is None else f" rel_err {row['rel_err']:.2e}"
    roof = "" if row["roofline_us"] is None else f" (roofline {row['roofline_us']:.1f} us)"
    fail = "" if row["error"] is None else f" ERROR {row['error'][:160]}"
    print(f"{row['model']:22s} M={row['M']:5d} {row['impl']:10s} {us}{roof}{err}{fail}", flush=True)


# ---- output ---------------------------------------------------------------------------------------------------


def _cell(row: Optional[dict], key: str, fmt: str) -> str:
    if row is None:
        return "—"
    if row.get(key) is None:
        return "err" if row.get("error") else "—"
    return format(row[key], fmt)


def markdown_table(rows: list[dict]) -> str:
    """Time table (every model and M) and a correctness table (rows that carry rel_err)."""
    by = {(r["model"], r["M"], r["impl"]): r for r in rows}
    keys = list(dict.fromkeys((r["model"], r["M"]) for r in rows))
    lines = ["| model | M | cuteaot µs | humming µs | torch bf16 µs | cuteaot/humming (time) | cuteaot TF/s "
             "| roofline µs (NVFP4) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in keys:
        ours, hum, tor = (by.get((model, m, i)) for i in IMPLS)
        if not any(r.get("timed") for r in (ours, hum, tor) if r):
            continue  # the correctness M, outside --m
        ratio = "—"
        if ours and hum and ours.get("us") and hum.get("us"):
            ratio = f"{ours['us'] / hum['us']:.2f}"
        roof = (ours or hum or {}).get("roofline_us")
        lines.append(f"| {model} | {m} | {_cell(ours, 'us', '.1f')} | {_cell(hum, 'us', '.1f')} | "
                     f"{_cell(tor, 'us', '.1f')} | {ratio} | {_cell(ours, 'tflops', '.1f')} | "
                     f"{'—' if roof is None else format(roof, '.1f')} |")
    checks = [(model, m) for model, m in keys if any(by.get((model, m, i), {}).get("rel_err") is not None
                                                     for i in IMPLS)]
    lines += ["", "| model | M | cuteaot ‖out−ref‖/‖ref‖ | humming | torch bf16 |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for model, m in checks:
        cells = [_cell(by.get((model, m, i)), "rel_err", ".2e") for i in IMPLS]
        lines.append(f"| {model} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def git_commit() -> Optional[str]:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # no git (e.g. a copied tree): the lead passes --commit
    return sha + ("+dirty" if dirty else "")


def write_json(path: Path, rows: list[dict], env: Env, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": datetime.date.today().isoformat(), "commit": env.commit, "hbm_Bps": env.hbm,
           "tc_flops": env.tc, **meta, "method": __doc__, "rows": rows}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


# ---- command line -----------------------------------------------------------------------------------------------


def _csv(kind, choices=None):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v]
        except ValueError:
            values = []
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma list of {sorted(choices) if choices else kind.__name__}"
                                             f", got {text!r}")
        return values
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma list or 'all' (specs/moe-models.yaml's; default: %(default)s); known: {', '.join(MODELS)} "
                         "(the last ten: specs/bench-unseen.yaml and specs/bench-edge.yaml, run them with their bundles)")
    ap.add_argument("--m", type=_csv(int), default=list(MS), help="token counts (default: %(default)s)")
    ap.add_argument("--check-m", type=int, default=64, help="M of the correctness check (default: %(default)s)")
    ap.add_argument("--impls", type=_csv(str, set(IMPLS)), default=list(IMPLS))
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--json", help="default docs/results/peers-<date>.json (dry run: none)")
    ap.add_argument("--commit", help="recorded commit (default: git rev-parse --short HEAD)")
    ap.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer (default: %(default)s MiB)")
    ap.add_argument("--flush", choices=["read", "write"], default="read",
                    help="how the L2 is flushed before each call: a read (clean lines) or a zero fill (dirty lines)")
    ap.add_argument("--samples", type=int, default=60, help="timed calls per row, interleaved (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, no GPU kernels, no timing")
    args = ap.parse_args(argv)
    pool = DRY_MODELS if args.dry_run else MODELS
    names = list(pool if args.dry_run else SPEC_MODELS if args.models == "all" else args.models.split(","))
    unknown = [n for n in names if n not in pool]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(pool)} or 'all'")
    args.model_list = [pool[n] for n in names]
    if args.dry_run:
        args.m, args.check_m = [DRY_M], DRY_M
    return args


def make_env(args) -> tuple[Env, dict]:
    commit = args.commit or git_commit()
    if args.dry_run:
        return Env(torch.device("cpu"), True, 0.0, 0.0, None, commit), {"gpu": None, "dry_run": True}
    from benchmarks.common import hbm_copy_bandwidth
    from benchmarks.gemm import tensor_core_rate

    dev = torch.device("cuda")
    hbm, tc = hbm_copy_bandwidth(), tensor_core_rate()
    buf = torch.zeros(args.flush_mib << 18, dtype=torch.int32, device=dev)  # MiB / 4 bytes
    props = torch.cuda.get_device_properties(dev)
    meta = {"gpu": props.name, "sm_count": props.multi_processor_count,
            "l2_bytes": getattr(props, "L2_cache_size", None), "flush_bytes": buf.numel() * 4,
            "torch": torch.__version__}
    meta["flush"] = args.flush
    # a read flush leaves L2 clean: no write-back of the flush lands in the timed call; a write flush
    # (`--flush write`, as harnesses that zero a buffer do) leaves it dirty, and each call pays write-backs
    return Env(dev, False, hbm, tc, (lambda: buf.sum()) if args.flush == "read" else buf.zero_, commit), meta


def main(argv=None) -> None:
    args = parse_args(argv)
    env, meta = make_env(args)
    bundle = None
    if not args.dry_run and "cuteaot" in args.impls:
        try:
            from cuteaot.runtime import load_bundle

            bundle = load_bundle(args.bundle)
        except Exception as exc:  # noqa: BLE001 - the peers still run; every cuteaot row carries this error
            _report_failure(f"loading bundle {args.bundle}", exc)
    print(f"{meta.get('gpu') or 'CPU dry run'}: HBM copy {env.hbm / 1e12:.2f} TB/s, bf16 mm {env.tc / 1e12:.0f} "
          f"TFLOP/s, commit {env.commit}", flush=True)
    rows = []
    for model in args.model_list:
        try:
            rows += run_model(model, args.m, args.check_m, args.impls, env, bundle, args.samples)
        except Exception as exc:  # noqa: BLE001 - weights / reference failed: record, go on with the next model
            rows.append({"model": model.name, "M": None, "impl": None, "commit": env.commit,
                         "error": _report_failure(f"{model.name}", exc)})
    humming = _humming_version()
    meta.update(humming=humming, check_m=args.check_m, models=[m.name for m in args.model_list], ms=args.m,
                samples=args.samples, **_launch_meta(args.bundle, bundle))
    print("\n" + markdown_table([r for r in rows if r.get("impl")]))
    path = args.json or (None if args.dry_run else REPO / "docs" / "results" / f"peers-{datetime.date.today()}.json")
    if path:
        write_json(Path(path), rows, env, meta)
        print(f"\nwrote {path}")
    if args.dry_run:
        sys.exit(_dry_run_verdict(rows))


def _launch_meta(path: str, bundle) -> dict:
    """What a cuteaot row depends on beyond the commit: the bundle's manifest digest (its cubins are carried,
    not committed) and the launch modes the runtime used."""
    import hashlib

    from cuteaot.runtime.bundle import _LaunchSettings

    manifest = Path(path) / "manifest.json"
    return {"bundle": str(path),
            "bundle_manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
            "programmatic_launch": _LaunchSettings.programmatic,
            "cooperative_launch": {None: "once streams are reserved (none here)", True: "always",
                                   False: "never"}[_LaunchSettings.cooperative],
            "bundle_loaded": bundle is not None}


def _dry_run_verdict(rows: list[dict]) -> int:
    """0 when every path that can run on the CPU matched the reference, else 1 (with the offending rows)."""
    bad = [r for r in rows if r.get("impl") != "cuteaot"
           and (r.get("error") or r.get("rel_err") is None or r["rel_err"] > DRY_TOLERANCE)]
    for r in bad:
        print(f"dry run FAILED: {r.get('model')} {r.get('impl')}: rel_err {r.get('rel_err')} {r.get('error') or ''}",
              file=sys.stderr)
    return 1 if bad else 0


def _humming_version() -> str:
    try:
        import humming
    except Exception as exc:  # noqa: BLE001 - recorded: the JSON says why the peer is absent
        return f"not importable: {_error_text(exc)}"
    return getattr(humming, "__version__", "unknown")


if __name__ == "__main__":
    main()
