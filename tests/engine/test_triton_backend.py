"""The engine on the Triton attention backend, run by the Triton interpreter on CPU: the same
greedy tokens as transformers, so the runner feeds the kernels what the reference backend takes;
a prompt CUDA graph's padded forward (what `cuda_graphs.PromptGraphs` captures) computing
the logits the eager forward does; decode steps over a shared cached prefix giving the
tokens they give without reading it once for all; and steps that mix decodes with prompt chunks
giving the same tokens with their decodes attended by the decode kernels or by the prefill one.

TRITON_INTERPRET must be set before triton is first imported (transformers imports it), so the
engine runs in a fresh subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_cases import assert_greedy_equal, random_prompts, run_interpreted
from engine_checkpoints import Checkpoints

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check"),
]

PATCH = """
from triton.runtime import interpreter

original = interpreter._patch_lang_tensor

def patched(tensor, scope):
    # The interpreter keeps scalars as 1-element arrays; numpy >= 2.4 refuses int(array).
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

interpreter._patch_lang_tensor = patched
"""

SCRIPT = (
    PATCH
    + """
import json, sys
from kvfleet_engine import LLM, SamplingParams

path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, device="cpu", attention_backend="triton", max_model_len=256,
          max_num_batched_tokens=32, max_num_seqs=4)
params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""
)


def test_triton_backend_matches_transformers(checkpoints: Checkpoints) -> None:
    prompts = random_prompts([1, 17, 40, 5], seed=31)
    path: Path = checkpoints.path("qwen3")
    tokens = run_interpreted(SCRIPT, str(path), json.dumps(prompts), timeout=600)
    for prompt, engine_tokens in zip(prompts, tokens, strict=True):
        ref = checkpoints.reference("qwen3", prompt, 5)
        assert_greedy_equal(engine_tokens, ref, f"prompt of {len(prompt)}")


PADDED_SCRIPT = (
    PATCH
    + """
import json, sys
from dataclasses import dataclass
import torch
from kvfleet_engine import LLM
from kvfleet_engine.cuda_graphs import PromptGraphs
from kvfleet_engine.runner.inputs import build_inputs
from kvfleet_engine.step import PENDING_TOKEN

@dataclass
class Item:
    request_id: str
    token_ids: list
    start_position: int
    block_ids: list
    sample: bool

llm = LLM(sys.argv[1], device="cpu", attention_backend="triton", max_model_len=256,
          max_num_batched_tokens=64, max_num_seqs=4, kv_cache_blocks=16)
ex = llm.engine.model_runner.executor
g = torch.Generator().manual_seed(3)
def tokens(n):
    return torch.randint(1, 200, (n,), generator=g).tolist()
# Step 1 caches a 16-token prompt (blocks 1, 2) and a 30-token one (blocks 3, 4).
first = [Item("a", tokens(16), 0, [1, 2], False), Item("b", tokens(30), 0, [3, 4], True)]
ex.forward(build_inputs(first, 16, ex.device, {}))
# Step 2 mixes a chunk after a's cached prefix, b's decode (its token still a pending sample on
# the device) and a new 7-token prompt: 17 tokens of 3 sequences, into a 32-token graph of 4.
second = [
    Item("a", tokens(9), 16, [1, 2], True),
    Item("b", [PENDING_TOKEN], 30, [3, 4], True),
    Item("c", tokens(7), 0, [5], True),
]
inputs = build_inputs(second, 16, ex.device, {"b": 1})
ex.last_samples = torch.tensor([11, 42])
eager = ex.forward(inputs)[0]
graphs = PromptGraphs(ex.model, 64, 4, 16, ex.device, ex.attention_features)
size, apart = graphs.load(inputs.input_ids, inputs.positions, inputs.attention,
                          inputs.pending_sources, ex.last_samples)
hidden = graphs._forward((size, apart))
padded = ex.model.compute_logits(hidden[inputs.logits_indices]).float()
# Block 0 is no sequence's: the padding tokens (slot -1) must not have written there.
untouched = all(bool((cache[0] == 0).all()) for layer in ex.kv_caches for cache in layer[:2])
print(json.dumps({"size": size, "apart": apart, "rows": list(padded.shape), "untouched": untouched,
                  "max_abs_diff": float((padded - eager).abs().max()),
                  "scale": float(eager.abs().max())}))
"""
)


def test_prompt_graph_padded_forward_matches_the_eager_forward(checkpoints: Checkpoints) -> None:
    result = run_interpreted(PADDED_SCRIPT, str(checkpoints.path("llama3")), timeout=600)
    assert result["size"] == 32 and result["rows"][0] == 3 and result["untouched"]
    assert not result["apart"]  # one decode: the prefill kernel's
    assert result["max_abs_diff"] <= 1e-5 * max(1.0, result["scale"]), result


SHARED_SCRIPT = (
    PATCH
    + """
import dataclasses, json, sys
from kvfleet_engine import LLM, SamplingParams
import kvfleet_engine.runner.inputs as step_inputs

step_inputs.SHARED_PREFIX_MIN_SEQS = 4  # 16 on a GPU: the same steps at a quarter of the rows
path, prefix, tails = sys.argv[1], *json.loads(sys.argv[2])
llm = LLM(path, device="cpu", attention_backend="triton", max_model_len=256, max_num_seqs=6)
ex = llm.engine.model_runner.executor
features = ex.attention_features
assert features.shared_prefix_min == 512, features  # the default on this backend
forward, shared_steps = ex.forward, []
def counting(inputs):
    shared_steps.append(inputs.attention.shared_prefix is not None)
    return forward(inputs)
ex.forward = counting
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
llm.generate(prompt_token_ids=[prefix], sampling_params=params, use_tqdm=False)  # caches it
prompts = [prefix + tail for tail in tails]
runs = {}
for shared_min in (32, 0):  # a 32-token prefix shared (2 blocks), then never
    ex.attention_features = dataclasses.replace(features, shared_prefix_min=shared_min)
    shared_steps.clear()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    runs[shared_min] = {"tokens": [o.outputs[0].token_ids for o in outputs],
                        "shared_steps": sum(shared_steps),
                        "counted": llm.engine.stats().shared_prefix_steps_total}
print(json.dumps(runs))
"""
)


def test_decode_over_a_shared_cached_prefix_gives_the_same_tokens(checkpoints: Checkpoints) -> None:
    prefix, *tails = random_prompts([40, *range(3, 9)], seed=33)
    runs = run_interpreted(
        SHARED_SCRIPT, str(checkpoints.path("llama3")), json.dumps([prefix, tails]), timeout=600
    )
    shared, plain = runs["32"], runs["0"]
    assert shared["shared_steps"] >= 5 and plain["shared_steps"] == 0, runs
    # The engine's counter (kvfleet_shared_prefix_steps_total) counts those steps, no others.
    assert shared["counted"] == plain["counted"] == shared["shared_steps"], runs
    assert shared["tokens"] == plain["tokens"]


MIXED_SCRIPT = (
    PATCH
    + """
import dataclasses, json, sys
from kvfleet_engine import LLM, SamplingParams
import kvfleet_engine.runner.inputs as step_inputs

# Decode rows go apart, and over a prefix 4 of them share, from 4 rows (16 on a GPU): the same
# steps at a quarter of the rows, which the interpreter runs in a quarter of the time.
step_inputs.DECODES_APART_MIN_SEQS = step_inputs.SHARED_PREFIX_MIN_SEQS = 4
path, prefix, tails = sys.argv[1], *json.loads(sys.argv[2])
# 24 tokens a step: once 4 requests decode, the others' prompt chunks share steps with them.
llm = LLM(path, device="cpu", attention_backend="triton", max_model_len=256, max_num_seqs=8,
          max_num_batched_tokens=24)
ex = llm.engine.model_runner.executor
features = ex.attention_features
assert features.decodes_apart, features  # this backend's
forward, steps = ex.forward, []
def recording(inputs):
    meta = inputs.attention
    steps.append((meta.decodes_apart, meta.decodes_apart and meta.shared_prefix is not None))
    return forward(inputs)
ex.forward = recording
params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
once = SamplingParams(temperature=0.0, max_tokens=1)
llm.generate(prompt_token_ids=[prefix], sampling_params=once, use_tqdm=False)  # caches it
prompts = [prefix + tail for tail in tails]
runs = {}
for apart in (True, False):
    ex.attention_features = dataclasses.replace(features, shared_prefix_min=32, decodes_apart=apart)
    steps.clear()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    runs[apart] = {"tokens": [o.outputs[0].token_ids for o in outputs],
                   "apart_steps": sum(a for a, _ in steps),
                   "apart_shared_steps": sum(s for _, s in steps)}
print(json.dumps(runs))
"""
)


def test_mixed_steps_give_the_same_tokens_with_their_decodes_apart(
    checkpoints: Checkpoints,
) -> None:
    prefix, *tails = random_prompts([40, *range(10, 18)], seed=34)
    runs = run_interpreted(
        MIXED_SCRIPT, str(checkpoints.path("llama3")), json.dumps([prefix, tails]), timeout=600
    )
    apart, together = runs["true"], runs["false"]
    # Steps with 4+ decodes beside a prompt chunk happened, some over the shared prefix.
    assert apart["apart_steps"] >= 3 and apart["apart_shared_steps"] >= 1, runs
    assert together["apart_steps"] == 0, runs
    assert apart["tokens"] == together["tokens"]
