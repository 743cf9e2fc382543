"""`kvfleet bench throughput` (offline batch) and `kvfleet bench latency` (batch-1 decode) on a
model of a named shape with random weights, against `transformers` on the same weights and
workload (`--peer transformers`) and the roofline from ceilings measured at the start.

    kvfleet bench latency --shape llama-3.1-8b --peer transformers
    kvfleet bench throughput --shape llama-3.1-8b --num-prompts 512 --input-len 64:512 \\
        --output-len 256 --peer transformers
    kvfleet bench latency --shape llama-3.1-8b --quantization none,fp8,int8,awq,gptq

`--quantization` takes a comma-separated list, run one after the other in one process on the
same random weights: fp8 / int8 quantize the bf16 checkpoint at load; awq / gptq load a random
int4 checkpoint of the shape in that layout (group 128). Each has its own roofline, which
counts the packed bytes (fp8 / int8: 1 B per weight + a scale per channel; int4: 0.5 B + a
float16 scale and offset per group).
"""

from __future__ import annotations

from typing import Any

from kvfleet_engine.bench.offline_report import ceiling_rows, finish, label
from kvfleet_engine.bench.offline_runner import (
    free_device_memory,
    kvfleet_latency,
    kvfleet_throughput,
    missing_gpu,
    setup,
    try_peer,
)
from kvfleet_engine.bench.offline_workloads import (
    latency_args,
    latency_workload,
    throughput_args,
    throughput_workload,
)


def throughput(argv: list[str]) -> int:
    args = throughput_args(argv)
    prompts, peer_prompts, workload = throughput_workload(args)
    if missing_gpu("throughput", args.shape):
        return 2
    with setup(args) as s:
        from kvfleet_engine.bench import peers, roofline
        from kvfleet_engine.bench.results import Row

        rows = ceiling_rows(s)
        if args.peer == "transformers":

            def run_peer() -> list[Any]:
                rate, _ = peers.generate_batch_throughput(s.hf_model, peer_prompts, args.output_len)
                return [Row("transformers-generate_batch", "output_tokens_per_s", rate, "tokens/s")]

            rows += try_peer("transformers generate_batch", workload, run_peer)
        s.release_peer()
        for name in args.quantization:
            rows += kvfleet_throughput(args, s, prompts, name)
            free_device_memory(s)
            ideal = roofline.offline_seconds(
                s.costs[name],
                s.ceilings,
                [len(p) for p in prompts],
                args.output_len,
                args.max_num_seqs,
            )
            rate = args.num_prompts * args.output_len / ideal
            rows.append(Row(label("roofline", name), "output_tokens_per_s", rate, "tokens/s"))
        return finish(args, argv, "throughput", s, workload, rows)


def latency(argv: list[str]) -> int:
    args = latency_args(argv)
    prompts, workload = latency_workload(args)
    if missing_gpu("latency", args.shape):
        return 2
    with setup(args) as s:
        from kvfleet_engine.bench import peers, roofline
        from kvfleet_engine.bench.results import Row

        rows = ceiling_rows(s)
        if args.peer == "transformers" and args.batch_size == 1:

            def run_peer() -> list[Any]:
                rate = peers.generate_decode_rate(s.hf_model, prompts[0], args.output_len)
                return [Row("transformers-generate", "decode_tokens_per_s", rate, "tokens/s")]

            rows += try_peer("transformers generate", workload, run_peer)
        s.release_peer()
        for name in args.quantization:
            rows += kvfleet_latency(args, s, prompts, name)
            free_device_memory(s)
            step = roofline.decode_step_seconds(
                s.costs[name], s.ceilings, args.batch_size, args.input_len + args.output_len / 2
            )
            source = label("roofline", name)
            rows.append(Row(source, "decode_tokens_per_s", 1 / step, "tokens/s"))
            rows.append(Row(source, "inter_token_latency_ms", step * 1e3, "ms"))
        return finish(args, argv, "latency", s, workload, rows)
