"""What the kvfleet engine can serve today. The operator and the engine meet only at the
`kvfleet serve` command line (tests/operator/test_engine_contract.py parses every rendered
argument list with the engine's own parser); these sets say which spec values the operator may
hand it: `--tensor-parallel-size` 1, 2, 4 or 8, on one node or several (`--nnodes`: a replica
whose ranks outgrow a node's devices); `--pipeline-parallel-size` any size (the plan refuses
one larger than the model's layers, and the engine checks it again); `--quantization` int8,
fp8, awq and gptq (render.py maps the CRD's names onto the engine's), none of them for a GGUF
file; `--kv-cache-dtype` auto, fp8 or int8.

The CRD accepts the full API so that plans for larger topologies are computed and reported; an
InferenceDeployment that needs a value outside these sets is reported as Stalled with reason
FeatureUnavailable, and nothing is rolled out for it. Widen a set when the engine gains the
feature; no CRD change is needed."""

from __future__ import annotations

from kvfleet_operator.models import InferenceDeploymentSpec

TENSOR_PARALLEL_SIZES = frozenset({1, 2, 4, 8})
WEIGHT_QUANTIZATIONS = frozenset({"none", "int8", "fp8", "int4-awq", "int4-gptq"})
KV_CACHE_QUANTIZATIONS = frozenset({"auto", "fp8", "int8"})
# Whether a GGUF file's weights stay in their quantized blocks in GPU memory: the engine keeps
# the block linears (q, k, v, o, gate, up, down) of the GGUF_KEPT_QUANTIZED types quantized on
# CUDA, so the memory plan counts each header tensor at its engine bytes (plan.py).
GGUF_WEIGHTS_STAY_QUANTIZED = True
# GGUF type -> (kind, bytes per weight on the GPU) in the engine's layouts (group 32 with fp16
# scales, kvfleet_engine/quant/layout.py: int8 1 + 2/32, int4 0.5 + (2 + 2)/32). A fused q/k/v
# or gate/up whose parts differ in kind, and every other tensor (embeddings, output, Q5_x, Q6_K,
# F16 linears, norms), is dequantized to bf16.
GGUF_KEPT_QUANTIZED = {
    "Q8_0": ("int8", 1 + 2 / 32),
    "Q4_0": ("int4", 0.5 + 4 / 32),
    "Q4_1": ("int4", 0.5 + 4 / 32),
    "Q4_K": ("int4", 0.5 + 4 / 32),
}


def unavailable_features(spec: InferenceDeploymentSpec) -> list[str]:
    """One message per spec field whose value the engine cannot serve yet."""
    missing = []
    if spec.parallelism.tensor not in TENSOR_PARALLEL_SIZES:
        missing.append(
            f"parallelism.tensor={spec.parallelism.tensor}: the engine serves tensor parallel "
            f"size {_one_of(TENSOR_PARALLEL_SIZES)} only for now"
        )
    if spec.quantization.weights not in WEIGHT_QUANTIZATIONS:
        missing.append(
            f"quantization.weights={spec.quantization.weights}: the engine serves "
            f"{_one_of(WEIGHT_QUANTIZATIONS)} weights only for now"
        )
    if spec.model.is_gguf and spec.quantization.weights != "none":
        missing.append(
            f"quantization.weights={spec.quantization.weights}: a GGUF file's tensors keep their "
            "own formats (the engine refuses --quantization for it); set none"
        )
    if spec.quantization.kv_cache not in KV_CACHE_QUANTIZATIONS:
        missing.append(
            f"quantization.kvCache={spec.quantization.kv_cache}: the engine keeps the KV cache "
            f"as {_one_of(KV_CACHE_QUANTIZATIONS)} only for now"
        )
    return missing


def _one_of(values: frozenset[object]) -> str:
    return " or ".join(sorted(str(v) for v in values))
