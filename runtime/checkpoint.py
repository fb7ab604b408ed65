"""Checkpoint loading: the FP4 tensors of one MoE layer, read from safetensors files, -> PackedNvfp4.

Two NVFP4 key layouts (per expert, as ModelOpt and llm-compressor export them, and ModelOpt's fused
stacks) and gpt-oss's MXFP4 one are read (``P`` is the layer prefix, e.g.
``model.layers.3.mlp``):

    per_expert  P.experts.{e}.{gate,up,down}_proj.{weight, weight_scale, weight_scale_2, input_scale}
                weight (N, K/2) u8, weight_scale (N, K/16) e4m3fn, weight_scale_2 and input_scale
                () or (1,) f32; gate/up: (N, K) = (I, H), down: (H, I); experts without gate_proj
                (relu2: Nemotron) have W13 = up_proj alone.  Two variants are read alike:
                Mixtral's and Phi-3.5-MoE's projection names (w1 gate, w3 up, w2 down), and
                compressed-tensors' (llm-compressor's) NVFP4 tensor names: weight_packed,
                weight_scale, weight_global_scale (= 1 / weight_scale_2), input_global_scale
    w13 / w31   P.experts.{w13,w31}_{weight, weight_scale, weight_scale_2, input_scale} and
                P.experts.w2_{...}: the same tensors stacked over experts, gate rows first (w13)
                or up rows first (w31); weight_scale_2 (E,), (E, 1) or, for w13/w31, (E, 2)
    gpt_oss     P.experts.{gate_up,down}_proj_{blocks, scales, bias}: MXFP4 blocks (E, N, K/32, 16) u8,
                e8m0 scales (E, N, K/32) u8, biases (E, N); gate/up rows interleaved (gate at even rows)

Biases are optional in every layout (NVFP4: P.experts.{e}.{proj}.bias, P.experts.{w13,w31,w2}_bias);
a layer with any bias needs the `bias: true` kernels of its spec.

The result is what `prepare_w13` / `prepare_w2` (runtime/weights.py) make of the stacked tensors.
A per-expert checkpoint's two gate/up global scales become the (E, 2) (gate, up) pair
`prepare_w13` takes; a fused (E, 2) `w31_weight_scale_2` is read as (gate, up) too, the convention
of `prepare_w13`.  `input_scale` (W4A4's activation scale) is optional; when present it is checked
(dtype, shape) and then dropped: W4A16 keeps the activations in bf16/fp16.

MXFP4 is packed exactly (`prepare_w13_mxfp4`: the codes as stored, each power-of-two block scale
re-expressed against a per-expert global scale), never re-quantized.

Reads are lazy: `safe_open` memory-maps each file and reads only its header up front; a tensor
is read when a layer needs it, after its dtype and shape were checked from the header, so a
whole model never sits in memory.  `safetensors` is imported inside the functions (extra
``cuteaot[checkpoint]``): importing the runtime does not need it.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from .errors import BadInputError
from .model_config import moe_config, read_config
from .modelopt import prepare_w2_modelopt, prepare_w13_modelopt
from .moe import MoeLayer
from .parallel import (
    ModelOptTensors, ParallelMoeLayer, Shard, _check_shard, check_group, ep_partition, mxfp4_tp_blocks,
    tp_shard_bias2, tp_shard_bias13, tp_shard_w2, tp_shard_w2_mxfp4, tp_shard_w13, tp_shard_w13_mxfp4, tp_slice,
)
from .types import Activation, DType
from .weights import (
    MXFP4_BLOCK_BYTES, MXFP4_BLOCK_K, PackedNvfp4, W13Order, _check_dtype, prepare_w2, prepare_w2_mxfp4,
    prepare_w13, prepare_w13_mxfp4,
)

INDEX_FILE = "model.safetensors.index.json"  # the Hugging Face shard index: {"weight_map": {key: file}}
FP4_PER_BYTE = 2
SCALE_GROUP_K = 16  # k per e4m3 block scale
# safetensors header dtype names -> torch, for the ones NVFP4 uses and the usual mistakes
SAFETENSORS_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}
MAX_CLOSE_MATCHES = 3


class CheckpointError(BadInputError):
    """A checkpoint lacks a tensor, or holds one of the wrong dtype or shape; names the key and file."""


class CheckpointLayout(str, Enum):
    """How a checkpoint stores the experts of one MoE layer."""

    AUTO = "auto"  # detected from the keys under the layer prefix
    PER_EXPERT = "per_expert"  # experts.{e}.gate_proj.weight, ...
    W13 = "w13"  # experts.w13_weight (gate rows first), experts.w2_weight
    W31 = "w31"  # experts.w31_weight (up rows first), experts.w2_weight
    GPT_OSS = "gpt_oss"  # MXFP4 experts.gate_up_proj_blocks (gate/up interleaved), experts.down_proj_blocks


_PACKED_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")  # what packing needs; input_scale is only checked
_FUSED_ORDER = {CheckpointLayout.W13: W13Order.GATE_UP, CheckpointLayout.W31: W13Order.UP_GATE}
_BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _safetensors():
    """The safetensors module, imported on first use so that the runtime does not depend on it."""
    try:
        import safetensors
    except ImportError as e:
        raise ImportError(
            "loading checkpoints needs the safetensors library: pip install safetensors "
            "(or pip install 'cuteaot[checkpoint]')"
        ) from e
    return safetensors


# ---- files ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointFiles:
    """The safetensors files of one checkpoint and which file holds each key.

    Open it with `CheckpointFiles.open(path)`.  Files are opened lazily (header only, memory
    mapped) and stay open until `close()` or the end of a ``with`` block.
    """

    key_files: dict[str, Path]  # tensor name -> the file that holds it
    _handles: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _keysets: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, source: str | Path | Sequence[str | Path]) -> CheckpointFiles:
        """A directory (with `model.safetensors.index.json`, or every `*.safetensors` in it), an
        index json, one `.safetensors` file, or a list of `.safetensors` files."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir():
                index = path / INDEX_FILE
                return cls._from_index(index) if index.is_file() else cls._from_files(_shards_in(path))
            if path.suffix == ".json":
                return cls._from_index(path)
            return cls._from_files([path])
        return cls._from_files([Path(p) for p in source])

    @classmethod
    def _from_index(cls, index: Path) -> CheckpointFiles:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"'weight_map' is a JSON {type(weight_map).__name__}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index} is not a readable safetensors index (a JSON object with a 'weight_map' of "
                f"tensor name -> file): {e}"
            ) from e
        key_files = {key: index.parent / name for key, name in weight_map.items()}
        missing = sorted({str(p) for p in key_files.values() if not p.is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard file(s) that do not exist: {missing}")
        return cls(key_files)

    @classmethod
    def _from_files(cls, files: list[Path]) -> CheckpointFiles:
        if not files:
            raise CheckpointError("no .safetensors file given; pass a directory, an index json or file paths")
        found = cls({})
        key_files: dict[str, Path] = {}
        for path in files:
            for key in found._handle(path).keys():
                if key in key_files:
                    raise CheckpointError(f"tensor {key!r} is in both {key_files[key]} and {path}; pass one of them")
                key_files[key] = path
        result = cls(key_files)
        result._handles.update(found._handles)
        return result

    def __repr__(self) -> str:
        files = self.files
        where = str(files[0].parent) if files else "no files"
        return f"CheckpointFiles({where}: {len(files)} file(s), {len(self.key_files)} tensors)"

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.key_files.values()))

    def keys_under(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix` + '.' (sorted)."""
        return sorted(k for k in self.key_files if k.startswith(prefix + "."))

    def has(self, key: str) -> bool:
        return key in self.key_files

    def header(self, key: str, prefix: str) -> tuple[str, tuple[int, ...], Path]:
        """(safetensors dtype name, shape, file) of `key`, read from the file's header only."""
        path = self._file_of(key, prefix)
        info = self._handle(path).get_slice(key)
        return info.get_dtype(), tuple(info.get_shape()), path

    def read(self, key: str, prefix: str) -> torch.Tensor:
        """The tensor `key`, read from its file (CPU), starting 16-byte aligned: a tensor read in place starts
        where its data does in the file (safetensors aligns to 8 bytes), and the kernels read every operand
        in 16-byte vectors (weights read as stored and biases are used as read), so such a one is copied."""
        t = self._handle(self._file_of(key, prefix)).get_tensor(key)
        return t if t.data_ptr() % 16 == 0 else t.clone()

    def close(self) -> None:
        """Drop the open file handles (they are reopened on the next read)."""
        self._handles.clear()
        self._keysets.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _file_of(self, key: str, prefix: str) -> Path:
        path = self.key_files.get(key)
        if path is None:
            raise CheckpointError(self._missing_message(key, prefix))
        if key not in self._keys_of(path):
            raise CheckpointError(f"the index puts {key!r} in {path}, but that file does not hold it")
        return path

    def _missing_message(self, key: str, prefix: str) -> str:
        nearby = self.keys_under(prefix) or list(self.key_files)
        close = difflib.get_close_matches(key, nearby, n=MAX_CLOSE_MATCHES)
        hint = f"; close matches: {close}" if close else f"; no key starts with {prefix + '.'!r}"
        files = [str(p) for p in self.files]
        return f"tensor {key!r} (layer {prefix!r}) is not in the checkpoint (searched {files}){hint}"

    def _keys_of(self, path: Path) -> frozenset[str]:
        if path not in self._keysets:
            self._keysets[path] = frozenset(self._handle(path).keys())
        return self._keysets[path]

    def _handle(self, path: Path):
        if path not in self._handles:
            safetensors = _safetensors()
            try:
                self._handles[path] = safetensors.safe_open(str(path), framework="pt", device="cpu")
            except (OSError, safetensors.SafetensorError) as e:
                raise CheckpointError(f"cannot open {path} as a safetensors file: {e}") from e
        return self._handles[path]


def _shards_in(directory: Path) -> list[Path]:
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{directory} holds neither {INDEX_FILE} nor any *.safetensors file")
    return shards


# ---- checked reads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expect:
    """What one tensor must be: dtype, allowed shapes, and a phrase for the error message."""

    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    what: str
    checkpoint: str = "an NVFP4 (ModelOpt or compressed-tensors)"  # what a wrong dtype suggests it is not


def _dtype_name(safetensors_dtype: str) -> str:
    found = SAFETENSORS_DTYPES.get(safetensors_dtype)
    return str(found).removeprefix("torch.") if found is not None else safetensors_dtype


def _check_header(files: CheckpointFiles, key: str, prefix: str, expect: _Expect) -> None:
    st_dtype, shape, path = files.header(key, prefix)
    if SAFETENSORS_DTYPES.get(st_dtype) != expect.dtype:
        raise CheckpointError(
            f"{key} in {path}: expected dtype {str(expect.dtype).removeprefix('torch.')} ({expect.what}), "
            f"got {_dtype_name(st_dtype)}; is this {expect.checkpoint} checkpoint?"
        )
    if shape not in expect.shapes:
        raise CheckpointError(
            f"{key} in {path}: expected shape {' or '.join(map(str, expect.shapes))} ({expect.what}), got {shape}"
        )


def _read(files: CheckpointFiles, key: str, prefix: str, expect: _Expect) -> torch.Tensor:
    _check_header(files, key, prefix, expect)
    return files.read(key, prefix)


def _check_optional(files: CheckpointFiles, key: str, prefix: str, expect: _Expect) -> None:
    """The input scale: checked when present (a wrong one means a wrong file), never needed by W4A16."""
    if files.has(key):
        _check_header(files, key, prefix, expect)


def _read_bias(files: CheckpointFiles, key: str, prefix: str, shape: tuple[int, ...], what: str):
    """An optional bias: None when the checkpoint has no `key`, else the checked tensor."""
    if not files.has(key):
        return None
    st_dtype, found, path = files.header(key, prefix)
    if SAFETENSORS_DTYPES.get(st_dtype) not in _BIAS_DTYPES:
        raise CheckpointError(f"{key} in {path}: expected a bf16, f16 or f32 bias ({what}), got {_dtype_name(st_dtype)}")
    if found != shape:
        raise CheckpointError(f"{key} in {path}: expected shape {shape} ({what}), got {found}")
    return files.read(key, prefix)


def _modelopt_expects(lead: tuple[int, ...], n: int, half_k: int, scale_2_shapes, what: str) -> dict[str, _Expect]:
    """weight / weight_scale / weight_scale_2 / input_scale expectations of an (N, K) matrix."""
    if half_k * FP4_PER_BYTE % SCALE_GROUP_K:
        raise CheckpointError(
            f"{what}: K = {half_k * FP4_PER_BYTE} (2 x the weight's last dim {half_k}) is not a multiple of "
            f"{SCALE_GROUP_K}, so it has no NVFP4 block scales"
        )
    return {
        "weight": _Expect(torch.uint8, (lead + (n, half_k),), f"{what}: two e2m1 codes a byte, [N, K/2]"),
        "weight_scale": _Expect(
            torch.float8_e4m3fn,
            (lead + (n, half_k * FP4_PER_BYTE // SCALE_GROUP_K),),
            f"{what}: one e4m3 scale per 16 k, [N, K/16]",
        ),
        "weight_scale_2": _Expect(torch.float32, scale_2_shapes, f"{what}: global scale"),
        "input_scale": _Expect(torch.float32, scale_2_shapes, f"{what}: activation scale, unused by W4A16"),
    }


# ---- one rank's part -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """Which part of a layer this process loads: every expert and all of I, or one tensor-parallel rank's
    slice of I (`tp`), or one expert-parallel rank's experts (`ep`; runtime/parallel.py cuts both)."""

    num_experts: int
    tp: Shard | None = None
    ep: Shard | None = None

    experts: range = dataclasses.field(init=False)  # the global ids of the experts this process reads

    def __post_init__(self) -> None:
        # ep_partition checks the rank (in range, at least one expert each) before any read
        local = ep_partition(self.num_experts, *self.ep)[1] if self.ep else range(self.num_experts)
        object.__setattr__(self, "experts", local)
        if self.tp is not None:
            _check_shard(*self.tp)

    def check_split(self, intermediate_size: int, mxfp4: bool = False) -> None:
        """Refuse, before any tensor is read, a tensor-parallel degree that cannot cut this I (NVFP4: into
        multiples of 16; MXFP4's W2: into whole 32-k blocks)."""
        if self.tp is not None:
            (mxfp4_tp_blocks if mxfp4 else tp_slice)(intermediate_size, *self.tp)

    def select(self, tensors: dict) -> dict:
        """The local experts' entries of per-expert stacked tensors (every value's first axis is E)."""
        if self.ep is None:
            return tensors
        pick = slice(self.experts.start, self.experts.stop)
        return {k: None if v is None else v[pick].contiguous() for k, v in tensors.items()}

    def tp_cut(self, t13: dict, t2: dict, order: W13Order, gated: bool) -> tuple[dict, dict, W13Order]:
        """The ModelOpt tensors of this rank's slice of I (rows of W13 in gate|up order, columns of W2)."""
        if self.tp is None:
            return t13, t2, order
        act = Activation.SILU if gated else Activation.RELU2  # what decides the row layout, not the math
        rows_order = order if gated else None
        weight, scale, scale_2 = tp_shard_w13(ModelOptTensors(t13["weight"], t13["weight_scale"],
                                                              t13["weight_scale_2"]), *self.tp, activation=act,
                                              order=rows_order)
        bias = t13.get("bias")
        t13 = {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2,
               "bias": None if bias is None else tp_shard_bias13(bias, *self.tp, activation=act, order=rows_order)}
        weight, scale, scale_2 = tp_shard_w2(ModelOptTensors(t2["weight"], t2["weight_scale"], t2["weight_scale_2"]),
                                             *self.tp)
        bias = t2.get("bias")
        t2 = {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2,
              "bias": None if bias is None else tp_shard_bias2(bias, *self.tp)}
        return t13, t2, W13Order.GATE_UP


def _shard(name: str, value) -> Shard | None:
    """`tp=` / `ep=` as a Shard: None, or (rank, world)."""
    if value is None:
        return None
    try:
        rank, world = value
    except (TypeError, ValueError):
        raise CheckpointError(f"{name} must be (rank, world), e.g. {name}=(0, 2), got {value!r}") from None
    return Shard(rank, world)


# ---- layouts -------------------------------------------------------------------------------------


def detect_layout(files: CheckpointFiles, prefix: str) -> CheckpointLayout:
    """The one layout (NVFP4 per expert or fused, gpt-oss MXFP4) whose keys exist under `prefix`; errors when none
    or several do."""
    naming = _per_expert_naming(files, prefix)
    markers = {
        CheckpointLayout.PER_EXPERT: naming.key(prefix, 0, naming.projections[0], "weight") if naming
        else f"{prefix}.experts.0.{{gate_proj,w1}}.{{weight,weight_packed}}",
        CheckpointLayout.W13: f"{prefix}.experts.w13_weight",
        CheckpointLayout.W31: f"{prefix}.experts.w31_weight",
        CheckpointLayout.GPT_OSS: f"{prefix}.experts.gate_up_proj_blocks",
    }
    found = [layout for layout, key in markers.items() if files.has(key)]  # (a per-expert marker names a found key)
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(
            f"layer {prefix!r} holds keys of several layouts {[f.value for f in found]} "
            f"({[markers[f] for f in found]}); pass layout= one of them"
        )
    under = files.keys_under(prefix)
    raise CheckpointError(
        f"layer {prefix!r} has none of the NVFP4 / MXFP4 MoE keys {list(markers.values())} "
        f"(searched {[str(p) for p in files.files]}); keys under the prefix: {under[:8]}"
        f"{' ...' if len(under) > 8 else ''}"
    )


def _load_fused(files, prefix, num_experts, dtype, layout, device, as_stored, part) -> tuple[PackedNvfp4, PackedNvfp4]:
    """Stacked w13 / w31 and w2: gated (W13 holds 2I rows, gate and up) or relu2 (I rows, the up projection
    alone), which W2's K = I tells apart."""
    name13 = "w13" if layout is CheckpointLayout.W13 else "w31"
    base = f"{prefix}.experts."
    _, shape13, path = files.header(f"{base}{name13}_weight", prefix)
    _, shape2, path2 = files.header(f"{base}w2_weight", prefix)
    if len(shape13) != 3 or shape13[0] != num_experts:
        raise CheckpointError(
            f"{base}{name13}_weight in {path}: expected shape (E={num_experts}, 2I or I, H/2), got {shape13}"
        )
    e, h = num_experts, shape13[2] * FP4_PER_BYTE
    if len(shape2) != 3 or shape2[:2] != (e, h):
        raise CheckpointError(f"{base}w2_weight in {path2}: expected shape (E={e}, H={h}, I/2), got {shape2}")
    inter, rows = shape2[2] * FP4_PER_BYTE, shape13[1]
    if rows not in (2 * inter, inter):
        raise CheckpointError(f"{base}{name13}_weight in {path}: {rows} rows, but w2's K is I = {inter}: W13 holds "
                              f"2I = {2 * inter} rows (gate and up) or I (relu2's up projection alone)")
    gated = rows == 2 * inter
    part.check_split(inter)
    pair = ((e,), (e, 1), (e, 2)) if gated else ((e,), (e, 1))
    what13 = f"{name13} [E, {'2I' if gated else 'I'}, H]"
    spec13 = _modelopt_expects((e,), rows, h // FP4_PER_BYTE, pair, what13)
    spec2 = _modelopt_expects((e,), h, inter // FP4_PER_BYTE, ((e,), (e, 1)), "w2 [E, H, I]")
    t13 = {s: _read(files, f"{base}{name13}_{s}", prefix, spec13[s]) for s in _PACKED_SUFFIXES}
    t2 = {s: _read(files, f"{base}w2_{s}", prefix, spec2[s]) for s in _PACKED_SUFFIXES}
    _check_optional(files, f"{base}{name13}_input_scale", prefix, spec13["input_scale"])
    _check_optional(files, f"{base}w2_input_scale", prefix, spec2["input_scale"])
    t13["bias"] = _read_bias(files, f"{base}{name13}_bias", prefix, (e, rows), f"{what13} bias")
    t2["bias"] = _read_bias(files, f"{base}w2_bias", prefix, (e, h), "w2 bias [E, H]")
    order = _FUSED_ORDER[layout] if gated else W13Order.GATE_UP  # one projection: no halves to order
    return _prepare(part.select(t13), part.select(t2), dtype, order, device, as_stored, gated=gated, part=part)


_PER_EXPERT_SCALAR = ((), (1,))


@dataclass(frozen=True)
class _Naming:
    """How a per-expert checkpoint names one expert's projections and each projection's tensors.

    `gate` is None for experts without a gate projection (relu2: W13 is the up projection alone).
    The tensors are addressed by their ModelOpt names (`_PACKED_SUFFIXES`, "input_scale") and stored
    under `suffixes`' names; `inverse_global`: the file holds 1 / weight_scale_2 (compressed-tensors'
    weight_global_scale, the factor a weight is divided by)."""

    gate: str | None
    up: str
    down: str
    suffixes: dict[str, str]
    inverse_global: bool
    label: str  # the checkpoint's kind, for messages

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections' names, W13's first ((gate, up) or (up,)), down last."""
        return (self.up, self.down) if self.gate is None else (self.gate, self.up, self.down)

    def key(self, prefix: str, expert: int, projection: str, tensor: str) -> str:
        return f"{prefix}.experts.{expert}.{projection}.{self.suffixes.get(tensor, tensor)}"


_PROJECTION_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # HF's; Mixtral's, Phi-3.5-MoE's
_TENSOR_NAMES = (
    ("ModelOpt NVFP4", {}, False),
    ("compressed-tensors NVFP4", {"weight": "weight_packed", "weight_scale_2": "weight_global_scale",
                                  "input_scale": "input_global_scale"}, True),
)
_RELU2_NAMES = (None, "up_proj", "down_proj")  # experts without a gate projection (Nemotron)
_NAMINGS = tuple(
    _Naming(gate, up, down, suffixes, inverse, label)
    for label, suffixes, inverse in _TENSOR_NAMES
    for gate, up, down in _PROJECTION_NAMES + (_RELU2_NAMES,)
)


def _per_expert_naming(files: CheckpointFiles, prefix: str) -> _Naming | None:
    """The naming whose expert-0 keys the layer holds (every projection's codes), None where none does;
    CheckpointError where several do (a checkpoint mixing two exports)."""
    found = [n for n in _NAMINGS if all(files.has(n.key(prefix, 0, p, "weight")) for p in n.projections)]
    gated = [n for n in found if n.gate is not None]
    found = gated or found  # a gated layer also holds the relu2 naming's up_proj and down_proj
    if len(found) > 1:
        raise CheckpointError(
            f"layer {prefix!r} holds expert 0 under several namings: "
            f"{[n.key(prefix, 0, n.projections[0], 'weight') for n in found]}; a checkpoint holds one export"
        )
    return found[0] if found else None


def _load_per_expert(files, prefix, num_experts, dtype, device, as_stored, part) -> tuple[PackedNvfp4, PackedNvfp4]:
    naming = _per_expert_naming(files, prefix) or _NAMINGS[0]  # none: reading gate_proj says what is missing
    lead = naming.projections[0]
    first = naming.key(prefix, 0, lead, "weight")
    _, lead_shape, path = files.header(first, prefix)
    if len(lead_shape) != 2:
        raise CheckpointError(f"{first} in {path}: expected a 2-D (I, H/2) weight, got shape {lead_shape}")
    inter, h = lead_shape[0], lead_shape[1] * FP4_PER_BYTE
    if inter % SCALE_GROUP_K:
        raise CheckpointError(f"{first} in {path}: I = {inter} is not a multiple of {SCALE_GROUP_K}, the NVFP4 scale "
                              "group along FC2's K")
    part.check_split(inter)
    _check_expert_keys(files, prefix, num_experts, naming)

    def expects(n: int, half_k: int, what: str) -> dict[str, _Expect]:
        found = _modelopt_expects((), n, half_k, _PER_EXPERT_SCALAR, what)
        if naming.inverse_global:
            found["weight_scale_2"] = dataclasses.replace(found["weight_scale_2"], what=f"{what}: 1 / global scale")
        return {name: dataclasses.replace(e, checkpoint=f"a {naming.label}") for name, e in found.items()}

    specs = {proj: expects(inter, h // FP4_PER_BYTE, f"{proj} [I, H]") for proj in naming.projections[:-1]}
    specs[naming.down] = expects(h, inter // FP4_PER_BYTE, f"{naming.down} [H, I]")
    experts = [_read_expert(files, prefix, e, specs, lead_shape, naming) for e in part.experts]  # the local ones

    def stacked(proj: str, suffix: str) -> torch.Tensor:
        return torch.stack([ex[proj][suffix] for ex in experts])

    w13_projections = naming.projections[:-1]  # (gate, up) or (up,)
    t13 = {
        "weight": torch.cat([stacked(proj, "weight") for proj in w13_projections], dim=1),
        "weight_scale": torch.cat([stacked(proj, "weight_scale") for proj in w13_projections], dim=1),
        # gated: (E, 2) = (gate, up), which prepare_w13 keeps exact when equal and merges when not
        "weight_scale_2": torch.stack([stacked(proj, "weight_scale_2") for proj in w13_projections], dim=1),
    }
    t2 = {s: stacked(naming.down, s) for s in _PACKED_SUFFIXES}
    biases = {proj: [ex[proj].get("bias") for ex in experts] for proj in naming.projections}
    for proj, found in biases.items():
        if any(b is not None for b in found) and any(b is None for b in found):
            missing = [e for e, b in zip(part.experts, found) if b is None]
            raise CheckpointError(f"layer {prefix!r}: {proj}.bias exists for some experts but not for {missing[:8]}")

    def bias(proj: str) -> torch.Tensor | None:
        return None if biases[proj][0] is None else torch.stack(biases[proj])

    if naming.gate is not None:
        gate, up = bias(naming.gate), bias(naming.up)
        if (gate is None) != (up is None):
            raise CheckpointError(f"layer {prefix!r}: {naming.gate} and {naming.up} must both have biases or neither")
        t13["bias"] = None if gate is None else torch.cat((gate, up), dim=1)
    else:
        t13["weight_scale_2"] = t13["weight_scale_2"][:, 0]  # (E,): one projection, one global scale
        t13["bias"] = bias(naming.up)
    t2["bias"] = bias(naming.down)
    return _prepare(t13, t2, dtype, W13Order.GATE_UP, device, as_stored, gated=naming.gate is not None, part=part)


def _check_expert_keys(files: CheckpointFiles, prefix: str, num_experts: int, naming: _Naming) -> None:
    """Refuse a layer that holds more experts than `num_experts` (their weights would be dropped), and one whose
    expert 0 has no gate projection while others do (it would load as ungated)."""
    lead = naming.projections[0]
    if files.has(naming.key(prefix, num_experts, lead, "weight")):
        held = next(e for e in itertools.count(num_experts) if not files.has(naming.key(prefix, e, lead, "weight")))
        raise CheckpointError(f"layer {prefix!r} holds {held} experts ({naming.key(prefix, held - 1, lead, 'weight')}"
                              f" exists), but num_experts={num_experts}: the experts past it would be dropped")
    if naming.gate is None:
        gated = dataclasses.replace(naming, gate=_PROJECTION_NAMES[0][0])
        stray = [e for e in range(num_experts) if files.has(gated.key(prefix, e, gated.gate, "weight"))]
        if stray:
            raise CheckpointError(f"layer {prefix!r}: expert 0 has no {gated.gate} but experts {stray[:8]} do; "
                                  "a layer's experts are all gated or none (a truncated checkpoint?)")


def _read_expert(files, prefix, expert, specs, lead_shape, naming: _Naming) -> dict[str, dict[str, torch.Tensor]]:
    """One expert's projections by ModelOpt tensor name (weight_scale_2 as a 0-d tensor; for compressed-tensors,
    the reciprocal of its weight_global_scale), checked against expert 0's shapes."""
    lead = next(iter(specs))
    lead_key = naming.key(prefix, expert, lead, "weight")
    _, shape, path = files.header(lead_key, prefix)
    if shape != lead_shape:
        raise CheckpointError(
            f"{lead_key} in {path} has shape {shape}, expert 0's {lead_shape}; "
            "every expert of a layer must have the same shape (a mixed or truncated checkpoint?)"
        )
    out = {}
    for proj in specs:
        spec = specs[proj]
        t = {s: _read(files, naming.key(prefix, expert, proj, s), prefix, spec[s]) for s in _PACKED_SUFFIXES}
        t["weight_scale_2"] = t["weight_scale_2"].reshape(())
        if naming.inverse_global:
            key = naming.key(prefix, expert, proj, "weight_scale_2")
            t["weight_scale_2"] = _inverse_global(t["weight_scale_2"], key)
        _check_optional(files, naming.key(prefix, expert, proj, "input_scale"), prefix, spec["input_scale"])
        n = spec["weight"].shapes[0][0]
        t["bias"] = _read_bias(files, naming.key(prefix, expert, proj, "bias"), prefix, (n,), f"{proj} bias [N]")
        out[proj] = t
    return out


def _inverse_global(global_scale: torch.Tensor, key: str) -> torch.Tensor:
    """ModelOpt's weight_scale_2 of a compressed-tensors weight_global_scale (the weight is codes x block scale
    / global scale), which must be positive and finite."""
    value = float(global_scale)
    if not (0.0 < value < float("inf")):
        raise CheckpointError(f"{key} = {value:g}: a global scale divides the weights, so it must be positive and "
                              "finite (compressed-tensors: 448 * 6 / amax)")
    return torch.reciprocal(global_scale)


def _to(tensors: dict, device) -> dict:
    return {k: None if v is None else v.to(device) for k, v in tensors.items()}


def _prepare(t13, t2, dtype, order, device, as_stored=False, gated=True, part=None) -> tuple[PackedNvfp4, PackedNvfp4]:
    """Pack on `device` (vectorised torch: the GPU packs a large layer far faster than the CPU), or with
    `as_stored` wrap the tensors moved there as they are (runtime/modelopt.py: no repacking pass).
    `gated=False`: W13 is one projection (relu2), which packs as is.  `part`: a tensor-parallel rank's slice
    of I is cut first (the tensors hold the local experts already)."""
    if part is not None:
        t13, t2, order = part.tp_cut(t13, t2, order, gated)
    on = _to(t13, device)
    if as_stored:
        w13 = prepare_w13_modelopt(on["weight"], on["weight_scale"], on["weight_scale_2"], dtype, order=order,
                                   gated=gated, bias=on.get("bias"))
    else:
        w13 = prepare_w13(on["weight"], on["weight_scale"], on["weight_scale_2"], dtype, order=order,
                          bias=on.get("bias"))
    p2 = prepare_w2_modelopt if as_stored else prepare_w2
    on = _to(t2, device)
    w2 = p2(on["weight"], on["weight_scale"], on["weight_scale_2"], dtype, bias=on.get("bias"))
    return w13, w2


GPT_OSS = "a gpt-oss MXFP4"


def _load_gpt_oss(files, prefix, num_experts, dtype, device, part) -> tuple[PackedNvfp4, PackedNvfp4]:
    base = f"{prefix}.experts."
    first = f"{base}gate_up_proj_blocks"
    _, shape13, path = files.header(first, prefix)
    if len(shape13) != 4 or shape13[0] != num_experts or shape13[3] != MXFP4_BLOCK_BYTES:
        raise CheckpointError(f"{first} in {path}: expected shape (E={num_experts}, 2I, H/32, "
                              f"{MXFP4_BLOCK_BYTES}), got {shape13}")
    e, rows, h = num_experts, shape13[1], shape13[2] * MXFP4_BLOCK_K
    if rows % 2:
        raise CheckpointError(f"{first} in {path}: 2I = {rows} rows is odd; gate/up rows come in pairs")
    inter = rows // 2
    if inter % MXFP4_BLOCK_K:
        raise CheckpointError(f"{first} in {path}: I = {inter} is not a multiple of {MXFP4_BLOCK_K}, so "
                              "down_proj has no whole MXFP4 blocks")
    part.check_split(inter, mxfp4=True)

    def mx(name: str, n: int, k: int) -> dict:
        what = f"{name} [E, N, K] = [{e}, {n}, {k}]"
        blocks = _read(files, f"{base}{name}_blocks", prefix, _Expect(
            torch.uint8, ((e, n, k // MXFP4_BLOCK_K, MXFP4_BLOCK_BYTES),), f"{what}: two e2m1 codes a byte", GPT_OSS))
        scales = _read(files, f"{base}{name}_scales", prefix, _Expect(
            torch.uint8, ((e, n, k // MXFP4_BLOCK_K),), f"{what}: one e8m0 scale per 32 k", GPT_OSS))
        bias = _read_bias(files, f"{base}{name}_bias", prefix, (e, n), f"{name} bias [E, N]")
        return part.select({"blocks": blocks, "scales": scales, "bias": bias})

    t13, order = mx("gate_up_proj", rows, h), W13Order.INTERLEAVED
    if part.tp is not None:  # this rank's gate and up rows, in gate|up order
        bias = t13["bias"]
        t13 = dict(zip(("blocks", "scales"), tp_shard_w13_mxfp4(t13["blocks"], t13["scales"], *part.tp, order=order)),
                   bias=None if bias is None else tp_shard_bias13(bias, *part.tp, activation=Activation.SWIGLUOAI,
                                                                  order=order))
        order = W13Order.GATE_UP
    t13 = _to(t13, device)
    w13 = prepare_w13_mxfp4(t13["blocks"], t13["scales"], dtype, order=order, bias=t13["bias"])
    del t13
    t2 = mx("down_proj", h, inter)
    if part.tp is not None:  # this rank's K blocks; W2's bias on rank 0 only (the all-reduce adds it once)
        bias = t2["bias"]
        t2 = dict(zip(("blocks", "scales"), tp_shard_w2_mxfp4(t2["blocks"], t2["scales"], *part.tp)),
                  bias=None if bias is None else tp_shard_bias2(bias, *part.tp))
    t2 = _to(t2, device)
    w2 = prepare_w2_mxfp4(t2["blocks"], t2["scales"], dtype, bias=t2["bias"])
    return w13, w2


# ---- public API ----------------------------------------------------------------------------------


def load_moe_layer(
    files: CheckpointFiles | str | Path | Sequence[str | Path],
    prefix: str,
    *,
    num_experts: int,
    dtype: DType | str | torch.dtype,
    layout: CheckpointLayout | str = CheckpointLayout.AUTO,
    device: torch.device | str = "cpu",
    as_stored: bool = False,
    tp: Shard | tuple[int, int] | None = None,
    ep: Shard | tuple[int, int] | None = None,
) -> tuple[PackedNvfp4, PackedNvfp4]:
    """(w13, w2) of the MoE layer under `prefix` (e.g. ``model.layers.3.mlp``), packed for the GEMM
    with `dtype` activations, on `device`.  `files` is a `CheckpointFiles` or what its `open` takes.

    `as_stored=True` (NVFP4 layouts): the tensors as the checkpoint stores them, `ModelOptNvfp4`
    for the `weights: modelopt` / `modelopt_w31` kernels, with no repacking (a per-expert checkpoint's
    projections are stacked into one (E, 2I, H/2) tensor: that is the only copy).

    `tp=(rank, world)`: this tensor-parallel rank's slice of I (`tp_shard_*` of runtime/parallel.py);
    `ep=(rank, world)`: this expert-parallel rank's experts (`ep_partition`; a per-expert checkpoint
    reads only those).  `num_experts` stays the checkpoint's (global) count; one of the two at most."""
    dtype = _check_dtype(dtype)  # before any read
    if not isinstance(files, CheckpointFiles):
        files = CheckpointFiles.open(files)
    try:
        chosen = CheckpointLayout(layout)
    except ValueError:
        allowed = [m.value for m in CheckpointLayout]
        raise CheckpointError(f"layout must be one of {allowed}, got {layout!r}") from None
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise CheckpointError(f"num_experts must be a positive int (the layer's expert count), got {num_experts!r}")
    if tp is not None and ep is not None:
        raise CheckpointError(f"pass tp= or ep=, not both (got tp={tp!r}, ep={ep!r}): a rank holds a slice of I "
                              "of every expert, or whole experts")
    if chosen is CheckpointLayout.AUTO:
        chosen = detect_layout(files, prefix)
    try:
        part = _Part(num_experts, _shard("tp", tp), _shard("ep", ep))
        if chosen is CheckpointLayout.PER_EXPERT:
            return _load_per_expert(files, prefix, num_experts, dtype, device, as_stored, part)
        if chosen is CheckpointLayout.GPT_OSS:
            if as_stored:
                raise CheckpointError(f"layer {prefix!r} holds gpt-oss MXFP4 weights, which are packed "
                                      "(prepare_w13_mxfp4); as_stored reads ModelOpt NVFP4 layouts only")
            return _load_gpt_oss(files, prefix, num_experts, dtype, device, part)
        return _load_fused(files, prefix, num_experts, dtype, chosen, device, as_stored, part)
    except CheckpointError:
        raise
    except BadInputError as e:  # prepare_w13 / prepare_w2 rejected the values: say which layer and files
        raise CheckpointError(
            f"layer {prefix!r} ({chosen.value} layout, files {[str(p) for p in files.files]}): {e}"
        ) from e


def load_moe_layers(
    files: CheckpointFiles | str | Path | Sequence[str | Path],
    prefixes: Iterable[str],
    *,
    progress: bool = True,
    **kwargs,
) -> list[tuple[PackedNvfp4, PackedNvfp4]]:
    """`load_moe_layer` for each prefix (same keyword arguments), with a progress bar: tqdm when it
    is installed, one line per layer on stderr otherwise."""
    if not isinstance(files, CheckpointFiles):
        files = CheckpointFiles.open(files)
    prefixes = list(prefixes)
    report, close = _progress(len(prefixes)) if progress else (None, None)
    layers = []
    try:
        for prefix in prefixes:
            layers.append(load_moe_layer(files, prefix, **kwargs))
            if report is not None:
                report(len(layers), prefix)
    finally:
        if close is not None:
            close()
    return layers


def moe_layer_prefixes(files: CheckpointFiles) -> list[str]:
    """The prefixes of the checkpoint's MoE layers (what precedes `.experts.` in their keys), in layer order
    (model.layers.2.mlp before model.layers.10.mlp)."""
    found = {key.split(".experts.", 1)[0] for key in files.key_files if ".experts." in key}
    return sorted(found, key=lambda p: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p)])


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def is_draft_layer(prefix: str, num_layers: int | None) -> bool:
    """Whether a MoE layer is a multi-token-prediction (MTP) layer that the checkpoint keeps beside the main
    model's, for a speculative draft: DeepSeek-V3's and GLM-4.5's `model.layers.{num_hidden_layers + i}`,
    Qwen3-Next's `mtp.` keys, MiMo's `mtp_layers`.  A serving engine's main model does not load them."""
    if any(part == "mtp" or part.startswith("mtp_") for part in prefix.split(".")):
        return True
    index = _LAYER_INDEX.search(prefix)
    return num_layers is not None and index is not None and int(index.group(1)) >= num_layers


def load_model_moe(bundle, model: str | Path, *, dtype: DType | str | None = None, as_stored: bool = False,
                   tp: Shard | tuple[int, int] | None = None, ep: Shard | tuple[int, int] | None = None, group=None,
                   prefixes: Iterable[str] | None = None, progress: bool = True,
                   **layer_options) -> dict[str, MoeLayer | ParallelMoeLayer]:
    """Every MoE layer of a Hugging Face model directory (config.json and safetensors files) on the bundle's
    device, by layer prefix: `MoeLayer`s, or with `tp=` / `ep=` this rank's `ParallelMoeLayer`s.

    The routed experts' shape and options come from config.json (`model_config.moe_config`: top-k,
    activation, SwiGLU limit, router weight on the input, the activations' dtype unless `dtype` is given),
    the layers from the checkpoint's keys (`moe_layer_prefixes`); each is read by `load_moe_layer`
    (`as_stored`: NVFP4 as stored, for `weights: modelopt` bundles) and built with `layer_options`
    (max_tokens, deterministic, validate_ids, ...).  `tp=(rank, world)`: this rank's slice of every
    expert's I (the bundle needs the `<name>-tp<world>` problems: `cuteaot spec --tp`); `ep=(rank, world)`:
    this rank's experts and their `expert_map` (`cuteaot spec --ep`); both all-reduce over `group` (the
    default process group when None), so torch.distributed must be initialised.  `prefixes`: only these
    of the model's MoE layers (a pipeline stage's); by default every MoE layer of the main model, without
    the multi-token-prediction layers some checkpoints keep for a draft model (`is_draft_layer`: DeepSeek-V3's
    layer 61, Qwen3-Next's `mtp.`), which `prefixes=` loads when named.  The bundle must hold the model's kernels:
    `cuteaot spec <model> -o spec.yaml` and `cuteaot build spec.yaml` make it.
    """
    config, file = read_config(model)
    moe = moe_config(config, Path(model).name, dtype=None if dtype is None else _check_dtype(dtype).value,
                     source=str(file))
    decided = {"top_k": file, "activation": file, "swiglu_limit": file, "router_weight_on_input": file,
               "expert_map": "ep=(rank, world)"}
    clash = sorted(decided.keys() & layer_options.keys())
    if clash:
        raise CheckpointError(f"{clash[0]} comes from {decided[clash[0]]}; pass the layers' other options only")
    shard = _shard("tp", tp) or _shard("ep", ep)
    if shard is not None:
        check_group(shard, group)  # before anything is read
    files = CheckpointFiles.open(file.parent)
    found = moe_layer_prefixes(files)
    if not found:
        raise CheckpointError(f"no MoE layer in {[str(p) for p in files.files]}: no key holds '.experts.'")
    if prefixes is None:
        prefixes = [p for p in found if not is_draft_layer(p, moe.num_layers)]
        if not prefixes:
            raise CheckpointError(f"every MoE layer of {file.parent} ({found[:4]}) is a multi-token-prediction "
                                  "layer beyond the main model's; pass prefixes= to load them")
    else:
        prefixes = list(prefixes)
        unknown = [p for p in prefixes if p not in found]
        if unknown:
            raise CheckpointError(f"{unknown} are not MoE layers of {file.parent}; its MoE layers are {found[:4]}"
                                  f"{' ...' if len(found) > 4 else ''} ({len(found)})")
    weights = load_moe_layers(files, prefixes, num_experts=moe.num_experts, dtype=moe.dtype, device=bundle.device,
                              as_stored=as_stored, tp=tp, ep=ep, progress=progress)
    options = dict(top_k=moe.top_k, activation=moe.activation, swiglu_limit=moe.swiglu_limit,
                   router_weight_on_input=moe.router_weight_on_input, **layer_options)
    if tp is None and ep is None:
        return {prefix: MoeLayer(bundle, w13, w2, **options) for prefix, (w13, w2) in zip(prefixes, weights)}
    expert_map = None if ep is None else ep_partition(moe.num_experts, *_shard("ep", ep), device=bundle.device)[0]
    return {prefix: ParallelMoeLayer(bundle, w13, w2, group=group, expert_map=expert_map, shard=shard, **options)
            for prefix, (w13, w2) in zip(prefixes, weights)}


def _progress(total: int):
    """(report(done, prefix), close()): a tqdm bar, or one line per layer on stderr without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None:

        def plain(done: int, prefix: str) -> None:
            print(f"cuteaot: loaded MoE layer {done}/{total} ({prefix})", file=sys.stderr, flush=True)

        return plain, lambda: None
    bar = tqdm(total=total, desc="cuteaot: MoE layers", unit="layer")

    def update(done: int, prefix: str) -> None:
        bar.set_postfix_str(prefix, refresh=False)
        bar.update(1)

    return update, bar.close
