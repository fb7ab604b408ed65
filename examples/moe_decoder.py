"""A small MoE decoder in plain torch whose expert MLP is cuteaot's MoeLayer or bf16 grouped GEMMs.

    python -m examples.moe_decoder --bundle generated/qwen3-30b-a3b --json moe_decoder.json

One decode step of a Qwen3-30B-A3B-shaped stack (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of intermediate 768, top-8, SwiGLU), `--layers` layers deep:

    h = x + attention(rms_norm(x), KV cache)          one new token per sequence
    y = h + experts(rms_norm(h), softmax-top-k router)

Two interchangeable expert backends compute the same function from the same weights:

* `CuteaotExperts`: the `cuteaot::moe_layer` torch op of a `MoeLayer` built from NVFP4 weights
  (synthetic bf16 weights quantised to ModelOpt NVFP4 here, packed by `prepare_w13/prepare_w2`);
* `GroupedMmExperts`: routes sorted by expert, two `torch._grouped_mm` calls in bf16 on the
  *dequantised* NVFP4 weights, the top-k sum in float32.

`main()` compiles each model (`torch.compile`), captures one CUDA graph per batch size
(all in one memory pool, largest first, as serving engines do) and times graph replays.
No rotary embedding and no LM head: neither changes how the MoE layer is served.
Importing this module needs no GPU (tests/test_example_cpu.py traces it on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cuteaot.runtime import MoeLayer, load_bundle, prepare_w2, prepare_w13
from cuteaot.runtime.errors import BadInputError

__all__ = [
    "DecoderConfig",
    "QWEN3_30B_A3B",
    "BATCH_SIZES",
    "DecoderWeights",
    "make_weights",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "CuteaotExperts",
    "GroupedMmExperts",
    "cuteaot_experts",
    "grouped_mm_experts",
    "Decoder",
    "KvCache",
    "CapturedDecoder",
    "main",
]


@dataclass(frozen=True)
class DecoderConfig:
    hidden_size: int = 2048
    intermediate_size: int = 768  # per expert
    num_experts: int = 128
    top_k: int = 8
    num_layers: int = 4
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    context: int = 1024  # KV-cache slots per sequence
    rms_eps: float = 1e-6

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise BadInputError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                                "(grouped-query attention)")
        if self.top_k > self.num_experts:
            raise BadInputError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")


QWEN3_30B_A3B = DecoderConfig()  # the MoE shape of the default bundle (specs/qwen3-30b-a3b.yaml)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DTYPE = torch.bfloat16  # activations; the bundles' Qwen3 kernels are bf16

# ---- NVFP4 (ModelOpt layout) ---------------------------------------------------------------------
# value = e2m1(code) * weight_scale[e, n, k // 16] (e4m3) * weight_scale_2[e] (float32)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
E2M1_MAX, E4M3_MAX, NVFP4_BLOCK = 6.0, 448.0, 16
SIGN_BIT = 8


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> ModelOpt (weight (E, N, K/2) u8, weight_scale (E, N, K/16) e4m3, weight_scale_2 (E,) f32).

    Per-expert scale_2 maps the expert's largest block scale onto e4m3's range; each 16-wide
    block's scale maps its largest magnitude onto e2m1's 6; codes round to the nearest e2m1
    magnitude (ties to the smaller), low nibble = even k.
    """
    w = w.float()
    experts, n, k = w.shape
    scale_2 = w.abs().amax(dim=(1, 2)).clamp_min(1e-30) / (E2M1_MAX * E4M3_MAX)
    blocks = w.view(experts, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    wanted = blocks.abs().amax(dim=-1) / E2M1_MAX / scale_2.view(-1, 1, 1)
    weight_scale = wanted.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # e4m3fn has no inf: out of range is NaN
    step = (weight_scale.float() * scale_2.view(-1, 1, 1)).unsqueeze(-1)
    x = torch.where(step > 0, blocks / step.clamp_min(1e-30), torch.zeros((), device=w.device))
    grid = torch.tensor(E2M1_MAGNITUDES, device=w.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    codes = torch.bucketize(x.abs(), midpoints) | ((x < 0).long() * SIGN_BIT)
    codes = codes.view(experts, n, k).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), weight_scale, scale_2


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ModelOpt NVFP4 tensors -> (E, N, K) weights in `dtype` (products formed in float32)."""
    experts, n, half_k = weight.shape
    lut = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    lut = torch.cat((lut, -lut))
    codes = torch.stack((weight & 0xF, weight >> 4), dim=-1).view(experts, n, 2 * half_k)
    values = lut[codes.long()] * weight_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * weight_scale_2.float().view(-1, 1, 1)).to(dtype)


def _random_nvfp4(experts: int, n: int, k: int, g: torch.Generator, device, chunk: int = 8):
    """ModelOpt tensors of random normal (E, N, K) weights with std 1/sqrt(K), a few experts at a time
    (the quantiser's float32 temporaries are several times the weights)."""
    parts = []
    for start in range(0, experts, chunk):
        w = torch.randn(min(chunk, experts - start), n, k, generator=g, device=device) * k ** -0.5
        parts.append(quantize_nvfp4(w))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


# ---- synthetic weights ---------------------------------------------------------------------------


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, H) bf16
    o: torch.Tensor  # (H, heads * head_dim) bf16
    router: torch.Tensor  # (E, H) bf16
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ModelOpt NVFP4, (E, 2I, H): [gate | up] rows
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ModelOpt NVFP4, (E, H, I)


@dataclass
class DecoderWeights:
    config: DecoderConfig
    layers: list[LayerWeights]


def make_weights(cfg: DecoderConfig, device: torch.device | str = "cuda", seed: int = 0) -> DecoderWeights:
    """Random weights of every layer, std 1/sqrt(fan-in) (activations stay O(1) through the stack)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    h, e, i, hd = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size, cfg.head_dim

    def dense(n, k):
        return (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(DTYPE)

    layers = [
        LayerWeights(
            qkv=dense((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h),
            o=dense(h, cfg.num_heads * hd),
            router=dense(e, h),
            w13=_random_nvfp4(e, 2 * i, h, g, device),
            w2=_random_nvfp4(e, h, i, g, device),
        )
        for _ in range(cfg.num_layers)
    ]
    return DecoderWeights(cfg, layers)


# ---- expert backends: (x (M, H), topk_weights (M, k) f32, topk_ids (M, k) i32) -> (M, H) ---------


class CuteaotExperts(nn.Module):
    """cuteaot's fused W4A16 layer through its torch op: opaque to torch.compile, capturable.

    `layer` needs `id` (the op finds the MoeLayer by it), `hidden_size` and `top_k`; this
    module keeps it alive (the op's registry holds layers weakly).
    """

    def __init__(self, layer, cfg: DecoderConfig):
        super().__init__()
        if (layer.hidden_size, layer.top_k) != (cfg.hidden_size, cfg.top_k):
            raise BadInputError(f"the MoE layer has hidden {layer.hidden_size}, top_k {layer.top_k}; the decoder "
                                f"needs hidden {cfg.hidden_size}, top_k {cfg.top_k}: build it from this config")
        self.layer = layer
        self.layer_id = layer.id

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        # (hidden, weights, ids, out, activation_amax, layer_idx (-1: none), layer id); writes `out`
        torch.ops.cuteaot.moe_layer(x, topk_weights, topk_ids, out, None, -1, self.layer_id)
        return out


class GroupedMmExperts(nn.Module):
    """The same experts in bf16: routes sorted by expert, one grouped GEMM per projection."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        # grouped_mm's second operand is (E, K, N); the transposed (column-major) view is its fast layout
        self.register_buffer("w13", w13.to(DTYPE).contiguous())  # (E, 2I, H)
        self.register_buffer("w2", w2.to(DTYPE).contiguous())  # (E, H, I)
        self.num_experts, self.inter = w13.shape[0], w2.shape[2]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        m, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # route slots grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # end row of each expert's group
        h = torch._grouped_mm(x[order // top_k], self.w13.transpose(1, 2), offs=offs)  # (routes, 2I)
        gate, up = h[:, : self.inter].float(), h[:, self.inter :].float()
        a = (F.silu(gate) * up).to(x.dtype)
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs).float()  # (routes, H)
        y = y * topk_weights.reshape(-1)[order, None]
        # un-sort with unique indices (no atomics: the sum below is deterministic)
        routes = torch.empty_like(y).index_copy_(0, order, y)
        return routes.view(m, top_k, -1).sum(dim=1).to(x.dtype)


def cuteaot_experts(weights: DecoderWeights, bundle, *, max_tokens: int | None = None) -> list[CuteaotExperts]:
    """One MoeLayer a layer, its workspaces sized for `max_tokens` (every layer of the shape shares them)."""
    cfg = weights.config
    device = bundle.device
    modules = []
    for lw in weights.layers:
        w13 = prepare_w13(*(t.to(device) for t in lw.w13), "bf16")
        w2 = prepare_w2(*(t.to(device) for t in lw.w2), "bf16")
        layer = MoeLayer(bundle, w13, w2, top_k=cfg.top_k, activation="silu", max_tokens=max_tokens)
        modules.append(CuteaotExperts(layer, cfg))
    return modules


def grouped_mm_experts(weights: DecoderWeights) -> list[GroupedMmExperts]:
    return [GroupedMmExperts(dequantize_nvfp4(*lw.w13, dtype=DTYPE), dequantize_nvfp4(*lw.w2, dtype=DTYPE))
            for lw in weights.layers]


# ---- the decoder ---------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=DTYPE, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Grouped-query attention of one new token per sequence over its KV cache (Qwen3: q/k norms)."""

    def __init__(self, cfg: DecoderConfig, lw: LayerWeights):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Parameter(lw.qkv, requires_grad=False)
        self.o = nn.Parameter(lw.o, requires_grad=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, lw.qkv.device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, lw.qkv.device)

    def forward(self, x, positions, k_cache, v_cache):
        """x (B, H); positions (B,) int64 slot of the new token; caches (B, kv_heads, context, head_dim)."""
        c, b = self.cfg, x.shape[0]
        q, k, v = F.linear(x, self.qkv).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1)
        q = self.q_norm(q.reshape(b, c.num_heads, 1, c.head_dim))
        k = self.k_norm(k.reshape(b, c.num_kv_heads, 1, c.head_dim))
        v = v.reshape(b, c.num_kv_heads, 1, c.head_dim)
        # the new token's K and V into its slot (an index_put that torch.compile keeps in place)
        rows = torch.arange(b, device=x.device)
        k_cache[rows, :, positions] = k.squeeze(2)
        v_cache[rows, :, positions] = v.squeeze(2)
        visible = torch.arange(k_cache.shape[2], device=x.device) <= positions.view(b, 1)  # (B, context)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible.view(b, 1, 1, -1), enable_gqa=True)
        return F.linear(o.reshape(b, c.num_heads * c.head_dim), self.o)


class MoeMlp(nn.Module):
    """Softmax router, top-k renormalised (Qwen3's norm_topk_prob), then the experts."""

    def __init__(self, cfg: DecoderConfig, router: torch.Tensor, experts: nn.Module):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Parameter(router, requires_grad=False)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return self.experts(x, topk_weights, topk_ids.to(torch.int32))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, lw: LayerWeights, experts: nn.Module):
        super().__init__()
        device = lw.qkv.device
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device)
        self.attention = Attention(cfg, lw)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, device)
        self.mlp = MoeMlp(cfg, lw.router, experts)

    def forward(self, x, positions, k_cache, v_cache):
        h = x + self.attention(self.input_norm(x), positions, k_cache, v_cache)
        return h + self.mlp(self.post_attention_norm(h))


class Decoder(nn.Module):
    """One decode step: (B, H) hidden states of the new tokens -> (B, H) after every layer and a final norm."""

    def __init__(self, weights: DecoderWeights, experts: list[nn.Module]):
        super().__init__()
        cfg = weights.config
        if len(experts) != cfg.num_layers:
            raise BadInputError(f"got {len(experts)} expert modules for {cfg.num_layers} layers; pass one a layer")
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, lw, ex) for lw, ex in zip(weights.layers, experts))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, weights.layers[0].qkv.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = layer(x, positions, k_cache, v_cache)
        return self.norm(x)


class KvCache:
    """Per-layer K and V caches, (max_batch, kv_heads, context, head_dim) bf16, batch first so that
    the first B sequences are one contiguous slice."""

    def __init__(self, cfg: DecoderConfig, max_batch: int, device, seed: int = 1):
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (max_batch, cfg.num_kv_heads, cfg.context, cfg.head_dim)
        self.k = [torch.randn(shape, generator=g, device=device).to(DTYPE) for _ in range(cfg.num_layers)]
        self.v = [torch.randn(shape, generator=g, device=device).to(DTYPE) for _ in range(cfg.num_layers)]

    def view(self, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[:batch] for k in self.k], [v[:batch] for v in self.v]

    def clone(self) -> "KvCache":
        other = KvCache.__new__(KvCache)
        other.k, other.v = [k.clone() for k in self.k], [v.clone() for v in self.v]
        return other


class CapturedDecoder:
    """A decode step captured once per batch size into CUDA graphs sharing one memory pool.

    Static buffers hold the inputs of the largest batch; batch B reads their first B rows.
    Graphs are captured largest first (the pool's blocks then fit every smaller graph) on a
    side stream, after warm-up calls on that stream (torch.compile compiles in those).
    """

    def __init__(self, step, cfg: DecoderConfig, batch_sizes, device, cache: KvCache | None = None):
        max_batch = max(batch_sizes)
        self.cache = KvCache(cfg, max_batch, device) if cache is None else cache
        self.hidden = torch.zeros(max_batch, cfg.hidden_size, dtype=DTYPE, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        stream = torch.cuda.Stream(device)
        for b in sorted(set(batch_sizes), reverse=True):
            args = (self.hidden[:b], self.positions[:b], *self.cache.view(b))
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step(*args)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[b] = step(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize(device)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Copy the inputs in, replay the batch size's graph; the result is the graph's static output."""
        b = hidden.shape[0]
        if b not in self.graphs:
            raise BadInputError(f"no graph was captured for batch {b}; captured: {sorted(self.graphs)}")
        self.hidden[:b].copy_(hidden)
        self.positions[:b].copy_(positions)
        self.graphs[b].replay()
        return self.outputs[b]


# ---- benchmark -----------------------------------------------------------------------------------


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 50, inner: int = 10) -> float:
    """Median over `reps` of the CUDA-event time of `inner` back-to-back replays, per replay."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / inner)
    return statistics.median(samples)


def build_models(weights: DecoderWeights, bundle, max_batch: int) -> dict[str, Decoder]:
    return {
        "cuteaot": Decoder(weights, cuteaot_experts(weights, bundle, max_tokens=max_batch)).eval(),
        "grouped_mm": Decoder(weights, grouped_mm_experts(weights)).eval(),
    }


def run(bundle_path: str, cfg: DecoderConfig, batch_sizes, *, compile: bool = True, reps: int = 50) -> dict:
    bundle = load_bundle(bundle_path)
    device = bundle.device
    weights = make_weights(cfg, device)
    models = build_models(weights, bundle, max(batch_sizes))
    times: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for name, model in models.items():
            step = torch.compile(model) if compile else model
            captured = CapturedDecoder(step, cfg, batch_sizes, device)
            times[name] = {b: replay_us(captured.graphs[b], reps) for b in batch_sizes}
            del captured
    rows = [{"batch": b, **{f"{n}_us": round(times[n][b], 2) for n in times},
             "speedup": round(times["grouped_mm"][b] / times["cuteaot"][b], 3)} for b in batch_sizes]
    return {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "bundle": str(bundle_path),
        "compiled": compile,
        "config": asdict(cfg),
        "what": "one decode step (all layers), median CUDA-graph replay time in microseconds",
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = ["| batch | cuteaot (us) | grouped_mm bf16 (us) | speedup |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['batch']} | {r['cuteaot_us']:.1f} | {r['grouped_mm_us']:.1f} | {r['speedup']:.2f}x |"
              for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default="generated/qwen3-30b-a3b", help="a bundle with the Qwen3-30B-A3B MoE layer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=QWEN3_30B_A3B.context, help="KV-cache slots per sequence")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-compile", action="store_true", help="capture the eager model instead of torch.compile's")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    cfg = DecoderConfig(num_layers=args.layers, context=args.context)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    result = run(args.bundle, cfg, batch_sizes, compile=not args.no_compile, reps=args.reps)
    print(f"{result['device']}, {cfg.num_layers} layers, context {cfg.context}, "
          f"{'torch.compile + ' if result['compiled'] else ''}CUDA graphs\n")
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
