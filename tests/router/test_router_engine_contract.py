"""What the engine does is what the router reads and answers: the engine's /metrics text, as
kvfleet_engine.metrics renders it (queue, running, KV usage, and vllm:cache_config_info: block
size, number of blocks); its reading of the Authorization header, which the router copies (it
does not import the engine); its answer to a body without a Content-Type."""

from __future__ import annotations

import pytest

from kvfleet_engine.metrics import EngineInfo, EngineMetrics
from kvfleet_engine.outputs import SchedulerStats
from kvfleet_engine.server import auth as engine_auth
from kvfleet_engine.server.errors import invalid_request
from kvfleet_router import auth as router_auth
from kvfleet_router.load import parse_load
from kvfleet_router.prefix_index import capacity_blocks


def test_the_router_reads_the_engines_metrics() -> None:
    metrics = EngineMetrics(EngineInfo("tiny", "0.1.0", "none", 1))
    metrics.observe_scheduler(SchedulerStats(5, 2, 0.375, 0, 0, 0, 0, 0, 4096, 2560))
    before = parse_load(metrics.render()[0].decode())
    assert before.num_gpu_blocks is None  # not known until the core reported its cache
    metrics.set_cache_config(block_size=16, num_gpu_blocks=4096)
    text = metrics.render()[0].decode()
    info = 'vllm:cache_config_info{block_size="16",model_name="tiny",num_gpu_blocks="4096"} 1.0'
    assert info in text
    sample = parse_load(text)
    assert (sample.waiting, sample.running, sample.kv_usage) == (2.0, 5.0, 0.375)
    assert (sample.block_size, sample.num_gpu_blocks) == (16, 4096)
    assert sample.model_names == {"tiny"}
    # 4096 blocks x 16 tokens x ~4 characters / 64 characters per router block
    assert capacity_blocks(sample.num_gpu_blocks, sample.block_size, 64) == 4096


KEY = b"sk-0123"
MALFORMED = "malformed Authorization header: expected 'Authorization: Bearer <key>'"
WRONG = "incorrect API key provided"


@pytest.mark.parametrize(
    ("authorization", "answer"),
    [
        (None, "missing API key: send it as the header 'Authorization: Bearer <key>'"),
        (b"Bearer sk-0123", "accepted"),
        (b"bearer sk-0123", "accepted"),
        (b"BEARER sk-0123", "accepted"),
        (b"Bearer  sk-0123", "accepted"),
        (b"Bearer sk-0123 ", "accepted"),
        (b"Bearer SK-0123", WRONG),
        (b"Bearer sk-0123 x", WRONG),
        (b"Bearer \xff", WRONG),
        (b"Bearer", MALFORMED),
        (b"Bearer ", MALFORMED),
        (b"", MALFORMED),
        (b"sk-0123", MALFORMED),
        (b"Basic c2stMDEyMw==", MALFORMED),
        (b"Bearer\tsk-0123", MALFORMED),
        (b"Token sk-0123", MALFORMED),
    ],
)
def test_the_router_reads_the_authorization_header_as_the_engine_does(
    authorization: bytes | None, answer: str
) -> None:
    def engine(given: bytes | None) -> str:
        token = None if given is None else engine_auth._bearer_token(given)
        return "accepted" if token == KEY else engine_auth._refusal(given, token)

    def router(given: bytes | None) -> str:
        token = None if given is None else router_auth.bearer_token(given)
        return "accepted" if token == KEY else router_auth.refusal(given, token)

    assert engine(authorization) == router(authorization) == answer


def test_the_engine_names_a_missing_content_type_which_the_router_leaves_missing() -> None:
    """The router used to send a body without a Content-Type on as application/octet-stream
    (aiohttp's default), so the engine's 400 named that; now it sends none on (tested in
    test_bad_requests.py), and the engine's answer is this."""
    not_json = [{"type": "model_attributes_type", "loc": ("body",), "msg": "not an object"}]
    assert invalid_request(not_json, None).body()["error"]["message"] == (
        "request body must be JSON (no Content-Type): send a JSON object with "
        "Content-Type: application/json"
    )
