"""Plain-torch reference of the route-packing contract, independent of cuteaot's code.

Contract (see cuteaot.runtime.kernels.route_pack): routes r = token * top_k + k are
grouped by local expert (increasing), in increasing r within an expert; each group is
padded with the sentinel M * top_k to a multiple of b; every later slot is the
sentinel; block_expert_ids names each block's expert and is -1 at or past the
packed count.  Routes whose id is outside [0, num_experts), or whose mapped id is
outside [0, num_experts) (e.g. -1: not on this GPU), are dropped.
"""

from __future__ import annotations

import torch


def local_experts(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The local expert of every route (flattened), -1 for a dropped route; int64 on the CPU."""
    ids = topk_ids.reshape(-1).to("cpu", torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    local = torch.where(valid, ids, torch.full_like(ids, -1))
    if expert_map is not None:
        table = expert_map.to("cpu", torch.int64)
        local = torch.where(valid, table[ids.clamp(0, num_experts - 1)], local)
        local = torch.where((local >= 0) & (local < num_experts), local, torch.full_like(local, -1))
    return local


def pack_routes_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    capacity_slots: int,
    capacity_blocks: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed_route_indices, block_expert_ids, packed_route_count), int32 on the CPU."""
    routes = topk_ids.numel()
    local = local_experts(topk_ids, num_experts, expert_map)
    packed: list[int] = []
    block_experts: list[int] = []
    for e in range(num_experts):
        mine = torch.nonzero(local == e).flatten().tolist()  # increasing route index
        if not mine:
            continue
        blocks = -(-len(mine) // block_size)
        packed += mine + [routes] * (blocks * block_size - len(mine))
        block_experts += [e] * blocks
    count = len(packed)
    if count > capacity_slots or len(block_experts) > capacity_blocks:
        raise ValueError(f"{count} packed slots do not fit capacity {capacity_slots} / {capacity_blocks} blocks")
    packed += [routes] * (capacity_slots - count)
    block_experts += [-1] * (capacity_blocks - len(block_experts))
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_i32(packed), as_i32(block_experts), as_i32([count])


def capacity_slots_reference(routes: int, block_size: int, num_experts: int) -> int:
    """Worst case: every non-empty expert wastes b - 1 slots; whole blocks."""
    slots = routes + min(num_experts, routes) * (block_size - 1)
    return (slots + block_size - 1) // block_size * block_size
