"""On the GPU (device tool, bf16): greedy tokens equal transformers' on the same tiny random
checkpoints, ties judged at bf16 tolerance; CUDA graphs on and off agree. Marked `gpu`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import (
    ARCHITECTURES,
    assert_greedy_equal,
    random_prompts,
    reference_greedy,
    write_checkpoint,
)

from kvfleet_engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# bf16 keeps ~3 significant digits: logits of a few units differ by ~1e-2 between two correct
# implementations, so a gap below this is a tie.
BF16_TIE = 0.1
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LENGTHS = [1, 2, 16, 17, 45, 120, 300, 700]


@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-checkpoints")
    paths = {}
    for name in ARCHITECTURES:
        paths[name] = root / name
        paths[name].mkdir()
        write_checkpoint(name, paths[name], max_position_embeddings=2048)
    return paths


def hf_model(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def agree_but_near_ties(
    path: Path, prompts: list[list[int]], max_tokens: int, first: list, second: list
) -> None:
    """Two float32 runs' greedy tokens are equal, or differ only where transformers itself sees a
    near-tie (both then match its reference up to one)."""
    model = None
    for prompt, a, b in zip(prompts, first, second, strict=True):
        if a != b:
            model = model or hf_model(path, torch.float32)
            ref = reference_greedy(model, prompt, max_tokens)
            assert_greedy_equal(a, ref, "first run", 1e-3)
            assert_greedy_equal(b, ref, "second run", 1e-3)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_bf16_greedy_matches_transformers(name: str, gpu_checkpoints: dict[str, Path]) -> None:
    path = gpu_checkpoints[name]
    prompts = random_prompts(LENGTHS, seed=21)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=16)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    model = hf_model(path, torch.bfloat16)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = reference_greedy(model, prompt, GREEDY.max_tokens)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"{name} {len(prompt)}", BF16_TIE)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_bf16_first_step_logits_close(name: str, gpu_checkpoints: dict[str, Path]) -> None:
    path = gpu_checkpoints[name]
    prompts = random_prompts([5, 100, 600], seed=22)
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=16)
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY)
    runner = engine.model_runner
    logits = runner.compute_logits(runner.prepare_inputs(engine.scheduler.schedule())).cpu()
    model = hf_model(path, torch.bfloat16)
    for index, prompt in enumerate(prompts):
        expected = reference_greedy(model, prompt, 1).first_logits
        scale = expected.abs().max().item()
        torch.testing.assert_close(logits[index], expected, rtol=2e-2, atol=2e-2 * scale)


def test_bf16_scenarios_match_transformers(gpu_checkpoints: dict[str, Path]) -> None:
    """Prefix hits, preemption and chunked prefill together, on the GPU."""
    path = gpu_checkpoints["llama3"]
    prefix = random_prompts([160], seed=23)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 40, 90, 17, 64, 5], seed=24)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        max_model_len=320,
        kv_cache_blocks=24,  # 20 blocks hold one full sequence: the others must wait or yield
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    model = hf_model(path, torch.bfloat16)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = reference_greedy(model, prompt, params.max_tokens)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"{len(prompt)}", BF16_TIE)


def test_cuda_graphs_on_and_off_agree(gpu_checkpoints: dict[str, Path]) -> None:
    path = gpu_checkpoints["llama3"]
    prompts = random_prompts([3, 30, 200, 7, 64, 129, 1, 500], seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cuda",
            max_model_len=1024,
            max_num_seqs=16,
            enforce_eager=eager,
        )
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outputs]
        del llm
        torch.cuda.empty_cache()
    agree_but_near_ties(path, prompts, params.max_tokens, results[True], results[False])


def test_seeded_sampling_is_reproducible_on_gpu(gpu_checkpoints: dict[str, Path]) -> None:
    llm = LLM(
        str(gpu_checkpoints["llama3"]),
        dtype="bfloat16",
        device="cuda",
        max_model_len=512,
        max_num_seqs=16,
    )
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=5, max_tokens=16)
    prompts = random_prompts([10, 20, 30], seed=26)
    alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == batched[0].outputs[0].token_ids


def test_mixed_steps_of_any_shape_compile_each_kernel_once(
    gpu_checkpoints: dict[str, Path],
) -> None:
    """Batches of every size and mix reuse one compiled variant per kernel: a new variant means
    a Triton compile (hundreds of ms) in the middle of serving."""
    from kvfleet_engine.kernels.activation import _silu_and_mul_kernel
    from kvfleet_engine.kernels.fused import _rotary_store_kv_kernel
    from kvfleet_engine.kernels.prefill_attention import _prefill_kernel
    from kvfleet_engine.kernels.rms_norm import _rms_norm_kernel

    kernels = [_prefill_kernel, _rotary_store_kv_kernel, _rms_norm_kernel, _silu_and_mul_kernel]
    llm = LLM(
        str(gpu_checkpoints["llama3"]),
        dtype="bfloat16",
        device="cuda",
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=random_prompts([40], seed=30), sampling_params=params)
    device = torch.cuda.current_device()
    before = [len(kernel.device_caches[device][0]) for kernel in kernels]
    # Odd and even token counts, 1..23 sequences, chunked prompts next to decodes.
    lengths = [
        1,
        2,
        3,
        7,
        16,
        17,
        33,
        100,
        255,
        5,
        9,
        13,
        300,
        41,
        2,
        3,
        77,
        18,
        19,
        20,
        21,
        22,
        23,
    ]
    llm.generate(prompt_token_ids=random_prompts(lengths, seed=31), sampling_params=params)
    after = [len(kernel.device_caches[device][0]) for kernel in kernels]
    assert after == before, [k.fn.__name__ for k in kernels]


def test_eager_mixed_steps_of_any_shape_compile_the_attention_kernels_once(
    gpu_checkpoints: dict[str, Path],
) -> None:
    """Steps of more prompt tokens than the prompt graphs hold run eagerly; with 16+ decodes
    beside them (over a shared prefix), whatever their sequence count and block-table width,
    they reuse the attention kernels' variants compiled when the graphs were captured."""
    from kvfleet_engine.kernels.decode_kernels import decode_split_kernel
    from kvfleet_engine.kernels.partial_merge import decode_merge_kernel
    from kvfleet_engine.kernels.prefill_attention import _prefill_kernel
    from kvfleet_engine.kernels.shared_prefix import shared_prefix_kernel

    kernels = [decode_split_kernel, decode_merge_kernel, shared_prefix_kernel, _prefill_kernel]
    llm = LLM(
        str(gpu_checkpoints["llama3"]),
        dtype="bfloat16",
        device="cuda",
        max_model_len=2048,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    executor = llm.engine.model_runner.executor
    forward, eager_apart = executor.forward, []

    def recording(inputs: Any) -> Any:
        meta = inputs.attention
        eager_apart.append(meta.decodes_apart and inputs.input_ids.shape[0] > 1024)
        return forward(inputs)

    executor.forward = recording
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prefix = random_prompts([600], seed=36)[0]
    llm.generate(prompt_token_ids=[prefix], sampling_params=params, use_tqdm=False)
    device = torch.cuda.current_device()
    before = [len(kernel.device_caches[device][0]) for kernel in kernels]
    for count, seed in ((24, 37), (40, 38)):
        tails = random_prompts([300 + 17 * i for i in range(count)], seed=seed)
        prompts = [prefix + tail for tail in tails]
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    after = [len(kernel.device_caches[device][0]) for kernel in kernels]
    assert sum(eager_apart) >= 2, eager_apart
    assert after == before, [k.fn.__name__ for k in kernels]


def test_decode_over_a_shared_prefix_agrees_with_reading_it_per_sequence(
    gpu_checkpoints: dict[str, Path],
) -> None:
    """24 prompts behind one cached 600-token prefix decode in the shared-prefix CUDA graphs;
    their tokens are those of the same engine reading the prefix per sequence."""
    path = gpu_checkpoints["llama3"]
    prefix, *tails = random_prompts([600, *range(5, 29)], seed=34)
    prompts = [prefix + tail for tail in tails]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for shared in (True, False):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cuda",
            max_model_len=1024,
            max_num_seqs=32,
            shared_prefix_attention=shared,
        )
        runner = llm.engine.model_runner.executor
        assert runner.attention_features.shared_prefix_min == (512 if shared else 0)
        graphs = runner.decode_graphs
        assert ((32, True) in graphs.graphs) == shared
        llm.generate(prompt_token_ids=[prefix], sampling_params=params, use_tqdm=False)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[shared] = [o.outputs[0].token_ids for o in outputs]
        # The last shared-prefix replay's prefix: the 37 full blocks of the 600 tokens.
        assert int(graphs.shared[0]) == (37 * 16 if shared else 0)
        del llm, runner, graphs
        torch.cuda.empty_cache()
    agree_but_near_ties(path, prompts, params.max_tokens, results[True], results[False])


def test_mixed_steps_agree_with_their_decodes_apart_or_not(
    gpu_checkpoints: dict[str, Path],
) -> None:
    """24 prompts behind one cached 600-token prefix, 96 tokens a step: once 16 decode, the
    others' chunks share steps with them, replayed from the prompt graphs whose decode kernels
    attend the one-token sequences (over the shared prefix); their tokens are those of the same
    engine leaving the decodes to the prefill kernel."""
    path = gpu_checkpoints["llama3"]
    prefix, *tails = random_prompts([600, *range(5, 29)], seed=35)
    prompts = [prefix + tail for tail in tails]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=96,
    )
    executor = llm.engine.model_runner.executor
    features, graphs = executor.attention_features, executor.prompt_graphs
    assert features.decodes_apart and (96, True) in graphs.graphs
    llm.generate(prompt_token_ids=[prefix], sampling_params=params, use_tqdm=False)
    forward, apart_steps = executor.forward, []

    def recording(inputs: Any) -> Any:
        apart_steps.append(inputs.attention.decodes_apart)
        return forward(inputs)

    executor.forward = recording
    results = {}
    for apart in (True, False):
        executor.attention_features = dataclasses.replace(features, decodes_apart=apart)
        apart_steps.clear()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results[apart] = [o.outputs[0].token_ids for o in outputs]
        assert (sum(apart_steps) >= 3) == apart, apart_steps
        if apart:  # the last apart replay read the 37 full blocks of the prefix once
            assert int(graphs.shared[0]) == 37 * 16
    agree_but_near_ties(path, prompts, params.max_tokens, results[True], results[False])
