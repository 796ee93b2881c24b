"""Stage 1 of a Hard MoE run (Gross et al. 2017): from a trained dense gater to fitted k-means routing.

    mobile-moe train --model vit      --size 6x64 --patch 4 --image-size 16 --data digits --out runs/gater
    mobile-moe train --model hard-moe --init-from runs/gater --experts 4 --moe-layers 2 --data digits --out runs/hard

Before the first epoch of a fresh run: copy the gater's best.pt into the frozen trunk and into every expert
(upcycling, mobile_moe/training/init_from.py), take the pooled trunk features of the TRAINING split under the evaluation
transform (no augmentation), fit PCA(pca_dims) then KMeans(E) on them and store both in the router's buffers.
Stage 2 is the ordinary training loop: the grouped forward gives each expert gradients from its own cluster's images
only; the frozen trunk gets none.

The paper does not balance clusters and neither do we: an empty cluster's expert never trains (it keeps the gater's
weights) and evaluation reports its load as 0. What was fitted (cluster sizes, explained variance, ...) is recorded
in the run's config.json ("hard_moe"), with the gater's path ("init_from"); a resume reads both and refits nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mobile_moe.errors import UsageError
from mobile_moe.training import init_from
from mobile_moe.training.evaluate import in_order


@torch.no_grad()
def trunk_features(model, dataset: Dataset, device, batch_size: int) -> np.ndarray:
    """(N, D) float64: the pooled gater features of every image of `dataset`, in order, in float32 arithmetic."""
    was_training = model.training
    model.eval()
    features = [model.image_features(images.to(device)).float().cpu() for images, _ in in_order(dataset, batch_size)]
    model.train(was_training)
    return torch.cat(features).double().numpy()


def fit_clusters(features: np.ndarray, num_experts: int, pca_dims: int, seed: int) -> dict[str, Any]:
    """PCA(pca_dims) (skipped when 0) then KMeans(E) on (N, D) features -> the fitted estimators and arrays."""
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA

    n = len(features)
    if n < num_experts or n < pca_dims:
        raise UsageError(
            f"{n} training images cannot be clustered into {num_experts} experts with pca_dims={pca_dims}: "
            "use fewer --experts, a smaller pca_dims (--model-kwargs pca_dims=N) or more data"
        )
    pca = PCA(pca_dims, svd_solver="full", random_state=seed).fit(features) if pca_dims else None
    projected = pca.transform(features) if pca is not None else features
    kmeans = KMeans(num_experts, n_init=10, random_state=seed).fit(projected)
    return {"pca": pca, "kmeans": kmeans, "projected": projected}


def prepare_hard_moe(
    model, gater_dir, train_dataset: Dataset, device, batch_size: int, seed: int, *, class_names: list[str]
) -> dict[str, Any]:
    """Stage 1 on a freshly built HardMoE (on `device`): gater weights (its classifier left out when it classifies
    other classes than `class_names`, the data's), then PCA + k-means on the gater's pooled features of
    `train_dataset` (un-augmented training split), stored in the router. -> the record for config.json.

    Deterministic given `seed`: under DDP every process fits the same clusters (and DDP broadcasts rank 0's buffers).
    """
    cfg = model.config
    record = init_from.load_dense(model, gater_dir, class_names=class_names)
    features = trunk_features(model, train_dataset, device, batch_size)  # (N, D)
    fitted = fit_clusters(features, cfg.num_experts, cfg.pca_dims, seed)
    pca, kmeans = fitted["pca"], fitted["kmeans"]
    as_buffer = lambda array: torch.as_tensor(np.asarray(array), dtype=torch.float32)  # noqa: E731
    model.router.set_clusters(
        as_buffer(pca.mean_) if pca is not None else None,
        as_buffer(pca.components_) if pca is not None else None,
        as_buffer(kmeans.cluster_centers_),
    )
    # Sizes as the model itself routes (float32), which is what training will see.
    routed = model.router.distances(torch.as_tensor(features, dtype=torch.float32, device=device)).argmin(-1)
    sizes = torch.bincount(routed.cpu(), minlength=cfg.num_experts).tolist()
    return {
        "gater_epoch": record["dense_epoch"],
        "images": len(features),
        "pca_dims": cfg.pca_dims,
        "explained_variance": float(pca.explained_variance_ratio_.sum()) if pca is not None else None,
        "kmeans_inertia": float(kmeans.inertia_),
        "cluster_sizes": sizes,
        "empty_clusters": [e for e, size in enumerate(sizes) if size == 0],
        "seed": seed,
        "new_head": record["new_head"],
        "dense_classes": record["dense_classes"],
    }


def stage_one(model, gater_dir, data, train_config, device, resumed: dict[str, Any] | None) -> dict[str, Any]:
    """config.json entries of a Hard MoE run: fitted now on a fresh start; on a resume, kept from the run's own
    config.json (`resumed`), whose clusters checkpoint.pt already holds."""
    if resumed is not None:
        return {"init_from": resumed.get("init_from"), "hard_moe": resumed.get("hard_moe")}
    init_from.check_init_from(model.config, gater_dir)  # again: the run may have changed while the data was opened
    train_set = data.split("train")  # the evaluation transform: features of the images, not of augmentations
    record = prepare_hard_moe(
        model, gater_dir, train_set, device, train_config.eval_batch_size, train_config.seed,
        class_names=data.class_names,
    )  # fmt: skip
    return {"init_from": str(Path(gater_dir).resolve()), "hard_moe": record}
