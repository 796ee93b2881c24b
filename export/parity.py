"""Parity at export time: the bundle, run through the runtime graph by graph, against the eager model.

fp32 passes when the class probabilities agree within 1e-4 (absolute, after softmax) and every image picks the same
experts. Quantized or fp16 bundles are measured the same way and recorded, but not held to that bound: they change
the logits by design, and their accuracy change is reported on the validation split instead.
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
    """Max |logit| and |probability| errors and expert agreement of `bundle` (a runtime Bundle) vs `model` on images."""
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
        eager_experts = reference.routing.experts.tolist()
        same = [sorted(p.experts) == sorted(e) for p, e in zip(predictions, eager_experts, strict=True)]
        result["expert_agreement"] = float(np.mean(same))
        gate_errors = [
            abs(g - float(eg))
            for p, egs in zip(predictions, reference.routing.gates, strict=True)
            for g, eg in zip(p.gates, egs, strict=True)
        ]
        result["max_abs_gate_error"] = float(max(gate_errors))
    return result


def parity_passed(result: dict[str, Any]) -> bool:
    return result["max_abs_prob_error"] <= PROB_TOLERANCE and result.get("expert_agreement", 1.0) == 1.0
