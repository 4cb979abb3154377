"""Numerics of the split-KV decode attention kernels (run under the Triton interpreter on CPU).

The reference is float64 torch over the textbook formula on the kernels' (already rounded) inputs:
scores q k^T * scale with k/v repeated per query head, the ALiBi bias, the visibility mask built
from kv_lengths and the query positions (pos_i = n_b - Lq + i, keys 0 <= j <= pos_i), softmax, and
a matmul with v; rows that see no key are 0. The kernels get a cache whose padding (keys past each
row's length) is NaN, so reading it anywhere would show; the reference gets zeros there. With
key_padding ([B, L] bool, True = may be attended) the visibility mask is also ANDed with it.
"""
import math

import pytest
import torch

import fusionpass.fusions.decode_attention.kernels as DA
from fusionpass.fusions.decode_attention.kernels import decode_attention, default_num_splits

# The interpreter turns program ids into Python ints for range() through a deprecated numpy path.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Tolerance relative to the largest reference value. The kernel rounds the probabilities to the
# input dtype before the P V matmul, as FA2 does: a few ulps of the output dtype.
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.2e-2}


def alibi_slopes(h):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=F32)


def rnd(shape, dtype):
    return torch.randn(shape, dtype=torch.float64).to(dtype)


def cache(B, Hkv, L, D, dtype, lens, token_major=False):
    """k or v [B, Hkv, L, D] (token_major: a transpose of a [B, L, Hkv, D] tensor) with NaN past
    each row's length, and its zero-padded copy for the reference."""
    if token_major:
        t = rnd((B, L, Hkv, D), dtype).transpose(1, 2)
    else:
        t = rnd((B, Hkv, L, D), dtype)
    pad = torch.arange(L)[None, :] >= lens.long()[:, None]       # [B, L]
    t[pad[:, None, :, None].expand_as(t)] = float("nan")
    return t, t.masked_fill(pad[:, None, :, None], 0.0)


def reference(q, k, v, lens, scale=None, slopes=None, key_padding=None):
    B, Hq, Lq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    n = lens.long().clamp(0, L)
    pos = n[:, None] - Lq + torch.arange(Lq)[None, :]                   # [B, Lq]
    j = torch.arange(L)
    vis = ((j[None, None, :] <= pos[:, :, None]) & (j[None, None, :] < n[:, None, None]))[:, None]
    if key_padding is not None:
        vis = vis & key_padding[:, None, None, :]
    if slopes is not None:
        s = s - slopes.double()[None, :, None, None] * (pos[:, None, :, None] - j).double()
    vis = vis.expand(B, Hq, Lq, L)
    empty = ~vis.any(-1)
    s = s.masked_fill(~vis, -math.inf).masked_fill(empty[..., None], 0.0)
    p = torch.softmax(s, -1).masked_fill(~vis, 0.0)
    return p @ vv, empty


def check(q, k, v, lens, k_ref, v_ref, tol=None, **opts):
    out = decode_attention(q, k, v, lens, **opts)
    ref, empty = reference(q, k_ref, v_ref, lens, opts.get("scale"), opts.get("alibi_slopes"),
                           opts.get("key_padding"))
    dt = q.dtype
    assert out.dtype == dt and out.shape == (*q.shape[:3], v.shape[3]) and out.is_contiguous()
    assert torch.isfinite(out).all(), "not finite"
    if empty.any():
        assert not out[empty].any(), "rows that see no key must be 0"
    tol = TOL[dt] if tol is None else tol
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale)
    return out, ref, empty


def make(B, Hq, Hkv, Lq, L, D, dt, lens, token_major=False, lens_dtype=torch.int32):
    """D: the head dim, or (q/k head dim, v head dim) as MLA has them."""
    D, Dv = D if isinstance(D, tuple) else (D, D)
    lens = torch.tensor(lens, dtype=lens_dtype)
    q = rnd((B, Lq, Hq, D), dt).transpose(1, 2) if token_major else rnd((B, Hq, Lq, D), dt)
    k, k_ref = cache(B, Hkv, L, D, dt, lens, token_major)
    v, v_ref = cache(B, Hkv, L, Dv, dt, lens, token_major)
    return q, k, v, lens, k_ref, v_ref


# --------------------------------------------------------------------------------------------------
# Numerics against the reference
# --------------------------------------------------------------------------------------------------
# (B, Hq, Hkv, Lq, L, D, dtype, kv_lengths, options). Odd cache lengths against BLOCK_N 16; lengths
# 1, L and a middle value per case; GQA 1, 4, 8; with Lq = 4 a length-1 row has 3 rows that see
# nothing (pos < 0).
CASES = {
    "f32-mha-q1-L37": (3, 2, 2, 1, 37, 64, F32, [1, 37, 20], {}),
    "f16-gqa4-q4-L100": (3, 8, 2, 4, 100, 64, F16, [100, 1, 50], {}),
    "bf16-gqa8-q1-d128-L100": (3, 8, 1, 1, 100, 128, BF16, [57, 100, 1], {}),
    "bf16-gqa4-q4-d128-L37": (3, 4, 1, 4, 37, 128, BF16, [37, 3, 1], {}),
    "f32-gqa8-q4-L37": (2, 16, 2, 4, 37, 64, F32, [37, 16], {}),
    "f16-mha-q4-d128-L100": (3, 2, 2, 4, 100, 128, F16, [1, 100, 33], {}),
    "f16-gqa4-q1-d256-L37": (2, 4, 1, 1, 37, 256, F16, [37, 9], {}),
    "f32-gqa4-q16-L37": (2, 4, 1, 16, 37, 64, F32, [37, 10], {}),
    # 16 heads x 16 rows = 256 rows: two row blocks of 128
    "f32-gqa16-q16-rowblocks": (1, 16, 1, 16, 37, 64, F32, [30], {}),
    "f32-gqa4-q4-scale": (2, 8, 2, 4, 37, 64, F32, [37, 20], {"scale": 0.3}),
    "f32-gqa4-q4-alibi": (3, 8, 2, 4, 100, 64, F32, [100, 2, 47], {"alibi": True}),
    "bf16-gqa8-q1-d128-alibi": (2, 8, 1, 1, 37, 128, BF16, [37, 18], {"alibi": True}),
    # head dims that are not powers of two (padded to 128 in registers), and MLA's q/k 192 with v 128
    "bf16-gqa4-q1-d80-L37": (2, 4, 1, 1, 37, 80, BF16, [37, 9], {}),
    "f32-gqa2-q4-d96-L37": (2, 4, 2, 4, 37, 96, F32, [37, 2], {}),
    "bf16-mla-q1-d192v128-L37": (2, 2, 2, 1, 37, (192, 128), BF16, [37, 20], {}),
    "f32-mla-q4-d192v128-L37": (1, 2, 2, 4, 37, (192, 128), F32, [30], {}),
}


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention(case, num_splits):
    B, Hq, Hkv, Lq, L, D, dt, lens, opts = CASES[case]
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = alibi_slopes(Hq)
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, dt, lens)
    check(q, k, v, lens, k_ref, v_ref, block_n=16, num_splits=num_splits, **opts)


@pytest.mark.parametrize("dt", [F16, BF16])
def test_token_major_cache(dt):
    # q, k, v as transposes of [B, L, H, D] tensors (HF's / a static cache's layout): no copies
    B, Hq, Hkv, Lq, L, D = 3, 8, 2, 4, 37, 64
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, dt, [37, 1, 22], token_major=True)
    assert not k.is_contiguous() and k.transpose(1, 2).is_contiguous()
    check(q, k, v, lens, k_ref, v_ref, block_n=16, num_splits=2, alibi_slopes=alibi_slopes(Hq))


def test_split_counts_agree():
    # 1 split, 3 splits, and more splits than key blocks (37 keys = 3 blocks of 16; splits 3..7
    # own no key) give the same result; so does a larger BLOCK_N
    B, Hq, Hkv, Lq, L, D = 3, 8, 2, 4, 37, 64
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, F32, [37, 5, 19])
    base, *_ = check(q, k, v, lens, k_ref, v_ref, block_n=16, num_splits=1)
    for opts in ({"num_splits": 3}, {"num_splits": 8}, {"num_splits": 40}, {"num_splits": 2, "block_n": 32}):
        out, *_ = check(q, k, v, lens, k_ref, v_ref, **{"block_n": 16, **opts})
        torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-6, msg=lambda m, o=opts: f"{o}: {m}")


def test_zero_length_rows():
    # kv_lengths 0 (and a length past L, clamped to L): zeros for the empty row, never NaN
    B, Hq, Hkv, Lq, L, D = 3, 4, 1, 2, 37, 64
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, BF16, [0, 37, 12], lens_dtype=torch.int64)
    out, _, empty = check(q, k, v, lens, k_ref, v_ref, block_n=16, num_splits=3)
    assert empty[0].all() and not out[0].any()
    longer = decode_attention(q, k, v, torch.tensor([0, 1000, 12]), block_n=16, num_splits=3)
    assert torch.equal(longer, out)
    all_empty = decode_attention(q, k, v, torch.zeros(B, dtype=torch.int32), block_n=16)
    assert not all_empty.any()


def test_default_launch_config():
    # the GPU defaults (BLOCK_N 64 at D=64 and 128, 32 at 256) and the default split count
    B, Hq, Hkv, Lq, L, D = 2, 4, 1, 1, 100, 128
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, BF16, [100, 65])
    check(q, k, v, lens, k_ref, v_ref)


# --------------------------------------------------------------------------------------------------
# key_padding
# --------------------------------------------------------------------------------------------------
def padding(L, lens, rows, transposed=False):
    """[B, L] bool key_padding from one pattern per row: ("left", n) n leading keys False (a
    left-padded prompt), ("holes", p) each key False with probability p, ("none",), or
    ("last", m) only the last m valid keys True (with Lq > m, the first query rows see nothing).
    Keys past each row's length stay True: the kernel must still skip them (they are NaN).
    transposed: the same values as a transpose of an [L, B] tensor (strides (1, B))."""
    kp = torch.ones(len(rows), L, dtype=torch.bool)
    for b, (row, n) in enumerate(zip(rows, lens.tolist())):
        if row[0] == "left":
            kp[b, :row[1]] = False
        elif row[0] == "holes":
            kp[b] = torch.rand(L) >= row[1]
        elif row[0] == "last":
            kp[b, :max(n - row[1], 0)] = False
    if transposed:
        kp = kp.t().contiguous().t()
    return kp


# (B, Hq, Hkv, Lq, L, D, dtype, kv_lengths, row patterns, options); block_n 16. With num_splits 3
# the 100-key chunks are 48 keys: a 50-key left padding fills split 0 (a full, unmasked range) and a
# block of split 1, so a split with nothing visible must store the empty marker, not NaN.
KPM_CASES = {
    # q_len 1: left padding, none, holes; row 3 sees only padded keys (output exactly 0)
    "f16-gqa4-q1": (4, 8, 2, 1, 100, 64, F16, [100, 70, 100, 40],
                    [("left", 50), ("none",), ("holes", 0.4), ("left", 40)], {}),
    # q_len 4, cache as [B, L, Hkv, D]: row 1's visible keys (<= its last 3) partly padded, row 2
    # sees only its last key: query rows 0-2 see nothing
    "bf16-gqa4-q4-token-major": (3, 4, 1, 4, 100, 128, BF16, [100, 23, 61],
                                 [("left", 7), ("left", 21), ("last", 1)], {"token_major": True}),
    # q_len 4, ALiBi, a transposed (non-contiguous) key_padding
    "f32-gqa4-q4-alibi": (3, 8, 2, 4, 37, 64, F32, [37, 30, 37],
                          [("holes", 0.5), ("none",), ("left", 20)],
                          {"alibi": True, "kpm_transposed": True}),
}


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("case", list(KPM_CASES))
def test_key_padding(case, num_splits):
    B, Hq, Hkv, Lq, L, D, dt, lens, rows, opts = KPM_CASES[case]
    opts = dict(opts)
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, dt, lens, token_major=opts.pop("token_major", False))
    kp = padding(L, lens, rows, transposed=opts.pop("kpm_transposed", False))
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = alibi_slopes(Hq)
    out, ref, empty = check(q, k, v, lens, k_ref, v_ref, block_n=16, num_splits=num_splits, key_padding=kp,
                            **opts)
    # the padding changes the result (a kernel ignoring it would fail), and the padded-away rows are 0
    plain, _ = reference(q, k_ref, v_ref, lens, None, opts.get("alibi_slopes"))
    assert not torch.allclose(ref, plain, atol=0.1)
    assert empty.any() == (case != "f32-gqa4-q4-alibi")
    if case == "f16-gqa4-q1":
        assert empty[3].all() and not out[3].any()
    if case == "bf16-gqa4-q4-token-major":
        assert empty[2, :, :3].all() and not empty[2, :, 3].any()


def test_key_padding_all_true_and_launch():
    # all-True padding gives the plain result; the launch (grid, every non-tensor argument) is the
    # same for any padding values: only HAS_KPM (whether a key_padding is given) changes it
    B, Hq, Hkv, Lq, L, D = 2, 4, 1, 2, 37, 64
    q, k, v, lens, k_ref, v_ref = make(B, Hq, Hkv, Lq, L, D, F32, [37, 12])
    plain = decode_attention(q, k, v, lens, block_n=16, num_splits=2)
    ones = decode_attention(q, k, v, lens, block_n=16, num_splits=2, key_padding=torch.ones(B, L, dtype=torch.bool))
    torch.testing.assert_close(ones, plain, rtol=0, atol=0)
    launches = []
    real = DA.launcher

    def record(kernel, t):
        launch = real(kernel, t)

        class Grid:
            def __getitem__(self, grid):
                def run(*args, **kw):
                    launches.append((grid, [a for a in args if not isinstance(a, torch.Tensor)], kw))
                    return launch[grid](*args, **kw)
                return run
        return Grid()

    DA.launcher, saved = record, DA.launcher
    try:
        for kp in (torch.ones(B, L, dtype=torch.bool), padding(L, lens, [("left", 30), ("holes", 0.5)])):
            decode_attention(q, k, v, lens, block_n=16, num_splits=2, key_padding=kp)
    finally:
        DA.launcher = saved
    assert launches[0::2] == [launches[0]] * 2 and launches[1::2] == [launches[1]] * 2
    assert launches[0][2]["HAS_KPM"] is True


# --------------------------------------------------------------------------------------------------
# The split rule
# --------------------------------------------------------------------------------------------------
def test_default_num_splits_rule():
    # ~2 programs per SM, chunks a multiple of BLOCK_N and >= 4 blocks long, no empty split at L
    assert default_num_splits(1, 8, 32768, 64, 132) == 32              # 256 programs
    assert default_num_splits(32, 8, 4096, 64, 132) == 2               # 512 programs
    assert default_num_splits(8, 8, 8192, 64, 132) == 5
    assert default_num_splits(1, 8, 600, 64, 132) == 2                 # capped by chunks >= 256 keys
    assert default_num_splits(1, 8, 300, 64, 132) == 1
    assert default_num_splits(64, 8, 4096, 64, 132) == 1
    assert default_num_splits(1, 1, 10, 64, 132) == 1
    for B, Hkv, L, bn, sms in ((1, 8, 32768, 64, 132), (3, 2, 1000, 16, 78), (2, 4, 131072, 32, 132)):
        n = default_num_splits(B, Hkv, L, bn, sms)
        chunk = -(-L // n)
        chunk = -(-chunk // bn) * bn
        assert -(-L // chunk) == n, "no split is empty at full length"
        assert n == 1 or chunk >= 4 * bn
        assert B * Hkv * n <= 2 * sms + B * Hkv


def test_launch_depends_on_shapes_only(monkeypatch):
    # grids and every launch argument but the tensors are the same for any kv_lengths (CUDA graphs)
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((self.kernel.fn.__name__, grid,
                                 [a for a in args if not isinstance(a, torch.Tensor)], kw))
                return self.kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(DA, "launcher", lambda kernel, t: Recorder(kernel))
    B, Hq, Hkv, Lq, L, D = 2, 4, 1, 1, 300, 64
    q, k, v = rnd((B, Hq, Lq, D), F32), rnd((B, Hkv, L, D), F32), rnd((B, Hkv, L, D), F32)
    for lens in ([300, 300], [1, 0], [37, 200]):
        decode_attention(q, k, v, torch.tensor(lens), block_n=16)
    assert len(launches) == 6
    assert launches[0::2] == [launches[0]] * 3 and launches[1::2] == [launches[1]] * 3
    name, grid, _, _ = launches[0]
    assert name == "_split_kernel" and grid == (default_num_splits(B, Hkv, L, 16, DA._CPU_SMS), B * Hkv)
    assert grid[0] == 4


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------
def _bad(match, q=None, k=None, v=None, lens=None, **opts):
    q = torch.randn(1, 4, 2, 64) if q is None else q
    k = torch.randn(1, 2, 5, 64) if k is None else k
    v = k.clone() if v is None else v
    lens = torch.tensor([5], dtype=torch.int32) if lens is None else lens
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, v, lens, **opts)


def test_bad_arguments():
    _bad("4-D", torch.randn(4, 2, 64))
    _bad("4-D", k=torch.randn(2, 5, 64), v=torch.randn(2, 5, 64))
    _bad("head dim", torch.randn(1, 4, 2, 32), torch.randn(1, 2, 5, 32))
    _bad("head dim", torch.randn(1, 4, 2, 48), torch.randn(1, 2, 5, 48))
    _bad("value head dim 32", v=torch.randn(1, 2, 5, 32))
    _bad("multiple", torch.randn(1, 3, 2, 64))
    _bad("query length", torch.randn(1, 4, 17, 64))
    _bad("query length", torch.randn(1, 4, 0, 64))
    _bad("one dtype", torch.randn(1, 4, 2, 64).half())
    _bad("dtype", torch.randn(1, 4, 2, 64).double(), torch.randn(1, 2, 5, 64).double())
    _bad("same shape", v=torch.randn(1, 2, 6, 64))
    _bad("batch or head dim", k=torch.randn(2, 2, 5, 64))
    _bad("kv_lengths", lens=torch.tensor([5, 5], dtype=torch.int32))
    _bad("kv_lengths", lens=torch.tensor([5.0]))
    _bad("kv_lengths", lens=[5])
    _bad("alibi_slopes", alibi_slopes=torch.ones(2))
    _bad("alibi_slopes", alibi_slopes=torch.ones(4, dtype=torch.int32))
    _bad("num_splits", num_splits=0)
    _bad("power of two", block_n=24)
    _bad("power of two", block_n=8)
    _bad("num_warps", num_warps=0)


def test_bad_key_padding():
    ok = torch.ones(1, 5, dtype=torch.bool)
    _bad("key_padding.*shape", key_padding=torch.ones(1, 4, dtype=torch.bool))
    _bad("key_padding.*shape", key_padding=torch.ones(5, dtype=torch.bool))
    _bad("key_padding.*shape", key_padding=torch.ones(1, 1, 5, dtype=torch.bool))
    _bad("key_padding.*shape", key_padding=[[True] * 5])
    _bad("key_padding.*torch.bool", key_padding=ok.to(torch.uint8))
    _bad("key_padding.*torch.bool", key_padding=ok.to(torch.int64))
    _bad("key_padding.*device", key_padding=ok.to("meta"))


def test_empty_cache():
    q = torch.randn(2, 4, 1, 64)
    out = decode_attention(q, torch.randn(2, 2, 0, 64), torch.randn(2, 2, 0, 64), torch.tensor([0, 0]))
    assert out.shape == q.shape and not out.any()
