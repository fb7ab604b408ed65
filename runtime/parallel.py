"""Tensor- and expert-parallel MoE across GPUs: shard the checkpoint, run the local layer, all-reduce.

Tensor parallelism (TP, world w): every rank holds every expert but only I / w of the
intermediate size: rows [r*I/w, (r+1)*I/w) of both the gate and the up half of W13 (of W13
itself for the non-gated relu2, whose W13 has I rows and no halves), and the same columns (K)
of W2.  Each rank's FC2 output is a partial sum over its slice of I; the
all-reduce adds them.  I / w must be a multiple of 16 (one NVFP4 scale group): an NVFP4 export of
gpt-oss (I = 2880) splits 2 and 4 ways (1440, 720) but not 8 (360); that is refused with a clear error.

Expert parallelism (EP, world w): rank r holds a contiguous range of experts, the first
E % w ranks one more than the others (uneven counts are allowed); `expert_map` maps a global
expert id to its local index or -1.  Every rank sees every token (replicated), computes the
routes of its own experts (the others contribute 0) and the all-reduce adds the ranks.

MXFP4 (gpt-oss) checkpoints shard with tp_shard_w13_mxfp4 / tp_shard_w2_mxfp4 the same way; their
scales cover 32 k, so W2's slice of I must be a multiple of 32: 2880 splits 2 ways (1440) but not
4 (720 = 22.5 blocks), which is refused.

Both take the ModelOpt tensors of one layer (`weight` u8, `weight_scale` e4m3, `weight_scale_2`
f32, as prepare_w13 / prepare_w2 accept) and return the local ones; the combine goes through
`torch.distributed.all_reduce` on the caller's process group (NCCL across GPUs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .bundle import Bundle
from .errors import BadInputError
from .moe import MoeLayer
from .types import Activation
from .weights import MXFP4_BLOCK_K, SCALE_GROUP_K, PackedNvfp4, W13Order


__all__ = ["Shard", "ModelOptTensors", "tp_shard_w13", "tp_shard_w2", "tp_shard_bias13", "tp_shard_bias2",
           "tp_shard_w13_mxfp4", "tp_shard_w2_mxfp4", "mxfp4_tp_blocks", "ep_partition", "ep_select",
           "check_group", "ParallelMoeLayer"]


class ModelOptTensors(NamedTuple):
    weight: torch.Tensor  # (E, N, K/2) u8
    weight_scale: torch.Tensor  # (E, N, K/16) float8_e4m3fn
    weight_scale_2: torch.Tensor  # (E,), (E, 1) or (E, 2) float32


class Shard(NamedTuple):
    rank: int
    world: int


def _check_shard(rank: int, world: int) -> None:
    for name, v in (("rank", rank), ("world", world)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadInputError(f"{name} must be an int, got {v!r}")
    if world < 1 or not 0 <= rank < world:
        raise BadInputError(f"need 0 <= rank < world, got rank={rank}, world={world}")


def tp_slice(intermediate_size: int, rank: int, world: int) -> slice:
    """The slice of the intermediate size rank `rank` of `world` holds."""
    _check_shard(rank, world)
    if intermediate_size % world or (intermediate_size // world) % SCALE_GROUP_K:
        raise BadInputError(
            f"intermediate_size {intermediate_size} does not split {world} ways into multiples of "
            f"{SCALE_GROUP_K} (an NVFP4 scale group): {intermediate_size} / {world} = {intermediate_size / world:g}"
        )
    part = intermediate_size // world
    return slice(rank * part, (rank + 1) * part)


def tp_shard_w13(w13: ModelOptTensors, rank: int, world: int, *, activation: Activation | str,
                 order: W13Order | str | None = None) -> ModelOptTensors:
    """This rank's rows of W13: (E, 2I, H/2) [gate | up] for a gated activation, (E, I, H/2) for relu2.

    `activation` is required because the row count alone cannot tell the layouts apart: a
    non-gated (relu2) W13 has I rows with no halves, and cutting it as gate|up would hand every
    rank rows of two unrelated slices.  Gated: `order` is the checkpoint's row order (as
    prepare_w13 takes it, gate_up when None) and the shard comes back in gate|up order, so pass
    it to prepare_w13 with the default order.  relu2: rank r takes rows tp_slice(I) as stored;
    an `order` is refused (there are no halves to order).
    """
    weight, scale, scale_2 = ModelOptTensors(*w13)
    act = _activation(activation)
    if weight.dim() != 3 or scale.dim() != 3 or scale.shape[:2] != weight.shape[:2]:
        raise BadInputError(f"w13 must be weight (E, rows, H/2) and weight_scale (E, rows, H/16) with the same "
                            f"E and rows, got {tuple(weight.shape)} and {tuple(scale.shape)}")
    if act.is_gated:
        take = _gated_rows(weight.shape[1], rank, world, W13Order.GATE_UP if order is None else order, act)
    elif order is not None:
        raise BadInputError(f"{act.value} is not gated: its W13 has no gate/up halves, so order={order!r} has no "
                            f"meaning; leave order out")
    else:
        s = tp_slice(weight.shape[1], rank, world)
        take = torch.arange(s.start, s.stop)
    take = take.to(weight.device)
    return ModelOptTensors(weight.index_select(1, take), scale.index_select(1, take), scale_2)


def _activation(activation: Activation | str) -> Activation:
    try:
        return Activation(activation)
    except ValueError:
        raise BadInputError(f"activation must be one of {[a.value for a in Activation]} (the layer's; it decides "
                            f"whether W13 has gate/up halves), got {activation!r}") from None


def _gated_rows(rows: int, rank: int, world: int, order: W13Order | str, act: Activation) -> torch.Tensor:
    """Indices of a rank's gate rows then its up rows in a gated W13 of `rows` = 2I rows stored in `order`."""
    try:
        order = W13Order(order)
    except ValueError:
        raise BadInputError(f"order must be one of {[o.value for o in W13Order]}, got {order!r}") from None
    if rows % 2:
        raise BadInputError(f"{act.value} is gated, so W13 needs 2I rows (gate and up halves), got an odd count "
                            f"{rows}; for a non-gated layer pass activation='relu2'")
    inter = rows // 2
    stored = torch.arange(rows)
    if order is W13Order.INTERLEAVED:  # gate rows at even indices, up rows at odd ones
        gate, up = stored[0::2], stored[1::2]
    else:
        gate, up = stored[:inter], stored[inter:]
        if order is W13Order.UP_GATE:
            gate, up = up, gate
    s = tp_slice(inter, rank, world)
    return torch.cat((gate[s], up[s]))


def tp_shard_w2(w2: ModelOptTensors, rank: int, world: int) -> ModelOptTensors:
    """This rank's K columns of W2 (E, H, I/2): the slice of I its FC1 produced."""
    weight, scale, scale_2 = ModelOptTensors(*w2)
    if weight.dim() != 3:
        raise BadInputError(f"w2 weight must be (E, H, I/2), got {tuple(weight.shape)}")
    s = tp_slice(2 * weight.shape[2], rank, world)
    return ModelOptTensors(
        weight[:, :, s.start // 2: s.stop // 2].contiguous(),
        scale[:, :, s.start // SCALE_GROUP_K: s.stop // SCALE_GROUP_K].contiguous(),
        scale_2,
    )


def tp_shard_w13_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, rank: int, world: int, *,
                       order: W13Order | str = W13Order.INTERLEAVED) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of an MXFP4 W13 (gate_up_proj_blocks (E, 2I, H/32, 16), _scales (E, 2I, H/32)),
    in gate|up order: pass them to prepare_w13_mxfp4 with order="gate_up" (and the bias from
    tp_shard_bias13 with the checkpoint's order, which comes back gate|up too)."""
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor) or blocks.dim() != 4 \
            or scales.dim() != 3 or blocks.shape[:3] != scales.shape:
        raise BadInputError(f"MXFP4 W13 must be blocks (E, 2I, H/32, 16) and scales (E, 2I, H/32), got "
                            f"{tuple(getattr(blocks, 'shape', ()))} and {tuple(getattr(scales, 'shape', ()))}")
    take = _gated_rows(blocks.shape[1], rank, world, order, Activation.SWIGLUOAI).to(blocks.device)
    return blocks.index_select(1, take), scales.index_select(1, take)


def tp_shard_w2_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, rank: int,
                      world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's K blocks of an MXFP4 W2 (down_proj_blocks (E, H, I/32, 16), _scales (E, H, I/32))."""
    if not isinstance(blocks, torch.Tensor) or not isinstance(scales, torch.Tensor) or blocks.dim() != 4 \
            or scales.dim() != 3 or blocks.shape[:3] != scales.shape:
        raise BadInputError(f"MXFP4 W2 must be blocks (E, H, I/32, 16) and scales (E, H, I/32), got "
                            f"{tuple(getattr(blocks, 'shape', ()))} and {tuple(getattr(scales, 'shape', ()))}")
    b = mxfp4_tp_blocks(blocks.shape[2] * MXFP4_BLOCK_K, rank, world)
    return blocks[:, :, b].contiguous(), scales[:, :, b].contiguous()


def mxfp4_tp_blocks(intermediate_size: int, rank: int, world: int) -> slice:
    """The MXFP4 blocks (32 k each) of I that rank `rank` of `world` holds in W2; BadInputError where the
    shard boundary would cut a block (gpt-oss's 2880 splits 2 ways, not 4)."""
    s = tp_slice(intermediate_size, rank, world)
    if s.start % MXFP4_BLOCK_K or s.stop % MXFP4_BLOCK_K:
        raise BadInputError(f"intermediate_size {intermediate_size} / {world} = {intermediate_size // world} is not a "
                            f"multiple of the MXFP4 block ({MXFP4_BLOCK_K}): the shard boundary would cut a scale "
                            "block; use fewer ranks")
    return slice(s.start // MXFP4_BLOCK_K, s.stop // MXFP4_BLOCK_K)


def tp_shard_bias13(bias: torch.Tensor, rank: int, world: int, *, activation: Activation | str,
                    order: W13Order | str | None = None) -> torch.Tensor:
    """This rank's entries of W13's bias (E, rows): the columns of `tp_shard_w13`'s rows, gate|up order."""
    act = _activation(activation)
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2:
        raise BadInputError(f"the W13 bias must be a (E, rows) tensor, got {getattr(bias, 'shape', type(bias))}")
    if act.is_gated:
        take = _gated_rows(bias.shape[1], rank, world, W13Order.GATE_UP if order is None else order, act)
    elif order is not None:
        raise BadInputError(f"{act.value} is not gated: order={order!r} has no meaning; leave order out")
    else:
        s = tp_slice(bias.shape[1], rank, world)
        take = torch.arange(s.start, s.stop)
    return bias.index_select(1, take.to(bias.device))


def tp_shard_bias2(bias: torch.Tensor, rank: int, world: int) -> torch.Tensor | None:
    """W2's bias (E, H) on rank 0 and None elsewhere: the all-reduce sums the ranks' FC2 outputs, so
    the bias must be added once (a layer without a W2 bias adds zeros)."""
    _check_shard(rank, world)
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2:
        raise BadInputError(f"the W2 bias must be a (E, H) tensor, got {getattr(bias, 'shape', type(bias))}")
    return bias if rank == 0 else None


def ep_partition(num_experts: int, rank: int, world: int, device=None) -> tuple[torch.Tensor, range]:
    """(expert_map, local global ids): contiguous ranges, the first E % world ranks one expert more."""
    _check_shard(rank, world)
    if not isinstance(num_experts, int) or num_experts < world:
        raise BadInputError(f"{num_experts} experts cannot be spread over {world} ranks (each needs one)")
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    local = range(start, start + base + (rank < extra))
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[local.start:local.stop] = torch.arange(len(local), dtype=torch.int32)
    return expert_map.to(device) if device is not None else expert_map, local


def ep_select(tensors: ModelOptTensors, local: range) -> ModelOptTensors:
    """The local experts' rows of every tensor (per-expert scales included)."""
    weight, scale, scale_2 = ModelOptTensors(*tensors)
    pick = slice(local.start, local.stop)
    return ModelOptTensors(weight[pick].contiguous(), scale[pick].contiguous(), scale_2[pick].contiguous())


def _distributed():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise BadInputError("ParallelMoeLayer needs torch.distributed initialised (e.g. NCCL under torchrun)")
    return dist


def check_group(shard: Shard, group=None) -> int:
    """The group's size, once this process is `shard.rank` of a group of `shard.world` ranks: a layer whose
    all-reduce runs over other ranks than its weights were cut for adds shards twice or misses some."""
    dist = _distributed()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (shard.rank, shard.world) != (rank, world):
        raise BadInputError(
            f"the weights are shard {shard.rank} of {shard.world}, but this process is rank {rank} of a group of "
            f"{world}: pass group= the process group of that parallelism (e.g. the tensor-parallel group when data "
            "parallelism also runs), or this rank's shard")
    return world


class ParallelMoeLayer:
    """The local MoeLayer of one rank plus the all-reduce that combines the ranks.

    w13 / w2 are this rank's prepared shards (tp_shard_* / ep_select, then prepare_*);
    expert_map is ep_partition's map for EP (None for TP).  Every rank must call it with
    the same tokens, routing and weights (replicated inputs); the output is the full layer's.
    `shard=(rank, world)`, the one the weights were cut for, is checked against the group: a
    group of other ranks would add shards twice or miss some, silently.
    CUDA-graph capturable per rank (the all-reduce is an NCCL collective on the current stream).
    """

    def __init__(self, bundle: Bundle, w13: PackedNvfp4, w2: PackedNvfp4, *, top_k: int, group=None,
                 expert_map: torch.Tensor | None = None, shard: Shard | tuple[int, int] | None = None,
                 **layer_options):
        dist = _distributed()
        self.group = group
        self.world = dist.get_world_size(group) if shard is None else check_group(Shard(*shard), group)
        self._all_reduce = dist.all_reduce
        self.layer = MoeLayer(bundle, w13, w2, top_k=top_k, expert_map=expert_map, **layer_options)

    def reserve(self, streams) -> None:
        """The local layer's per-stream workspaces (`MoeLayer.reserve`)."""
        self.layer.reserve(streams)

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        out = self.layer(hidden_states, topk_weights, topk_ids, out=out)
        if self.world > 1:
            self._all_reduce(out, group=self.group)
        return out
