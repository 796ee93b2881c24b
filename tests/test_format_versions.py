"""Format versions (mobile_moe/formats/versions.py): the one rule by which every versioned format's reader refuses a
file of another version, or of none, in one line; and bench's results.json, whose one reader decides whether a --out
holds an earlier bench. (The run directory's, the super-class file's and the packed store's are tested with their
readers: tests/training/test_training_faults.py, tests/super_class/test_super_class_faults.py and
tests/data/test_store.py.)
"""

from __future__ import annotations

import json

import pytest

from mobile_moe.app.cli import main
from mobile_moe.device_bench.bench import earlier_bench
from mobile_moe.errors import UsageError
from mobile_moe.formats.versions import check_version

NONE = "of format version 0 (it states none)"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ({}, f"f.json is a thing {NONE}; this mobile-moe reads version 3: make it again"),
        ({"version": None}, f"f.json is a thing {NONE}; this mobile-moe reads version 3: make it again"),
        ({"version": 2}, "f.json is a thing of format version 2; this mobile-moe reads version 3: make it again"),
        ({"version": 4}, "f.json is a thing of format version 4 (written by a newer mobile-moe); this mobile-moe "
                         "reads version 3: upgrade mobile-moe, or make it again"),  # fmt: skip
        ({"version": 3.0}, "f.json states format version 3.0, not an integer; this mobile-moe reads version 3: make it "
                           "again"),  # fmt: skip
        ({"version": "\x1b[31m3"}, "f.json states format version \"\\u001b[31m3\", not an integer;"),  # shown escaped
        ([3], f"f.json is a thing {NONE}"),
    ],
)
def test_a_file_of_another_version_is_one_line_saying_which_and_what_to_do(data, said):
    with pytest.raises(UsageError) as caught:
        check_version(data, 3, where="f.json", what="a thing", fix="make it again")
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value) and "\x1b" not in str(caught.value)
    check_version({"version": 3}, 3, where="f.json", what="a thing", fix="make it again")  # its own: accepted


def test_true_is_no_version_one():
    with pytest.raises(UsageError, match="states format version true, not an integer"):
        check_version({"version": True}, 1, where="f.json", what="a thing", fix="make it again")


RUN = {"bundle": "b", "model": "vit", "runtime": "native", "device": "host", "threads": 1,
       "latency_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}, "load_ms": {"router": 1.0, "expert": None},
       "switch_ms": None, "peak_rss_bytes": None, "bytes_loaded_per_image": 1.0, "params_active": 1,
       "expert_change_rate": None, "cache_hit_rate": {}}  # fmt: skip


def earlier(tmp_path, results: dict):
    """A --out holding an earlier bench whose results.json is `results`."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    (out / "report.md").write_text("an earlier bench's report")
    return out


@pytest.mark.parametrize(
    ("version", "said"),
    [
        (None, f"is a bench's results {NONE}; this mobile-moe reads version 1: move"),
        (0, "is a bench's results of format version 0; this mobile-moe reads version 1: move"),
        (2, "is a bench's results of format version 2 (written by a newer mobile-moe); this mobile-moe reads version "
            "1: upgrade mobile-moe, or move"),  # fmt: skip
        ("1", 'states format version "1", not an integer; this mobile-moe reads version 1: move'),
    ],
)
def test_an_earlier_bench_of_another_results_version_is_refused_in_one_line_and_kept(tmp_path, capsys, version, said):
    """bench replaces an earlier bench's --out whole; one whose results.json is of another format version (or none) is
    refused by the one reader of results.json, in one line, through the API and the command, and nothing is touched."""
    results = {"runs": [RUN], "host": "h", "rounds": 1, "settings": {}}
    out = earlier(tmp_path, results if version is None else {"version": version, **results})
    refusal = f"{out / 'results.json'} {said} {out} away, or choose another --out"
    with pytest.raises(UsageError) as caught:
        earlier_bench(out)
    assert str(caught.value) == refusal
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert main(["bench", str(tmp_path / "no-bundle"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"mobile-moe bench: error: {refusal}\n", err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_an_earlier_bench_of_this_version_is_replaced_and_a_folder_of_other_json_is_not_a_bench(tmp_path):
    assert earlier_bench(earlier(tmp_path, {"version": 1, "runs": [RUN], "host": "h", "rounds": 1, "settings": {}}))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text('{"accuracy": 0.9}')  # someone else's results.json
    with pytest.raises(UsageError, match="exists and is not a mobile-moe bench's output"):
        earlier_bench(tmp_path / "other")
