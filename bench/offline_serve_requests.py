"""The offline figures for the requests bench/gpu_serve_core.sh serves: the same token ids
(bench/serve_client.py's prompts: random.Random(7), ids in [1000, 120000)) through LLM.generate,
with the server's defaults (256 sequences, 8192 tokens per step).
Usage: python bench/offline_serve_requests.py CKPT OUT.json; prints one JSON line per figure."""

import json
import random
import sys
import time

from kvfleet_engine import LLM, SamplingParams


def prompts(num: int, input_len: int, shared: int = 0) -> list[list[int]]:
    """serve_client.py's prompts for (NUM, IN, SHARED_PREFIX)."""
    rnd = random.Random(7)
    prefix = [rnd.randrange(1000, 120000) for _ in range(shared)]
    return [
        prefix + [rnd.randrange(1000, 120000) for _ in range(input_len - shared)]
        for _ in range(num)
    ]


def main() -> None:
    ckpt, out_path = sys.argv[1:3]
    t0 = time.perf_counter()
    llm = LLM(
        model=ckpt,
        dtype="bfloat16",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        seed=0,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    res: dict[str, object] = {
        "system": "kvfleet-offline",
        "startup_s": round(time.perf_counter() - t0, 1),
    }

    def gen(token_lists: list[list[int]], max_tokens: int) -> tuple[float, int]:
        llm.engine.kv_cache.reset_prefix_cache()  # every run computes its prompts
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=token_lists, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    def report() -> None:
        print(json.dumps(res), flush=True)

    one = prompts(8, 512)
    gen(one[:1], 16)  # warm-up
    first, _ = min(gen([p], 1) for p in one[1:4])
    whole, _ = min(gen([p], 128) for p in one[4:7])
    res["bs1_ttft_ms"] = round(first * 1e3, 1)  # one 512-token prompt step plus one sample
    res["bs1_tpot_ms"] = round((whole - first) / 127 * 1e3, 2)
    report()
    c64 = prompts(256, 512)[:64]
    first64, _ = gen(c64, 1)
    whole64, _ = gen(c64, 256)
    res["bs64_tpot_ms"] = round((whole64 - first64) / 255 * 1e3, 2)
    report()
    c256 = prompts(512, 512)  # the c256 load's 512 requests
    seconds, tokens = gen(c256, 256)
    res["c256_requests_out_tok_s"] = round(tokens / seconds)
    report()
    shared = prompts(256, 2048, 1536)
    seconds, tokens = gen(shared, 128)
    res["shared_prefix_out_tok_s"] = round(tokens / seconds)
    report()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
