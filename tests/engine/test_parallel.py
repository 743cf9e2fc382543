"""Tensor parallelism on the CPU (gloo, float32): TP 2 and TP 4 give TP 1's greedy tokens on
every architecture the tiny checkpoints cover (grouped KV heads split, a single KV head
replicated, tied embeddings, q/k/v bias, q/k norms), through prefix hits, preemption, chunked
prefill and async scheduling; bad sizes are refused naming the numbers; a rank that dies fails
the next call with its reason instead of hanging. Each world is spawned once per test."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from parallel_cases import SETTINGS, assert_same_greedy, generate_twice

from kvfleet_engine import SamplingParams
from kvfleet_engine.model_runner import RankFailed


def _check_equal(
    world: Callable[..., Any], make_llm: Callable[..., Any], name: str, tp: int
) -> None:
    reference = generate_twice(make_llm(name, **SETTINGS))
    llm = world(name, tp)
    outputs = generate_twice(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0, "the test meant to preempt"
    assert stats.prefix_cache_hits_total > 0, "the test meant to hit the prefix cache"
    assert_same_greedy(outputs, reference, f"{name} tp{tp}")


def test_tp2_tied_embeddings_and_qkv_bias(world: Any, make_llm: Any) -> None:
    _check_equal(world, make_llm, "qwen2", 2)


def test_tp4_replicates_the_single_kv_head(world: Any, make_llm: Any) -> None:
    _check_equal(world, make_llm, "mistral", 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "tp"), [("llama3", 2), ("llama2-tied", 2), ("mistral", 2), ("qwen3", 2), ("qwen3", 4)]
)
def test_every_architecture(world: Any, make_llm: Any, name: str, tp: int) -> None:
    _check_equal(world, make_llm, name, tp)


def test_sizes_that_do_not_split_are_refused(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"
    ):
        make_llm("llama3", tensor_parallel_size=3)
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=3 is larger than the model's 2 layers"
    ):
        make_llm("llama3", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"nnodes must be a divisor of the world size .* = 2"):
        make_llm("llama3", tensor_parallel_size=2, nnodes=3)
    with pytest.raises(ValueError, match=r"node_rank must be 0 for the engine .* got 1"):
        make_llm("llama3", tensor_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="parallel_join_timeout_s must be a finite number"):
        make_llm("llama3", parallel_join_timeout_s=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        make_llm("llama3", tensor_parallel_size=0)


def test_kv_heads_that_do_not_split_are_refused() -> None:
    from kvfleet_engine.config import ModelConfig, ParallelConfig, check_model_split

    hf_config = dict(
        num_attention_heads=12, num_key_value_heads=3, intermediate_size=96, num_hidden_layers=2
    )
    model = ModelConfig(
        "m", "safetensors", "LlamaForCausalLM", "float32", 64, frozenset(), hf_config
    )
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=4 and the model's num_key_value_heads=3: one must divide",
    ):
        check_model_split(model, ParallelConfig(tensor_parallel_size=4))
    check_model_split(model, ParallelConfig(tensor_parallel_size=6))  # KV heads replicated


def test_more_ranks_than_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvfleet_engine.runner.executor import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"4 ranks on this host .* need 4 GPUs; 2 visible"):
        resolve_device("cuda", 0, 4)


def test_a_rank_that_dies_fails_the_call(world: Any) -> None:
    llm = world("llama3", 2, max_model_len=512, kv_cache_blocks=64, max_num_batched_tokens=64)
    (pid,) = llm.engine.model_runner.workers.pids.values()
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL)).start()  # while it generates
    began = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
        while time.monotonic() - began < 30:
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert time.monotonic() - began < 30
    with pytest.raises(RankFailed, match="rank 1"):  # and every call after it
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)


def test_a_leader_taking_other_hosts_on_the_default_key_warns(monkeypatch, caplog) -> None:
    from kvfleet_engine.config import ParallelConfig
    from kvfleet_engine.parallel import channel

    two_hosts = ParallelConfig(tensor_parallel_size=2, nnodes=2)
    monkeypatch.delenv(channel.AUTHKEY_ENV, raising=False)
    with caplog.at_level("WARNING"):
        channel.warn_if_default_key(ParallelConfig(tensor_parallel_size=2))  # one host: quiet
        assert caplog.records == []
        channel.warn_if_default_key(two_hosts)
    assert "set KVFLEET_PARALLEL_AUTHKEY to the same secret on every host" in caplog.text
    caplog.clear()
    monkeypatch.setenv(channel.AUTHKEY_ENV, "a-secret-of-this-deployment")
    channel.warn_if_default_key(two_hosts)
    assert caplog.records == [] and channel.authkey() == b"a-secret-of-this-deployment"


def test_the_leader_refuses_strangers_and_goes_on_accepting_ranks(caplog) -> None:
    """A client with another key, or one that connects and closes (a port probe), is refused
    with a warning; the rank after it still joins."""
    import socket
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from kvfleet_engine.parallel.listener import RankListener

    listener = RankListener(("127.0.0.1", 0), b"the-group-key")
    with caplog.at_level("WARNING"):
        listener.start()
        with pytest.raises(AuthenticationError):
            Client(listener.address, authkey=b"another-key")
        socket.create_connection(listener.address).close()  # a probe
        rank = Client(listener.address, authkey=b"the-group-key")
        assert _eventually(lambda: listener.joined == 1 and len(_refusals(caplog)) == 2)
    joined = listener.close()
    assert len(joined) == 1
    refusals = _refusals(caplog)
    assert any("AuthenticationError" in r for r in refusals), refusals
    joined[0].send_bytes(b"step")  # the joined connection is the rank's
    assert rank.recv_bytes() == b"step"
    rank.close()
    joined[0].close()


def test_a_silent_connection_does_not_hold_up_the_ranks_behind_it(caplog) -> None:
    """One that connects and never answers the challenge is refused at the time limit, and a
    rank that connects after it joins at once, not after that limit."""
    import socket
    import time
    from multiprocessing.connection import Client

    from kvfleet_engine.parallel.listener import RankListener

    listener = RankListener(("127.0.0.1", 0), b"the-group-key", handshake_timeout_s=3.0)
    with caplog.at_level("WARNING"):
        listener.start()
        silent = socket.create_connection(listener.address)
        time.sleep(0.2)  # its challenge is under way
        started = time.monotonic()
        rank = Client(listener.address, authkey=b"the-group-key")
        assert _eventually(lambda: listener.joined == 1)
        assert time.monotonic() - started < 2.0  # not behind the silent one's 3 s
        assert _refusals(caplog) == []
        assert _eventually(lambda: _refusals(caplog) != [], within=6.0)
    assert _refusals(caplog) == [
        "refused a connection to the step channel from 127.0.0.1: no answer to the key's "
        "challenge within 3 s"
    ]
    assert silent.recv(1 << 16) != b""  # it had the challenge, then
    silent.settimeout(1.0)
    assert silent.recv(1 << 16) == b""  # its connection was closed
    silent.close()
    assert len(listener.close()) == 1
    rank.close()


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]


def _eventually(check, within: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
