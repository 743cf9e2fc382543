"""spec.model and spec.quantization: what to serve and in which formats."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvfleet_operator.kinds.cel import cel
from kvfleet_operator.wire import Model, SecretName

# What each scheme names, no whitespace anywhere (the URI ends up in init-container and engine
# arguments): a Hugging Face repo id (NAME or ORG/NAME, each starting with a letter or digit, so
# never an option such as --help), whole, or a .gguf file inside it; a PersistentVolumeClaim's name
# (DNS-1123) and a path in it; an S3 bucket and a key; an absolute path on the node that is not
# the root. `..` segments are refused by a rule of their own (RE2, the API server's regex
# engine, has no lookahead).
_HF_ID = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MODEL_URI_PATTERN = (
    rf"^(hf://{_HF_ID}(/{_HF_ID})?"  # a whole repository: the directory `hf download` fetches
    rf"|hf://{_HF_ID}/{_HF_ID}/\S+[.]gguf"  # one GGUF file in it
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/\S*)?"
    r"|s3://[a-z0-9][-a-z0-9.]*[a-z0-9](/\S*)?"
    r"|file:///[^/\s]\S*)$"
)
MODEL_URI_MESSAGE = (
    "model.uri: hf://ORG/NAME (a whole repository; its id: letters, digits, '.', '_', '-', not "
    "starting with '-') or hf://ORG/REPO/FILE.gguf, pvc://CLAIM/PATH, s3://BUCKET/PREFIX or "
    "file:///PATH (absolute, not the root); no whitespace"
)
# `..` as a path segment: refused (a claim's or node's path outside the one named).
PARENT_SEGMENT_RULE = "!self.contains('/../') && !self.endsWith('/..')"
PARENT_SEGMENT_MESSAGE = "model.uri: a '..' path segment is not allowed"

# A URI ending in .gguf names one GGUF file inside its source; any other URI names a directory.
GGUF_SUFFIX = ".gguf"

GGUF_URI_PATTERN = r"^(hf://[^/]+/[^/]+|pvc://[^/]+|s3://[^/]+|file://)/.+[.]gguf$"

GGUF_URI_MESSAGE = (
    "model.uri: a .gguf file is named hf://ORG/REPO/FILE.gguf, pvc://CLAIM/PATH/FILE.gguf, "
    "s3://BUCKET/KEY.gguf or file:///PATH/FILE.gguf"
)

WeightQuantization = Literal["none", "int8", "fp8", "int4-awq", "int4-gptq"]

KVCacheQuantization = Literal["auto", "fp8", "int8"]

# quantization.kvCacheCalibration: a relative path of plain segments, none of them . or ..
CALIBRATION_PATTERN = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"
CALIBRATION_DOTS = r"(^|/)[.][.]?(/|$)"
# A file:// GGUF is mounted alone (hostPath of type File): nothing beside it reaches the pod.
FILE_GGUF_CALIBRATION = (
    "quantization.kvCacheCalibration cannot be used with a file:// .gguf model (the pod mounts "
    "that one file): use a directory, or a pvc://, hf:// or s3:// URI"
)
CALIBRATION_MESSAGE = (
    "quantization.kvCacheCalibration: a path relative to the model (no leading /, no . or .. "
    "segments)"
)


class SecretReference(Model):
    name: SecretName


HINTS_HEADS_MESSAGE = (
    "model.hints.numAttentionHeads must be a multiple of numKeyValueHeads: each KV head serves "
    "a whole group of query heads"
)


class ModelHints(Model):
    """Architecture numbers for models that are not in the built-in catalog; used to plan memory
    and to check tensor parallelism."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            ("self.numAttentionHeads % self.numKeyValueHeads == 0", HINTS_HEADS_MESSAGE)
        )
    )

    num_parameters: int = Field(ge=1, description="Total parameter count, e.g. 8030261248.")
    num_layers: int = Field(ge=1, description="Transformer layers (num_hidden_layers).")
    num_attention_heads: int = Field(ge=1, description="Query heads (num_attention_heads).")
    num_key_value_heads: int = Field(ge=1, description="KV heads (num_key_value_heads).")
    head_dim: int = Field(ge=1, description="Dimension of one attention head.")
    max_position_embeddings: int | None = Field(
        default=None, ge=1, description="Longest context the model supports."
    )
    hidden_size: int | None = Field(
        default=None,
        ge=1,
        description="Hidden size (hidden_size); numAttentionHeads × headDim when unset.",
    )
    intermediate_size: int | None = Field(
        default=None,
        ge=1,
        description="MLP width (intermediate_size). With it, quantized plans count the linear "
        "layers' weights apart from the embeddings and norms, which stay 16-bit; without it, "
        "every parameter counts as quantized.",
    )

    @model_validator(mode="after")
    def _heads_group(self) -> ModelHints:
        # The CEL rule above, for objects stored before it existed.
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{HINTS_HEADS_MESSAGE} (got {self.num_attention_heads} and "
                f"{self.num_key_value_heads})"
            )
        return self

    @property
    def hidden(self) -> int:
        return self.hidden_size or self.num_attention_heads * self.head_dim


REVISION_MESSAGE = (
    "model.revision applies to hf:// models only (a branch, tag or commit of the repository); "
    "for pvc://, s3:// and file:// name the revision's own path in model.uri"
)
CREDENTIALS_MESSAGE = (
    "model.credentialsSecret applies to hf:// and s3:// models only (the download's token or "
    "keys); a pvc:// or file:// model is mounted, not downloaded"
)

HINTS_CONTEXT_MESSAGE = (
    "model.hints without maxPositionEmbeddings needs model.maxModelLen: the memory plan sizes "
    "the KV cache by the context length"
)


class ModelSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "has(self.servedModelName) == has(oldSelf.servedModelName) && "
                "(!has(self.servedModelName) || self.servedModelName == oldSelf.servedModelName)",
                "model.servedModelName is immutable: it cannot be added, removed or changed "
                "after creation (clients address the model by it)",
            ),
            (
                "has(self.maxModelLen) || !has(self.hints) || "
                "has(self.hints.maxPositionEmbeddings)",
                HINTS_CONTEXT_MESSAGE,
            ),
            ("!has(self.revision) || self.uri.startsWith('hf://')", REVISION_MESSAGE),
            (
                "!has(self.credentialsSecret) || self.uri.startsWith('hf://') || "
                "self.uri.startsWith('s3://')",
                CREDENTIALS_MESSAGE,
            ),
        )
    )

    uri: str = Field(
        max_length=2048,
        description="Where the weights are: a directory, hf://ORG/NAME, pvc://CLAIM/PATH, "
        "s3://BUCKET/PREFIX or file:///PATH (on the node); or, ending in .gguf, one GGUF file: "
        "hf://ORG/REPO/FILE.gguf, pvc://CLAIM/PATH/FILE.gguf, s3://BUCKET/KEY.gguf or "
        "file:///PATH/FILE.gguf.",
        json_schema_extra=cel(
            (f"self.matches(r'{MODEL_URI_PATTERN}')", MODEL_URI_MESSAGE),  # CEL raw string
            (PARENT_SEGMENT_RULE, PARENT_SEGMENT_MESSAGE),
            (
                f"!self.endsWith('{GGUF_SUFFIX}') || self.matches('{GGUF_URI_PATTERN}')",
                GGUF_URI_MESSAGE,
            ),
        ),
    )
    revision: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="hf:// only: branch, tag or commit to download (not starting with '-').",
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^\S+$",
        description="Name clients pass as `model` (no whitespace: it is an argument, a metric "
        "label and a log field); defaults to metadata.name. Immutable.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Longest prompt + output per sequence, in tokens."
    )
    credentials_secret: SecretReference | None = Field(
        default=None,
        description="Secret whose keys become environment variables of the download init "
        "container (HF_TOKEN for hf://, AWS_* for s3://).",
    )
    hints: ModelHints | None = Field(
        default=None, description="Architecture numbers for a model not in the built-in catalog."
    )

    @field_validator("uri")
    @classmethod
    def _uri_names_one_source(cls, uri: str) -> str:
        # The same rules as the CEL ones above, for objects stored before they existed.
        if uri.endswith(GGUF_SUFFIX) and not re.match(GGUF_URI_PATTERN, uri):
            raise ValueError(GGUF_URI_MESSAGE)
        if not re.match(MODEL_URI_PATTERN, uri):
            raise ValueError(MODEL_URI_MESSAGE)
        if "/../" in uri or uri.endswith("/.."):
            raise ValueError(PARENT_SEGMENT_MESSAGE)
        return uri

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        # The CEL rules above, for objects stored before they existed.
        if self.revision is not None and not self.uri.startswith("hf://"):
            raise ValueError(REVISION_MESSAGE)
        if self.credentials_secret is not None and not self.uri.startswith(("hf://", "s3://")):
            raise ValueError(CREDENTIALS_MESSAGE)
        hints = self.hints
        if (
            self.max_model_len is None
            and hints is not None
            and hints.max_position_embeddings is None
        ):
            raise ValueError(HINTS_CONTEXT_MESSAGE)
        return self

    @property
    def is_gguf(self) -> bool:
        """Whether the URI names one GGUF file (else a directory of weights)."""
        return self.uri.endswith(GGUF_SUFFIX)

    def hf_file(self) -> tuple[str, str]:
        """(ORG/REPO, path of the file in the repository) of an hf:// GGUF URI."""
        org, repo, path = self.uri.removeprefix("hf://").split("/", 2)
        return f"{org}/{repo}", path


class QuantizationSpec(Model):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.kvCacheCalibration) || self.kvCache == 'fp8'",
                "quantization.kvCacheCalibration needs quantization.kvCache: fp8",
            )
        )
    )

    weights: WeightQuantization = Field(
        default="none", description="Weight format: none (bf16), int8, fp8, int4-awq, int4-gptq."
    )
    kv_cache: KVCacheQuantization = Field(
        default="auto",
        description="KV-cache format: auto (model dtype), fp8 (e4m3) or int8 (integer codes; any "
        "GPU): 8-bit codes with a scale per token and KV head, about twice the tokens.",
    )
    kv_cache_calibration: str | None = Field(
        default=None,
        max_length=1024,
        pattern=CALIBRATION_PATTERN,
        description="kvCache fp8 only: the model's KV calibration file (written by `python -m "
        "kvfleet_engine.bench.calibrate_kv`), as a path inside the model directory, or beside "
        "a .gguf file; the cache then rounds K toward the model's queries, not to nearest "
        "(closer to the model's own perplexity, a slower decode step).",
        json_schema_extra=cel((f"!self.matches('{CALIBRATION_DOTS}')", CALIBRATION_MESSAGE)),
    )

    @field_validator("kv_cache_calibration")
    @classmethod
    def _calibration_is_inside_the_model(cls, path: str | None) -> str | None:
        # The CEL rule above, for objects stored before it existed.
        if path is not None and re.search(CALIBRATION_DOTS, path):
            raise ValueError(CALIBRATION_MESSAGE)
        return path

    @model_validator(mode="after")
    def _calibration_needs_fp8(self) -> QuantizationSpec:
        if self.kv_cache_calibration is not None and self.kv_cache != "fp8":
            raise ValueError("quantization.kvCacheCalibration needs quantization.kvCache: fp8")
        return self
