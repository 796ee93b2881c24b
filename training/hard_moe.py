"""Stage 1 of a Hard MoE run (Gross et al. 2017): from a trained dense gater to fitted k-means routing.

    mobile-moe train --model vit      --size 6x64 --patch 4 --image-size 16 --data digits --out runs/gater
    mobile-moe train --model hard-moe --init-from runs/gater --experts 4 --moe-layers 2 --data digits --out runs/hard

Before the first epoch of a fresh run: copy the gater's best.pt into the frozen trunk and into every expert
(upcycling), take the pooled trunk features of the TRAINING split under the evaluation transform (no augmentation),
fit PCA(pca_dims) then KMeans(E) on them and store both in the router's buffers. Stage 2 is the ordinary training
loop: the grouped forward gives each expert gradients from its own cluster's images only; the frozen trunk gets none.

The paper does not balance clusters and neither do we: an empty cluster's expert never trains (it keeps the gater's
weights) and evaluation reports its load as 0. What was fitted (cluster sizes, explained variance, ...) is recorded
in the run's config.json ("hard_moe"), with the gater's path ("init_from"); a resume reads both and refits nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mobile_moe.checkpoint import load_checkpoint
from mobile_moe.config import ViTConfig, parse_size
from mobile_moe.errors import UsageError
from training import run

# The fields a gater must share with the Hard MoE built on it: its weights must fit the trunk and every expert.
GATER_FIELDS = tuple("depth width num_heads mlp_ratio patch_size image_size in_chans num_classes pool".split())
INIT_FROM_HELP = "a trained dense vit run of the same size (its --out); a Hard MoE's trunk and experts start from it"


def check_init_from(model_config: ViTConfig, init_from: str | os.PathLike | None, data=None) -> None:
    """--init-from is required by a Hard MoE (and must fit it, and `data` when given) and refused by every other
    model (for now). Checked before any data is opened too, so a wrong gater costs nothing."""
    if model_config.routing == "cluster" and init_from is None:
        raise UsageError(f"{model_config.name} trains from a dense gater: give --init-from RUN_DIR, {INIT_FROM_HELP}")
    if model_config.routing != "cluster" and init_from is not None:
        raise UsageError(f"--init-from applies to hard-moe; drop it for --model {model_config.name}")
    if init_from is not None:
        check_gater(model_config, init_from, data)


def same_run_dir(a: str | os.PathLike | None, b: str | os.PathLike | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def gater_defaults(gater_dir: str | os.PathLike, size: str | None) -> dict[str, Any]:
    """The gater's model fields, as defaults for the Hard MoE's (explicit flags win; --size replaces the fields its
    preset sets, so `--size deit-ti` still means patch 16 unless --patch says otherwise)."""
    model = run.read_config(gater_dir)["model"]
    preset = set(parse_size(size)) if size else set()
    return {key: model[key] for key in GATER_FIELDS if key in model and key not in preset}


def check_gater(model_config: ViTConfig, gater_dir: str | os.PathLike, data=None) -> dict[str, Any]:
    """The gater's config.json, if it is a dense `vit` run this Hard MoE can start from; one-line UsageError if not.
    With `data`, its classes and input normalisation must be the gater's too (the copied features and head assume
    them)."""
    config = run.read_config(gater_dir)
    gater = config["model"]
    where = f"--init-from {gater_dir}"
    if gater.get("name") != "vit":
        raise UsageError(f"{where} is a {gater.get('name')} run; a Hard MoE's gater is a trained dense vit run")
    if gater.get("wide_mlp_layers", 0):
        raise UsageError(f"{where} widens its last MLPs (a FLOPs-matched baseline); a Hard MoE's experts copy a plain "
                         "vit's blocks: train the gater without wide_mlp_layers")  # fmt: skip
    differ = [f"{k} {model_config.to_dict().get(k)} vs the gater's {gater.get(k)}" for k in GATER_FIELDS
              if model_config.to_dict().get(k) != gater.get(k)]  # fmt: skip
    if differ:
        raise UsageError(
            f"{where}: the gater does not fit this {model_config.name} ({'; '.join(differ)}); leave --size, --patch, "
            "--image-size, --num-classes and --pool out (they default to the gater's) or give its values"
        )
    if data is not None:
        check_gater_data(config["data"], data, where)
    return config


def check_gater_data(recorded: dict[str, Any], data, where: str) -> None:
    if list(recorded.get("class_names", [])) != list(data.class_names):
        raise UsageError(
            f"{where} was trained on {recorded.get('spec')}, whose classes are not those of {data.spec}; train the "
            "Hard MoE on the gater's data"
        )
    same = [np.allclose(recorded.get(k, []), getattr(data, k), atol=1e-6) for k in ("mean", "std")]
    if not all(same):
        raise UsageError(
            f"{where} was trained with the input normalisation of {recorded.get('spec')} (mean {recorded.get('mean')}, "
            f"std {recorded.get('std')}), {data.spec} has mean {list(data.mean)}, std {list(data.std)}; train the "
            "Hard MoE on the gater's data"
        )


@torch.no_grad()
def trunk_features(model, dataset: Dataset, device, batch_size: int) -> np.ndarray:
    """(N, D) float64: the pooled gater features of every image of `dataset`, in order, in float32 arithmetic."""
    was_training = model.training
    model.eval()
    features = [
        model.image_features(images.to(device)).float().cpu()
        for images, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False)
    ]
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


def load_gater_weights(model, gater_dir: Path) -> dict[str, Any]:
    """gater_dir/best.pt into the trunk and every expert; -> the checkpoint (for its epoch)."""
    path = gater_dir / run.BEST
    if not path.is_file():
        raise UsageError(f"--init-from {gater_dir} has no {run.BEST} yet; let the dense run finish an epoch")
    state = load_checkpoint(path, map_location="cpu")
    model.load_gater(state["model"], source=str(path))
    return state


def prepare_hard_moe(model, gater_dir, train_dataset: Dataset, device, batch_size: int, seed: int) -> dict[str, Any]:
    """Stage 1 on a freshly built HardMoE (on `device`): gater weights, then PCA + k-means on the gater's pooled
    features of `train_dataset` (un-augmented training split), stored in the router. -> the record for config.json.

    Deterministic given `seed`: under DDP every process fits the same clusters (and DDP broadcasts rank 0's buffers).
    """
    cfg = model.config
    gater_dir = Path(gater_dir)
    check_gater(cfg, gater_dir)
    state = load_gater_weights(model, gater_dir)
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
        "gater_epoch": int(state["epoch"]) if "epoch" in state else None,
        "images": len(features),
        "pca_dims": cfg.pca_dims,
        "explained_variance": float(pca.explained_variance_ratio_.sum()) if pca is not None else None,
        "kmeans_inertia": float(kmeans.inertia_),
        "cluster_sizes": sizes,
        "empty_clusters": [e for e, size in enumerate(sizes) if size == 0],
        "seed": seed,
    }


def stage_one(model, init_from, data, train_config, device, resumed: dict[str, Any] | None) -> dict[str, Any]:
    """config.json entries of a Hard MoE run: fitted now on a fresh start; on a resume, kept from the run's own
    config.json (`resumed`), whose clusters checkpoint.pt already holds."""
    if resumed is not None:
        return {"init_from": resumed.get("init_from"), "hard_moe": resumed.get("hard_moe")}
    check_init_from(model.config, init_from, data)  # again, now with the data's classes and normalisation
    train_set = data.split("train")  # the evaluation transform: features of the images, not of augmentations
    record = prepare_hard_moe(model, init_from, train_set, device, train_config.eval_batch_size, train_config.seed)
    return {"init_from": str(Path(init_from).resolve()), "hard_moe": record}
