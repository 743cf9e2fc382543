"""A quantized InferenceDeployment end to end on the local control plane: an `int4-awq` resource
rolls out to Ready, its pods carry the operator's `--quantization awq`, its status shows the
format, and a real `kvfleet serve` (CPU) bound at the pod's IP loads a tiny AWQ checkpoint with
exactly those flags and answers a completion.

The checkpoint is the tiny random Llama of `kvfleet tiny-model` with every linear layer of its
blocks quantized to AutoAWQ's GEMM layout (the layout of AWQ checkpoints on the Hugging Face Hub,
which the engine's AWQ loader reads): `qweight` and `qzeros` int32 [in, out / 8] and
[in / group, out / 8], eight 4-bit values per int32 in the order 0 2 4 6 1 3 5 7; `scales`
float16 [in / group, out]; weight = (code - zero) × scale; embeddings, norms and lm head float16;
`config.json` with `quantization_config` {quant_method: awq, bits: 4, group_size, zero_point,
version: gemm}.

Skipped while the engine's `kvfleet serve` does not accept `--quantization awq`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from engine_pods import EnginePods
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until


def _engine_serves_awq() -> bool:
    from kvfleet_engine.server.cli import build_parser

    return "awq" in build_parser().format_help()


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not _engine_serves_awq(), reason="kvfleet serve does not accept --quantization awq yet"
    ),
]

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-awq"
GROUP_SIZE = 32  # divides the tiny model's hidden size (64) and MLP width (128)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column packed at bits 4i .. 4i + 3
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # bits (in fours) of output column j, as readers use
BLOCK_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
T = TypeVar("T")


def _pack_columns(codes: Any) -> Any:
    """int32 codes [rows, out] in 0..15 -> int32 [rows, out / 8] in AWQ's GEMM order."""
    import torch

    grouped = codes.reshape(codes.shape[0], -1, 8)  # [rows, out / 8, 8]
    packed = torch.zeros(grouped.shape[:2], dtype=torch.int32)
    for i, column in enumerate(AWQ_PACK_ORDER):
        packed |= grouped[:, :, column] << (4 * i)
    return packed


def quantize_awq(weight: Any, group_size: int) -> dict[str, Any]:
    """A float nn.Linear weight [out, in] -> AutoAWQ GEMM tensors (asymmetric, min/max per group
    of `group_size` input columns)."""
    import torch

    out_features, in_features = weight.shape
    w = weight.float().t().reshape(in_features // group_size, group_size, out_features)
    low, high = w.amin(dim=1), w.amax(dim=1)  # [in / group, out]
    scales = ((high - low) / 15).clamp(min=1e-6)
    zeros = torch.round(-low / scales).clamp(0, 15)
    codes = torch.round(w / scales[:, None, :] + zeros[:, None, :]).clamp(0, 15)
    return {
        "qweight": _pack_columns(codes.reshape(in_features, out_features).to(torch.int32)),
        "qzeros": _pack_columns(zeros.to(torch.int32)),
        "scales": scales.to(torch.float16),
    }


def dequantize_awq(qweight: Any, qzeros: Any, scales: Any) -> Any:
    """AutoAWQ GEMM tensors -> float32 weight [in, out], unpacked as AWQ readers do."""
    import torch

    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32)

    def unpack(packed: Any) -> Any:
        return ((packed[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1).float()

    group = qweight.shape[0] // scales.shape[0]
    zeros = unpack(qzeros).repeat_interleave(group, dim=0)
    return (unpack(qweight) - zeros) * scales.float().repeat_interleave(group, dim=0)


def write_tiny_awq_checkpoint(directory: Path, plain: Path) -> dict[str, int]:
    """A tiny AWQ checkpoint in `directory`, quantized from the tiny model written to `plain`;
    returns its model.hints (config.json's numbers)."""
    from safetensors.torch import load_file, save_file

    subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "tiny-model", str(plain)],
        check=True,
        capture_output=True,
    )
    config = json.loads((plain / "config.json").read_text())
    tensors = load_file(str(plain / "model.safetensors"))
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(BLOCK_LINEARS):
            out.update({f"{module}.{k}": v for k, v in quantize_awq(tensor, GROUP_SIZE).items()})
        else:
            out[name] = tensor.half()
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(directory / "model.safetensors"))
    for file in plain.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, directory / file.name)
    config["dtype"] = config["torch_dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    heads = config["num_attention_heads"]
    return {
        "numParameters": sum(t.numel() for t in tensors.values()),
        "numLayers": config["num_hidden_layers"],
        "numAttentionHeads": heads,
        "numKeyValueHeads": config["num_key_value_heads"],
        "headDim": config.get("head_dim") or config["hidden_size"] // heads,
        "hiddenSize": config["hidden_size"],
        "intermediateSize": config["intermediate_size"],
        "maxPositionEmbeddings": config["max_position_embeddings"],
    }


@pytest.fixture
def operator(cluster: E2ECluster, namespace: str, tmp_path: Path) -> Iterator[Path]:
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.wait_established("inferencedeployments.kvfleet.io")
    log_path = tmp_path / "operator.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_cli", "operator", "--namespace", namespace],
            env=cluster.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield log_path
    stop_child(proc, signal.SIGTERM, 20)


def tails(logs: Path) -> str:
    """The end of every log in `logs`: the operator's and each engine's."""
    return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in sorted(logs.glob("*.log")))


def wait(check: Callable[[], T | None], timeout: float, what: str, logs: Path) -> T:
    return wait_until(check, timeout, what, lambda: tails(logs))


def test_int4_awq_rolls_out_to_ready_and_serves(
    cluster: E2ECluster, namespace: str, operator: Path, tmp_path: Path
) -> None:
    kubectl = cluster.kubectl
    model, plain = tmp_path / "tiny-awq", tmp_path / "tiny-plain"
    hints = write_tiny_awq_checkpoint(model, plain)
    # The checkpoint holds the tiny model's weights to within half a quantization step (plus
    # float16 rounding of the scales), read back in the order AWQ readers unpack.
    from safetensors.torch import load_file

    original, packed = (load_file(str(d / "model.safetensors")) for d in (plain, model))
    q_proj = "model.layers.1.self_attn.q_proj"
    step = packed[f"{q_proj}.scales"].float().repeat_interleave(GROUP_SIZE, dim=0)
    weight = dequantize_awq(*(packed[f"{q_proj}.{k}"] for k in ("qweight", "qzeros", "scales")))
    assert float(((weight - original[f"{q_proj}.weight"].t()).abs() / step).max()) < 0.51
    manifest = {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"uri": f"file://{model}", "maxModelLen": 512, "hints": hints},
            "quantization": {"weights": "int4-awq"},
            "resources": {"accelerator": "h100-80gb"},
            "replicas": 1,
        },
    }
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))
    logs = operator.parent  # operator.log, then engine-POD.log

    def infd() -> dict[str, Any]:
        return dict(kubectl.json("get", "infd", NAME, "-n", namespace))

    def ready() -> dict[str, Any] | None:
        obj = infd()
        status = obj.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        done = status.get("observedGeneration") == 1 and conditions.get("Ready", {}).get("status")
        return obj if done == "True" else None

    obj = wait(ready, 90, "the int4-awq InferenceDeployment to be Ready", logs)
    status = obj["status"]
    assert status["quantization"] == "int4-awq"
    assert status["memoryPlan"]["source"] == "hints" and status["memoryPlan"]["fits"] is True
    columns = kubectl("get", "infd", NAME, "-n", namespace).splitlines()[1].split()
    assert columns[6] == "int4-awq", columns  # NAME MODEL READY REPLICAS ACCELERATOR TP QUANT..

    deployment = kubectl.json("get", "deployment", NAME, "-n", namespace)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    at = args.index("--quantization")
    quantization_flags = args[at : at + 2]
    assert quantization_flags == ["--quantization", "awq"]
    assert "--kv-cache-dtype" not in args

    # The engine on the pod's IP runs with the operator's own quantization flags.
    with EnginePods(
        kubectl, namespace, NAME, model, tmp_path, extra_args=quantization_flags
    ) as engines:

        def engine_ready() -> list[str]:
            exited = [name for name, (_, proc) in engines.procs.items() if proc.poll() is not None]
            assert not exited, f"the engine of {exited} exited\n{tails(logs)}"
            return engines.ready_ips()

        ips = wait(engine_ready, 240, "the AWQ engine to be ready", logs)
        response = httpx.post(
            f"http://{ips[0]}:8000/v1/completions",
            json={"model": NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True},
            timeout=60,
        )  # fmt: skip
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == NAME and body["usage"]["completion_tokens"] == 8, body
        assert body["choices"][0]["finish_reason"] == "length", body
