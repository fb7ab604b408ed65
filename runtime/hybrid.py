"""One MoE layer whose experts come in several weight formats (the seed's NVFP4/NF3 hybrid).

    layer = HybridMoeLayer(bundle, [(w13_fp4, w2_fp4, fp4_ids), (w13_nf3, w2_nf3, nf3_ids)], top_k=8)
    out = layer(hidden_states, topk_weights, topk_ids)

Each part is a MoeLayer over the experts it holds (`experts`: their global ids, in the order of
the part's weights), with an expert map that drops every other expert's routes; the layer's
output is the sum of the parts' outputs.  The first part writes `out`, the others write a scratch
buffer reserved at construction that is then added in (one bf16/fp16 rounding per extra part).
Like MoeLayer, a call allocates nothing, so it can be captured in a CUDA graph.  The bundle needs
each part's `expert_map: true` kernels for its weight format.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .bundle import Bundle, current_stream_handle
from .errors import BadInputError, CaptureError
from .moe import MoeLayer
from .tensors import check_rank
from .weights import PackedNvfp4
from .workspace import capturing

__all__ = ["HybridMoeLayer"]


class HybridMoeLayer:
    """MoeLayer parts over disjoint expert sets that together cover experts 0..E-1, summed."""

    def __init__(self, bundle: Bundle, parts: Sequence[tuple[PackedNvfp4, PackedNvfp4, Sequence[int] | torch.Tensor]],
                 *, top_k: int, max_tokens: int | None = None, **options):
        if "expert_map" in options:
            raise BadInputError("a hybrid layer builds its parts' expert maps from their expert ids")
        if len(parts) < 2:
            raise BadInputError(f"a hybrid layer has two or more parts (w13, w2, experts), got {len(parts)}")
        ids = [self._expert_ids(experts, w13, i) for i, (w13, _, experts) in enumerate(parts)]
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
        for (w13, w2, _), e in zip(parts, ids):
            expert_map = torch.full((total,), -1, dtype=torch.int32)
            expert_map[e] = torch.arange(len(e), dtype=torch.int32)
            self.parts.append(MoeLayer(bundle, w13, w2, top_k=top_k, expert_map=expert_map.to(bundle.device),
                                       max_tokens=max_tokens, **options))
        first = self.parts[0]
        for part in self.parts[1:]:
            if (part.hidden_size, part.intermediate_size, part.dtype) != (first.hidden_size, first.intermediate_size,
                                                                          first.dtype):
                raise BadInputError("the parts must share H, I and the activation dtype")
        self.device, self.hidden_size, self.dtype = first.device, first.hidden_size, first.dtype
        self.max_tokens = min(p.max_tokens for p in self.parts)
        self._scratch: dict[int | str, torch.Tensor] = {"default": self._allocate()}

    @staticmethod
    def _expert_ids(experts, w13: PackedNvfp4, index: int) -> torch.Tensor:
        e = torch.as_tensor(experts).to(torch.int64).flatten().cpu()
        if not isinstance(w13, PackedNvfp4) or e.numel() != w13.num_experts:
            raise BadInputError(f"part {index}: give the global ids of its {getattr(w13, 'num_experts', '?')} "
                                f"experts, got {e.numel()}")
        return e

    def _allocate(self) -> torch.Tensor:
        if capturing(self.device):
            raise CaptureError("a hybrid layer's scratch is reserved before capture (build it, or call "
                               "reserve(streams), outside the graph)")
        return torch.empty((self.max_tokens, self.hidden_size), dtype=self.dtype.torch, device=self.device)

    def reserve(self, streams: Iterable[torch.cuda.Stream]) -> None:
        """Per-stream scratch (and the parts' workspaces) for layers run concurrently on these streams."""
        streams = list(streams)
        for part in self.parts:
            part.reserve(streams)
        for stream in streams:
            self._scratch.setdefault(stream.cuda_stream, self._allocate())

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        check_rank(hidden_states, "hidden_states", 2, f"(M, {self.hidden_size})")
        m = hidden_states.shape[0]
        out = self.parts[0](hidden_states, topk_weights, topk_ids, out=out)
        scratch = self._scratch.get(current_stream_handle(self.device.index), self._scratch["default"])
        for start in range(0, m, self.max_tokens):
            stop = min(m, start + self.max_tokens)
            rows = slice(start, stop) if (start, stop) != (0, m) else slice(None)
            partial = scratch[: stop - start]
            for part in self.parts[1:]:
                part(hidden_states[rows], topk_weights[rows], topk_ids[rows], out=partial)
                out[rows].add_(partial)
        return out
