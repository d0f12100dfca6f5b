"""The one place that reads HF config attributes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    # multi-head latent attention (DeepSeek): the cache holds one "head" per token, the latent
    # and the rope key ([latent_dim + rope dim] = head_dim), and the values are its first
    # latent_dim dims. None: keys and values per KV head.
    latent_dim: int | None = None

    @classmethod
    def from_hf(cls, config, generation_config=None) -> ModelInfo:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        if eos is None:
            eos = []
        elif isinstance(eos, int):
            eos = [eos]
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        latent_dim = getattr(text, "kv_lora_rank", None)
        if latent_dim is not None:  # MLA: one latent "head" of latent + rope key per token
            num_kv_heads, head_dim = 1, latent_dim + text.qk_rope_head_dim
        return cls(
            architecture=(getattr(config, "architectures", None) or ["?"])[0],
            vocab_size=text.vocab_size,
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=text.hidden_size,
            max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048,
            eos_token_ids=tuple(eos),
            latent_dim=latent_dim,
        )
