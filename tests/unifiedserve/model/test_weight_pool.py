"""One copy of the LLM weights: layout, binding, and two processes computing from the same bytes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from unifiedserve.model.demo import write_demo_model
from unifiedserve.model.loader import load_model
from unifiedserve.model.weight_pool import ALIGN_BYTES, bind_parameters, llm_weight_bytes, weight_layout
from unifiedserve.runtime.shm import create_cpu_pool, open_pool, unlink_pool


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def _logits(model) -> torch.Tensor:
    ids = torch.arange(5, 25)
    hidden = model.language_model.embed_tokens(ids)
    return model.compute_logits(hidden) + model.language_model.layers[0].mlp.gate_up_proj.weight.sum()


def test_layout_is_aligned_and_covers_every_parameter(demo):
    model, config = load_model(demo)
    slots = weight_layout(model.language_model)
    assert [s.name for s in slots] == [n for n, _ in model.language_model.named_parameters()]
    assert all(s.offset % ALIGN_BYTES == 0 for s in slots)
    assert all(a.offset + a.num_bytes <= b.offset for a, b in zip(slots, slots[1:]))  # no overlap
    total = llm_weight_bytes(config, torch.float32)
    assert total == slots[-1].offset + slots[-1].num_bytes
    assert total >= sum(p.numel() * 4 for p in model.language_model.parameters())
    assert llm_weight_bytes(config, torch.bfloat16) < total


def test_bound_models_share_the_bytes_and_compute_the_same(demo):
    reference, config = load_model(demo)
    storage = torch.zeros(llm_weight_bytes(config, torch.float32), dtype=torch.uint8)
    loader, _ = load_model(demo, llm_storage=storage)
    reader, _ = load_model(demo, llm_storage=storage, fill_llm=False)
    start, end = storage.data_ptr(), storage.data_ptr() + storage.numel()
    for model in (loader, reader):
        assert all(start <= p.data_ptr() < end for p in model.language_model.parameters())
        assert not any(start <= p.data_ptr() < end for p in model.visual.parameters())
    for ref, got in zip(reference.parameters(), reader.parameters()):
        assert torch.equal(ref, got)
    assert torch.equal(_logits(reference), _logits(reader))


def test_a_decode_side_model_maps_the_llm_and_leaves_the_vision_tower_unallocated(demo):
    """What the decode process loads: LLM from the pool, no vision tower; counted by weight_bytes."""
    from unifiedserve.model.loader import weight_bytes

    reference, config = load_model(demo)
    storage = torch.zeros(llm_weight_bytes(config, torch.float32), dtype=torch.uint8)
    core, _ = load_model(demo, llm_storage=storage)
    decode, _ = load_model(demo, llm_storage=storage, fill_llm=False, load_vision=False)
    assert all(p.is_meta for p in decode.visual.parameters())
    assert not any(p.is_meta for p in decode.language_model.parameters())
    assert torch.equal(_logits(reference), _logits(decode))
    llm = sum(p.numel() * 4 for p in reference.language_model.parameters())
    vision = sum(p.numel() * 4 for p in reference.visual.parameters())
    assert weight_bytes(core, storage) == (vision, llm)  # the core process: its vision tower, the pool's LLM
    assert weight_bytes(decode, storage) == (0, llm)  # decode: nothing of its own
    assert weight_bytes(reference) == (vision + llm, 0)
    private, _ = load_model(demo, load_vision=False)  # without a pool, too
    assert weight_bytes(private) == (llm, 0) and torch.equal(_logits(reference), _logits(private))


def test_bad_storage_is_refused(demo):
    model, config = load_model(demo)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        bind_parameters(model.language_model, torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError, match="the parameters need"):
        bind_parameters(model.language_model, torch.zeros(64, dtype=torch.uint8))


def _child_logits(path, spec, queue) -> None:
    model, _ = load_model(path, llm_storage=open_pool(spec).view(-1), fill_llm=False)
    queue.put(_logits(model).tolist())  # plain data: a tensor would travel as a handle to the exiting child


def test_a_second_process_runs_on_the_first_ones_weights(demo, tmp_path):
    _, config = load_model(demo)
    spec = create_cpu_pool(str(tmp_path), "t", "weights", (llm_weight_bytes(config, torch.float32),), torch.uint8)
    try:
        model, _ = load_model(demo, llm_storage=open_pool(spec))  # the loading process fills the pool
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_logits, args=(str(demo), spec, queue))
        child.start()
        theirs = queue.get(timeout=120)
        child.join(30)
        assert theirs == _logits(model).tolist()
    finally:
        unlink_pool(spec)
