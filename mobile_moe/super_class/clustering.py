"""Cluster the confusion graph into exactly E super-classes: spectral (default), louvain, or balanced.

Every method returns an assignment (C,) with values 0..E-1, each used, numbered in order of each super-class's
smallest class index (so equal partitions give equal files), and is deterministic for a given seed.
"""

from __future__ import annotations

import signal
import threading

import networkx as nx
import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.cluster import KMeans, SpectralClustering
from sklearn.manifold import spectral_embedding

from mobile_moe.errors import UsageError
from mobile_moe.super_class.graph import AFFINITIES, clustering_affinity, default_neighbours
from mobile_moe.super_class.methods import METHODS

LOUVAIN_TIME_LIMIT_S = 30.0  # per call; healthy calls take well under a second at 1000 classes


def cluster(
    confusion: np.ndarray,
    num_super_classes: int,
    method: str = "spectral",
    seed: int = 0,
    affinity: str = "auto",
    details: dict | None = None,
) -> np.ndarray:
    """Assignment (C,) of each class to one of `num_super_classes` super-classes.

    affinity: "direct" (the paper's confusion graph), "shared" (second-order, for thinly spread errors; graph.py) or
    "auto": direct, except that spectral clustering switches to shared when direct breaks off tiny super-classes.
    details: if given, receives {"affinity": the one used}.
    """
    num_classes = confusion.shape[0]
    if not 2 <= num_super_classes <= num_classes:
        raise UsageError(f"--num-super-classes {num_super_classes}: must be between 2 and {num_classes} (the classes)")
    if method not in METHODS:
        raise UsageError(f"--method {method}: unknown; choose one of {', '.join(METHODS)}")
    if affinity not in ("auto", *AFFINITIES):
        raise UsageError(f"--affinity {affinity}: unknown; choose one of auto, {', '.join(AFFINITIES)}")
    if num_super_classes == num_classes:  # one class each, whatever the graph (an eigensolver would warn at k = N)
        if details is not None:
            details["affinity"] = "direct" if affinity == "auto" else affinity
        return np.arange(num_classes)
    labels = None  # spectral with the auto affinity has clustered already
    if method == "spectral" and affinity == "auto":
        labels, affinity = spectral_auto(confusion, num_super_classes, seed)
    affinity = "direct" if affinity == "auto" else affinity
    if details is not None:
        details["affinity"] = affinity
    graph = clustering_affinity(confusion, affinity)
    if method == "spectral":
        labels = spectral_clusters(graph, num_super_classes, seed) if labels is None else labels
    elif method == "louvain":
        # Louvain runs on the kNN graph without regularisation: a complete graph (C^2 edges) is too slow for
        # pure-Python Louvain at 1000 classes, and the strongest partners carry its signal.
        sparse = clustering_affinity(confusion, affinity, neighbours=default_neighbours(num_classes), regularisation=0)
        labels = louvain_clusters(sparse, num_super_classes, seed)
    else:
        labels = balanced_clusters(graph, num_super_classes, seed)
    return canonical(exactly(labels, num_super_classes, graph, seed))


def canonical(labels: np.ndarray) -> np.ndarray:
    """Renumber clusters 0.. in order of their smallest member."""
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)  # cluster ranks by first appearance
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[np.unique(labels, return_inverse=True)[1]]


# --- spectral -------------------------------------------------------------------------------------------------------


def spectral_clusters(affinity: np.ndarray, num_super_classes: int, seed: int) -> np.ndarray:
    model = SpectralClustering(
        n_clusters=num_super_classes, affinity="precomputed", assign_labels="kmeans", n_init=10, random_state=seed
    )
    return model.fit_predict(affinity)


def tiny_size(num_classes: int, num_super_classes: int) -> int:
    """Super-classes below this size (a tenth of the mean size, at least 2) signal a degenerate spectral split."""
    return max(2, num_classes // (10 * num_super_classes))


SWITCH_FROM = 10  # classes per super-class on average from which a tiny super-class means a degenerate split


def spectral_auto(confusion: np.ndarray, num_super_classes: int, seed: int) -> tuple[np.ndarray, str]:
    """Spectral clustering on the direct graph, or on the shared one if direct breaks off tiny super-classes.

    On sparse, noisy graphs the leading eigenvectors localise on a few weakly attached classes, and spectral
    clustering returns super-classes of 1-3 classes (seen on planted 1000-class structure at noise 0.6); the shared
    affinity is dense and does not. The one with the larger smallest super-class wins; ties keep direct. Below
    SWITCH_FROM classes per super-class on average a super-class of one or two classes is an ordinary outcome (ten
    digits into five groups), not a sign of it: direct stays (the shared graph's even sizes had cost the demo its
    grouping, down to chance).
    """
    direct = spectral_clusters(clustering_affinity(confusion, "direct"), num_super_classes, seed)
    smallest = np.bincount(direct, minlength=num_super_classes).min()
    few_per_group = confusion.shape[0] < SWITCH_FROM * num_super_classes
    if few_per_group or smallest >= tiny_size(confusion.shape[0], num_super_classes):
        return direct, "direct"
    shared = spectral_clusters(clustering_affinity(confusion, "shared"), num_super_classes, seed)
    if np.bincount(shared, minlength=num_super_classes).min() > smallest:
        return shared, "shared"
    return direct, "direct"


# --- louvain --------------------------------------------------------------------------------------------------------


def louvain_clusters(affinity: np.ndarray, num_super_classes: int, seed: int, max_steps: int = 24) -> np.ndarray:
    """Louvain communities; search the resolution (log-bisection) until exactly E communities, else the closest.

    The number of communities grows with the resolution, though not strictly; if no resolution tried lands on E, the
    closest partition is repaired by `exactly` (deterministic merges / splits). Classes with no edge at all (never
    confused either way) carry no information and would each be a community of their own: they are left out of the
    search and then fill up the smallest communities, one by one.
    """
    connected = np.flatnonzero(affinity.sum(1) > 0)
    if len(connected) < affinity.shape[0] and len(connected) >= num_super_classes:
        labels = np.empty(affinity.shape[0], dtype=np.int64)
        labels[connected] = louvain_clusters(affinity[np.ix_(connected, connected)], num_super_classes, seed, max_steps)
        for isolated in np.flatnonzero(affinity.sum(1) == 0):
            sizes = np.bincount(labels[connected], minlength=labels[connected].max() + 1)
            labels[isolated] = int(np.argmin(sizes))
            connected = np.append(connected, isolated)
        return labels
    # Integer weights: networkx <= 3.6's Louvain can loop forever on round-off ties between equal gains
    # (networkx issues #8739, #5175; fixed upstream by PR #8757); integer weights make such ties much rarer.
    graph = nx.from_numpy_array(np.round(affinity * (1e6 / max(affinity.max(), 1e-300))))
    tried: dict[float, np.ndarray] = {}

    def communities(resolution: float) -> np.ndarray:
        if resolution not in tried:
            parts = _louvain_guarded(graph, resolution, seed)
            labels = np.empty(affinity.shape[0], dtype=np.int64)
            for index, part in enumerate(parts):
                labels[list(part)] = index
            tried[resolution] = labels
        return tried[resolution]

    # Louvain never returns fewer communities than the graph has connected components (sparse confusion can have
    # many), and very low resolutions make networkx's Louvain slow: search within [1/64, 64] and only as far down as
    # the components allow; `exactly` merges what remains.
    low, high = 1.0, 1.0
    floor = nx.number_connected_components(graph)
    while len(np.unique(communities(low))) > max(num_super_classes, floor) and low > 1 / 64:
        low /= 4
    while len(np.unique(communities(high))) < num_super_classes and high < 64:
        high *= 4
    for _ in range(max_steps):
        middle = float(np.sqrt(low * high))
        count = len(np.unique(communities(middle)))
        if count == num_super_classes:
            return communities(middle)
        low, high = (middle, high) if count < num_super_classes else (low, middle)
    # Closest count wins; on a tie prefer more communities (merging is gentler than splitting), then lower resolution.
    best = min(tried, key=lambda r: (abs(len(np.unique(tried[r])) - num_super_classes), -len(np.unique(tried[r])), r))
    return tried[best]


class _LouvainStuck(Exception):
    """networkx's Louvain did not finish in time (it can loop forever: networkx #8739)."""


def _louvain_guarded(graph: nx.Graph, resolution: float, seed: int, attempts: int = 4) -> list[set]:
    """networkx Louvain, retried with the next seed if it is still running after a generous time limit.

    The upstream infinite loop (see above) depends on the seed, so a retry with seed + 1 finishes; the sequence of
    seeds is fixed, so results stay deterministic unless a healthy call is slower than the limit (30 s; healthy calls
    take well under a second at 1000 classes). The guard needs SIGALRM, i.e. Unix and the main thread.
    """
    if not (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()):
        return nx.community.louvain_communities(graph, weight="weight", resolution=resolution, seed=seed)

    def stuck(signum, frame):
        raise _LouvainStuck

    for attempt in range(attempts):
        previous = signal.signal(signal.SIGALRM, stuck)
        signal.setitimer(signal.ITIMER_REAL, LOUVAIN_TIME_LIMIT_S)
        try:
            return nx.community.louvain_communities(graph, weight="weight", resolution=resolution, seed=seed + attempt)
        except _LouvainStuck:
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    raise UsageError("Louvain did not finish (networkx bug #8739); use --method spectral or another --seed")


# --- balanced -------------------------------------------------------------------------------------------------------


def balanced_sizes(num_classes: int, num_super_classes: int) -> np.ndarray:
    """The target sizes: floor(C/E) or ceil(C/E) each (largest minus smallest <= 1)."""
    base, extra = divmod(num_classes, num_super_classes)
    return np.array([base + (1 if s < extra else 0) for s in range(num_super_classes)])


def balanced_clusters(affinity: np.ndarray, num_super_classes: int, seed: int, max_rounds: int = 20) -> np.ndarray:
    """Balanced k-means on the spectral embedding: each round assigns classes to exactly-sized slots.

    Each super-class s owns size[s] slots at its centre; the Hungarian algorithm (linear_sum_assignment) gives every
    class one slot at least total squared distance. Centres are then re-estimated, until the assignment is stable.
    """
    num_classes = affinity.shape[0]
    embedding = spectral_embedding(affinity, n_components=num_super_classes, random_state=seed, drop_first=False)
    embedding /= np.maximum(np.linalg.norm(embedding, axis=1, keepdims=True), 1e-12)  # (C, E) on the unit sphere
    labels = KMeans(num_super_classes, n_init=10, random_state=seed).fit_predict(embedding)
    for _ in range(max_rounds):
        centres = np.stack([embedding[labels == s].mean(0) for s in range(num_super_classes)])  # (E, E)
        # The largest clusters get the ceil(C/E) slots, so the first round moves as few classes as possible.
        order = np.argsort(-np.bincount(labels, minlength=num_super_classes), kind="stable")
        slot_owner = np.repeat(order, balanced_sizes(num_classes, num_super_classes))  # (C,) super-class per slot
        distances = ((embedding[:, None, :] - centres[None, :, :]) ** 2).sum(-1)  # (C, E)
        _, slots = linear_sum_assignment(distances[:, slot_owner])  # (C, C) cost: class x slot
        new_labels = slot_owner[slots]
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return labels


# --- exactly E ------------------------------------------------------------------------------------------------------


def exactly(labels: np.ndarray, num_super_classes: int, affinity: np.ndarray, seed: int) -> np.ndarray:
    """Merge or split clusters deterministically until there are exactly E.

    Merge: the pair whose merge raises modularity most. Split: the cluster whose spectral bisection cuts cleanest.
    """
    labels = canonical(labels)
    while labels.max() + 1 > num_super_classes:
        labels = canonical(_merge_closest(labels, affinity))
    while labels.max() + 1 < num_super_classes:
        labels = canonical(_split_best(labels, affinity, seed))
    return labels


def _merge_closest(labels: np.ndarray, affinity: np.ndarray) -> np.ndarray:
    """Merge the pair whose merge raises modularity most: tiny, isolated clusters go first, real groups last."""
    count = labels.max() + 1
    membership = np.eye(count)[labels]  # (C, K) one-hot
    between = membership.T @ affinity @ membership  # (K, K) total affinity between clusters
    volumes = between.sum(1)
    total = volumes.sum()
    gain = between / total - np.outer(volumes, volumes) / total**2  # modularity gain / 2 of merging a and b
    np.fill_diagonal(gain, -np.inf)
    a, b = np.unravel_index(np.argmax(gain), gain.shape)
    return np.where(labels == max(a, b), min(a, b), labels)


def _split_best(labels: np.ndarray, affinity: np.ndarray, seed: int) -> np.ndarray:
    """Bisect every cluster by spectral clustering of its sub-graph; keep the cleanest cut (lowest normalised cut).

    Splitting simply the largest cluster can cut a real group in half while two merged groups stay together.
    """
    best, best_cut = None, np.inf
    for cluster_index in range(labels.max() + 1):
        members = np.flatnonzero(labels == cluster_index)
        if len(members) < 2:
            continue
        halves = _bisect(affinity[np.ix_(members, members)], seed)
        cut = _normalised_cut(affinity[np.ix_(members, members)], halves)
        if cut < best_cut:
            best, best_cut = members[halves == 1], cut
    if best is None:
        raise UsageError("cannot split super-classes further: every super-class has one class")
    result = labels.copy()
    result[best] = labels.max() + 1
    return result


def _bisect(sub: np.ndarray, seed: int) -> np.ndarray:
    if len(sub) == 2:
        return np.array([0, 1])
    sub = sub + 1e-9  # keeps the sub-graph connected
    np.fill_diagonal(sub, 0.0)
    halves = SpectralClustering(2, affinity="precomputed", random_state=seed, n_init=10).fit_predict(sub)
    if halves.min() == halves.max():  # degenerate: split by index order
        halves = (np.arange(len(sub)) >= len(sub) // 2).astype(np.int64)
    return halves


def _normalised_cut(sub: np.ndarray, halves: np.ndarray) -> float:
    one = halves == 1
    cut = sub[np.ix_(one, ~one)].sum()
    return float(cut / max(sub[one].sum(), 1e-12) + cut / max(sub[~one].sum(), 1e-12))
