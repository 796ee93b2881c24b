"""The paper's ImageNet-1k numbers (Daxberger et al. 2023, Fig. 3), printed beside ours in every table.

Top-1 in percent on the ImageNet-1k validation set; FLOPs in millions per image. Where the text extraction of the
paper lost a digit, the value is the one the rest of its column implies (noted on the line).
"""

from __future__ import annotations

# Fig. 3a (and Fig. 1): (depth, width) -> (MFLOPs, dense top-1, MoE top-1). Patch 32, E=10, k=1, L=2.
FIG3A: dict[tuple[int, int], tuple[int, float, float]] = {
    (12, 384): (2297, 71.88, 74.23),  # FLOPs: 1752 + the 545 that each 3 layers of width 384 add
    (9, 384): (1752, 69.94, 72.47),
    (6, 384): (1207, 63.21, 66.91),  # FLOPs: 1752 - 545
    (12, 192): (618, 59.51, 62.90),  # dense: 62.90 - 3.39
    (9, 192): (478, 56.50, 59.52),
    (6, 192): (338, 51.18, 55.69),
    (12, 96): (176, 53.79, 55.39),
    (9, 96): (140, 51.27, 52.99),
    (6, 96): (103, 46.54, 50.28),
    (12, 64): (88, 42.90, 46.07),
    (9, 64): (71, 40.46, 43.95),
    (6, 64): (54, 36.64, 41.30),
}

# Fig. 3b-e are ablations of DeiT-Ti/16 (E=10, k=1, L=2 unless varied). Deltas are the paper's, over its dense
# DeiT-Ti (70.69 in 3b/3c, 70.79 in the text), or over the FLOPs-matched dense model (3d, 3e).

ABLATION_DENSE = 70.69  # the dense DeiT-Ti that Fig. 3b and 3c's deltas are over (MoE top-1 - delta)

# Fig. 3b: E -> (router top-1 on the E-way super-class task, MoE top-1, delta)
FIG3B: dict[int, tuple[float, float, float]] = {
    5: (86.43, 72.33, 1.64),
    7: (87.43, 73.13, 2.44),
    10: (87.12, 73.52, 2.83),
    15: (84.16, 73.10, 2.41),
    20: (84.08, 73.36, 2.67),
}

# Fig. 3c: L -> (router top-1, MoE top-1, delta). The paper tried L = 1, 2, 4, 6, 8; the grid is 1..5.
FIG3C: dict[int, tuple[float, float, float]] = {
    1: (90.17, 72.14, 1.45),
    2: (87.12, 73.52, 2.83),
    4: (82.12, 71.67, 0.98),
    6: (77.70, 70.07, -0.62),
    8: (72.09, 64.47, -6.22),
}

# Fig. 3d: k -> (MFLOPs, dense top-1 with its last L MLPs k x wider, MoE top-1)
FIG3D: dict[int, tuple[int, float, float]] = {
    1: (2534, 70.79, 73.44),
    2: (2760, 71.70, 74.42),
    3: (3005, 73.58, 74.44),
    5: (3476, 74.87, 74.32),
    10: (4653, 75.10, 74.37),
}

# Fig. 3e (k=2): routing strategy -> top-1; the dense row is the FLOPs-matched dense model of Fig. 3d (k=2).
FIG3E: dict[str, float] = {
    "dense": 71.70,
    "super-class": 74.42,
    "random": 69.22,
    "e2e-image": 73.57,
    "e2e-token": 74.85,
}
