"""The modelopt main loop's data movement as docs/layouts.md ("NVFP4 read as stored") states it,
played out lane by lane in numpy: the shared-memory swizzles are bijections and bank-conflict free
for the loads the warps issue, and the relabelled k slots (ldmatrix bytes 4t .. 4t+3, activation
chunk 8t .. 8t+7, both paired (k, k + 4)) make the m16n8k16 fragments compute the plain product.  The swizzle formulas are
the kernel's (`_modelopt_b_swizzle`, `_a_swizzle`); the GPU tests run the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest

LANES = 32


def b_swizzle(n: int, chunks: int) -> int:
    return (n // (8 // chunks)) % chunks


def a_swizzle(row: int) -> int:
    return (row & 7) ^ ((row & 1) << 2)


@pytest.mark.parametrize("tile_n, tile_k", [(128, 64), (64, 128), (256, 64), (128, 128)])
def test_b_stage_swizzle_is_a_bijection_and_ldmatrix_is_conflict_free(tile_n, tile_k):
    chunks = tile_k // 32
    slots = {n * chunks + (c ^ b_swizzle(n, chunks)) for n in range(tile_n) for c in range(chunks)}
    assert slots == set(range(tile_n * chunks))
    for wn in range(tile_n // 64):
        for wr in range(chunks):
            for kk in range(2):
                for j in range(4):  # one 8x8 matrix = one shared-memory wavefront
                    rows = [64 * wn + 32 * kk + 8 * j + r for r in range(8)]
                    banks = {(n * chunks + (wr ^ b_swizzle(n, chunks))) % 8 for n in rows}
                    assert len(banks) == 8, (wn, wr, kk, j)


@pytest.mark.parametrize("stride", [8, 16])  # 16-byte chunks per activation row (tile_k 64 / 128)
def test_activation_chunk_loads_are_conflict_free(stride):
    for wr in range(stride // 4):
        for base_row in (0, 8, 16, 24):
            for q in range(4):  # a quarter-warp: lanes 8q .. 8q + 7 = (g, t), g in {2q, 2q + 1}
                slots = []
                for lane in range(8 * q, 8 * q + 8):
                    g, t = lane // 4, lane % 4
                    row = base_row + g
                    slots.append(row * stride + ((4 * wr + t) ^ a_swizzle(row)))
                assert len({s % 8 for s in slots}) == 8, (wr, base_row, q)
    assert all({c ^ a_swizzle(r) for c in range(stride)} == set(range(stride)) for r in range(8))  # a bijection


def _mma(a_frag, b_frag):
    """m16n8k16 with fragments given per lane: a (32, 4 pairs), b (32, 2 pairs) -> D (16, 8)."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for reg, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, k:k + 2] = a_frag[lane][reg]
        for reg, k in enumerate((2 * t, 2 * t + 8)):
            b[k:k + 2, g] = b_frag[lane][reg]
    return a @ b


def _pairs(chunk):
    """The 8 values k = 8t .. 8t+7 of one word / chunk as the decode pairs them: pair j = (k j, k j + 4)."""
    return [np.array([chunk[j], chunk[j + 4]]) for j in range(4)]


def test_relabelled_k_slots_compute_the_product():
    """One warp's 32-k slice, 16 tokens x 8 columns (one n8 block), both k-steps."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32))  # activations [token, k] of the slice
    w = rng.standard_normal((8, 32))  # weights [column, k] as stored (k-contiguous rows)
    d = np.zeros((16, 8))
    for ks in range(2):
        a_frag, b_frag = [], []
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            word = _pairs(w[g, 8 * t:8 * t + 8])  # ldmatrix: bytes 4t .. 4t + 3 of row g = k 8t .. 8t + 7
            b_frag.append((word[2 * ks], word[2 * ks + 1]))
            u, v = _pairs(x[g, 8 * t:8 * t + 8]), _pairs(x[g + 8, 8 * t:8 * t + 8])  # rows g, g + 8
            a_frag.append((u[2 * ks], v[2 * ks], u[2 * ks + 1], v[2 * ks + 1]))
        d += _mma(a_frag, b_frag)
    np.testing.assert_allclose(d, x @ w.T, rtol=1e-12, atol=1e-12)


def test_relabelled_k_slots_with_weights_as_the_a_operand():
    """The 8-row (m8) orientation: 16 columns (c0 block, c1 block) x 8 tokens."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 32))
    w = rng.standard_normal((16, 32))
    d = np.zeros((16, 8))
    for ks in range(2):
        a_frag, b_frag = [], []
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            c0, c1 = _pairs(w[g, 8 * t:8 * t + 8]), _pairs(w[g + 8, 8 * t:8 * t + 8])
            a_frag.append((c0[2 * ks], c1[2 * ks], c0[2 * ks + 1], c1[2 * ks + 1]))
            u = _pairs(x[g, 8 * t:8 * t + 8])
            b_frag.append((u[2 * ks], u[2 * ks + 1]))
        d += _mma(a_frag, b_frag)
    np.testing.assert_allclose(d, w @ x.T, rtol=1e-12, atol=1e-12)


def test_micro_kernel_slice_reads_compute_the_product():
    """The micro kernel's FC2 slice read as stored (codegen/kernels/w4a16/micro.py, `_stored_operands`): lane
    (g, t) loads bytes 8t .. 8t + 7 of its rows' 32-byte piece of the 64-k slice, two words (k = 16t + 8w ..
    16t + 8w + 7), one scale per lane and row (byte t: the 16-k group 16t .. 16t + 15); k-step (w, ks) takes word
    w's pairs 2ks and 2ks + 1, the activation (token column 0, lanes g = 0) paired alike."""
    rng = np.random.default_rng(2)
    x = np.zeros((8, 64))
    x[0] = rng.standard_normal(64)  # the route's activated slice; the MMA's other token columns are zeros
    w = rng.standard_normal((16, 64))  # two column blocks (rows c0 = g, c1 = g + 8) x the slice's k
    scale = rng.uniform(0.5, 2.0, (16, 4))  # a scale per row and 16-k group
    d = np.zeros((16, 8))
    for word in range(2):
        for ks in range(2):
            a_frag, b_frag = [], []
            for lane in range(LANES):
                g, t = lane // 4, lane % 4
                ks_of = slice(16 * t + 8 * word, 16 * t + 8 * word + 8)
                c0 = _pairs(w[g, ks_of] * scale[g, t])
                c1 = _pairs(w[g + 8, ks_of] * scale[g + 8, t])
                a_frag.append((c0[2 * ks], c1[2 * ks], c0[2 * ks + 1], c1[2 * ks + 1]))
                u = _pairs(x[g, ks_of])  # zeros but for g = 0
                b_frag.append((u[2 * ks], u[2 * ks + 1]))
            d += _mma(a_frag, b_frag)
    np.testing.assert_allclose(d, (w * np.repeat(scale, 16, axis=1)) @ x.T, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- the warpgroup-MMA loop
# (codegen/kernels/w4a16/wgmma.py, `_wg_plan_modelopt` / `_wg_words_modelopt`): a stage row holds a
# tile row's 32 stored bytes, chunk c at c ^ (row >> 2 & 1); lane (g, q) of a warp whose first column is
# n0 reads, per 16-k row kk and 16-row block j, 8 bytes of rows n0 + 16 j + g and + 8 at byte
# 8 (kk % 2) of chunk kk // 2, and decodes byte q of each word (`dequant_e2m1_byte_*`).


def wg_slot(row: int, chunk: int) -> int:
    """16-byte slot of (row, chunk) in a modelopt wgmma weight stage."""
    return 2 * row + (chunk ^ ((row >> 2) & 1))


@pytest.mark.parametrize("tile_n", [128])
def test_wgmma_stage_is_a_bijection_and_the_word_loads_are_conflict_free(tile_n):
    assert {wg_slot(r, c) for r in range(tile_n) for c in range(2)} == set(range(2 * tile_n))
    for n0 in range(0, tile_n, 16):
        for kk in range(4):
            for plus in (0, 8):  # rows g, then rows g + 8: one 8-byte load each
                words = set()
                for g in range(8):  # lanes with the same g read the same 8 bytes (broadcast)
                    byte = 16 * wg_slot(n0 + g + plus, kk // 2) + 8 * (kk % 2)
                    words |= {(byte // 4 + w) % 32 for w in range(2)}
                assert len(words) == 16, (n0, kk, plus)  # 8 distinct rows x 2 banks each


def test_wgmma_fragments_hold_the_stored_k_order():
    """Every lane's four pairs of every 16-k row are the m16n8k16 A fragment of the stored rows:
    (row g, k 2q, 2q+1), (row g + 8, same), (row g, k 2q + 8, +9), (row g + 8, same), k from 16 kk."""
    rng = np.random.default_rng(3)
    tile_n, k_tile = 128, 64
    codes = rng.integers(0, 16, (tile_n, k_tile))  # code of (row, k)
    stored = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)  # two codes a byte, even k low
    stage = np.zeros(tile_n * 32, dtype=np.uint8)
    for r in range(tile_n):
        for c in range(2):
            stage[16 * wg_slot(r, c): 16 * wg_slot(r, c) + 16] = stored[r, 16 * c: 16 * c + 16]

    def pair(row: int, kk: int, q: int, hi: int) -> tuple[int, int]:
        at = 16 * wg_slot(row, kk // 2) + 8 * (kk % 2) + 4 * hi  # the first or second word of the load
        byte = int(stage[at + q])
        return byte & 0xF, byte >> 4  # (low code, high code): dequant_e2m1_byte's pair

    for n0 in range(0, tile_n, 16):
        for kk in range(4):
            for g in range(8):
                for q in range(4):
                    k_lo, k_hi = 16 * kk + 2 * q, 16 * kk + 8 + 2 * q
                    for row in (n0 + g, n0 + g + 8):
                        assert pair(row, kk, q, 0) == (codes[row, k_lo], codes[row, k_lo + 1])
                        assert pair(row, kk, q, 1) == (codes[row, k_hi], codes[row, k_hi + 1])
