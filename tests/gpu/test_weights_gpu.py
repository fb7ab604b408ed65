"""Weight preparation on the GPU gives the CPU's packed tensors, bit for bit, in every format.

No bundle: this is the packing's torch code (table lookups a few experts at a time,
runtime/weights.py and runtime/nf3.py) run on CUDA tensors, which is what `load_moe_layer(...,
device="cuda")` does. The CPU results are the ones the CPU tests check against the device-decode
emulation; the shapes take several expert slices and zero-padded N and K.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import (
    pack_nvfp4, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4, prepare_w13_nf3, quantize_nf3, unpack_nf3,
    unpack_nvfp4,
)
from cuteaot.runtime import weights
from tests.reference.nvfp4 import random_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch):
    monkeypatch.setattr(weights, "_CHUNK_BYTES", 1 << 16)  # a few experts a slice at these sizes


def _same(cpu, gpu):
    for name in ("qweight", "scales", "global_scale"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    assert (cpu.bias is None) == (gpu.bias is None)
    if cpu.bias is not None:
        assert torch.equal(cpu.bias, gpu.bias.cpu())


def _cuda(tensors):
    return tuple(t.cuda() for t in tensors)


def _same_tensors(cpu: tuple, gpu: tuple):
    """Unpacked tensors equal bit for bit (float8 compared as bytes)."""
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(raw(a), raw(b).cpu())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("n, k", [(256, 512), (200, 320)])
def test_nvfp4_packs_the_same_on_the_gpu(dtype, n, k):
    q = random_nvfp4(6, n, k, torch.Generator().manual_seed(n + k))
    cpu, gpu = pack_nvfp4(*q, dtype), pack_nvfp4(*_cuda(q), dtype)
    _same(cpu, gpu)
    _same_tensors(unpack_nvfp4(cpu), unpack_nvfp4(gpu))


def test_w13_with_two_global_scales_and_bias_packs_the_same_on_the_gpu():
    g = torch.Generator().manual_seed(3)
    weight, scale, _ = random_nvfp4(5, 2 * 192, 256, g)
    scale_2 = torch.rand(5, 2, generator=g) + 0.5  # gate and up differ: block scales merged
    bias = torch.randn(5, 2 * 192, generator=g)
    args = (weight, scale, scale_2)
    _same(prepare_w13(*args, "bf16", order="up_gate", bias=bias),
          prepare_w13(*_cuda(args), "bf16", order="up_gate", bias=bias.cuda()))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mxfp4_packs_the_same_on_the_gpu(dtype):
    g = torch.Generator().manual_seed(5)
    e, i, h = 4, 96, 320  # H = 320: K zero-padded to 384
    blocks13 = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, generator=g)
    scales13 = torch.randint(118, 134, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g)
    blocks2 = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, generator=g)
    scales2 = torch.randint(118, 134, (e, h, i // 32), dtype=torch.uint8, generator=g)
    _same(prepare_w13_mxfp4(blocks13, scales13, dtype), prepare_w13_mxfp4(blocks13.cuda(), scales13.cuda(), dtype))
    _same(prepare_w2_mxfp4(blocks2, scales2, dtype), prepare_w2_mxfp4(blocks2.cuda(), scales2.cuda(), dtype))


def test_nf3_packs_the_same_on_the_gpu():
    w = torch.randn(3, 2 * 128, 256, generator=torch.Generator().manual_seed(9)) * 0.02
    q = quantize_nf3(w)
    cpu, gpu = prepare_w13_nf3(*q), prepare_w13_nf3(*_cuda(q))
    _same(cpu, gpu)
    _same_tensors(unpack_nf3(cpu), unpack_nf3(gpu))
