"""The engine on the Triton attention backend, run by the Triton interpreter on CPU: the same
greedy tokens as transformers, so the runner feeds the kernels what the reference backend takes.

TRITON_INTERPRET must be set before triton is first imported (transformers imports it), so the
engine runs in a fresh subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_cases import assert_greedy_equal, random_prompts

from conftest import Checkpoints

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check"),
]

SCRIPT = """
import json, sys
from triton.runtime import interpreter

original = interpreter._patch_lang_tensor

def patched(tensor, scope):
    # The interpreter keeps scalars as 1-element arrays; numpy >= 2.4 refuses int(array).
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

interpreter._patch_lang_tensor = patched
from kvfleet_engine import LLM, SamplingParams

path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(path, device="cpu", attention_backend="triton", max_model_len=256,
          max_num_batched_tokens=32, max_num_seqs=4)
params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


def test_triton_backend_matches_transformers(checkpoints: Checkpoints) -> None:
    prompts = random_prompts([1, 17, 40, 5], seed=31)
    path: Path = checkpoints.path("qwen3")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), json.dumps(prompts)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, engine_tokens in zip(prompts, tokens, strict=True):
        ref = checkpoints.reference("qwen3", prompt, 5)
        assert_greedy_equal(engine_tokens, ref, f"prompt of {len(prompt)}")
