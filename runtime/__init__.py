"""cuteaot runtime: load a prebuilt cubin bundle and launch its kernels on torch tensors.

Zero JIT: nothing in this package imports CuTeDSL, Triton, NVRTC or nvcc.
"""

from .bundle import Bundle, load_bundle
from .devices import PROFILES, DeviceProfile
from .errors import (
    AbiMismatchError,
    ArchNotInBundleError,
    BadInputError,
    BuildError,
    BundleError,
    CuteAotError,
    IntegrityError,
    LaunchError,
    NoDeviceError,
    SchemaMismatchError,
    SpecError,
    UnknownSpecializationError,
)
from .kernels import moe_activation, moe_topk_sum
from .manifest import verify_bundle
from .types import Activation, DType

__all__ = [
    "Bundle",
    "load_bundle",
    "verify_bundle",
    "moe_activation",
    "moe_topk_sum",
    "Activation",
    "DType",
    "DeviceProfile",
    "PROFILES",
    "CuteAotError",
    "SpecError",
    "BuildError",
    "AbiMismatchError",
    "BundleError",
    "SchemaMismatchError",
    "IntegrityError",
    "ArchNotInBundleError",
    "NoDeviceError",
    "UnknownSpecializationError",
    "BadInputError",
    "LaunchError",
]
