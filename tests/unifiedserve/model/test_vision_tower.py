"""Vision tower: window layout, slice-by-slice encoding, batching invariance, input errors."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.model.config import VisionConfig
from unifiedserve.model.vision import VisionTower, vision_layout

# Small but with the real geometry: patch 14, merge 2, window 112 px (4x4 merge groups), and both
# kinds of blocks.
CONFIG = VisionConfig(depth=3, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=48,
                      fullatt_block_indexes=(1,))
ATOL = 1e-5


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return VisionTower(CONFIG).eval()


def _patches(grid, seed):
    t, h, w = grid
    return torch.randn(t * h * w, CONFIG.patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(2, 10, 18)], [(1, 8, 8), (3, 12, 6)], [(1, 2, 2), (2, 18, 10)]])
def test_window_layout_matches_transformers(grids):
    """Our window order and window lengths equal transformers' ``get_vision_window_index``."""
    vision_utils = pytest.importorskip("transformers.vision_utils")
    ref_index, ref_cu = vision_utils.get_vision_window_index(torch.tensor(grids), spatial_merge_size=2,
                                                             window_size=112, patch_size=14)
    layout = vision_layout(tuple(grids), 2, 4)
    assert torch.equal(layout.window_index, ref_index)
    cu = torch.tensor([0, *layout.window_lens]).cumsum(0)
    assert torch.equal(cu.to(ref_cu.dtype), ref_cu)


def test_window_layout_invariants():
    grids = ((2, 10, 18), (1, 6, 4))
    layout = vision_layout(grids, 2, 4)
    num_groups = sum(t * h * w for t, h, w in grids) // 4
    assert sorted(layout.window_index.tolist()) == list(range(num_groups))
    assert torch.equal(layout.window_index[layout.reverse_index], torch.arange(num_groups))
    assert sum(layout.window_lens) == sum(layout.frame_lens) == 4 * num_groups
    assert max(layout.window_lens) <= 4 * 4 * 4
    assert layout.frame_lens == (180, 180, 24)
    # Every window lies inside one frame: frame boundaries are window boundaries.
    window_ends = set(torch.tensor(layout.window_lens).cumsum(0).tolist())
    assert set(torch.tensor(layout.frame_lens).cumsum(0).tolist()) <= window_ends


def test_video_slices_one_at_a_time_equal_whole_video(tower):
    """Attention never crosses a frame pair: encoding slices (1, h, w) one by one is the same."""
    grid = (4, 10, 14)
    patches = _patches(grid, seed=1)
    with torch.inference_mode():
        whole = tower(patches, [grid])
        per_slice = patches.shape[0] // grid[0]
        slices = [tower(patches[i * per_slice:(i + 1) * per_slice], [(1, 10, 14)]) for i in range(grid[0])]
    assert whole.shape == (patches.shape[0] // 4, CONFIG.out_hidden_size)
    torch.testing.assert_close(torch.cat(slices), whole, atol=ATOL, rtol=ATOL)


def test_images_one_at_a_time_equal_a_batch(tower):
    grids = [(1, 4, 6), (1, 12, 10), (1, 2, 2), (1, 10, 18)]
    patches = [_patches(g, seed=i) for i, g in enumerate(grids)]
    with torch.inference_mode():
        batch = tower(torch.cat(patches), grids)
        single = torch.cat([tower(p, [g]) for p, g in zip(patches, grids)])
    torch.testing.assert_close(single, batch, atol=ATOL, rtol=ATOL)


def test_window_attention_matters(tower):
    """A window block only sees its window: changing a far-away patch changes tokens only through
    the full-attention block, so a tower with no full-attention block keeps distant tokens fixed."""
    local = VisionTower(VisionConfig(depth=2, hidden_size=64, num_heads=2, intermediate_size=96,
                                     out_hidden_size=48, fullatt_block_indexes=())).eval()
    grid = (1, 16, 16)  # 8x8 merge groups = 2x2 windows of 4x4 groups
    patches = _patches(grid, seed=5)
    changed = patches.clone()
    changed[-4:] += 1.0  # the last merge group: bottom-right window
    with torch.inference_mode():
        a, b = local(patches, [grid]).view(8, 8, -1), local(changed, [grid]).view(8, 8, -1)
    assert torch.equal(a[:4, :4], b[:4, :4])  # top-left window untouched
    assert not torch.allclose(a[4:, 4:], b[4:, 4:])
    with torch.inference_mode():
        c, d = tower(patches, [grid]).view(8, 8, -1), tower(changed, [grid]).view(8, 8, -1)
    assert not torch.allclose(c[:4, :4], d[:4, :4])  # the full-attention block spreads it


@pytest.mark.parametrize("grids, rows, match", [
    ([], 0, "empty"),
    ([(1, 3, 4)], 12, "multiples"),
    ([(1, 4, 4)], 15, "needs 16"),
    ([(0, 4, 4)], 0, "positive"),
])
def test_bad_grids_raise(tower, grids, rows, match):
    with pytest.raises(ValueError, match=match):
        tower(torch.zeros(rows, CONFIG.patch_dim), grids)


def test_bad_patch_width_raises(tower):
    with pytest.raises(ValueError, match="1176"):
        tower(torch.zeros(16, 1000), [(1, 4, 4)])


def test_aligned_mlp_gives_the_same_visual_tokens():
    """align_mlp (done on CUDA at load) pads each MLP's 96 units to 128 with zeros: same outputs, and the
    config keeps the checkpoint's width (FLOP counts and checkpoint shapes read it)."""
    torch.manual_seed(1)
    tower = VisionTower(CONFIG).eval()
    for block in tower.blocks:  # nonzero biases, so that a misplaced row would change the outputs
        torch.nn.init.normal_(block.mlp.gate_up_proj.bias)
        torch.nn.init.normal_(block.mlp.down_proj.bias)
    grids = [(2, 8, 12), (1, 4, 4)]
    patches = _patches((1, 2 * 8 * 12 + 16, 1), seed=5)
    with torch.no_grad():
        before = tower(patches, grids)
        assert tower.align_mlp(64) == 128
        after = tower(patches, grids)
    for block in tower.blocks:
        assert block.mlp.gate_up_proj.weight.shape == (256, 64) and block.mlp.gate_up_proj.bias.shape == (256,)
        assert block.mlp.down_proj.weight.shape == (64, 128) and block.mlp.intermediate_size == 128
    assert tower.config.intermediate_size == 96
    torch.testing.assert_close(after, before, atol=ATOL, rtol=0)
    assert tower.align_mlp(64) == 128 and tower.blocks[0].mlp.down_proj.weight.shape == (64, 128)  # no second pad


@pytest.mark.parametrize("act, bias", [("silu", False), ("gelu_pytorch_tanh", True), ("quick_gelu", True)])
def test_mlp_pad_intermediate_keeps_the_function(act, bias):
    from unifiedserve.model.llm import MLP

    torch.manual_seed(2)
    mlp = MLP(24, 20, act, bias=bias).eval().requires_grad_(False)  # as loaded
    if bias:
        torch.nn.init.normal_(mlp.gate_up_proj.bias)
    x = torch.randn(7, 24)
    with torch.no_grad():
        before = mlp(x)
        assert mlp.pad_intermediate(8) == 24 and mlp.pad_intermediate(8) == 24
        torch.testing.assert_close(mlp(x), before, atol=1e-6, rtol=0)
    assert mlp.gate_up_proj.weight.shape == (48, 24) and mlp.down_proj.weight.shape == (24, 24)
    assert not any(p.requires_grad for p in mlp.parameters())
    with pytest.raises(ValueError, match="multiple"):
        mlp.pad_intermediate(0)


@pytest.mark.cuda
def test_cuda_load_aligns_the_tower_and_keeps_its_outputs(tmp_path):
    """On CUDA the loader pads the demo tower's 432-unit MLPs to 448; its visual tokens equal the CPU model's."""
    from unifiedserve.model.demo import write_demo_model
    from unifiedserve.model.loader import load_model

    path = write_demo_model(tmp_path / "demo")
    cpu, config = load_model(path, torch.float32, "cpu")
    gpu, _ = load_model(path, torch.float32, "cuda")
    assert config.vision.intermediate_size % 64 and {b.mlp.intermediate_size for b in gpu.visual.blocks} == {
        -(-config.vision.intermediate_size // 64) * 64}
    grids = [(2, 8, 12)]
    patches = torch.randn(2 * 8 * 12, config.vision.patch_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = cpu.encode_vision(patches, grids)
        got = gpu.encode_vision(patches.cuda(), grids).cpu()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
