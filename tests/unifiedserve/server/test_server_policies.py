"""The baseline placements serve the same tokens as the single-process engine; /health names the policy."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_helpers import Server, http

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(clip_dir):
    import flashcodec
    from unifiedserve.engine import LLM, SamplingParams, VisionInput

    llm = LLM()
    video = VisionInput.from_video(flashcodec.decode_video(str(clip_dir / "clip.mp4"), output="patches",
                                                           patch_spec=llm.processor.patch_spec))
    ids, vision = llm.build_prompt([{"role": "user", "content": [{"type": "video", "vision": video},
                                                                 {"type": "text", "text": "What happens?"}]}])
    return llm.generate([(ids, vision, SamplingParams(max_tokens=10, ignore_eos=True))])[0].text


@pytest.mark.parametrize("policy, extra", [("monolithic", ()), ("split", ()),
                                           # async scheduling: in decode (unified) and in core (monolithic)
                                           ("unified", ("--async-scheduling",)),
                                           ("monolithic", ("--async-scheduling",))])
def test_policy_serves_engine_tokens(policy, extra, clip_dir, reference):
    srv = Server("--policy", policy, *extra, media_dir=clip_dir)
    try:
        status, health = http("GET", srv.url + "/health")
        assert health["policy"] == policy
        expected_workers = {"vision", "core"} if policy == "monolithic" else {"vision", "core", "decode"}
        assert set(health["workers"]) == expected_workers
        if policy == "split":  # disjoint core sets (on a 1-core machine both get the same core)
            core, decode = (os.sched_getaffinity(health["workers"][n]) for n in ("core", "decode"))
            assert core.isdisjoint(decode) or len(os.sched_getaffinity(0)) == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        video = {"type": "video_url", "video_url": {"url": f"file://{clip_dir}/clip.mp4"}}
        messages = [{"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}]
        def ask(_):
            return client.chat.completions.create(model="demo-model", messages=messages, temperature=0,
                                                  max_tokens=10, extra_body={"ignore_eos": True})

        outs = [ask(0)]
        with ThreadPoolExecutor(3) as pool:  # then three at once: they decode in one batch
            outs += list(pool.map(ask, range(3)))
        assert all(o.choices[0].message.content == reference for o in outs)
        srv.wait_idle()
    finally:
        assert srv.stop(signal.SIGTERM) == 0
