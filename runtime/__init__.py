"""cuteaot runtime: load a prebuilt cubin bundle and launch its kernels on torch tensors.

Zero JIT: nothing in this package imports CuTeDSL, Triton, NVRTC or nvcc.
"""

from .bundle import Bundle, load_bundle, set_cooperative_launch, set_programmatic_launch
from .checkpoint import (
    CheckpointError, CheckpointFiles, CheckpointLayout, load_model_moe, load_moe_layer, load_moe_layers,
)
from .devices import PROFILES, DeviceProfile
from .errors import (
    AbiMismatchError,
    ArchNotInBundleError,
    BadInputError,
    BuildError,
    BundleError,
    BundleNotFoundError,
    CaptureError,
    CuteAotError,
    IntegrityError,
    LaunchError,
    NoDeviceError,
    SchemaMismatchError,
    SpecError,
    UnknownSpecializationError,
)
from .kernels import (
    GemmRoutes, GemmWorkspace, moe_activation, moe_topk_sum, pack_gemm_routes, pack_routes, w4a16_moe_gemm,
)
from .manifest import verify_bundle
from .model_config import MoeConfig, moe_config
from .hybrid import HybridMoeLayer
from .moe import MoeLayer, MoeWorkspace, run_w4a16_moe
from .parallel import (
    ParallelMoeLayer, ep_partition, ep_select, tp_shard_bias2, tp_shard_bias13, tp_shard_w2, tp_shard_w2_mxfp4,
    tp_shard_w13, tp_shard_w13_mxfp4,
)
from .modelopt import ModelOptNvfp4, prepare_w2_modelopt, prepare_w13_modelopt
from .nf3 import PackedNf3, pack_nf3, prepare_w2_nf3, prepare_w13_nf3, quantize_nf3, unpack_nf3
from .types import Activation, DType, WeightFormat
from .weights import (
    PackedNvfp4, W13Order, pack_nvfp4, prepare_w2, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4, unpack_nvfp4,
)

__all__ = [
    "Bundle",
    "load_bundle",
    "set_cooperative_launch",
    "set_programmatic_launch",
    "verify_bundle",
    "moe_activation",
    "moe_topk_sum",
    "pack_routes",
    "w4a16_moe_gemm",
    "pack_gemm_routes",
    "GemmRoutes",
    "GemmWorkspace",
    "MoeLayer",
    "HybridMoeLayer",
    "MoeWorkspace",
    "run_w4a16_moe",
    "ParallelMoeLayer",
    "ep_partition",
    "ep_select",
    "tp_shard_w13",
    "tp_shard_w2",
    "tp_shard_bias13",
    "tp_shard_bias2",
    "tp_shard_w13_mxfp4",
    "tp_shard_w2_mxfp4",
    "Activation",
    "DType",
    "DeviceProfile",
    "PROFILES",
    "CuteAotError",
    "SpecError",
    "BuildError",
    "AbiMismatchError",
    "BundleError",
    "BundleNotFoundError",
    "CaptureError",
    "SchemaMismatchError",
    "IntegrityError",
    "ArchNotInBundleError",
    "NoDeviceError",
    "UnknownSpecializationError",
    "BadInputError",
    "LaunchError",
    "PackedNvfp4",
    "W13Order",
    "pack_nvfp4",
    "unpack_nvfp4",
    "prepare_w13",
    "prepare_w2",
    "prepare_w13_mxfp4",
    "prepare_w2_mxfp4",
    "PackedNf3",
    "WeightFormat",
    "quantize_nf3",
    "pack_nf3",
    "unpack_nf3",
    "prepare_w13_nf3",
    "prepare_w2_nf3",
    "ModelOptNvfp4",
    "prepare_w13_modelopt",
    "prepare_w2_modelopt",
    "CheckpointError",
    "CheckpointFiles",
    "CheckpointLayout",
    "load_moe_layer",
    "load_moe_layers",
    "load_model_moe",
    "MoeConfig",
    "moe_config",
]
