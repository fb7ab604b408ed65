"""Float32 references for the activation and top-k sum, independent of cuteaot's code."""

from __future__ import annotations

import torch


def activation_reference(fc1: torch.Tensor, facts: dict) -> torch.Tensor:
    x = fc1.float()
    kind = facts["activation"]
    if kind == "relu2":
        return torch.relu(x) ** 2
    inter = x.shape[1] // 2
    gate, up = x[:, :inter], x[:, inter:]
    limit = facts["swiglu_limit"]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if kind == "swigluoai":
        return gate * torch.sigmoid(facts["swiglu_alpha"] * gate) * (up + facts["swiglu_beta"])
    return torch.nn.functional.silu(gate) * up


def topk_sum_reference(fc2: torch.Tensor) -> torch.Tensor:
    return fc2.double().sum(dim=1).float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
