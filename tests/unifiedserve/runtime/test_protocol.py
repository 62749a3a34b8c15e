"""Messages survive the wire exactly, and each destination decodes only its own union."""

import msgspec
import pytest

from unifiedserve.engine.params import SamplingParams
from unifiedserve.runtime import protocol as p

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop_token_ids=(1, 2),
                        stop=("END",), ignore_eos=True)

MESSAGES = [
    (p.ToVision, p.ProbeMedia("r1", [p.MediaRef("video", path="/x.mp4", fps=1.5, max_frames=8),
                                     p.MediaRef("image", data=b"\x89PNG", min_pixels=3136)])),
    (p.ToVision, p.WritePatches("r1", [4, 9, 2])),
    (p.ToVision, p.CancelMedia("r1")),
    (p.ToCore, p.AddRequest("r1", [1, 2, 3], [p.MediaPlan("video", (2, 4, 6), 1.0, 4, 2.5)], PARAMS, [1, 2, 9])),
    (p.ToCore, p.AbortRequest("r1")),
    (p.ToCore, p.MediaReady("r1", 0, 0.25)),
    (p.ToCore, p.ReleaseBlocks(["a", "b"])),
    (p.ToCore, p.ReleaseBlocks(["a", "b"], [[5, 6, 7], []])),
    (p.ToDecode, p.Handoff("r1", [0, 1], 30, -4, 17, PARAMS, [9], b"\x00\x01state")),
    (p.ToDecode, p.WeightsLoaded()),
    (p.ToApi, p.MediaProbed("r1", [p.MediaPlan("image", (1, 4, 4))], 0.01)),
    (p.ToApi, p.MediaFailed("r1", "media 0: not a video")),
    (p.ToApi, p.TokenOutputs([p.TokenOutput("r1", 0, 5, None, p.StageTimes(added=1.0, admitted=2.0)),
                              p.TokenOutput("r2", 3, 6, "length")])),
    (p.ToApi, p.RequestFailed("r1", "too big", 400)),
    (p.ToApi, p.WorkerReady("core", 123, {"device": "cpu"})),
    (p.ToApi, p.WorkerStats("core", {"kv_blocks_used": 3.0})),
    (p.ToCore, p.Shutdown()),
]


@pytest.mark.parametrize("union,message", MESSAGES,
                         ids=[type(m).__name__ + str(i) for i, (_, m) in enumerate(MESSAGES)])
def test_round_trip(union, message):
    back = p.decoder(union).decode(p.encode(message))
    assert back == message and type(back) is type(message)


def test_sampling_params_are_validated_on_arrival():
    good = p.encode(p.AbortRequest("x"))
    assert p.decoder(p.ToCore).decode(good) == p.AbortRequest("x")
    bad = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "r", "prompt_token_ids": [1], "media": [],
                                  "params": {"max_tokens": 0}, "stop_token_ids": []})
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        p.decoder(p.ToCore).decode(bad)


def test_a_destination_rejects_foreign_messages():
    with pytest.raises(msgspec.ValidationError):
        p.decoder(p.ToDecode).decode(p.encode(p.MediaReady("r", 0, 0.0)))
