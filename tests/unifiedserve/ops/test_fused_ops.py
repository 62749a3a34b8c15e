"""Fused layer ops (csrc/fused_ops.cpp, fused_ops_cuda.cu) against the model's unfused torch code."""

from __future__ import annotations


import pytest
import torch

from unifiedserve import ops
from unifiedserve.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def native(native):
    """The native ops (conftest), with the fused ones switched on."""
    if not ops.fused_enabled():
        pytest.skip("UNIFIEDSERVE_NO_FUSED_OPS is set")
    return native


def randn(shape, dtype, seed, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def assert_matches(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Exact, or within the last bits the reduction order / exp implementation may change."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got, want)
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # at most one unit in the last place, on a small share of the elements
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert got.numel() == 0 or (got != want).float().mean().item() <= 0.02


# hidden sizes: odd, under one 8-lane step, the demo's, the 7B's; rows: none, one (decode), several
NORM_SHAPES = [(0, 64), (1, 5), (3, 256), (5, 300), (2, 3584)]


def check_rms_norm(device: str, dtype, rows: int, hidden: int, strided: bool) -> None:
    base = randn((rows, hidden + (7 if strided else 0)), dtype, seed=rows * 31 + hidden, device=device, scale=3.0)
    x = base[:, :hidden]  # rows not contiguous with each other when strided
    w = randn((hidden,), dtype, seed=1, device=device) * 0.2 + 1
    assert_matches(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), exact=False)


def check_fused_add(device: str, dtype, rows: int, hidden: int, offset: int = 0) -> None:
    """``offset`` > 0: x's rows start that many elements into a wider buffer (strided, off 16-byte alignment)."""
    base = randn((rows, hidden + offset), dtype, seed=2, device=device)
    x = base[:, offset:]
    r = randn((rows, hidden), dtype, seed=3, device=device, scale=4.0)
    w = randn((hidden,), dtype, seed=4, device=device) * 0.2 + 1
    want_norm, want_h = reference.fused_add_rms_norm(x, r, w, 1e-5)
    xi, ri = base.clone()[:, offset:], r.clone()  # x's layout: a clone of the view itself would be contiguous
    got_norm, got_h = ops.fused_add_rms_norm(xi, ri, w, 1e-5)
    assert torch.equal(got_h, want_h)  # the add rounds once, as torch's does
    assert_matches(got_norm, want_norm, exact=False)
    # written in place: the caller's buffers hold the results
    assert got_norm.data_ptr() == xi.data_ptr() and got_h.data_ptr() == ri.data_ptr()


def check_silu(device: str, dtype, rows: int, inter: int, offset: int = 0) -> None:
    """``offset`` > 0: gate_up starts that many elements into its memory (a pointer off 16-byte alignment)."""
    gate_up = randn((rows, 2 * inter + offset), dtype, seed=5, device=device, scale=4.0)[:, offset:]
    assert_matches(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), exact=dtype != torch.float32)


def check_rotary(device: str, dtype, table_dtype, rows: int, q_heads: int, k_heads: int, dim: int) -> None:
    qkv = randn((rows, (q_heads + 2 * k_heads) * dim), dtype, seed=6, device=device, scale=2.0)
    q = qkv[:, :q_heads * dim].view(rows, q_heads, dim)  # views of one projection, as the model has them
    k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(rows, k_heads, dim)
    v_before = qkv[:, (q_heads + k_heads) * dim:].clone()
    angles = randn((rows, dim // 2), torch.float32, seed=7, device=device, scale=50.0)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    want_q, want_k = reference.rotary(q, k, cos, sin)
    got_q, got_k = ops.rotary(q, k, cos, sin)
    # every product and sum rounds where the reference rounds: bit-identical in every dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the projection's memory
    assert torch.equal(qkv[:, (q_heads + k_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm_matches_reference(native, dtype, rows, hidden):
    check_rms_norm("cpu", dtype, rows, hidden, strided=False)
    check_rms_norm("cpu", dtype, rows, hidden, strided=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm_matches_reference(native, dtype, rows, hidden):
    check_fused_add("cpu", dtype, rows, hidden)
    check_fused_add("cpu", dtype, rows, hidden, offset=3)  # x strided, written in place where it is


def test_silu_and_mul_on_the_cpu_is_torchs(native, monkeypatch):
    """No CPU kernel (torch's vectorised silu and mul are faster there): the wrapper runs the reference."""
    gate_up = randn((3, 74), torch.float32, seed=5)
    calls = []
    monkeypatch.setattr(reference, "silu_and_mul", lambda t: calls.append(t) or t[..., :37])
    ops.silu_and_mul(gate_up)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", ["model", "float32"])
@pytest.mark.parametrize("rows,q_heads,k_heads,dim", [(0, 2, 1, 8), (1, 4, 2, 64), (5, 28, 4, 128), (3, 16, 16, 80)])
def test_rotary_matches_reference(native, dtype, table, rows, q_heads, k_heads, dim):
    check_rotary("cpu", dtype, dtype if table == "model" else torch.float32, rows, q_heads, k_heads, dim)


def check_rotary_cache(device: str, dtype, table_dtype, rows: int, q_heads: int, k_heads: int, dim: int,
                       padded: bool) -> None:
    qkv = randn((rows, (q_heads + 2 * k_heads) * dim), dtype, seed=16, device=device, scale=2.0)
    q = qkv[:, :q_heads * dim].view(rows, q_heads, dim)
    k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(rows, k_heads, dim)
    v = qkv[:, (q_heads + k_heads) * dim:].view(rows, k_heads, dim)
    slots = 3 * rows + 5
    caches = [randn((slots, k_heads, dim), dtype, seed=17 + i, device=device) for i in range(2)]
    gen = torch.Generator().manual_seed(rows)
    slot_mapping = torch.randperm(slots, generator=gen)[:rows].to(device)
    write_rows = None
    if padded and rows > 1:  # CUDA-graph padding: the last rows repeat row 0's write
        write_rows = torch.arange(rows)
        write_rows[rows // 2:] = 0
        slot_mapping[rows // 2:] = slot_mapping[0]
        write_rows = write_rows.to(device)
    angles = randn((rows, dim), torch.float32, seed=18, device=device, scale=50.0)
    cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    qkv_before = qkv.clone()
    want_caches = [c.clone() for c in caches]
    want_q = reference.rotary_cache(q.clone(), k, v, cos, sin, *want_caches, slot_mapping, write_rows)
    got_q = ops.rotary_cache(q, k, v, cos, sin, *caches, slot_mapping, write_rows)
    assert torch.equal(got_q, want_q) and got_q.data_ptr() == q.data_ptr()
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    assert torch.equal(qkv[:, q_heads * dim:], qkv_before[:, q_heads * dim:])  # k and v only read


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table", ["model", "float32"])
@pytest.mark.parametrize("rows,q_heads,k_heads,dim,padded", [(0, 2, 1, 8, False), (1, 4, 2, 64, False),
                                                             (6, 28, 4, 128, True), (5, 4, 2, 64, False)])
def test_rotary_cache_matches_reference(native, dtype, table, rows, q_heads, k_heads, dim, padded):
    check_rotary_cache("cpu", dtype, dtype if table == "model" else torch.float32, rows, q_heads, k_heads, dim,
                       padded)


def test_rotary_cache_bad_index_raises_and_writes_nothing(native):
    q, k, v = (randn((2, 2, 8), torch.float32, seed=19 + i) for i in range(3))
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    caches = [torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)]
    q_before = q.clone()
    for slots, rows, message in [(torch.tensor([0, 4]), None, "slot_mapping\\[1\\] = 4 is outside"),
                                 (torch.tensor([0, -1]), None, "slot_mapping\\[1\\] = -1"),
                                 (torch.tensor([0, 1]), torch.tensor([0, 2]), "write_rows\\[1\\] = 2")]:
        with pytest.raises(RuntimeError, match=message):
            native.rotary_cache_(q, k, v, cos, sin, *caches, slots, rows)
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        native.rotary_cache_(q, k, v, cos, sin, *caches, torch.tensor([0, 1], dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match="k_cache must be"):
        native.rotary_cache_(q, k, v, cos, sin, torch.zeros(4, 3, 8), caches[1], torch.tensor([0, 1]), None)
    assert torch.equal(q, q_before) and not caches[0].any() and not caches[1].any()


def test_backend_forward_rope_equals_rotary_then_forward(native):
    """TorchPagedAttention: the fused rotary + K/V write gives the unfused path's output and cache."""
    from unifiedserve.attention import KVCache, TorchPagedAttention

    outs = []
    for fused in (True, False):
        cache = KVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                        device="cpu")
        attn = TorchPagedAttention(cache, num_q_heads=4, num_kv_heads=2, head_dim=16)
        attn.plan([(0, 5, [0, 1]), (0, 3, [2])])  # two prompts: 5 and 3 new tokens
        q, k, v = (randn((8, h, 16), torch.float32, seed=30 + i) for i, h in enumerate((4, 2, 2)))
        angles = randn((8, 16), torch.float32, seed=33)
        cos, sin = angles.cos(), angles.sin()
        if fused:
            out = attn.forward_rope(0, q, k, v, cos, sin)
        else:
            rq, rk = reference.rotary(q, k, cos, sin)
            out = attn.forward(0, rq, rk, v)
        outs.append((out, cache.layer(0)[0].clone(), cache.layer(0)[1].clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(4, 2, 64), (28, 4, 128), (2, 2, 20)])
def test_paged_decode_attention_matches_gather_and_sdpa(native, dtype, q_heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(q_heads + dim)
    num_slots, lengths = 300, [37, 1, 120, 0]
    width = max(lengths) + 3
    q = randn((5, q_heads, dim * 2), dtype, seed=40)[:, :, :dim]  # rows and heads strided, last dim contiguous
    caches = [randn((num_slots, kv_heads, dim), dtype, seed=41 + i) for i in range(2)]
    slots = torch.randint(0, num_slots, (5, width), generator=gen)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths + [width])[:, None]
    slots[~valid] = num_slots + 7  # never read: out of range on purpose
    got = ops.paged_decode_attention(q, *caches, slots, valid, dim ** -0.5)
    want = reference.paged_decode_attention(q, *caches, torch.where(valid, slots, 0), valid, dim ** -0.5)
    assert got.shape == (5, q_heads, dim) and got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not got[3].any()  # no key at all: zeros, as torch's SDPA gives


def test_paged_decode_attention_bad_slots_raise(native):
    q, caches = torch.ones(1, 2, 8), [torch.ones(4, 1, 8), torch.ones(4, 1, 8)]
    valid = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="slots\\[0, 2\\] = 4 is outside"):
        native.paged_decode_attention(q, *caches, torch.tensor([[0, 1, 4]]), valid, 1.0)
    with pytest.raises(RuntimeError, match="valid must be"):
        native.paged_decode_attention(q, *caches, torch.tensor([[0, 1, 2]]), valid[:, :2], 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        native.paged_decode_attention(torch.ones(1, 3, 8), torch.ones(4, 2, 8), torch.ones(4, 2, 8),
                                      torch.tensor([[0, 1, 2]]), valid, 1.0)


def test_leading_dims_are_kept(native):
    x = randn((2, 3, 40), torch.float32, seed=8)
    w = torch.ones(40)
    assert ops.rms_norm(x, w, 1e-6).shape == (2, 3, 40)
    assert ops.silu_and_mul(randn((2, 3, 40), torch.float32, seed=9)).shape == (2, 3, 20)


def test_grad_mode_takes_the_reference(native):
    """The kernels have no backward: with autograd watching, the ops run the torch reference."""
    w = torch.ones(16, requires_grad=True)
    x = randn((2, 16), torch.float32, seed=10)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.requires_grad
    out.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert not ops.rms_norm(x, w, 1e-6).requires_grad


def test_uncovered_inputs_take_the_reference(native):
    """float64, mismatched weight dtype, odd head_dim: no error, the reference's answer."""
    x64 = randn((3, 10), torch.float64, seed=11)
    assert torch.equal(ops.rms_norm(x64, torch.ones(10, dtype=torch.float64), 1e-6),
                       reference.rms_norm(x64, torch.ones(10, dtype=torch.float64), 1e-6))
    x = randn((3, 10), torch.bfloat16, seed=12)
    assert torch.equal(ops.rms_norm(x, torch.ones(10), 1e-6), reference.rms_norm(x, torch.ones(10), 1e-6))
    q, k = randn((2, 1, 6), torch.float32, seed=13), randn((2, 1, 6), torch.float32, seed=14)
    cos, sin = torch.ones(2, 6, dtype=torch.float64), torch.zeros(2, 6, dtype=torch.float64)
    got = ops.rotary(q, k, cos, sin)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], q)


def test_switch_off_gives_the_reference_bits(native, monkeypatch):
    """UNIFIEDSERVE_NO_FUSED_OPS=1 (read at import) sends every op to the reference."""
    monkeypatch.setenv("UNIFIEDSERVE_NO_FUSED_OPS", "1")
    assert not ops.fused_enabled()
    monkeypatch.setattr(ops, "_FUSED", False)
    x, w = randn((3, 300), torch.float32, seed=15), torch.ones(300)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    xi = x.clone()
    norm, h = ops.fused_add_rms_norm(xi, x, w, 1e-6)
    assert torch.equal(xi, x)  # the reference leaves its inputs alone


BAD = [
    ("int", lambda op: op.rms_norm(torch.empty(2, 4, dtype=torch.int32), torch.ones(2, 4, dtype=torch.int32),
                                   torch.ones(4, dtype=torch.int32), 1e-6), "must be float32, bfloat16 or float16"),
    ("weight", lambda op: op.rms_norm(torch.empty(2, 4), torch.ones(2, 4), torch.ones(5), 1e-6), "weight must be [4]"),
    ("out", lambda op: op.rms_norm(torch.empty(2, 5), torch.ones(2, 4), torch.ones(4), 1e-6), "out must be shaped"),
    ("eps", lambda op: op.rms_norm(torch.empty(2, 4), torch.ones(2, 4), torch.ones(4), float("nan")), "eps must be"),
    ("x 1-D", lambda op: op.rms_norm(torch.empty(4), torch.ones(4), torch.ones(4), 1e-6), "x must be [N, hidden]"),
    ("residual", lambda op: op.fused_add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6),
     "residual must be shaped like x"),
    ("residual dtype", lambda op: op.fused_add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.half),
                                                        torch.ones(4), 1e-6), "residual is"),
    ("odd head_dim", lambda op: op.rotary_(torch.ones(2, 1, 5), torch.ones(2, 1, 5), torch.ones(2, 5),
                                          torch.ones(2, 5)), "head_dim must be even"),
    ("cos shape", lambda op: op.rotary_(torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.ones(3, 4),
                                       torch.ones(3, 4)), "cos must be [2, 4]"),
    ("cos dtype", lambda op: op.rotary_(torch.ones(2, 1, 4), torch.ones(2, 1, 4),
                                       torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)),
     "cos must be float32 or"),
    ("k dim", lambda op: op.rotary_(torch.ones(2, 1, 4), torch.ones(2, 1, 6), torch.ones(2, 4), torch.ones(2, 4)),
     "k must be"),
    ("strided head", lambda op: op.rotary_(torch.ones(2, 1, 8)[..., ::2], torch.ones(2, 1, 4),
                                          torch.ones(2, 4), torch.ones(2, 4)), "last dims must be contiguous"),
]


@pytest.mark.parametrize("name,call,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_clear_error(native, name, call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(native)


def test_model_greedy_tokens_are_the_same_fused_or_not(native, monkeypatch, tmp_path):
    """The demo model (float32) generates the same greedy tokens and near-identical logits either way."""
    from unifiedserve.engine import LLM, EngineConfig, SamplingParams
    from unifiedserve.model.demo import write_demo_model

    path = tmp_path / "demo"
    write_demo_model(path)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [(list(range(100, 140)), [], params), (list(range(300, 317)), [], params)]
    fused = [o.token_ids for o in LLM(path, EngineConfig(device="cpu")).generate(prompts)]
    monkeypatch.setattr(ops, "_FUSED", False)
    plain = [o.token_ids for o in LLM(path, EngineConfig(device="cpu")).generate(prompts)]
    assert fused == plain and all(len(t) == 24 for t in fused)


# -- CUDA ------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_match_reference(cuda_native, dtype):
    # widths that are whole 16-byte packs take the packed kernels when the rows and pointers are aligned (the
    # contiguous cases), the one-element kernels otherwise (the strided and offset ones, and 5 / 300 / 3420)
    for rows, hidden in NORM_SHAPES + [(257, 3584), (300, 1280)]:
        for strided in (True, False):
            check_rms_norm("cuda", dtype, rows, hidden, strided=strided)
        for offset in (0, 1):
            check_fused_add("cuda", dtype, rows, hidden, offset)
    for rows, inter in [(0, 8), (1, 18944), (33, 1344), (70, 3420), (70, 3456), (2, 13)]:
        for offset in (0, 1):
            check_silu("cuda", dtype, rows, inter, offset)
    for table in (dtype, torch.float32):  # head dims 128 and 80 take 16-byte packs, 20 and 8 (bf16) elements
        for shape in [(1, 28, 4, 128), (64, 16, 2, 128), (100, 16, 16, 80), (7, 4, 2, 20), (9, 2, 1, 8)]:
            check_rotary("cuda", dtype, table, *shape)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_rotary_cache_matches_reference(cuda_native, dtype):
    for table in (dtype, torch.float32):
        for rows, padded in [(1, False), (64, True), (300, False)]:
            check_rotary_cache("cuda", dtype, table, rows, 28, 4, 128, padded)  # 16-byte packs
        for rows, padded in [(5, True), (40, False)]:
            check_rotary_cache("cuda", dtype, table, rows, 4, 2, 20, padded)  # one element at a time


@pytest.mark.cuda
def test_cuda_public_ops_use_the_kernels(cuda_native, monkeypatch):
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary"):
        monkeypatch.setattr(reference, name, lambda *a, _n=name: pytest.fail(f"reference {_n} ran on CUDA"))
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x.clone(), x.clone(), w, 1e-6)
    ops.silu_and_mul(x)
    q = torch.randn(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    ops.rotary(q, q.clone(), x, x)
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager(cuda_native):
    """The four kernels in one captured graph give the eager bits (no host sync, capturable)."""
    dtype, hidden = torch.bfloat16, 512
    x = torch.randn(8, hidden, device="cuda", dtype=dtype)
    r = torch.randn(8, hidden, device="cuda", dtype=dtype)
    w = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    cos = torch.rand(8, 64, device="cuda", dtype=dtype)
    sin = torch.rand(8, 64, device="cuda", dtype=dtype)

    def body(x, r):
        n = ops.rms_norm(x, w, 1e-6)
        a, h = ops.fused_add_rms_norm(n.clone(), r.clone(), w, 1e-6)
        q, k = ops.rotary(a.view(8, 8, 64)[:, :4], a.view(8, 8, 64)[:, 4:], cos, sin)
        return ops.silu_and_mul(torch.cat((q.reshape(8, -1), k.reshape(8, -1)), dim=-1)), h

    eager = body(x, r)
    static_x, static_r = x.clone(), r.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body(static_x, static_r)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body(static_x, static_r)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


@pytest.mark.cuda
def test_cuda_bad_input_raises(cuda_native):
    for gate_up, out, message in [(torch.ones(2, 7), torch.empty(2, 3), "gate_up must be"),
                                  (torch.ones(2, 6), torch.empty(2, 4), "out must be")]:
        with pytest.raises(RuntimeError, match=message):
            cuda_native.silu_and_mul(out.cuda(), gate_up.cuda())
    with pytest.raises(RuntimeError, match="weight is on"):
        cuda_native.rms_norm(torch.empty(2, 4, device="cuda"), torch.ones(2, 4, device="cuda"), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="out is on cpu"):
        cuda_native.silu_and_mul(torch.empty(2, 2), torch.ones(2, 4, device="cuda"))
