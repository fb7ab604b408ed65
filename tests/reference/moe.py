"""Float32 reference of a whole MoE layer, from dequantised weights; independent of cuteaot.runtime.

    out[t] = sum over k of  w[t,k] * FC2_e(act(FC1_e(x[t])))     e = ids[t,k],  FC_e(x) = x W_e^T (+ b_e)

(router weight on the FC1 output rows instead when `on_input`), with the activation in float32:
    silu       silu(min(g, L)) * clamp(u, -L, L)         (L only when given)
    swigluoai  g = min(g, L), u = clamp(u, -L, L);  g * sigmoid(alpha * g) * (u + beta)
    relu2      max(h, 0) ** 2
Routes whose expert is not in `local` (a set of global ids; None = all) contribute nothing.
"""

from __future__ import annotations

import torch


def activation_reference(h: torch.Tensor, activation: str, inter: int, alpha=None, beta=None, limit=None):
    if activation == "relu2":
        return torch.relu(h) ** 2
    g, u = h[:, :inter], h[:, inter:]
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    return g * torch.sigmoid(alpha * g) * (u + beta)


def skewed_topk_ids(m: int, experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """(m, top_k) int32 expert ids on the generator's device where 80 % of the tokens put experts 0 and 1
    first: a few experts with many route blocks, the others with part-filled ones."""
    logits = torch.rand(m, experts, generator=g, device=g.device)
    logits[:, :2] += 2.0 * (torch.rand(m, 1, generator=g, device=g.device) < 0.8)
    return logits.topk(top_k, dim=1).indices.to(torch.int32)


def moe_reference(x, w13, w2, topk_weights, topk_ids, activation: str, *, alpha=None, beta=None, limit=None,
                  on_input=False, local=None, expert_index=None, b13=None, b2=None):
    """x (M, H); w13 (E_w, N1, H), w2 (E_w, H, I) float32; ids (M, top_k) global expert ids.

    expert_index maps a global id to its row of w13/w2 (default: identity).
    b13 (E_w, N1), b2 (E_w, H): optional per-expert biases, FC(x) = x W^T + b.
    Returns (out (M, H), activation rows (M*top_k, I) (zero where not local), the local-route mask).
    """
    m, top_k = topk_ids.shape
    inter = w2.shape[2]
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.reshape(-1).long()
    keep = torch.ones_like(ids, dtype=torch.bool)
    if local is not None:
        keep = torch.tensor([int(e) in local for e in ids.tolist()], device=x.device)
    rows = ids if expert_index is None else expert_index[ids.clamp(min=0)].long()
    tokens = torch.arange(m * top_k, device=x.device) // top_k
    w = topk_weights.reshape(-1).float()
    act = torch.zeros(m * top_k, inter, device=x.device)
    for e in rows[keep].unique().tolist():  # one matmul per expert: no per-route weight copies
        r = (keep & (rows == e)).nonzero().view(-1)
        h = x.float()[tokens[r]] @ w13[e].T
        if b13 is not None:
            h = h + b13[e].float()
        if on_input:
            h = h * w[r, None]
        a = activation_reference(h, activation, inter, alpha, beta, limit)
        y = a @ w2[e].T
        if b2 is not None:
            y = y + b2[e].float()
        if not on_input:
            y = y * w[r, None]
        out.index_add_(0, tokens[r], y)
        act[r] = a
    return out, act, keep
