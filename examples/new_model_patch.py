"""Serve an architecture lmengine does not ship, from your own code: LG's EXAONE 4.

EXAONE 4 is Llama with three twists: an RMSNorm per head on q and k before rotary (as in
Qwen3); hybrid attention (with a sliding window configured, the layers that `layer_types` marks
"sliding_attention" use rotary and the window, the global ones use neither); and RMSNorms after
attention and after the MLP instead of before them (as in OLMo 2). The patched classes below
subclass lmengine's Llama patches and EXAONE 4's HF classes; the map from HF names to them goes
to the engine either in `EngineConfig(module_map=...)` or through
`lmengine.models.register_module`. Nothing in the lmengine package is edited. See
docs/adding_a_model.md for the walkthrough.

    python examples/new_model_patch.py             # EngineConfig(module_map=...)
    python examples/new_model_patch.py --register  # register_module(...)

It builds a tiny random EXAONE 4 checkpoint, shows that lmengine refuses it without the patch,
then checks the engine's greedy output against transformers' `generate`, token for token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from transformers.models.exaone4.modeling_exaone4 import (
    Exaone4Attention,
    Exaone4DecoderLayer,
    Exaone4ForCausalLM,
    Exaone4MLP,
    Exaone4Model,
    Exaone4RMSNorm,
)

from lmengine import Engine, EngineConfig, GenerationConfig
from lmengine.models import register_module
from lmengine.models.attention import PerHeadQKNorm
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
class PatchedExaone4RMSNorm(PatchedRMSNorm, Exaone4RMSNorm):
    pass


class PatchedExaone4MLP(PatchedLlamaMLP, Exaone4MLP):
    pass


class PatchedExaone4Model(PatchedLlamaModel, Exaone4Model):
    pass  # embeddings, this step's cos/sin, the layers, the final norm


class PatchedExaone4ForCausalLM(PatchedLlamaForCausalLM, Exaone4ForCausalLM):
    """Llama with per-head q/k norms, norms after attention and MLP, and sliding-window
    layers with rotary between global layers without it (user patch)."""


# 2. The twists: override only what differs.
class PatchedExaone4Attention(PerHeadQKNorm, PatchedLlamaAttention, Exaone4Attention):
    """q_norm and k_norm per head before rotary (the mixin's `norm_qk`); rotary and the window
    per layer as Exaone4Attention.forward decides them."""

    def lmengine_post_patch(self) -> None:
        super().lmengine_post_patch()  # q/k/v merged into one GEMM, o_proj packed
        # NOTE: transformers' rule reads the configured window (which its __init__ put on every
        # layer), so decide rotary before clearing the window: rotary when no window is
        # configured or the layer is sliding; the window only on sliding layers.
        self.use_rope = self.sliding_window is None or self.is_sliding
        if not self.is_sliding:
            self.sliding_window = None  # what PagedAttentionMixin hands the kernel

    def rotary(self, ctx) -> tuple[torch.Tensor, torch.Tensor] | None:
        return super().rotary(ctx) if self.use_rope else None


class PatchedExaone4DecoderLayer(PatchedLlamaDecoderLayer, Exaone4DecoderLayer):
    """Norms after attention and MLP, no input norm: returns (normed MLP output, the stream
    before it); the next layer, or the model's final norm, adds the two."""

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:  # the residual add the previous layer deferred
            hidden_states = hidden_states + residual
        attn = self.post_attention_layernorm(self.self_attn(hidden_states))
        residual = hidden_states + attn
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


# 3. The map: HF qualified class name -> patched qualified class name (this module's name,
#    whether it runs as a script or is imported).
_HF = "transformers.models.exaone4.modeling_exaone4"
EXAONE4_MODULE_MAP = {
    f"{_HF}.{name}": f"{__name__}.Patched{name}"
    for name in (
        "Exaone4ForCausalLM",
        "Exaone4Model",
        "Exaone4DecoderLayer",
        "Exaone4Attention",
        "Exaone4MLP",
        "Exaone4RMSNorm",
    )
}

WINDOW = 8  # keys a sliding layer sees: fewer than most prompts below hold


def save_tiny_exaone4(path: str, tokenizer_src: str) -> str:
    """A tiny random EXAONE 4, sliding and global layers alternating (the released models:
    three sliding, then one global), saved with save_pretrained."""
    from transformers import AutoTokenizer, Exaone4Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    config = Exaone4Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Exaone4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)  # decisive greedy choices on random weights
            else:
                p.add_(torch.randn_like(p) * 0.3)  # norm weights start as ones: a wrong norm shows
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
        path = save_tiny_exaone4(tmp, resolve_model_path(None))
        try:
            Engine.from_pretrained(path, EngineConfig(num_gpu_blocks=64)).close()
            print("unexpected: EXAONE 4 loaded without a patch")
            return 1
        except ValueError as err:
            print(f"without the patch: {err}\n")

        # float32, as transformers runs below ("auto" is bfloat16 on CPUs with bfloat16 units)
        engine_args = dict(block_size=4, num_gpu_blocks=64, dtype="float32")
        if args.register:
            for hf_name, patched_name in EXAONE4_MODULE_MAP.items():
                register_module(hf_name, patched_name)
            config = EngineConfig(**engine_args)
        else:
            config = EngineConfig(**engine_args, module_map=EXAONE4_MODULE_MAP)

        # shorter and longer than the window; generation carries the short ones past it
        prompts = [[1, 2, 3, 4, 5], list(range(100, 130)), [42], list(range(500, 517))]
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
