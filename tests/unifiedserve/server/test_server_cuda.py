"""The whole server on a GPU (``serve --device cuda``): vision writes patches into the CUDA patch pool, core
and decode share the KV pool and the weights by CUDA IPC, and greedy outputs equal the single-process
engine's on the same GPU. Skipped without CUDA (``scripts/gpu_check.sh attention`` runs it).

Both sides get bit-identical inputs: the server decodes on its CPU decoders (``--vision-device cpu``) and cuts
patches on the GPU; the reference decodes the same way with its output on the GPU (``output_device``). float32
and whole-video hand-off keep the two schedules' kernels the same shapes, one request at a time. The server runs
with async scheduling (its CUDA default), the engine without: the same tokens, also for requests that end at
different steps at once.
"""

from __future__ import annotations

import signal

import openai
import pytest

from serve_helpers import Server, leftovers, tiny_clip

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

QUESTION = "What happens in this video?"
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    import synthetic_video

    d = tmp_path_factory.mktemp("media")
    return d, {"video": tiny_clip(d), "image": synthetic_video.make_image(d / "img.png", width=200, height=150, seed=3)}


def messages(files, name):
    part = {"video": {"type": "video_url", "video_url": {"url": f"file://{files['video']}"}},
            "image": {"type": "image_url", "image_url": {"url": f"file://{files['image']}"}}}.get(name)
    text = {"video": QUESTION, "image": "Describe the image.", "text": "Tell me a story."}[name]
    return [{"role": "user", "content": [part, {"type": "text", "text": text}] if part else text}]


def reference(files):
    """The same requests through the single-process engine on the GPU (float32, greedy, 12 tokens)."""
    import torch

    import flashcodec
    from unifiedserve.engine import LLM, EngineConfig, SamplingParams, VisionInput

    llm = LLM(config=EngineConfig(device="cuda", dtype="float32", num_kv_blocks=512))
    spec = llm.processor.patch_spec
    decoded = flashcodec.decode_video(str(files["video"]), output="patches", patch_spec=spec, output_device="cuda:0")
    assert decoded.patches.is_cuda
    vision = {"video": VisionInput.from_video(decoded),
              "image": VisionInput.from_image(flashcodec.decode_image(str(files["image"])), spec)}
    out = {}
    for name in ("video", "image", "text"):
        msgs = messages(files, name)
        content = msgs[0]["content"]
        if name != "text":
            content = [{"type": name, "vision": vision[name]}, content[1]]
        ids, inputs = llm.build_prompt([{"role": "user", "content": content}])
        out[name] = llm.generate([(ids, inputs, SamplingParams(max_tokens=12, ignore_eos=True))])[0]
    del llm
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def server(media):
    d, _ = media
    srv = Server("--device", "cuda", "--dtype", "float32", "--vision-device", "cpu", "--ingest", "whole",
                 media_dir=d, startup_timeout=400.0)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()[-3000:]
    assert leftovers(srv.instance) == []


@pytest.fixture(scope="module")
def want(media):
    return reference(media[1])


def test_a_cuda_server_serves_what_the_engine_computes(server, media, want):
    _, files = media
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for name in ("video", "image", "text"):  # one at a time: the same kernel shapes as the reference
        got = client.chat.completions.create(model="demo-model", messages=messages(files, name), **GREEDY)
        assert got.usage.prompt_tokens == want[name].prompt_len, name
        assert got.choices[0].message.content == want[name].text, name
    m = server.metrics()
    pools = {k: v for k, v in m.items() if k.startswith("unifiedserve_pool_bytes")}
    assert pools and all('device="cuda:' in k for k in pools), pools  # the shared pools are on the GPU
    log = server.log()
    assert "output on cuda:0" in log and "on cuda:0" in log, log[-3000:]  # vision's decoders feed the GPU


def test_requests_ending_at_different_steps_at_once_match_the_engine(server, media, want):
    """Async scheduling is a CUDA server's default: a request that ends keeps its row in the step already launched
    (its blocks go back to core only once that step is read). Greedy requests ending at different steps, all at
    once, answer what each answers alone (texts, not token prefixes: a cut can split a character's bytes), the
    12-token one the engine's, and every KV block and page comes back."""
    from concurrent.futures import ThreadPoolExecutor

    _, files = media
    assert "async scheduling on (the CUDA default" in server.log(), server.log()[-3000:]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(max_tokens):
        return client.chat.completions.create(model="demo-model", messages=messages(files, "text"),
                                              **dict(GREEDY, max_tokens=max_tokens))

    lengths = (3, 6, 9, 12)
    alone = [ask(n).choices[0].message.content for n in lengths]
    with ThreadPoolExecutor(len(lengths)) as pool:
        answers = list(pool.map(ask, lengths))
    assert [a.usage.completion_tokens for a in answers] == list(lengths)
    assert [a.choices[0].message.content for a in answers] == alone and alone[-1] == want["text"].text
    server.wait_idle()


def test_a_server_sized_by_gpu_memory_utilization_stays_inside_its_share(media):
    """``--gpu-memory-utilization 0.4``: the KV pool is sized from the start-up profile, requests run, and the
    whole GPU's memory in use (this test process and any other server included) stays within 0.4 of it."""
    import torch

    d, files = media
    share = 0.4
    torch.cuda.mem_get_info()  # this process's own context exists before the server measures what is in use
    # the KV cache from the share; the buffers small, as in every server test
    srv = Server("--device", "cuda", "--gpu-memory-utilization", str(share), media_dir=d, startup_timeout=400.0,
                 pools=["--patch-buffer-gb", "0.25", "--visual-buffer-gb", "0.0625"])
    try:
        assert "KV pool:" in srv.log() and "x --gpu-memory-utilization 0.40" in srv.log(), srv.log()[-3000:]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for name in ("video", "image", "text"):
            got = client.chat.completions.create(model="demo-model", messages=messages(files, name), **GREEDY)
            assert got.usage.completion_tokens == 12, name
        free, total = torch.cuda.mem_get_info()  # the caching allocators keep their peaks reserved
        assert total - free <= share * total + 2**29, f"{(total - free) / 2**30:.2f} GiB in use of {total / 2**30:.2f}"
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.log()[-3000:]
    assert leftovers(srv.instance) == []
