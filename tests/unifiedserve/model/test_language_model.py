"""The language model on the paged runtime: chunked prefill, mixed batches, decode, M-RoPE."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
from unifiedserve.model import LanguageModel, TextConfig, load_model
from unifiedserve.model.demo import write_demo_model
from unifiedserve.model.llm import mrope_cos_sin

BLOCK_SIZE = 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model, _ = load_model(write_demo_model(tmp_path_factory.mktemp("demo"), seed=4))
    return model


def _backend(config: TextConfig, num_blocks: int = 32) -> TorchPagedAttention:
    cache = KVCache(config.num_hidden_layers, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return TorchPagedAttention(cache, config.num_attention_heads, config.num_key_value_heads, config.head_dim)


def _positions(n: int, start: int = 0) -> torch.Tensor:
    """Made-up 3-D positions whose axes differ, so every M-RoPE section matters."""
    i = torch.arange(start, start + n)
    return torch.stack([i, i // 2 + 3, i % 5 + start])  # [3, n]


def _run(model, attn, seqs, ids, positions):
    attn.begin(AttentionMetadata.build(seqs, BLOCK_SIZE))
    return model.compute_logits(model(model.embed(ids), positions, attn))


def test_chunked_prefill_equals_one_chunk(model):
    cfg = model.config.text
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    blocks = list(range(6))
    with torch.inference_mode():
        whole = _run(model, _backend(cfg), [(0, 23, blocks)], ids, _positions(23))
        attn = _backend(cfg)
        first = _run(model, attn, [(0, 10, blocks)], ids[:10], _positions(23)[:, :10])
        second = _run(model, attn, [(10, 13, blocks)], ids[10:], _positions(23)[:, 10:])
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL, rtol=ATOL)


def test_mixed_batch_equals_sequences_alone(model):
    """A step holding a prefill chunk of one sequence and a decode token of another."""
    cfg = model.config.text
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, cfg.vocab_size, (9,), generator=gen), torch.randint(0, cfg.vocab_size, (6,), generator=gen)
    blocks_a, blocks_b = [0, 1, 2], [5, 6]
    with torch.inference_mode():
        alone_a = _run(model, _backend(cfg), [(0, 9, blocks_a)], a, _positions(9))
        alone_b = _run(model, _backend(cfg), [(0, 6, blocks_b)], b, _positions(6))
        attn = _backend(cfg)
        _run(model, attn, [(0, 5, blocks_b)], b[:5], _positions(6)[:, :5])  # b's prompt first
        mixed = _run(model, attn, [(0, 9, blocks_a), (5, 1, blocks_b)], torch.cat([a, b[5:]]),
                     torch.cat([_positions(9), _positions(6)[:, 5:]], dim=1))
        # Then a batched pure-decode step for both sequences.
        nxt = torch.tensor([3, 4])
        decode = _run(model, attn, [(9, 1, blocks_a), (6, 1, blocks_b)], nxt,
                      torch.cat([_positions(10)[:, 9:], _positions(7)[:, 6:]], dim=1))
        ref_a = _run(model, _backend(cfg), [(0, 10, blocks_a)], torch.cat([a, nxt[:1]]), _positions(10))
        ref_b = _run(model, _backend(cfg), [(0, 7, blocks_b)], torch.cat([b, nxt[1:]]), _positions(7))
    torch.testing.assert_close(mixed[:9], alone_a, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(mixed[9], alone_b[5], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(decode, torch.stack([ref_a[-1], ref_b[-1]]), atol=ATOL, rtol=ATOL)


def test_mrope_with_equal_axes_is_plain_rope():
    positions = torch.arange(11).expand(3, -1)
    cos, sin = mrope_cos_sin(positions, 64, 1e6, (8, 12, 12), torch.float32)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.arange(11).float()[:, None] * inv_freq
    torch.testing.assert_close(cos, torch.cat([freqs, freqs], -1).cos())
    torch.testing.assert_close(sin, torch.cat([freqs, freqs], -1).sin())


def test_mrope_sections_use_their_axis():
    positions = torch.tensor([[5], [7], [9]])
    cos, _ = mrope_cos_sin(positions, 16, 10000.0, (2, 3, 3), torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    expected = torch.tensor([5, 5, 7, 7, 7, 9, 9, 9]).float() * inv_freq
    torch.testing.assert_close(cos[0], torch.cat([expected, expected]).cos())


def test_directly_built_model_is_initialised_and_checks_positions():
    cfg = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 1, 1))
    lm = LanguageModel(cfg, tie_word_embeddings=True)
    assert torch.isfinite(lm.tok_embeddings.weight).all()
    with pytest.raises(ValueError, match=r"positions must be \[3, 2\]"):
        lm(torch.zeros(2, 32), torch.zeros(3, 3, dtype=torch.int64), _backend(cfg))
