"""What an app developer meets first, in one line each: the manifest given instead of its folder, and what
mm_model_info says of a bundle it opened."""

from __future__ import annotations

import pytest
from conftest import needs_build

from mobile_moe.library.binding import LibraryError, Model

pytestmark = [pytest.mark.export, needs_build]


def test_the_manifest_file_given_for_its_folder_says_so(bundle):
    with pytest.raises(LibraryError, match=r"manifest.json is a file: pass the bundle's folder \(the one holding"):
        Model(bundle / "manifest.json")


def test_a_split_bundle_says_what_it_keeps_and_whether_it_prefetches(bundle):
    info = Model(bundle, weight_cache_dir="").info
    assert (info["kind_name"], info["cache_experts"], info["top_k"]) == ("split", 1, 1)
    assert info["prefetch"] == 0 and info["has_trunk_tail"] == 0  # no early routing: loads in line, as said
