"""Log-probs at temperature 1 from TRL's fused LM head, for the KL term of `RemoteGRPOTrainer`.

TRL 1.16's fused head divides the logits by `temperature` before scoring a token; SGLang's reference log-probs (and the
built-in server's) are never divided. `at_temperature_one()` makes the head's kernel also score the same hidden states
at temperature 1 (one more pass of the LM-head kernel, not of the model); `laid_out()` puts those scores in TRL's layout.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import trl.trainer.utils as trl_utils


@contextmanager
def at_temperature_one(replace: bool = False) -> Iterator[list[torch.Tensor]]:
    """While open, every call of TRL's fused-head kernel (`trl.trainer.utils._ChunkedLogProbFunction`, which the head
    looks up at each call) also scores its tokens at temperature 1; the scores are appended to the yielded list, one
    tensor per call, in the kernel's own layout (`laid_out`), and gradients flow through them as through TRL's. With
    `replace`, the head returns the temperature-1 log-probs in place of its own (a reference's forward, where nothing
    else is read) and the list stays empty.

    The kernel is TRL's own, given the arguments TRL's head computed (soft-capping, logit scale, fp32 head), so the
    scores at temperature 1 differ from TRL's only by the division. Not thread-safe: open it around one forward of the
    training thread (no other thread runs a model)."""
    kernel = trl_utils._ChunkedLogProbFunction
    scored: list[torch.Tensor] = []

    class KernelAlsoAtTemperatureOne:
        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                  logit_scale=1.0, outputs=("log_probs",)):
            if replace:
                return kernel.apply(hidden, weight, bias, targets, 1.0, chunk_size, final_logit_softcapping,
                                    logit_scale, outputs)
            result = kernel.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                  logit_scale, outputs)
            if temperature == 1.0:
                scored.append(result[0])
            else:
                scored.append(kernel.apply(hidden, weight, bias, targets, 1.0, chunk_size, final_logit_softcapping,
                                           logit_scale, ("log_probs",))[0])
            return result

    trl_utils._ChunkedLogProbFunction = KernelAlsoAtTemperatureOne
    try:
        yield scored
    finally:
        trl_utils._ChunkedLogProbFunction = kernel


def laid_out(scored: list[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
             batch_size: Optional[int] = None) -> torch.Tensor:
    """The scores `at_temperature_one` collected during one `_get_per_token_logps_and_entropies(model, input_ids,
    attention_mask, logits_to_keep, batch_size)` of TRL, laid out as TRL lays out its log-probs: `(rows,
    logits_to_keep)`, 0 where the label is masked (padding, or before the kept columns).

    TRL's head hands the kernel either only the unmasked positions (on Triton devices) or every position of the chunk
    (elsewhere); both are undone here, with the mask TRL builds from the same arguments."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    mask = labels[:, 1:] != -100  # the head's mask: the label of position p is token p + 1
    chunks = mask.split(batch_size or input_ids.size(0))
    if len(chunks) != len(scored):
        raise RuntimeError(f"TRL's fused LM head ran its kernel {len(scored)} times for {len(chunks)} chunks of rows: "
                           "this trl version does not fit RemoteGRPOTrainer's KL at temperature != 1")
    rows = []
    for chunk_mask, values in zip(chunks, scored):
        if values.numel() == chunk_mask.numel():  # every position scored
            full = values.view(chunk_mask.shape).masked_fill(~chunk_mask, 0)
        else:  # the unmasked positions only
            full = values.new_zeros(chunk_mask.shape).masked_scatter(chunk_mask, values)
        rows.append(full[:, -logits_to_keep:])
    return torch.cat(rows)
