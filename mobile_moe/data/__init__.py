"""mobile_moe/data/: the input path, read top to bottom. Data specs and their readers (datasets.py opens a spec:
idx_files, folders, digits_pairs, synthetic), the one image decoder and the folder check (image_files, image_check),
and augmentation (augment: torchvision's per-image pipeline and MixUp/CutMix).

Entry point: `mobile_moe.data.datasets.open_data(spec, image_size)`.
"""
