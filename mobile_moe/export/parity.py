"""Parity at export time: the bundle, run through the runtime graph by graph, against the eager model.

fp32 passes when the class probabilities agree within 1e-4 (absolute, after softmax) and every image picks the same
experts: the chosen experts of a per-image MoE, or, for a whole per-token bundle, the set of experts the image used
(MoEStats.expert_tokens > 0), whose token-slot shares are compared as the gates. Quantized or fp16 bundles are
measured the same way and recorded, but not held to that bound: they change the logits by design, and their accuracy
change is reported on the validation split instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

PROB_TOLERANCE = 1e-4


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@torch.no_grad()
def measure_parity(bundle, model, images: torch.Tensor) -> dict[str, Any]:
    """Max |logit| and |probability| errors and expert agreement of `bundle` (a BundleRuntime) vs `model` on images."""
    reference = model(images)
    eager_logits = reference.logits.numpy()
    predictions = [bundle.predict(image.contiguous()) for image in images]
    bundle_logits = np.stack([p.logits for p in predictions])
    result: dict[str, Any] = {
        "images": len(images),
        "max_abs_logit_error": float(np.abs(bundle_logits - eager_logits).max()),
        "max_abs_prob_error": float(np.abs(_softmax(bundle_logits) - _softmax(eager_logits)).max()),
        "top1_agreement": float((bundle_logits.argmax(-1) == eager_logits.argmax(-1)).mean()),
    }
    if reference.routing is not None:
        result.update(_chosen_agreement(predictions, reference.routing))
    elif reference.stats is not None:
        per_expert = reference.stats.expert_tokens.reshape(len(images), -1, reference.stats.expert_tokens.shape[-1])
        result.update(_used_agreement(predictions, per_expert.sum(1).numpy()))  # (N, G, E) -> (N, E)
    return result


def parity_summary(result: dict[str, Any]) -> str:
    """ "max |prob error| 1.2e-07, expert agreement 1.00": the agreement only where the model routes (a dense model
    has no experts to agree on)."""
    summary = f"max |prob error| {result['max_abs_prob_error']:.2e}"
    if "expert_agreement" in result:
        summary += f", expert agreement {result['expert_agreement']:.2f}"
    return summary


def _chosen_agreement(predictions, routing) -> dict[str, float]:
    """Per-image MoEs: the same chosen experts, and their gates."""
    same = [sorted(p.experts) == sorted(e) for p, e in zip(predictions, routing.experts.tolist(), strict=True)]
    gate_errors = [
        abs(g - float(eg))
        for p, egs in zip(predictions, routing.gates, strict=True)
        for g, eg in zip(p.gates, egs, strict=True)
    ]
    return {"expert_agreement": float(np.mean(same)), "max_abs_gate_error": float(max(gate_errors))}


def _used_agreement(predictions, expert_tokens: np.ndarray) -> dict[str, float]:
    """Per-token MoEs: the same used experts (token slots > 0), and each expert's share of the slots (as gates)."""
    eager_shares = expert_tokens / np.maximum(expert_tokens.sum(-1, keepdims=True), 1e-12)  # (N, E)
    bundle_shares = np.zeros_like(eager_shares)
    for row, prediction in zip(bundle_shares, predictions, strict=True):
        row[prediction.experts] = prediction.gates
    same = [p.experts == np.flatnonzero(row > 0).tolist() for p, row in zip(predictions, expert_tokens, strict=True)]
    return {
        "expert_agreement": float(np.mean(same)),
        "max_abs_gate_error": float(np.abs(bundle_shares - eager_shares).max()),
    }


def parity_passed(result: dict[str, Any]) -> bool:
    return result["max_abs_prob_error"] <= PROB_TOLERANCE and result.get("expert_agreement", 1.0) == 1.0
