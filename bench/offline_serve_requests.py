"""The offline figures for the requests bench/gpu_serve_core.sh serves: the same token ids
(bench/serve_client.py's prompts: random.Random(7), ids in [1000, 120000)) through LLM.generate,
with the server's defaults (256 sequences, 8192 tokens per step), and the process set up as the
engine core sets up its own (`core.heap.settle`: start-up objects frozen out of GC, young
collections every 20,000 allocations), so the figures compare like for like with the served
ones. Each figure's step phases (the engine core's profile: schedule,
launch, collect, update; GC pauses) come with it, under the same names as the served core's
in `GET /debug/profile`.
Usage: python bench/offline_serve_requests.py CKPT OUT.json; prints one JSON line per figure."""

import json
import random
import sys
import time

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.core import heap
from kvfleet_engine.core.profile import interval


def prompts(num: int, input_len: int, shared: int = 0) -> list[list[int]]:
    """serve_client.py's prompts for (NUM, IN, SHARED_PREFIX)."""
    rnd = random.Random(7)
    prefix = [rnd.randrange(1000, 120000) for _ in range(shared)]
    return [
        prefix + [rnd.randrange(1000, 120000) for _ in range(input_len - shared)]
        for _ in range(num)
    ]


def served_settings_llm(ckpt: str, max_model_len: int = 4096) -> tuple[LLM, dict[str, object]]:
    """The offline engine with the served runs' settings, GC frozen as the engine core does once
    its model is loaded; the result record started with its start-up time."""
    t0 = time.perf_counter()
    llm = LLM(
        model=ckpt,
        dtype="bfloat16",
        max_model_len=max_model_len,
        gpu_memory_utilization=0.9,
        seed=0,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    res: dict[str, object] = {
        "system": "kvfleet-offline",
        "startup_s": round(time.perf_counter() - t0, 1),
    }
    heap.settle()
    llm.engine.profile.track_gc()
    return llm, res


def main() -> None:
    ckpt, out_path = sys.argv[1:3]
    llm, res = served_settings_llm(ckpt)
    profile = llm.engine.profile

    def phases(before, name: str) -> None:  # type: ignore[no-untyped-def]
        """The step phases since `before`: ms per step for each, and GC pauses."""
        split = interval(before, profile.snapshot())
        res[f"{name}_phases_ms"] = {
            k: round(v["s"] / max(v["count"], 1) * 1e3, 3)
            for k, v in split["phases"].items()
            if v["count"]
        }
        res[f"{name}_phase_counts"] = {
            k: v["count"] for k, v in split["phases"].items() if v["count"]
        }
        res[f"{name}_gc"] = {"collections": split["gc_collections"], "pause_s": split["gc_pause_s"]}

    def gen(token_lists: list[list[int]], max_tokens: int, cold: bool = True) -> tuple[float, int]:
        if cold:  # the run computes all its prompts
            llm.engine.kv_cache.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=token_lists, sampling_params=params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    def report() -> None:
        print(json.dumps(res), flush=True)

    one = prompts(8, 512)
    gen(one[:1], 16)  # warm-up
    mark = profile.snapshot()
    first, _ = min(gen([p], 1) for p in one[1:4])
    phases(mark, "bs1_ttft")  # three prefills of 512 tokens: launch vs collect per step
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
    mark = profile.snapshot()
    seconds, tokens = gen(c256, 256)
    res["c256_requests_out_tok_s"] = round(tokens / seconds)
    phases(mark, "c256")
    report()
    # As served: c256 runs after c64, whose 256 requests are c256's first 256 (one seed), so
    # the prefix cache holds half of its prompts.
    kv = llm.engine.kv_cache
    gen(prompts(256, 512), 256)
    hits, queries = kv.prefix_cache_hits_total, kv.prefix_cache_queries_total
    seconds, tokens = gen(c256, 256, cold=False)
    res["c256_after_c64_out_tok_s"] = round(tokens / seconds)
    res["c256_after_c64_cached"] = round(
        (kv.prefix_cache_hits_total - hits) / (kv.prefix_cache_queries_total - queries), 3
    )
    report()
    shared = prompts(256, 2048, 1536)
    seconds, tokens = gen(shared, 128)
    res["shared_prefix_out_tok_s"] = round(tokens / seconds)
    report()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
