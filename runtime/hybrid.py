"""One MoE layer whose experts come in several weight formats (the seed's NVFP4/NF3 hybrid).

    layer = HybridMoeLayer(bundle, [(w13_fp4, w2_fp4, fp4_ids), (w13_nf3, w2_nf3, nf3_ids)], top_k=8)
    out = layer(hidden_states, topk_weights, topk_ids)

Each part is a MoeLayer over the experts it holds (`experts`: their global ids, in the order of
the part's weights), with an expert map that drops every other expert's routes; the layer's
output is the sum of the parts' outputs, all written into one output: the first part writes
`out`, the others add into it (`MoeLayer(accumulate=True)`: their top-k sum starts from out's
rows, one float32 add and one rounding per extra part), as the seed's second launch did.  Like
MoeLayer, a call allocates nothing, so it can be captured in a CUDA graph.  The bundle needs each
part's `expert_map: true` kernels for its weight format (which include the accumulating top-k sums).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .bundle import Bundle
from .errors import BadInputError
from .moe import MoeLayer
from .weights import PackedNvfp4

__all__ = ["HybridMoeLayer"]


class HybridMoeLayer:
    """MoeLayer parts over disjoint expert sets that together cover experts 0..E-1, summed."""

    def __init__(self, bundle: Bundle, parts: Sequence[tuple[PackedNvfp4, PackedNvfp4, Sequence[int] | torch.Tensor]],
                 *, top_k: int, max_tokens: int | None = None, **options):
        if "expert_map" in options or "accumulate" in options:
            raise BadInputError("a hybrid layer builds its parts' expert maps from their expert ids, and has its "
                                "later parts add into the first one's output (expert_map, accumulate are its own)")
        if len(parts) < 2:
            raise BadInputError(f"a hybrid layer has two or more parts (w13, w2, experts), got {len(parts)}")
        ids = [self._expert_ids(experts, w13, i) for i, (w13, _, experts) in enumerate(parts)]
        first = parts[0][0]
        for index, (w13, w2, _) in enumerate(parts):  # before any part reserves memory
            if not isinstance(w2, PackedNvfp4):
                raise BadInputError(f"part {index}: w2 must be prepared weights (prepare_w2, ...), got "
                                    f"{type(w2).__name__}")
            if (w13.k, w2.k, w13.dtype) != (first.k, parts[0][1].k, first.dtype):
                raise BadInputError(f"the parts must share H, I and the activation dtype: part {index} has H = {w13.k}, "
                                    f"I = {w2.k}, {w13.dtype.value}; part 0 H = {first.k}, I = {parts[0][1].k}, "
                                    f"{first.dtype.value}")
        total = sum(len(e) for e in ids)
        seen = torch.zeros(total, dtype=torch.int64)
        for e in ids:
            if int(e.max()) >= total or int(e.min()) < 0:
                raise BadInputError(f"the parts' experts must be ids in [0, {total}) (their count), got range "
                                    f"[{int(e.min())}, {int(e.max())}]")
            seen.index_add_(0, e, torch.ones_like(e))
        if bool((seen != 1).any()):
            raise BadInputError(f"each expert in [0, {total}) must belong to exactly one part; expert(s) "
                                f"{(seen != 1).nonzero().flatten()[:8].tolist()} do not")
        self.num_experts, self.top_k = total, top_k
        self.parts: list[MoeLayer] = []
        for index, ((w13, w2, _), e) in enumerate(zip(parts, ids)):
            expert_map = torch.full((total,), -1, dtype=torch.int32)
            expert_map[e] = torch.arange(len(e), dtype=torch.int32)
            self.parts.append(MoeLayer(bundle, w13, w2, top_k=top_k, expert_map=expert_map.to(bundle.device),
                                       max_tokens=max_tokens, accumulate=index > 0, **options))
        first = self.parts[0]
        self.device, self.hidden_size, self.dtype = first.device, first.hidden_size, first.dtype
        self.max_tokens = min(p.max_tokens for p in self.parts)

    @staticmethod
    def _expert_ids(experts, w13: PackedNvfp4, index: int) -> torch.Tensor:
        if not isinstance(w13, PackedNvfp4):
            raise BadInputError(f"part {index}: w13 must be prepared weights (prepare_w13, prepare_w13_nf3, ...), got "
                                f"{type(w13).__name__}")
        e = torch.as_tensor(experts).to(torch.int64).flatten().cpu()
        if e.numel() != w13.num_experts:
            raise BadInputError(f"part {index}: give the global ids of its {w13.num_experts} experts, got {e.numel()}")
        return e

    def reserve(self, streams: Iterable[torch.cuda.Stream]) -> None:
        """The parts' per-stream workspaces, for layers run concurrently on these streams."""
        streams = list(streams)
        for part in self.parts:
            part.reserve(streams)

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.parts[0](hidden_states, topk_weights, topk_ids, out=out)
        for part in self.parts[1:]:
            part(hidden_states, topk_weights, topk_ids, out=out)  # adds its experts' share into out
        return out
