"""The Llama family in one file: Llama 2/3 (grouped-query attention, llama3 rope scaling),
Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Single device, plain tensor code;
names mirror the Hugging Face checkpoints so weights load by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvfleet_engine.layers.attention import Attention, AttentionMetadata
from kvfleet_engine.layers.linear import Linear, MergedLinear
from kvfleet_engine.layers.norm import RMSNorm
from kvfleet_engine.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    from kvfleet_engine.parallel.pipeline import StageLayers


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        o_bias = arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False))
        self.qkv_proj = MergedLinear(
            hidden, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias=qkv_bias
        )
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, positions, rotary, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported; only silu is")
        self.gate_up_proj = MergedLinear(hidden, {"gate": inner, "up": inner}, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inner]: gate | up
        return self.down_proj(gate_up, silu_gated=True)  # of silu(gate) * up


class LlamaDecoderLayer(nn.Module):
    # Each norm -> the one linear its output feeds: `quant.swap` lets the norm hand an fp8
    # linear its rows already quantized.
    norm_consumers: ClassVar[dict[str, str]] = {
        "input_layernorm": "self_attn.qkv_proj",
        "post_attention_layernorm": "mlp.gate_up_proj",
    }

    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, arch)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream it adds to (None: first)
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds
        them, so each residual add is fused into a norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, positions, rotary, meta)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        # _weight: no random init (on the meta device it would import torch._dynamo, seconds).
        shape = (cfg["vocab_size"], cfg["hidden_size"])
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, arch) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary = RotaryEmbedding(
            head_dim, cfg.get("max_position_embeddings", 2048), rope_parameters(cfg)
        )
        # The layers this rank runs under pipeline parallelism (None: all of them).
        self.stage: StageLayers | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary, meta)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)[0]

    def forward_stage(
        self,
        input_ids: torch.Tensor,  # [num_tokens]: read by the first stage only
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None,  # [2, num_tokens, hidden]: the previous stage's
    ) -> torch.Tensor:
        """One pipeline stage's layers (`self.stage`, set by parallel.pipeline): from the input
        ids (the first stage) or the previous stage's hidden state and residual; returns them
        for the next stage [2, num_tokens, hidden], or on the last stage the final norm's
        output [num_tokens, hidden]."""
        stage = self.stage
        assert stage is not None, "forward_stage() runs a pipeline stage; forward() the model"
        if stage.is_first:
            hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        else:
            assert intermediate is not None
            hidden, residual = intermediate[0], intermediate[1]
        for layer in self.layers[stage.start : stage.end]:
            hidden, residual = layer(hidden, residual, positions, self.rotary, meta)
        assert residual is not None  # every stage owns a layer
        if not stage.is_last:
            return torch.stack((hidden, residual))  # [2, num_tokens, hidden]
        return self.norm.add_forward(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor name part -> (our fused module name part, shard).
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        super().__init__()
        self.model = LlamaModel(cfg, arch)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"])
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, meta)

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None,
    ) -> torch.Tensor:  # [2, num_tokens, hidden], or on the last stage [num_tokens, hidden]
        return self.model.forward_stage(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab]
        return self.lm_head(hidden)
