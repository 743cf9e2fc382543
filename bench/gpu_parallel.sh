#!/usr/bin/env bash
# Device call: tensor parallelism on the GPUs the machine has. (1) NCCL through parallel.groups
# at world size 1 (all-reduce, all-gather, broadcast); (2) the tiny llama3 in bf16 with CUDA
# graphs: greedy tokens at TP 1, then TP 2/4/8 where that many GPUs are visible, compared with
# TP 1; (3) batch-1 decode tok/s on the Llama-3.1-8B shape, random bf16 weights
# (bench/make_checkpoint.py), at each TP that fits. Prints a table; JSON in $OUT/parallel.json.
# Run: bash bench/gpu_parallel.sh, carrying .whl  (about 4 minutes on one H200; BENCH_8B=0 skips (3)).
set -uo pipefail
OUT=${OUT:-/tmp/kvfleet-gpu-parallel}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -m kvfleet_cli tiny-model /tmp/kvfleet-tiny --force >/dev/null || exit 1
if [ "${BENCH_8B:-1}" = 1 ] && [ ! -f /tmp/kvfleet-8b/config.json ]; then
  timeout 300 python3 bench/make_checkpoint.py /tmp/kvfleet-8b || echo "8B checkpoint failed"
fi
timeout -k 5 420 python3 - "$OUT" <<'PY'
import json, sys, time
import torch

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.config import ParallelConfig
from kvfleet_engine.parallel.groups import Groups, RankPlace

out, results = sys.argv[1], {"gpus": torch.cuda.device_count()}
# (1) NCCL at world size 1
parallel = ParallelConfig(master_port=29650)
groups = Groups.join(parallel, RankPlace.of(parallel, 0), torch.device("cuda", 0))
x = torch.arange(8, dtype=torch.float32, device="cuda").view(2, 4)
ok = bool((groups.all_reduce(x.clone()) == x).all() and (groups.all_gather_last(x) == x).all())
groups.broadcast_from_driver(x)
groups.leave()
results["nccl_world_1"] = ok
print(f"NCCL world size 1: {'ok' if ok else 'WRONG'}")

def run(path, tp, port, prompts, max_tokens, **kw):
    llm = LLM(path, device="cuda", dtype="bfloat16", tensor_parallel_size=tp, master_port=port,
              max_model_len=1024, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)  # warm
    began = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - began
    llm.engine.model_runner.shutdown()
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], seconds

# (2) greedy agreement, the tiny llama (4 heads, 2 KV heads), bf16, CUDA graphs
prompts = [[(7 * i + j) % 256 for j in range(5 + 9 * i)] for i in range(6)]
sizes = [tp for tp in (1, 2, 4, 8) if tp <= torch.cuda.device_count()]
ref, _ = run("/tmp/kvfleet-tiny", 1, 29660, prompts, 32)
print(f"{'TP':>3} {'tiny greedy = TP1':>18} {'8B batch-1 tok/s':>17}")
rows = []
for i, tp in enumerate(sizes):
    same = None
    if 1 < tp <= 4:  # the tiny model has 4 heads
        toks, _ = run("/tmp/kvfleet-tiny", tp, 29670 + 10 * i, prompts, 32)
        same = sum(a == b for a, b in zip(toks, ref))
    rate = None
    try:
        _, seconds = run("/tmp/kvfleet-8b", tp, 29720 + 10 * i, [[1] * 128], 256,
                         gpu_memory_utilization=0.8)
        rate = 256 / seconds
    except Exception as error:  # no checkpoint (BENCH_8B=0), or it does not fit
        print(f"  8B at TP {tp}: {type(error).__name__}: {str(error)[:120]}")
    rows.append({"tp": tp, "tiny_prompts_equal": same, "tiny_prompts": len(prompts),
                 "decode_tok_s_8b": rate})
    same_text = "reference" if same is None else f"{same}/{len(prompts)}"
    rate_text = "-" if rate is None else f"{rate:.1f}"
    print(f"{tp:>3} {same_text:>18} {rate_text:>17}")
results["rows"] = rows
json.dump(results, open(f"{out}/parallel.json", "w"), indent=1)
PY
echo "=== done ($(date +%T))"
