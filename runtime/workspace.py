"""Scratch memory of MoE layers: reserved before serving, only looked up by a call.

A workspace holds every scratch buffer one fused launch needs for up to `max_tokens`
tokens.  Layers of one `WorkspaceShape` share workspaces: a model's MoE layers run one
after another on a stream, so one set of buffers serves all of them.  Each shape has

* a **default** workspace, allocated when the first layer of the shape is built and
  used by every stream that has no reservation of its own, and
* one workspace per stream reserved with `MoeLayer.reserve(streams)`, for layers of the
  shape that run *concurrently* on several streams.

Calls never allocate: an allocation during CUDA-graph capture (or inside the private
memory pool of torch.compile's CUDA-graph trees) would live in the graph's pool and
outlive the graph.  Reserving is therefore refused under capture with `CaptureError`.

The pool counts the live layers of each shape and drops the shape's workspaces when the
last one is gone, so deleting a model gives its memory back to torch's allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Generic, Hashable, TypeVar

import torch

from .errors import CaptureError
from .types import DType

W = TypeVar("W")
DEFAULT = "default"  # the stream key of a shape's default workspace


@dataclass(frozen=True)
class WorkspaceShape:
    """What sizes a MoE workspace; layers with equal shapes share workspaces.

    The last four are the resolution table's sizes for max_tokens (split-K scratch, barrier and
    lock words, packed route slots and blocks): the build recorded them, the runtime allocates them.
    """

    hidden_size: int
    intermediate_size: int
    fc1_width: int  # 2I (gated) or I
    top_k: int
    route_experts: int  # experts the routing addresses (the expert map's length under EP)
    dtype: DType
    max_tokens: int
    c_tmp_floats: int
    lock_words: int
    route_slots: int
    route_blocks: int

    def __hash__(self) -> int:  # looked up on every call: hash the fields once
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
            return value

    @property
    def routes(self) -> int:
        return self.max_tokens * self.top_k


def capturing(device: torch.device) -> bool:
    """True while torch's current stream on `device` captures a CUDA graph (`device`'s, not the current
    device's: a process may drive several GPUs)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


class WorkspacePool(Generic[W]):
    """The workspaces of one bundle's layers, by (shape, stream); see the module doc."""

    def __init__(self, device: torch.device):
        self.device = device
        self._layers: dict[Hashable, int] = {}  # live layers per shape
        self._spaces: dict[tuple[Hashable, object], W] = {}
        self.allocations = 0  # workspaces allocated so far: a call must never move it
        self.generation = 0  # moves whenever a (shape, stream) -> workspace entry is added or removed

    # ---------------------------------------------------------------- layers

    def acquire(self, shape: Hashable, allocate: Callable[[], W]) -> None:
        """A layer of `shape` was built: make sure the shape's default workspace exists."""
        if (shape, DEFAULT) not in self._spaces:
            self._allocate(shape, DEFAULT, allocate, "building a MoE layer")
        self._layers[shape] = self._layers.get(shape, 0) + 1

    def release(self, shape: Hashable) -> None:
        """A layer of `shape` is gone; the last one takes the shape's workspaces with it."""
        left = self._layers.get(shape, 0) - 1
        if left > 0:
            self._layers[shape] = left
            return
        self._layers.pop(shape, None)
        for key in [k for k in self._spaces if k[0] == shape]:
            del self._spaces[key]
        self.generation += 1

    # ---------------------------------------------------------------- streams

    def reserve(self, shape: Hashable, stream: int, allocate: Callable[[], W]) -> W:
        """The workspace of `stream` (a raw cudaStream_t), allocated now if it has none."""
        found = self._spaces.get((shape, stream))
        if found is None:
            found = self._allocate(shape, stream, allocate, "reserve(streams=...)")
        return found

    def get(self, shape: Hashable, stream: int) -> W:
        """The workspace a call on `stream` uses: its own if reserved, else the default.  Never allocates."""
        found = self._spaces.get((shape, stream))
        return self._spaces[(shape, DEFAULT)] if found is None else found

    def reserved_streams(self, shape: Hashable) -> list[int]:
        return [s for (sh, s) in self._spaces if sh == shape and s != DEFAULT]

    def live_layers(self, shape: Hashable) -> int:
        return self._layers.get(shape, 0)

    def __len__(self) -> int:
        return len(self._spaces)

    def _allocate(self, shape: Hashable, stream: object, allocate: Callable[[], W], what: str) -> W:
        if capturing(self.device):
            raise CaptureError(
                f"{what} allocates a workspace, and the current stream is capturing a CUDA graph: memory "
                "allocated now would belong to the graph's private pool. Build the layers and call "
                "layer.reserve(streams=[...]) before capturing."
            )
        space = self._spaces[(shape, stream)] = allocate()
        self.allocations += 1
        self.generation += 1
        return space
