"""The offline batch-1 figures beside bench/gpu_serve_c1.sh's served c1 load, and how fast this
host is, so two sessions (or two trees in one session) compare like for like.

Same LLM settings as bench/offline_serve_requests.py and the server's defaults (256 sequences,
8192 tokens per step, bf16, max_model_len 4096), the same prompts (serve_client.py's
random.Random(7) ids). Figures: bs1 TTFT (one 512-token prompt step and its sample, best of 3),
bs1 TPOT (128 tokens, best of 3) and each one's step phases (the engine core's profile: schedule,
launch, collect, update, ms per step), then the host: a fixed pure-Python loop (ms) and the
host's launch cost of one small CUDA kernel (µs; the prompt step launches ~20 per layer).
It uses only what the engine had at 4ef429d too (run it with PYTHONPATH at either tree).
Usage: python bench/serve_offline_bs1.py CKPT OUT.json; prints the JSON."""

import json
import os
import random
import sys
import time

from offline_serve_requests import served_settings_llm

from kvfleet_engine import SamplingParams
from kvfleet_engine.core.profile import interval


def prompts(num: int, input_len: int) -> list[list[int]]:
    """serve_client.py's prompts for (NUM, IN)."""
    rnd = random.Random(7)
    high = int(os.environ.get("TOKEN_ID_HIGH", "120000"))  # a smaller vocabulary: smoke tests
    return [
        [rnd.randrange(min(1000, high // 2), high) for _ in range(input_len)] for _ in range(num)
    ]


def host_python_ms() -> float:
    """A fixed pure-Python loop, best of 5 (the interpreter's speed on this host)."""
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        total = 0
        for i in range(2_000_000):
            total += i & 7
        best = min(best, time.perf_counter() - began)
    return round(best * 1e3, 1)


def host_launch_us() -> float | None:
    """Host time to launch one small CUDA kernel (x.add_(1) on 256 floats), best of 5; None
    without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.zeros(256, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5000):
            x.add_(1)
        best = min(best, time.perf_counter() - began)
    torch.cuda.synchronize()
    return round(best / 5000 * 1e6, 2)


def main() -> None:
    ckpt, out_path = sys.argv[1:3]
    llm, res = served_settings_llm(ckpt, int(os.environ.get("MAX_MODEL_LEN", "4096")))
    profile = llm.engine.profile

    def gen(token_lists: list[list[int]], max_tokens: int) -> float:
        llm.engine.kv_cache.reset_prefix_cache()  # every run computes its prompt
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        began = time.perf_counter()
        llm.generate(prompt_token_ids=token_lists, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - began

    def phases(before, name: str) -> None:  # type: ignore[no-untyped-def]
        split = interval(before, profile.snapshot())
        res[f"{name}_phases_ms"] = {
            k: round(v["s"] / v["count"] * 1e3, 3) for k, v in split["phases"].items() if v["count"]
        }

    one = prompts(8, 512)
    gen(one[:1], 16)  # warm-up
    mark = profile.snapshot()
    first = min(gen([p], 1) for p in one[1:4])
    phases(mark, "bs1_ttft")
    mark = profile.snapshot()
    whole = min(gen([p], 128) for p in one[4:7])
    phases(mark, "bs1_128")
    res["bs1_ttft_ms"] = round(first * 1e3, 1)
    res["bs1_tpot_ms"] = round((whole - first) / 127 * 1e3, 2)
    res["host_python_ms"] = host_python_ms()
    res["host_launch_us"] = host_launch_us()
    print(json.dumps(res), flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
