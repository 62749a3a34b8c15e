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
