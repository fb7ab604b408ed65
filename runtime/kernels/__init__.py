"""Kernel families as the runtime sees them: specialization facts, parameter
signature, grid formula, argument checks and the public launch functions.

Codegen imports these to know what to compile; the runtime uses them to launch.
"""

from .activation import ActivationSpec, moe_activation
from .topk_sum import TopKSumSpec, moe_topk_sum
from .route_pack import RoutePackSpec, pack_routes, route_pack_specs
from .w4a16.gemm_spec import GemmSpec
from .w4a16.gemm import GemmRoutes, GemmWorkspace, pack_gemm_routes, w4a16_moe_gemm
from .probe import ProbeSpec
from .w4a16.fused_spec import FusedSpec

FAMILIES = {ActivationSpec.FAMILY: ActivationSpec, TopKSumSpec.FAMILY: TopKSumSpec, RoutePackSpec.FAMILY: RoutePackSpec,
            GemmSpec.FAMILY: GemmSpec, ProbeSpec.FAMILY: ProbeSpec, FusedSpec.FAMILY: FusedSpec}

__all__ = ["ActivationSpec", "TopKSumSpec", "FAMILIES", "moe_activation", "moe_topk_sum", "RoutePackSpec", "pack_routes", "route_pack_specs", "GemmSpec", "GemmRoutes", "GemmWorkspace", "pack_gemm_routes", "w4a16_moe_gemm"]
