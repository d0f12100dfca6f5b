"""Random LoRA adapters for tests and benchmarks: peft's own folders, made as a user's would
be (`get_peft_model` + `save_pretrained`), with weights that change the model's output."""

from __future__ import annotations


def save_random_lora(base_path: str, out_dir, seed: int = 0, std: float = 0.02, **lora_args):
    """A peft LoRA of the model in `base_path` (`lora_args`: LoraConfig's fields, no dropout
    unless given), its B matrices drawn from N(0, std) under `seed` (peft starts B at zero,
    which would leave the model unchanged), saved in `out_dir`; returns the folder as a str."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**{"lora_dropout": 0.0, **lora_args}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return str(out_dir)
