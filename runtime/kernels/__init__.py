"""Kernel families as the runtime sees them: specialization facts, parameter
signature, grid formula, argument checks and the public launch functions.

Codegen imports these to know what to compile; the runtime uses them to launch.
"""

from .activation import ActivationSpec, moe_activation
from .topk_sum import TopKSumSpec, moe_topk_sum

FAMILIES = {ActivationSpec.FAMILY: ActivationSpec, TopKSumSpec.FAMILY: TopKSumSpec}

__all__ = ["ActivationSpec", "TopKSumSpec", "FAMILIES", "moe_activation", "moe_topk_sum"]
