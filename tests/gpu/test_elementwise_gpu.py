"""GPU tests of the activation and top-k sum kernels in the tiny bundle (run on the H200)."""

from __future__ import annotations

import shutil

import pytest
import torch

from cuteaot.runtime import (
    BadInputError,
    IntegrityError,
    UnknownSpecializationError,
    load_bundle,
    moe_activation,
    moe_topk_sum,
)
from tests.reference.moe_elementwise import activation_reference, relative_error, topk_sum_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

ROWS = [1, 7, 128, 4097]
TOL = {"bf16": 1e-2, "fp16": 2e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def bundle(tiny_bundle_dir):
    return load_bundle(tiny_bundle_dir)


def _facts(bundle, family):
    seen = []
    for k in bundle.manifest["kernels"]:
        if k["family"] == family and k["arch"] == bundle.arch and k["facts"] not in seen:
            seen.append(k["facts"])
    assert seen, f"tiny bundle has no {family} kernels for {bundle.arch}"
    return seen


def _act_kwargs(f):
    return dict(
        activation=f["activation"], fast_math=f["fast_math"],
        swiglu_alpha=f["swiglu_alpha"], swiglu_beta=f["swiglu_beta"], swiglu_limit=f["swiglu_limit"],
    )


def _fc1(rows, f, gen):
    width = f["intermediate_size"] * (1 if f["activation"] == "relu2" else 2)
    # scale 4 so clamps (limit 1.5 / 7) and both sigmoid tails are exercised
    return (torch.randn(rows, width, generator=gen, device="cuda") * 4).to(DTYPES[f["dtype"]])


def test_activation_matches_float32_reference(bundle):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    report = []
    for f in _facts(bundle, "moe_activation"):
        for rows in ROWS:
            x = _fc1(rows, f, gen)
            out = torch.full((rows, f["intermediate_size"]), float("nan"), dtype=x.dtype, device="cuda")
            moe_activation(bundle, x, out, **_act_kwargs(f))
            torch.cuda.synchronize()
            assert not out.isnan().any(), f"unwritten outputs for {f} rows={rows}"
            err = relative_error(out, activation_reference(x, f))
            report.append((f["activation"], f["dtype"], f["fast_math"], f["swiglu_limit"], rows, err))
            assert err <= TOL[f["dtype"]], f"{f} rows={rows}: rel err {err:.2e}"
    worst = max(report, key=lambda r: r[-1])
    print(f"\nactivation: {len(report)} cases, worst rel err {worst[-1]:.2e} at {worst[:-1]}")


def test_topk_sum_matches_float32_reference(bundle):
    gen = torch.Generator(device="cuda").manual_seed(99)
    worst = 0.0
    for f in _facts(bundle, "moe_topk_sum"):
        for rows in ROWS:
            fc2 = torch.randn(rows, f["top_k"], f["hidden_size"], generator=gen, device="cuda").to(DTYPES[f["dtype"]])
            out = torch.full((rows, f["hidden_size"]), float("nan"), dtype=fc2.dtype, device="cuda")
            moe_topk_sum(bundle, fc2, out)
            torch.cuda.synchronize()
            assert not out.isnan().any()
            err = relative_error(out, topk_sum_reference(fc2))
            worst = max(worst, err)
            assert err <= TOL[f["dtype"]], f"{f} rows={rows}: rel err {err:.2e}"
    print(f"\ntopk_sum: worst rel err {worst:.2e}")


def test_cuda_graph_replay_equals_eager(bundle):
    f = next(f for f in _facts(bundle, "moe_activation") if f["activation"] == "silu" and f["dtype"] == "bf16")
    s = next(s for s in _facts(bundle, "moe_topk_sum") if s["dtype"] == "bf16")
    rows = 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = _fc1(rows, f, gen)
    fc2 = torch.randn(rows, s["top_k"], s["hidden_size"], generator=gen, device="cuda").to(torch.bfloat16)
    act_out = torch.empty(rows, f["intermediate_size"], dtype=x.dtype, device="cuda")
    sum_out = torch.empty(rows, s["hidden_size"], dtype=x.dtype, device="cuda")
    moe_activation(bundle, x, act_out, **_act_kwargs(f))  # warm-up resolves plans outside capture
    moe_topk_sum(bundle, fc2, sum_out)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        moe_activation(bundle, x, act_out, **_act_kwargs(f))
        moe_topk_sum(bundle, fc2, sum_out)
    for trial in range(3):
        x.copy_(_fc1(rows, f, gen))
        fc2.copy_(torch.randn(fc2.shape, generator=gen, device="cuda"))
        act_out.fill_(float("nan"))
        sum_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_act = moe_activation(bundle, x, **_act_kwargs(f))
        eager_sum = moe_topk_sum(bundle, fc2)
        torch.cuda.synchronize()
        assert torch.equal(act_out, eager_act), f"trial {trial}: graph activation differs from eager"
        assert torch.equal(sum_out, eager_sum), f"trial {trial}: graph top-k sum differs from eager"


def test_two_streams_concurrently(bundle):
    f = next(f for f in _facts(bundle, "moe_activation") if f["activation"] == "swigluoai" and f["dtype"] == "fp16")
    gen = torch.Generator(device="cuda").manual_seed(5)
    xs = [_fc1(4097, f, gen) for _ in range(2)]
    outs = [torch.full((4097, f["intermediate_size"]), float("nan"), dtype=xs[0].dtype, device="cuda") for _ in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for _ in range(20):
        for x, out, st in zip(xs, outs, streams):
            with torch.cuda.stream(st):
                moe_activation(bundle, x, out, **_act_kwargs(f))
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        assert relative_error(out, activation_reference(x, f)) <= TOL["fp16"]


def test_launch_from_another_thread(bundle):
    """Each thread gets its own argument buffer (the driver call releases the GIL)."""
    import threading

    f = next(f for f in _facts(bundle, "moe_activation") if f["activation"] == "relu2" and f["dtype"] == "bf16")
    gen = torch.Generator(device="cuda").manual_seed(11)
    xs = [_fc1(128, f, gen) for _ in range(4)]
    outs = [torch.full((128, f["intermediate_size"]), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in xs]

    def work(i):
        for _ in range(50):
            moe_activation(bundle, xs[i], outs[i], **_act_kwargs(f))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        assert relative_error(out, activation_reference(x, f)) <= TOL["bf16"]


def test_bad_inputs_raise_before_launch(bundle):
    f = next(f for f in _facts(bundle, "moe_activation") if f["activation"] == "silu" and f["dtype"] == "bf16"
             and f["swiglu_limit"] is None and f["fast_math"])
    inter = f["intermediate_size"]
    good = torch.randn(8, 2 * inter, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="device"):
        moe_activation(bundle, good.cpu(), torch.empty(8, inter, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(BadInputError, match="dtype"):
        moe_activation(bundle, good, torch.empty(8, inter, dtype=torch.float16, device="cuda"))
    with pytest.raises(BadInputError, match="shape"):
        moe_activation(bundle, good, torch.empty(9, inter, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(BadInputError, match="contiguous"):
        moe_activation(bundle, torch.randn(2 * inter, 8, device="cuda", dtype=torch.bfloat16).t(),
                       torch.empty(8, inter, dtype=torch.bfloat16, device="cuda"))
    flat = torch.randn(8 * 2 * inter + 1, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="aligned"):
        moe_activation(bundle, flat[1:].view(8, 2 * inter))
    with pytest.raises(UnknownSpecializationError, match="Nearest built"):
        moe_activation(bundle, torch.randn(8, 2 * 64, device="cuda", dtype=torch.bfloat16))


def test_tampered_cubin_fails_load(tiny_bundle_dir, tmp_path):
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_bundle_dir, copy)
    victim = sorted((copy / "sm_90a").glob("*.cubin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=victim.name):
        load_bundle(copy)
