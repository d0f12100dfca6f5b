"""Calibration for W8A8: the built-in text corpus and per-channel activation maxima.

The default corpus needs no download: the docstrings of Python's standard library, read from
the installation's source files with `ast` (no module is imported), in sorted file order, so
every run on the same Python sees the same text.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


def stdlib_docstrings(max_chars: int) -> str:
    """Up to `max_chars` characters of standard-library docstrings, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        # NOTE: public modules only: private ones (`_pydecimal`...) are long and repetitive
        if "test" in path.parent.name or path.name.startswith(("test", "_")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:  # skip one-liners: little text, mostly names
                    parts.append(doc)
                    total += len(doc) + 2
        if total >= max_chars:
            break
    if not parts:
        raise RuntimeError(f"no standard-library docstrings found under {root}")
    return "\n\n".join(parts)[:max_chars]


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, return_dict=False
    )
    return list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)


def calibration_batches(
    tokenizer, num_samples: int, seqlen: int, text: str | None = None
) -> torch.Tensor:
    """[num_samples, seqlen] token ids from `text` (default: stdlib docstrings).

    With a chat template (an instruct model), each sample is one user turn holding the next
    piece of text, formatted by the template, so the calibration sees the system prompt and
    the special tokens the model will serve (NOTE: without them, SmolLM2's smoothing scales
    missed those tokens' activations and the answer to "capital of France?" went wrong while
    perplexity on plain text was fine). Without one, consecutive chunks of the token stream.
    """
    if num_samples < 1 or seqlen < 2:
        raise ValueError(
            f"need calib_samples >= 1 and calib_seqlen >= 2, got {num_samples} and {seqlen}"
        )
    chars_per_sample = seqlen * 6  # ~4 characters per token, with margin
    if text is None:
        text = stdlib_docstrings(num_samples * chars_per_sample)
    if getattr(tokenizer, "chat_template", None):
        rows = []
        for i in range(num_samples):
            piece = text[i * chars_per_sample : (i + 1) * chars_per_sample]
            ids = _chat_ids(tokenizer, piece)[:seqlen]
            if len(ids) < seqlen:
                raise ValueError(
                    f"the calibration text is too short for {num_samples} samples of {seqlen} "
                    f"tokens (sample {i} has {len(ids)}): give more text or lower them"
                )
            rows.append(ids)
        return torch.tensor(rows)  # [num_samples, seqlen]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = num_samples * seqlen
    if len(ids) < need:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens, fewer than calib_samples x calib_seqlen "
            f"= {need}: give more text or lower them"
        )
    return torch.tensor(ids[:need]).view(num_samples, seqlen)


@torch.inference_mode()
def collect_input_maxima(
    model: nn.Module,
    batches: torch.Tensor,
    layer_prefix: str,
    batch_size: int = 4,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run the (unpatched, float) HF model on `batches` [n, seqlen] and return, for every
    nn.Linear under `layer_prefix`, the maximum |input| per input channel: name -> [in] f32.
    `progress(k)` is called after each forward with the number of samples done."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []

    def hook_for(name: str):
        def hook(_module, args) -> None:
            x = args[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()  # [in]
            prev = maxima.get(name)
            maxima[name] = amax if prev is None else torch.maximum(prev, amax)

        return hook

    for name, module in model.named_modules():
        if name.startswith(layer_prefix + ".") and isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(hook_for(name)))
    device = next(model.parameters()).device
    try:
        for start in range(0, batches.shape[0], batch_size):
            chunk = batches[start : start + batch_size].to(device)  # [b, seqlen]
            model(input_ids=chunk, use_cache=False)
            if progress is not None:
                progress(chunk.shape[0])
    finally:
        for h in hooks:
            h.remove()
    return {k: v.cpu() for k, v in maxima.items()}
