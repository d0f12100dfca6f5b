"""What the GPU tests share: the mode they run in, sizes per mode, transformers' greedy
reference on the device (with the logits each token was chosen from) and the near-tie rule
that judges lmengine's greedy output against it.

Modes: on a CUDA machine the tests run on `cuda` with compiled Triton kernels. With
LMENGINE_GPU_TESTS_ON_CPU=1 the same test bodies run on `cpu` (Triton under
TRITON_INTERPRET=1, smaller sizes): a dry run of their logic, never a check of a GPU.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from lmengine import EngineConfig

T = TypeVar("T")

ON_CPU = os.environ.get("LMENGINE_GPU_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cpu" if ON_CPU else "cuda")

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "examples" / "prompts.txt"

# Greedy near-tie rules (docs/gpu.md). float32: token for token, except where transformers'
# own choice leads lmengine's by at most 1e-3 in logit (a float32 near tie: the order of
# float32 sums decides it); on CPU the two differ by < 3e-5 in log-probability and the
# smallest top-2 margin of the 16 SmolLM2 prompts is 6.7e-3, so the exception never fires
# there. bfloat16: logits are bfloat16 (steps of 0.125 between 16 and 32), so exact ties are
# common and lmengine's bfloat16 logits differ from transformers' by up to ~0.19 (CPU); a
# divergence is accepted where transformers' choice leads lmengine's by at most 0.5.
FP32_TIE_MARGIN, FP32_LOGPROB_TOL = 1e-3, 1e-3
BF16_TIE_MARGIN, BF16_LOGPROB_TOL = 0.5, 0.5


def by_mode(gpu: T, cpu: T) -> T:
    """`gpu` on a CUDA device, `cpu` in the dry run (smaller sizes for the interpreter)."""
    return cpu if ON_CPU else gpu


def engine_config(**fields) -> EngineConfig:
    """An EngineConfig on the device of the mode (one CPU thread in the dry run)."""
    return EngineConfig(device=DEVICE.type, num_threads=by_mode(gpu=0, cpu=1), **fields)


def release_device_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver (no-op on CPU)."""
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def free_device_bytes(device: torch.device) -> int:
    """Free memory of the device as the engine reads it (after releasing cached blocks)."""
    from lmengine.engine.cache_engine import free_memory_bytes

    release_device_memory()
    return free_memory_bytes(device)


def chat_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """The first `num_prompts` questions of examples/prompts.txt through the chat template."""
    from lmengine.api import chat_token_ids

    lines = PROMPTS_FILE.read_text().splitlines()[:num_prompts]
    return [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in lines]


@dataclass
class GreedyReference:
    """One prompt's greedy continuation by transformers and the raw logits of every step."""

    token_ids: list[int]  # generated ids, EOS included when it ends the generation
    logits: torch.Tensor  # [len(token_ids), vocab] float32 on CPU


def hf_greedy_reference(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = False,
) -> list[GreedyReference]:
    """transformers `generate(do_sample=False)`, one prompt at a time (no padding), on the
    device and in the dtype of `model`."""
    device = next(model.parameters()).device
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False)
            if ignore_eos:
                kwargs["eos_token_id"] = None
            x = torch.tensor([ids], device=device)
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            logits = torch.cat(out.logits).float().cpu()  # [steps, vocab]
            # NOTE: greedy picks the argmax of the raw logits (no processor changed them), so
            # these logits are the ones the near-tie rule must read
            assert logits.argmax(-1).tolist() == tokens, "a logits processor changed greedy"
            refs.append(GreedyReference(tokens, logits))
    return refs


def load_hf(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def matched_prefix(
    got: list[int], ref: GreedyReference, tie_margin: float, label: str = "output"
) -> int:
    """How many leading tokens of `got` equal the reference. Where they part, the reference's
    logit of its own token must lead the logit of `got`'s token by at most `tie_margin` (a
    near tie); they may not part in any other way (different lengths without a differing
    token, or a decisive choice)."""
    for i, (a, b) in enumerate(zip(got, ref.token_ids)):
        if a != b:
            lead = float(ref.logits[i, b] - ref.logits[i, a])
            assert lead <= tie_margin, (
                f"{label}, token {i}: lmengine chose {a}, transformers {b}, which leads by "
                f"{lead:.4g} "
                f"(> {tie_margin}, not a near tie)"
            )
            return i
    assert len(got) == len(ref.token_ids), f"{label}: {len(got)} vs {len(ref.token_ids)} tokens"
    return len(got)


def check_greedy_against(
    responses,
    refs: list[GreedyReference],
    tie_margin: float,
    logprob_tol: float,
    min_matched: float,
) -> None:
    """Every response follows its reference up to a near tie (`matched_prefix`), at least
    `min_matched` of all reference tokens are matched (so the rule cannot pass by parting
    early everywhere), and where they match, the log-probability lmengine reports for its
    token is transformers' within `logprob_tol` (needs GenerationConfig(logprobs=1))."""
    matched = total = 0
    for i, (r, ref) in enumerate(zip(responses, refs, strict=True)):
        assert r.finish_reason in ("stop", "length"), f"prompt {i}: {r.error}"
        n = matched_prefix(r.token_ids, ref, tie_margin, f"prompt {i}")
        ref_logprobs = ref.logits.log_softmax(-1)  # [steps, vocab]
        for j in range(n):
            token = r.token_ids[j]
            diff = abs(r.logprobs[j][token] - float(ref_logprobs[j, token]))
            assert diff <= logprob_tol, f"prompt {i} token {j}: logprob off by {diff:.4g}"
        matched += n
        total += len(ref.token_ids)
    assert matched >= min_matched * total, f"only {matched} of {total} tokens matched"
