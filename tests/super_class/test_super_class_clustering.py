"""Clustering into exactly E super-classes: recovery of planted structure, determinism, balance, repairs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from mobile_moe.errors import UsageError
from mobile_moe.super_class.clustering import balanced_sizes, canonical, cluster, exactly
from mobile_moe.super_class.graph import clustering_affinity
from mobile_moe.super_class.methods import METHODS
from mobile_moe.super_class.planted import planted_confusion
from mobile_moe.super_class.quality import quality


def assert_partition(assignment: np.ndarray, num_classes: int, num_super_classes: int) -> None:
    assert assignment.shape == (num_classes,)
    assert sorted(set(assignment.tolist())) == list(range(num_super_classes))


@pytest.fixture(scope="module")
def clear():
    """Clear planted structure: unequal groups, asymmetric and a few strong cross-group confusions, 50 images."""
    return planted_confusion(num_classes=120, num_groups=6, images_per_class=50, noise=0.2, seed=3)


def test_planted_generator_is_what_it_says(clear):
    sizes = np.bincount(clear.groups)
    assert sizes.max() >= 1.5 * sizes.min()  # unequal sizes
    assert not np.allclose(clear.confusion, clear.confusion.T)  # asymmetric
    assert np.all(clear.confusion.sum(1) == 50)  # 50 images per class, sampled counts
    assert np.mean(clear.confusion - np.diag(np.diag(clear.confusion)) == 0) > 0.8  # sparse
    cross = (clear.rates >= 0.1) & (clear.groups[:, None] != clear.groups[None, :])
    assert cross.sum() >= 3  # a few strong cross-group confusions


@pytest.mark.parametrize("method", ["spectral", "louvain"])
def test_recovers_clear_structure(clear, method):
    assignment = cluster(clear.confusion, 6, method, seed=0)
    assert_partition(assignment, 120, 6)
    assert adjusted_rand_score(clear.groups, assignment) >= 0.9


def test_balanced_recovers_equal_groups_with_equal_sizes():
    planted = planted_confusion(num_classes=120, num_groups=6, noise=0.2, equal_sizes=True, seed=4)
    assignment = cluster(planted.confusion, 6, "balanced", seed=0)
    assert np.bincount(assignment).tolist() == [20] * 6
    assert adjusted_rand_score(planted.groups, assignment) >= 0.9


@pytest.mark.parametrize("num_super_classes", [2, 5, 13, 40])
def test_balanced_sizes_within_one(clear, num_super_classes):
    """The stated tolerance: every size is floor(C/E) or ceil(C/E)."""
    assignment = cluster(clear.confusion, num_super_classes, "balanced", seed=1)
    sizes = np.bincount(assignment)
    assert sizes.max() - sizes.min() <= 1
    assert sorted(sizes.tolist()) == sorted(balanced_sizes(120, num_super_classes).tolist())


def test_balanced_costs_within_confusion_on_unequal_groups(clear):
    spectral = quality(clear.confusion, cluster(clear.confusion, 6, "spectral"))
    balanced = quality(clear.confusion, cluster(clear.confusion, 6, "balanced"))
    assert balanced["balance"] > spectral["balance"]
    assert balanced["within_confusion_share"] < spectral["within_confusion_share"]
    assert balanced["within_confusion_share"] > 2 * balanced["chance_share"]  # still far better than random


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_super_classes", [2, 7, 30, 120])
def test_exactly_e_each_class_once(clear, method, num_super_classes):
    assignment = cluster(clear.confusion, num_super_classes, method, seed=0)
    assert_partition(assignment, 120, num_super_classes)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_under_seed(clear, method):
    first = cluster(clear.confusion, 6, method, seed=7)
    again = cluster(clear.confusion.copy(), 6, method, seed=7)
    assert np.array_equal(first, again)


def test_numbered_by_smallest_member(clear):
    assignment = cluster(clear.confusion, 6)
    first_members = [np.flatnonzero(assignment == s)[0] for s in range(6)]
    assert first_members == sorted(first_members)


def test_default_holds_up_on_sparse_noisy_confusion():
    """Errors mostly spread thinly over all classes: direct spectral clustering on the raw confusion graph breaks off
    tiny super-classes here; the default (auto affinity) must not, and must still find the groups."""
    planted = planted_confusion(num_classes=400, num_groups=8, images_per_class=50, noise=0.7, seed=1)
    default = cluster(planted.confusion, 8, "spectral", seed=0)
    direct = cluster(planted.confusion, 8, "spectral", seed=0, affinity="direct")
    assert np.bincount(direct).min() <= 3  # the failure mode the default guards against
    assert np.bincount(default).min() >= 10
    assert adjusted_rand_score(planted.groups, default) >= 0.55  # 70% of all errors are uniform noise here
    assert adjusted_rand_score(planted.groups, default) > adjusted_rand_score(planted.groups, direct) + 0.1


def test_sparse_few_images_still_recovered():
    """Ten hard-count images per class (a handful of errors each)."""
    planted = planted_confusion(num_classes=300, num_groups=6, images_per_class=10, noise=0.1, seed=2)
    assert adjusted_rand_score(planted.groups, cluster(planted.confusion, 6)) >= 0.8


@pytest.mark.parametrize("method", METHODS)
def test_classes_nobody_confuses_do_not_become_super_classes(method):
    """Classes with no errors and never predicted wrongly have no edges; they must not form their own groups."""
    planted = planted_confusion(num_classes=90, num_groups=3, noise=0.1, seed=5)
    confusion = planted.confusion.copy()
    isolated = [4, 40, 77]
    for c in isolated:
        confusion[c, :] = 0.0
        confusion[:, c] = 0.0
        confusion[c, c] = 50.0
    assignment = cluster(confusion, 3, method, seed=0)
    assert_partition(assignment, 90, 3)
    assert np.bincount(assignment).min() >= 15
    if method == "balanced":  # planted sizes are unequal: balanced cannot match them
        return
    keep = np.setdiff1d(np.arange(90), isolated)
    assert adjusted_rand_score(planted.groups[keep], assignment[keep]) >= 0.85


def test_exactly_merges_and_splits_deterministically(clear):
    affinity = clustering_affinity(clear.confusion)
    too_many = canonical(np.arange(120) % 9)
    merged = exactly(too_many, 6, affinity, seed=0)
    assert_partition(merged, 120, 6)
    assert np.array_equal(merged, exactly(too_many, 6, affinity, seed=0))
    too_few = canonical(clear.groups % 3)
    split = exactly(too_few, 6, affinity, seed=0)
    assert_partition(split, 120, 6)
    # Splitting the planted 3-way merge should find planted groups again.
    assert adjusted_rand_score(clear.groups, split) > adjusted_rand_score(clear.groups, too_few)


def test_merge_prefers_the_tiny_isolated_cluster(clear):
    """A one-class cluster merges before two real groups do."""
    labels = clear.groups.copy()
    lonely = int(np.flatnonzero(labels == 0)[0])
    labels[lonely] = 6  # 7 clusters: the 6 planted + a singleton
    merged = exactly(labels, 6, clustering_affinity(clear.confusion), seed=0)
    assert adjusted_rand_score(clear.groups, merged) >= 0.98


@pytest.mark.parametrize("num_super_classes", [1, 0, 121])
def test_bad_number_of_super_classes(clear, num_super_classes):
    with pytest.raises(UsageError, match="num-super-classes"):
        cluster(clear.confusion, num_super_classes)


def test_unknown_method_and_affinity(clear):
    with pytest.raises(UsageError, match="method"):
        cluster(clear.confusion, 3, "kmeans")
    with pytest.raises(UsageError, match="affinity"):
        cluster(clear.confusion, 3, affinity="cosine")


def test_louvain_retries_when_networkx_gets_stuck(clear, monkeypatch):
    """networkx's Louvain can loop forever for some seeds (networkx #8739); the guard retries with the next seed."""
    import networkx as nx

    import mobile_moe.super_class.clustering as clustering

    real = nx.community.louvain_communities
    seeds = []

    def sometimes_stuck(graph, weight, resolution, seed):
        seeds.append(seed)
        while seed == 0:  # stuck like the upstream bug, until the guard's alarm interrupts it
            pass
        return real(graph, weight=weight, resolution=resolution, seed=seed)

    monkeypatch.setattr(clustering, "LOUVAIN_TIME_LIMIT_S", 0.2)
    monkeypatch.setattr(nx.community, "louvain_communities", sometimes_stuck)
    assignment = cluster(clear.confusion, 6, "louvain", seed=0)
    assert_partition(assignment, 120, 6)
    assert seeds[:2] == [0, 1]
    assert adjusted_rand_score(clear.groups, assignment) >= 0.9


@pytest.mark.parametrize("method", METHODS)
def test_as_many_super_classes_as_classes_is_one_class_each_without_a_third_party_warning(method):
    confusion = np.random.default_rng(0).random((4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's eigensolver warns "k >= N" when asked for N eigenvectors
        assert cluster(confusion, 4, method=method).tolist() == [0, 1, 2, 3]


def ten_digits_confusion() -> np.ndarray:
    """A 10-class dense model's validation confusion as the demo's: a few strong pairs and a triple, one class that
    is confused with nobody, and thin noise everywhere (hard counts, 27 images per class)."""
    matrix = np.full((10, 10), 0.2)
    for group in ((0, 6), (1, 8), (3, 5, 9), (4, 2)):
        for a in group:
            for b in group:
                matrix[a, b] += 3.0 if a != b else 0.0
    np.fill_diagonal(matrix, 25.0)
    return matrix


@pytest.mark.parametrize("num_classes, tries_shared", [(10, False), (40, False), (100, True)])
def test_a_one_class_super_class_switches_to_the_shared_graph_only_with_many_classes_per_group(
    monkeypatch, num_classes, tries_shared
):
    """10 digits into 5: a super-class of one class is an ordinary outcome, not a degenerate spectral split (the
    shared graph's even pairs had taken the demo's grouping down to chance); 100 classes into 5, it is one."""
    from mobile_moe.super_class import clustering

    graphs = []

    def one_class_apart(graph, num_super_classes, seed):
        graphs.append(graph)
        labels = np.arange(graph.shape[0]) % (num_super_classes - 1) + 1
        labels[0] = 0  # super-class 0 holds class 0 alone
        return labels

    monkeypatch.setattr(clustering, "spectral_clusters", one_class_apart)
    confusion = np.eye(num_classes) * 20 + 0.5
    labels, affinity = clustering.spectral_auto(confusion, 5, seed=0)
    assert (len(graphs) == 2) == tries_shared and affinity == "direct" and np.bincount(labels).min() == 1


def test_the_demos_kind_of_confusion_keeps_its_grouping_well_above_chance():
    measured = quality(ten_digits_confusion(), cluster(ten_digits_confusion(), 5))
    assert measured["within_confusion_share"] > measured["chance_share"] + 2 * measured["chance_share_std"]


def test_chance_has_a_measured_spread_and_the_listing_states_it():
    from mobile_moe.formats.superclasses import SuperClasses
    from mobile_moe.super_class.table import chance_caution, format_table

    confusion = ten_digits_confusion()
    rng = np.random.default_rng(1)
    randoms = [quality(confusion, rng.permutation(np.repeat(np.arange(5), 2)))["within_confusion_share"]
               for _ in range(400)]  # fmt: skip
    measured = quality(confusion, np.repeat(np.arange(5), 2))
    assert measured["chance_share"] == pytest.approx(np.mean(randoms), abs=0.02)
    assert measured["chance_share_std"] == pytest.approx(np.std(randoms), rel=0.25)
    derived = cluster(confusion, 5)
    listing = format_table(SuperClasses(derived.tolist(), [str(c) for c in range(10)], [f"s{s}" for s in range(5)],
                                        "spectral", "test", quality(confusion, derived)))  # fmt: skip
    assert f"± {quality(confusion, derived)['chance_share_std']:.1%}" in listing and "caution" not in listing
    near = {"within_confusion_share": 0.2, "chance_share": 0.15, "chance_share_std": 0.04}
    assert chance_caution(near) is not None  # 0.2 is within two of chance's stds of 0.15
    assert chance_caution({**near, "chance_share_std": 0.01}) is None


def test_a_grouping_on_few_confusions_comes_with_a_caution():
    """Three mistakes on 100 images can all fall inside super-classes: a 100% share that means nothing."""
    from mobile_moe.super_class.table import evidence_caution

    few = np.diag(np.full(10, 10.0))
    few[0, 1] = few[2, 3] = few[4, 5] = 1  # hard counts: 3 misclassified images
    measured = quality(few, np.repeat(np.arange(5), 2))
    assert measured["confusion_mass"] == 3 and measured["within_confusion_share"] == 1.0
    assert "rest on 3 images' worth of confusion" in evidence_caution(measured)
    assert evidence_caution(quality(ten_digits_confusion(), cluster(ten_digits_confusion(), 5))) is None


def test_stability_is_the_rand_index_over_bootstrap_resamples():
    """A strong planted grouping holds on every resample (ARI 1); a matrix of a few confusions spread evenly does not;
    each resample keeps every class's image count."""
    from mobile_moe.super_class.derive import derive_super_classes
    from mobile_moe.super_class.quality import bootstrap_confusion

    confusion = ten_digits_confusion()
    resampled = bootstrap_confusion(confusion, np.random.default_rng(0))
    assert np.array_equal(resampled.sum(1), np.maximum(1, np.round(confusion.sum(1))))
    assert not np.array_equal(resampled, confusion)
    strong = derive_super_classes(confusion, 5, stability_resamples=5).quality["stability"]
    assert strong["resamples"] == 5 and strong["min_ari"] > 0.9
    weak = np.full((10, 10), 0.3) + np.diag(np.full(10, 30.0))
    loose = derive_super_classes(weak, 5, stability_resamples=5).quality["stability"]
    assert loose["mean_ari"] < 0.5
