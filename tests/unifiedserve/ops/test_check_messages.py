"""The native ops' error messages are built without iostreams (csrc/check_msg.h: a private copy of libstdc++'s
stream code crashed the first message that printed an integer on the GPU machine) and read as before."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from unifiedserve import ops
from unifiedserve.memory.pages import RaggedIndex
from unifiedserve.ops import RaggedIndexTensors

CSRC = pathlib.Path(__file__).resolve().parents[3] / "csrc"


def test_every_check_in_csrc_goes_through_us_check():
    direct = [f"{p.name}:{i}" for p in sorted(CSRC.glob("*.[ch]*")) if p.name != "check_msg.h"
              for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bTORCH_CHECK\(", line)]
    assert direct == [], f"TORCH_CHECK formats its message with an ostringstream: use US_CHECK ({direct})"


@pytest.fixture(scope="module")
def native():
    if not ops.native_available():
        pytest.skip(f"native ops not built here: {ops.build_info().get('reason')}")
    return torch.ops.unifiedserve


def test_messages_print_integers_sizes_and_dtypes(native):
    buffer = torch.zeros(4, 4, 3)
    good = RaggedIndexTensors.from_index(RaggedIndex.build([(3, 2, [1, 2])], 4))
    few = good._replace(pv_page_indices=torch.tensor([1]), pv_page_indptr=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"^request 0: 3 rows from token 2 span 2 pages of 4, but the index lists 1"):
        native.paged_scatter(buffer, torch.ones(3, 3), *few)
    with pytest.raises(RuntimeError, match=re.escape("src must be [N, [3]] to match buffer [4, 4, 3], got [3, 4]")):
        native.paged_scatter(buffer, torch.ones(3, 4), *good)
    with pytest.raises(RuntimeError, match="src dtype Double must match buffer dtype Float"):
        native.paged_scatter(buffer, torch.ones(3, 3, dtype=torch.float64), *good)
    with pytest.raises(RuntimeError, match=re.escape("pv_page_indices[1] = 9 is out of range for a buffer of 4 pages")):
        native.paged_scatter(buffer, torch.ones(3, 3), *good._replace(pv_page_indices=torch.tensor([1, 9])))
