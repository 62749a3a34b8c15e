"""The device-aware runner: sync-free forward equals the model's own path; CUDA generate and graph replay."""

import pytest
import torch

from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
from unifiedserve.engine.llm import LLM, EngineConfig
from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.runner import ModelRunner, RopeTables, forward_tokens
from unifiedserve.model.llm import mrope_cos_sin
from unifiedserve.model.loader import load_model


@pytest.fixture(scope="module")
def model(demo_path):
    return load_model(demo_path, torch.float32, "cpu")[0].eval()


def _attn(model, num_blocks=16, block_size=16):
    t = model.config.text
    cache = KVCache(t.num_hidden_layers, num_blocks, block_size, t.num_key_value_heads, t.head_dim)
    return TorchPagedAttention(cache, t.num_attention_heads, t.num_key_value_heads, t.head_dim)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rope_tables_equal_mrope_cos_sin(model, device):
    t = model.config.text
    positions = torch.randint(0, 5000, (3, 37))
    # and positions float32 cannot hold exactly (past 2**24): the product's own int64 -> float32 conversion must
    # round them as mrope_cos_sin's .float() does
    positions = torch.cat([positions, torch.tensor([[2 ** 24 + 1, 2 ** 25 + 3, 123456789]] * 3)], dim=1)
    positions = positions.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        ours = RopeTables(t, torch.device(device))(positions, dtype)
        ref = mrope_cos_sin(positions, t.head_dim, t.rope_theta, t.mrope_section, dtype)
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
        # row-major, as the skinny Q/K/V epilogue's rotary reads them (RopeWrite.check)
        assert all(t.is_contiguous() for t in ours)


@torch.inference_mode()
def test_forward_tokens_equals_the_models_own_forward(model):
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (40,), generator=gen)
    ids[5:13] = cfg.image_token_id  # 8 visual rows
    visual = torch.randn(8, cfg.text.hidden_size, generator=gen)
    positions = torch.randint(0, 60, (3, 40), generator=gen)
    seqs = [(0, 25, [0, 1]), (0, 15, [2])]
    ours = forward_tokens(model, _attn(model), ids, positions, seqs, visual, [24, 39])
    attn = _attn(model)
    attn.begin(AttentionMetadata.build(seqs, 16))
    hidden = model(model.embed(ids, visual), positions, attn)
    assert torch.equal(ours, model.compute_logits(hidden[[24, 39]]))


def test_forward_tokens_checks_its_inputs(model):
    ids = torch.full((4,), model.config.image_token_id)
    with pytest.raises(ValueError, match="4 image/video placeholder tokens but 0"):
        forward_tokens(model, _attn(model), ids, torch.zeros(3, 4, dtype=torch.int64), [(0, 4, [0])], None, [3])
    with pytest.raises(ValueError, match=r"positions must be \[3, 4\]"):
        forward_tokens(model, _attn(model), ids, torch.zeros(3, 5, dtype=torch.int64), [(0, 4, [0])], None, [3])


def test_runner_refuses_graphs_and_foreign_devices_on_cpu(model):
    runner = ModelRunner(model, num_kv_blocks=8, block_size=16, num_patch_pages=4, num_visual_pages=4,
                         page_size=64, device="cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.capture_decode_graphs([1, 2])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="weights are on cpu"):
            ModelRunner(model, num_kv_blocks=8, block_size=16, num_patch_pages=4, num_visual_pages=4,
                        page_size=64, device="cuda")


def _prompts(engine, n=3):
    texts = ["Tell me a story about the sea.", "What is two plus two?", "Describe a red square."]
    return [engine.build_prompt([{"role": "user", "content": texts[i % 3]}])[0] for i in range(n)]


@pytest.mark.cuda
def test_cuda_fp32_greedy_equals_cpu_greedy(demo_path):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cpu = LLM(demo_path, EngineConfig(device="cpu"))
    expected = [o.token_ids for o in cpu.generate([(p, [], params) for p in _prompts(cpu)])]
    for eager in (True, False):
        gpu = LLM(demo_path, EngineConfig(device="cuda", dtype="float32", num_kv_blocks=256, enforce_eager=eager))
        assert (gpu.runner.graphs is None) == eager
        assert [o.token_ids for o in gpu.generate([(p, [], params) for p in _prompts(gpu)])] == expected


@pytest.mark.cuda
def test_cuda_bf16_generate_end_to_end(demo_path):
    engine = LLM(demo_path, EngineConfig(device="cuda"))  # auto dtype, KV pool sized from memory
    assert engine.config.dtype == "bfloat16" and engine.runner.kv_cache.dtype == torch.bfloat16
    assert engine.kv_sizing is not None and engine.config.num_kv_blocks == engine.kv_sizing.num_blocks
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    outs = engine.generate([(p, [], seeded) for p in _prompts(engine, 5)])
    again = engine.generate([(p, [], seeded) for p in _prompts(engine, 5)])
    assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(demo_path, dtype):
    engine = LLM(demo_path, EngineConfig(device="cuda", dtype=dtype, num_kv_blocks=256, max_cuda_graph_batch=8))
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4, 8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for p in _prompts(engine, 3):
        engine.add_request(p, [], params)
    while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
        engine.step()  # prefill: every request now has its first token
    reqs = list(engine.scheduler.requests.values())
    seqs, ids, pos = [], [], []
    for r in reqs:
        cached = r.prompt_len + len(r.output_token_ids) - 1
        seqs.append((cached, 1, engine.runner._blocks(r)))
        ids.append(r.output_token_ids[-1])
        pos.append(cached + engine.runner.mrope_delta(r.request_id))
    ids = torch.tensor(ids)
    positions = torch.tensor(pos).expand(3, -1)
    with torch.inference_mode():
        replayed = graphs.run(seqs, ids, positions)
        eager = graphs.run_eager(seqs, ids, positions)
        plain = forward_tokens(engine.model, engine.runner.attn, ids, positions, seqs, None, list(range(len(reqs))),
                               torch.zeros(len(reqs), dtype=torch.bool), engine.runner.rope)
    assert replayed.shape == (3, engine.model_config.text.vocab_size)
    assert torch.equal(replayed, eager)  # the graph is exactly its kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a replay queues its inputs and its plan: the host never waits
    try:
        with torch.inference_mode():
            graphs.run(seqs, ids, positions)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with torch.inference_mode():
        graphs.run(seqs, ids, positions)  # the graph's metadata is this step's again (the plain forward planned)
    kv = engine.runner.kv_cache.tensor.clone()
    assert 0 < graphs.replay_seconds(3, repeats=5) < 1.0  # bench_engine's device-only step
    assert torch.equal(engine.runner.kv_cache.tensor, kv)  # replays rewrite the last step's slots, same values
    with pytest.raises(ValueError, match="no captured decode graph serves 9"):
        graphs.replay_seconds(9)
    tol = 1e-4 if dtype == "float32" else 5e-2  # padded batch / graph attention kernels vs the eager path
    torch.testing.assert_close(replayed.float(), plain.float(), atol=tol, rtol=tol)
    assert torch.equal(replayed.argmax(-1), plain.argmax(-1))
    while engine.has_unfinished:
        engine.step()


@torch.inference_mode()
def test_padded_graph_step_matches_the_plain_forward_on_cpu(model):
    """The graph body (static buffers, padding rows, graph-mode attention plan), run eagerly on the CPU."""
    from unifiedserve.engine.cuda_graph import DecodeGraphs

    bs = 16
    attn = _attn(model, num_blocks=32, block_size=bs)
    rope = RopeTables(model.config.text, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 20, 33]  # prompts, each in its own blocks
    blocks = [[0, 1], [2, 3], [4, 5, 6]]
    for n, b in zip(lengths, blocks):  # prefill each prompt into its blocks
        ids = torch.randint(10, 1000, (n,), generator=gen)
        forward_tokens(model, attn, ids, torch.arange(n).expand(3, -1), [(0, n, b)], None, [n - 1])
    graphs = DecodeGraphs(model, attn, rope, [1, 2, 4, 8], max_seq_len=64)
    assert not graphs.captured and [graphs.graph_size(n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    seqs = [(n, 1, b) for n, b in zip(lengths, blocks)]
    ids = torch.randint(10, 1000, (3,), generator=gen)
    positions = torch.tensor(lengths).expand(3, -1)
    assert graphs.serves(seqs) and graphs.serves([(63, 1, [0, 1, 2, 3])])
    assert not graphs.serves([(64, 1, [0, 1, 2, 3, 4])])  # past max_seq_len
    assert not graphs.serves([(0, 2, [0])])  # not a decode
    before = attn.kv_cache.tensor.clone()  # [layers, 2, blocks, block_size, heads, dim]
    padded = graphs.run_eager(seqs, ids, positions)  # 3 sequences in the size-4 buffers
    after_padded = attn.kv_cache.tensor.clone()
    changed = (after_padded != before).any(-1).any(-1).any(0).any(0).nonzero().tolist()  # [block, offset]
    assert sorted(changed) == sorted([b[n // bs], n % bs] for n, b in zip(lengths, blocks))  # padding wrote nothing
    plain = forward_tokens(model, attn, ids, positions, seqs, None, [0, 1, 2], rope=rope)
    torch.testing.assert_close(attn.kv_cache.tensor, after_padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.argmax(-1), plain.argmax(-1))
    with pytest.raises(ValueError, match="no captured decode graph serves 9"):
        graphs.run_eager([(1, 1, [0])] * 9, torch.zeros(9, dtype=torch.int64), torch.zeros(3, 9, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.run(seqs, ids, positions)
    with pytest.raises(RuntimeError, match="before capture"):
        graphs.replay_seconds(3)
    with pytest.raises(ValueError, match="CUDA graphs need"):
        graphs.capture()


@torch.inference_mode()
def test_a_graph_steps_inputs_are_written_by_one_copy_and_fed_rows_by_one_more(model):
    """Every operation outside a decode graph's replay costs the device microseconds (issue 13): the step's token
    ids and positions go into the size's contiguous [1 + 3, B] static inputs by one copy; tokens fed from the
    device add one more, a slice copy for consecutive rows or an index copy otherwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from unifiedserve.engine.cuda_graph import DecodeGraphs
    from unifiedserve.engine.runner import consecutive

    graphs = DecodeGraphs(model, _attn(model), RopeTables(model.config.text, torch.device("cpu")), [2, 4],
                          max_seq_len=64)
    storage = graphs._inputs.untyped_storage().data_ptr()

    class Writes(TorchDispatchMode):  # the ops whose destination is the graphs' static inputs
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if dst is not None and func._schema.is_mutable and dst.untyped_storage().data_ptr() == storage:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    seqs = [(5, 1, [0]), (9, 1, [1]), (3, 1, [2])]
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([[5, 9, 3], [6, 10, 4], [7, 11, 5]])
    tokens = torch.tensor([40, 41, 42, 43])
    for fed, ops, want_ids in (
            (None, ["copy_.default"], [11, 12, 13, 0]),
            ((consecutive([0, 1, 2]), tokens[consecutive([1, 2, 3])]), ["copy_.default"] * 2, [41, 42, 43, 0]),
            ((torch.tensor([2, 0]), tokens[torch.tensor([0, 3])]), ["copy_.default", "index_copy_.default"],
             [43, 12, 40, 0])):
        with Writes() as mode:
            size, _ = graphs._prepare(seqs, ids, positions, fed)
        assert size == 4 and mode.ops == ops
        inputs = graphs.inputs(4)
        assert inputs.is_contiguous() and inputs.data_ptr() == graphs._inputs.data_ptr()
        assert inputs[0].tolist() == want_ids and inputs[1:, :3].tolist() == positions.tolist()
        assert not inputs[1:, 3].any()  # the padding row: position 0
    assert [consecutive(v) for v in ([3], [0, 1, 2], [1, 3], [2, 1], [])] == [slice(3, 4), slice(0, 3), None, None,
                                                                              None]


class _TwoVariants(TorchPagedAttention):
    """The torch backend offering two graph variants: "short" for steps whose sequences hold at most 8 tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.planned = []

    def graph_variants(self, batch_size):
        return ("long", "short")

    def graph_variant(self, seqs, batch_size):
        return "short" if max(c + n for c, n, _ in seqs) <= 8 else "long"

    def plan(self, seqs, graph_batch_size=None, graph_variant=None):
        self.planned.append(graph_variant)
        super().plan(seqs, graph_batch_size)


@torch.inference_mode()
def test_graph_steps_plan_the_variant_the_backend_names(model):
    from unifiedserve.engine.cuda_graph import DecodeGraphs

    t = model.config.text
    attn = _TwoVariants(KVCache(t.num_hidden_layers, 8, 16, t.num_key_value_heads, t.head_dim),
                        t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    graphs = DecodeGraphs(model, attn, RopeTables(t, torch.device("cpu")), [2], max_seq_len=64)
    ids, positions = torch.tensor([5, 6]), torch.tensor([[7, 20]] * 3)
    graphs.run_eager([(7, 1, [0]), (3, 1, [1])], ids, torch.tensor([[7, 3]] * 3))
    graphs.run_eager([(7, 1, [0]), (19, 1, [1, 2])], ids, positions)
    assert attn.planned == ["short", "long"] and graphs._last == {2: "long"}
    with pytest.raises(ValueError, match="one kind of decode graph"):
        _attn(model).plan([(0, 1, [0])], graph_batch_size=1, graph_variant="short")
