"""Serve an architecture lmengine does not ship, from your own code: IBM Granite.

Granite is Llama with four scalars: embeddings times `embedding_multiplier`, each residual
branch times `residual_multiplier`, attention scale `attention_multiplier` (transformers
already stores it as the attention's `scaling`, which the Llama patch uses) and logits
divided by `logits_scaling`. The patched classes below subclass lmengine's Llama patches and
Granite's HF classes; the map from HF names to them goes to the engine either in
`EngineConfig(module_map=...)` or through `lmengine.models.register_module`. Nothing in the
lmengine package is edited. See docs/adding_a_model.md for the walkthrough.

    python examples/new_model_patch.py             # EngineConfig(module_map=...)
    python examples/new_model_patch.py --register  # register_module(...)

It builds a tiny random Granite checkpoint, shows that lmengine refuses it without the patch,
then checks the engine's greedy output against transformers' `generate`, token for token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from transformers.models.granite.modeling_granite import (
    GraniteAttention,
    GraniteDecoderLayer,
    GraniteForCausalLM,
    GraniteMLP,
    GraniteModel,
    GraniteRMSNorm,
)

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.models import register_module
from lmengine.models.attention import set_rotary
from lmengine.models.llama import (
    PatchedLlamaAttention,
    PatchedLlamaDecoderLayer,
    PatchedLlamaForCausalLM,
    PatchedLlamaMLP,
    PatchedLlamaModel,
    PatchedRMSNorm,
)


# 1. Modules identical to Llama's: subclass the Llama patch first, then the HF class it
#    replaces (`patch` checks that the patched class is a subclass of the HF one).
class PatchedGraniteRMSNorm(PatchedRMSNorm, GraniteRMSNorm):
    pass


class PatchedGraniteMLP(PatchedLlamaMLP, GraniteMLP):
    pass


class PatchedGraniteAttention(PatchedLlamaAttention, GraniteAttention):
    pass  # self.scaling is already config.attention_multiplier


# 2. The twists: override only the forward that differs.
class PatchedGraniteDecoderLayer(PatchedLlamaDecoderLayer, GraniteDecoderLayer):
    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # input norm fused with the residual add the previous layer deferred
        hidden_states, residual = self.norm_input(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states) * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class PatchedGraniteModel(PatchedLlamaModel, GraniteModel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        set_rotary(self.rotary_emb, hidden_states)
        residual = None
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, residual = layer(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class PatchedGraniteForCausalLM(PatchedLlamaForCausalLM, GraniteForCausalLM):
    """Llama with embedding, residual, attention and logit multipliers (user patch)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) / self.config.logits_scaling


# 3. The map: HF qualified class name -> patched qualified class name (this module's name,
#    whether it runs as a script or is imported).
_HF = "transformers.models.granite.modeling_granite"
GRANITE_MODULE_MAP = {
    f"{_HF}.{name}": f"{__name__}.Patched{name}"
    for name in (
        "GraniteForCausalLM",
        "GraniteModel",
        "GraniteDecoderLayer",
        "GraniteAttention",
        "GraniteMLP",
        "GraniteRMSNorm",
    )
}


def save_tiny_granite(path: str, tokenizer_src: str) -> str:
    """A tiny random Granite with non-trivial multipliers, saved with save_pretrained."""
    from transformers import AutoTokenizer, GraniteConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    config = GraniteConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = GraniteForCausalLM(config)
    with torch.no_grad():  # decisive greedy choices on random weights
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--register", action="store_true", help="use register_module")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from lmengine.engine.loader import resolve_model_path

    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_granite(tmp, resolve_model_path(None))
        try:
            Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=64)).close()
            print("unexpected: Granite loaded without a patch")
            return 1
        except ValueError as err:
            print(f"without the patch: {err}\n")

        if args.register:
            for hf_name, patched_name in GRANITE_MODULE_MAP.items():
                register_module(hf_name, patched_name)
            config = EngineConfig(block_size=4, num_gpu_blocks=64)
        else:
            config = EngineConfig(block_size=4, num_gpu_blocks=64, module_map=GRANITE_MODULE_MAP)

        prompts = [[1, 2, 3, 4, 5], list(range(100, 130)), [42]]
        gen = GenerationConfig(max_new_tokens=10)
        engine = Engine.from_pretrained(path, config)
        try:
            inst = engine.create_instance()
            got = [inst.infer(i, p, gen_config=gen).token_ids for i, p in enumerate(prompts)]
            engine.check_integrity()
        finally:
            engine.close()

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = [
                hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[
                    0, len(p) :
                ].tolist()
                for p in prompts
            ]
    for p, g, e in zip(prompts, got, expected):
        print(f"prompt of {len(p)} tokens: lmengine {g}\n{'':>21}transformers {e}")
    same = got == expected
    print("\ngreedy output equals transformers:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
