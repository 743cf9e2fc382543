"""Hostile or broken checkpoints: a ValueError naming the file and what is wrong in it, before
anything is allocated — never a hang on a billion layers, an allocation of terabytes trusted
from a size field, a tensor silently loaded as something else, or a read outside the model
directory."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from engine_cases import write_checkpoint
from engine_checkpoints import Checkpoints
from gguf_files import write_gguf
from parallel_cases import free_port_pair
from safetensors.torch import load_file, save_file

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.config.model_checks import check_sizes
from kvfleet_engine.llm import LLM
from kvfleet_engine.tokenizer import load_tokenizer

Edit = Callable[[Path], None]


def _config(**changes: Any) -> Edit:
    def edit(directory: Path) -> None:
        config_file = directory / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))

    return edit


def _without(key: str) -> Edit:
    def edit(directory: Path) -> None:
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text())
        del config[key]
        config_file.write_text(json.dumps(config))

    return edit


def _tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Edit:
    def edit(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        change(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    return edit


def _as_int8(tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int8)


def _write(name: str, text: str) -> Edit:
    return lambda directory: (directory / name).write_text(text)


def _edited(source: Path, tmp_path: Path, edit: Edit) -> Path:
    """A copy of the checkpoint `source` with `edit` made to it."""
    directory = tmp_path / "m"
    shutil.copytree(source, directory)
    edit(directory)
    return directory


CONFIG = "config.json"
CASES: dict[str, tuple[Edit, str]] = {
    "a billion layers": (
        _config(num_hidden_layers=10**9),
        f"{CONFIG}: 'num_hidden_layers' is 1000000000, but the checkpoint's tensors hold 2 layers",
    ),
    "a vocabulary of 10**12": (
        _config(vocab_size=10**12),
        rf"{CONFIG}: 'vocab_size' and 'hidden_size' are \[1000000000000, 64\], but the "
        r"checkpoint's model.embed_tokens.weight has shape \[260, 64\]",
    ),
    "an MLP of 10**9": (
        _config(intermediate_size=10**9),
        rf"{CONFIG}: its sizes .* make 384000024576 layer weights, more than the checkpoint's "
        r"\d+ bytes of tensors can hold",
    ),
    "10**12 positions": (
        _config(max_position_embeddings=10**12),
        rf"{CONFIG}: 'max_position_embeddings' must be at most 16777216, got 1000000000000",
    ),
    "KV heads that do not divide the heads": (
        _config(num_key_value_heads=3),
        rf"{CONFIG}: 'num_key_value_heads' \(3\) must divide 'num_attention_heads' \(4\)",
    ),
    "hidden size not a multiple of the heads": (
        _config(hidden_size=66, head_dim=None),
        rf"{CONFIG}: 'hidden_size' \(66\) must be a multiple of 'num_attention_heads' \(4\)",
    ),
    "architectures a number": (
        _config(architectures=5),
        rf"{CONFIG}: 'architectures' must be a list like \[\"LlamaForCausalLM\"\], got 5",
    ),
    "architectures a string": (
        _config(architectures="LlamaForCausalLM"),
        rf"{CONFIG}: 'architectures' must be a list",
    ),
    "no rms_norm_eps": (
        _without("rms_norm_eps"),
        rf"{CONFIG}: 'rms_norm_eps' must be a number in \(0, 1\), got None",
    ),
    "tie_word_embeddings a string": (
        _config(tie_word_embeddings="false"),
        rf"{CONFIG}: 'tie_word_embeddings' must be true or false, got 'false'",
    ),
    "rope_parameters a string": (
        _config(rope_parameters="x"),
        rf"{CONFIG}: 'rope_parameters' must be an object or null, got 'x'",
    ),
    "llama3 rope without its factor": (
        _config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
        rf"{CONFIG}: rope_parameters.factor must be a number > 0 for llama3 rope scaling",
    ),
    "rope_parameters of an unknown type": (
        _config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        rf"{CONFIG}: rope_parameters: rope type 'yarn' is not supported; supported: default, "
        "llama3, frequency_factors",
    ),
    "rope_scaling of an unknown type": (
        _config(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}),
        rf"{CONFIG}: rope_scaling: rope type 'linear' is not supported",
    ),
    "dtype int8": (
        _config(dtype="int8"),
        rf"{CONFIG}: 'dtype' must be one of float32, float16, bfloat16, float64 or null, "
        "got 'int8'",
    ),
    "torch_dtype a number": (
        _config(dtype=None, torch_dtype=5),
        rf"{CONFIG}: 'torch_dtype' must be one of float32, float16, bfloat16, float64 or null, "
        "got 5",
    ),
    "eos_token_id past the vocabulary": (
        lambda d: (_config(eos_token_id=260)(d), (d / "generation_config.json").unlink()),
        rf"{CONFIG}: 'eos_token_id' 260 is not a token id: 'vocab_size' is 260",
    ),
    "generation_config eos_token_id past the vocabulary": (
        _write("generation_config.json", json.dumps({"eos_token_id": [257, 10**6]})),
        "generation_config.json: 'eos_token_id' 1000000 is not a token id: 'vocab_size' is 260",
    ),
    "eos_token_id a float": (
        lambda d: (_config(eos_token_id=1.5)(d), (d / "generation_config.json").unlink()),
        rf"{CONFIG}: 'eos_token_id' must be a token id or a list of them, got 1.5",
    ),
    "generation_config eos_token_id a string": (
        _write("generation_config.json", json.dumps({"eos_token_id": "</s>"})),
        "generation_config.json: 'eos_token_id' must be a token id or a list of them, got '</s>'",
    ),
    "an int8 tensor in a plain checkpoint": (
        _tensors(_as_int8),
        "model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' has dtype I8, but "
        f".*{CONFIG} has no quantization_config",
    ),
    "a header length of 2**63": (
        lambda d: (d / "model.safetensors").write_bytes(
            (2**63).to_bytes(8, "little") + (d / "model.safetensors").read_bytes()[8:]
        ),
        "model.safetensors is not a readable safetensors file: header length "
        r"9223372036854775808 does not fit the file \(\d+ bytes\)",
    ),
    "a truncated file": (
        lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:-1000]
        ),
        "model.safetensors is not a readable safetensors file: tensor '.*' .* has data_offsets "
        r"\[\d+, \d+\], which do not hold its \d+ bytes inside the file's \d+ data bytes",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_checkpoint_is_named_before_anything_loads(
    checkpoints: Checkpoints, tmp_path: Path, case: str
) -> None:
    edit, message = CASES[case]
    directory = _edited(checkpoints.path("llama3"), tmp_path, edit)
    with pytest.raises(ValueError, match=f"^model: {directory}/{message}"):
        EngineConfig.create(str(directory), device="cpu")


@pytest.mark.parametrize(
    ("saved", "served"),
    [
        ({"dtype": "float32"}, "float32"),
        ({"dtype": "float16"}, "float16"),
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float64"}, "float32"),
        ({"dtype": None}, "float32"),
        ({"dtype": "bf16"}, "bfloat16"),  # an alias, as the dtype setting takes them
    ],
)
def test_dtype_auto_serves_the_checkpoints_dtype(
    checkpoints: Checkpoints, tmp_path: Path, saved: dict[str, Any], served: str
) -> None:
    directory = _edited(checkpoints.path("llama3"), tmp_path, _config(**saved))
    assert EngineConfig.create(str(directory), device="cpu").model.dtype == served


def test_a_config_dtype_no_setting_reads_is_not_refused(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """config.json's dtype is read only for dtype auto: with another setting it is not used."""
    directory = _edited(checkpoints.path("llama3"), tmp_path, _config(dtype="float8_e4m3fn"))
    config = EngineConfig.create(str(directory), device="cpu", dtype="float32")
    assert config.model.dtype == "float32"


def test_gguf_sizes_are_checked_by_their_shapes_whatever_the_bits() -> None:
    """A GGUF file of 1-2 bits a weight (IQ1_S, IQ1_M, TQ1_0) holds fewer bytes than a 2-bit
    bound allows: its logical shapes are what is checked (Llama 3.1 70B's)."""
    hidden, inner, heads, kv_heads, layers = 8192, 28672, 64, 8, 80
    config = {"num_hidden_layers": layers, "vocab_size": 128256, "hidden_size": hidden,
              "intermediate_size": inner, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads}  # fmt: skip
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (128256, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (hidden, hidden),
            f"{layer}.self_attn.k_proj.weight": (1024, hidden),
            f"{layer}.self_attn.v_proj.weight": (1024, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, hidden),
            f"{layer}.mlp.gate_proj.weight": (inner, hidden),
            f"{layer}.mlp.up_proj.weight": (inner, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inner),
        }
    check_sizes(config, shapes, None, "70b-IQ1_S.gguf")  # 15.4 GB: under 2 bits a weight
    with pytest.raises(ValueError, match=r"more than twice the checkpoint's \d+ layer weights"):
        check_sizes({**config, "intermediate_size": 4 * inner}, shapes, None, "70b-IQ1_S.gguf")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    write_checkpoint("llama3", directory, max_shard_size="100KB")
    return directory


def _index(change: Callable[[dict[str, str]], None]) -> Edit:
    def edit(directory: Path) -> None:
        index_file = directory / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        change(index["weight_map"])
        index_file.write_text(json.dumps(index))

    return edit


def _duplicate(directory: Path) -> None:
    first, *_, last = sorted(directory.glob("model-*.safetensors"))
    tensors = load_file(last)
    name, tensor = next(iter(load_file(first).items()))
    save_file({**tensors, name: torch.zeros_like(tensor)}, last, metadata={"format": "pt"})


INDEX = "model.safetensors.index.json"
SHARD_CASES: dict[str, tuple[Edit, str]] = {
    "a shard outside the directory": (
        _index(lambda m: m.update({"model.norm.weight": "../../../../etc/passwd"})),
        f"{INDEX}: tensor 'model.norm.weight' is mapped to '../../../../etc/passwd'; a shard "
        "must be a file name inside the model directory",
    ),
    "an absolute shard path": (
        _index(lambda m: m.update({"model.norm.weight": "/dev/zero"})),
        f"{INDEX}: tensor 'model.norm.weight' is mapped to '/dev/zero'",
    ),
    "a shard that does not exist": (
        _index(lambda m: m.update({"model.norm.weight": "model-00009-of-00009.safetensors"})),
        f"{INDEX} names shard 'model-00009-of-00009.safetensors', which does not exist",
    ),
    "a tensor in two shards": (
        _duplicate,
        r"tensor '.*' is in both .*/model-00001-of-00005.safetensors and "
        r".*/model-00005-of-00005.safetensors",
    ),
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_a_broken_sharded_checkpoint_is_named(sharded: Path, tmp_path: Path, case: str) -> None:
    edit, message = SHARD_CASES[case]
    directory = _edited(sharded, tmp_path, edit)
    with pytest.raises(ValueError, match=f"^model: (.*/)?{message}"):
        EngineConfig.create(str(directory), device="cpu")


@pytest.mark.parametrize(
    ("file", "text", "message"),
    [
        ("tokenizer.json", "{not json", "tokenizer.json is not valid JSON: Expecting property"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json must hold a JSON object"),
        (
            "tokenizer.json",
            '{"model": 5}',
            ": the tokenizer files cannot be loaded: KeyError: 'added_tokens'",
        ),
    ],
)
def test_a_broken_tokenizer_file_is_named(
    checkpoints: Checkpoints, tmp_path: Path, file: str, text: str, message: str
) -> None:
    directory = _edited(checkpoints.path("llama3"), tmp_path, _write(file, text))
    config = EngineConfig.create(str(directory), device="cpu")
    with pytest.raises(ValueError, match=f"^model: {directory}/?{message}"):
        load_tokenizer(config.model)


BAD_TEMPLATE = "{% for message in messages %}{{ message.content }"


def _tokenizer_config(**changes: Any) -> Edit:
    """Keys of tokenizer_config.json changed; its chat_template used, as in checkpoints saved
    before transformers wrote chat_template.jinja (which takes its place)."""

    def edit(directory: Path) -> None:
        config_file = directory / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
        (directory / "chat_template.jinja").unlink()

    return edit


TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_CASES: dict[str, tuple[Edit, str]] = {
    "not Jinja": (
        _tokenizer_config(chat_template=BAD_TEMPLATE),
        rf"{TOKENIZER_CONFIG}: chat_template is not a valid template: unexpected '}}' \(line 1\)$",
    ),
    "a named template that is not Jinja": (
        _tokenizer_config(
            chat_template=[
                {"name": "default", "template": "{{ messages }}"},
                {"name": "tool_use", "template": "{% if tools %}"},
            ]
        ),
        rf"{TOKENIZER_CONFIG}: chat_template 'tool_use' is not a valid template: Unexpected end "
        "of template",
    ),
    "a number": (
        _tokenizer_config(chat_template=5),
        rf"{TOKENIZER_CONFIG}: chat_template must be a string or a list of "
        r'{"name": ..., "template": ...} objects, got 5$',
    ),
    "a list of strings": (
        _tokenizer_config(chat_template=["{{ messages }}"]),
        rf"{TOKENIZER_CONFIG}: chat_template must be a string or a list of ",
    ),
    "a chat_template.jinja that is not Jinja": (
        _write("chat_template.jinja", "line one\n{% endfor %}"),
        r"chat_template.jinja: is not a valid template: Encountered unknown tag 'endfor'. "
        r"\(line 2\)$",
    ),
}


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
def test_a_broken_chat_template_is_refused_at_start_up(
    checkpoints: Checkpoints, tmp_path: Path, case: str
) -> None:
    """Not at the first chat request (a 400 for every client of a server that looked ready)."""
    edit, message = TEMPLATE_CASES[case]
    directory = _edited(checkpoints.path("llama3"), tmp_path, edit)
    config = EngineConfig.create(str(directory), device="cpu")
    with pytest.raises(ValueError, match=f"^model: {directory}/{message}"):
        load_tokenizer(config.model)


def test_serve_names_a_broken_chat_template_in_one_line(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    directory = _edited(
        checkpoints.path("llama3"), tmp_path, _tokenizer_config(chat_template=BAD_TEMPLATE)
    )
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(directory)]
    command += ["--device", "cpu", "--kv-cache-blocks", "64", "--port", str(free_port_pair())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"kvfleet serve: model: {directory}/tokenizer_config.json: chat_template is not a valid "
        "template: unexpected '}' (line 1)"
    )


def _override(key: str, value: int) -> Callable[[gguf.GGUFWriter], None]:
    def metadata(writer: gguf.GGUFWriter) -> None:
        for kv in writer.kv_data:
            kv.pop(key, None)
        writer.add_uint32(key, value)

    return metadata


GGUF_CASES = {
    "llama.block_count": (10**9, "'num_hidden_layers' is 1000000000, but the checkpoint's"),
    "llama.attention.head_count": (0, "GGUF llama.attention.head_count must be >= 1, got 0"),
    "llama.embedding_length": (2**31, r"'vocab_size' and 'hidden_size' are \[260, 2147483648\]"),
    "llama.context_length": (2**32 - 1, "'max_position_embeddings' must be at most 16777216"),
}


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The transformers model the GGUF files are written from."""
    return write_checkpoint("llama2-tied", tmp_path_factory.mktemp("gguf-source"))


@pytest.mark.parametrize("key", list(GGUF_CASES))
def test_a_hostile_gguf_size_is_named(gguf_source: Any, tmp_path: Path, key: str) -> None:
    value, message = GGUF_CASES[key]
    path = write_gguf(gguf_source, tmp_path / "m.gguf", metadata=_override(key, value))
    with pytest.raises(ValueError, match=f"^model: {path}: {message}"):
        EngineConfig.create(str(path), device="cpu")


def test_a_gguf_chat_template_that_is_not_jinja_is_named(gguf_source: Any, tmp_path: Path) -> None:
    def template(writer: gguf.GGUFWriter) -> None:
        for kv in writer.kv_data:
            kv.pop("tokenizer.chat_template", None)
        writer.add_chat_template(BAD_TEMPLATE)

    path = write_gguf(gguf_source, tmp_path / "m.gguf", metadata=template)
    config = EngineConfig.create(str(path), device="cpu")
    with pytest.raises(
        ValueError,
        match=rf"^model: {path}: tokenizer.chat_template is not a valid template: unexpected '}}'",
    ):
        load_tokenizer(config.model)


@pytest.fixture(scope="module")
def gguf_files(gguf_source: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A GGUF file's bytes, of float32 tensors and of Q8_0 ones."""
    directory = tmp_path_factory.mktemp("gguf")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    return {
        "F32": write_gguf(gguf_source, directory / "f32.gguf").read_bytes(),
        "Q8_0": write_gguf(gguf_source, directory / "q8_0.gguf", lambda *_: q8_0).read_bytes(),
    }


def _set(name: str, skip: int, value: int) -> Callable[[bytes], bytes]:
    """`value` as a uint64, `skip` bytes after the key or tensor name `name` (or at byte `skip`
    with no name)."""

    def edit(data: bytes) -> bytes:
        key = name.encode()
        start = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) if name else 0
        return data[: start + skip] + struct.pack("<Q", value) + data[start + skip + 8 :]

    return edit


FITS = r"more than the \d+ bytes left in the file can hold$"
PAST_THE_END = r"needs \d+ bytes at byte \d+, past the file's end \(\d+ bytes\)$"
HOSTILE_GGUF_CASES: dict[str, tuple[str, Callable[[bytes], bytes], str]] = {
    "a tensor count of 2**63": (
        "F32",
        _set("", 8, 2**63),
        f"the tensor count is 9223372036854775808, {FITS}",
    ),
    "a key-value count of 2**63": (
        "F32",
        _set("", 16, 2**63),
        f"the key-value count is 9223372036854775808, {FITS}",
    ),
    "a key length of 2**62": (
        "F32",
        _set("", 24, 2**62),
        f"key-value 0's key's length is 4611686018427387904, {FITS}",
    ),
    "a string array's count of 2**62": (
        "F32",
        _set("tokenizer.ggml.tokens", 8, 2**62),
        f"tokenizer.ggml.tokens's item count is 4611686018427387904, {FITS}",
    ),
    "an int32 array's count of 2**62": (  # the reader looped on it forever
        "F32",
        _set("tokenizer.ggml.token_type", 8, 2**62),
        f"tokenizer.ggml.token_type's item count is 4611686018427387904, {FITS}",
    ),
    "tensor dims of 2**40": (
        "F32",
        _set("token_embd.weight", 4, 2**40),
        rf"tensor 'token_embd.weight' \(F32 \[1099511627776, 260\]\) {PAST_THE_END}",
    ),
    "a truncated Q8_0 file": (
        "Q8_0",
        lambda data: data[:-1000],
        rf"tensor 'blk.1.ffn_down.weight' \(Q8_0 \[128, 64\]\) {PAST_THE_END}",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(HOSTILE_GGUF_CASES))
def test_a_hostile_gguf_header_is_named(
    gguf_files: dict[str, bytes], tmp_path: Path, case: str
) -> None:
    """Each count and length against the file's size, before gguf.GGUFReader trusts it."""
    kind, edit, message = HOSTILE_GGUF_CASES[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(edit(gguf_files[kind]))
    with pytest.raises(ValueError, match=f"^model: {path}: is not a readable GGUF file: {message}"):
        EngineConfig.create(str(path), device="cpu")


def test_a_tensor_of_the_wrong_shape_is_named_with_its_checkpoint(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    """A layer weight the config's sizes pass but the layer cannot take fails the load with the
    checkpoint and the tensor named."""
    name = "model.layers.1.mlp.down_proj.weight"
    directory = _edited(
        checkpoints.path("llama3"),
        tmp_path,
        _tensors(lambda tensors: tensors.update({name: tensors[name][:, :-2].contiguous()})),
    )
    with pytest.raises(ValueError, match=rf"^model: {directory}: checkpoint tensor '{name}': "):
        LLM(str(directory), device="cpu", max_model_len=64)
