"""The `mobile-moe` console script: info output, lazy command discovery, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mobile_moe.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_info_json_is_one_object_with_the_counts(capsys):
    status, out, _ = run_cli(capsys, "info", "--model", "mobile-vmoe", "--size", "deit-ti", "--top-k", "2", "--json")
    assert status == 0
    info = json.loads(out)  # exactly one JSON object, nothing else on stdout
    assert info["params_total"] == 11_045_426 and info["params_active"] == 6_311_474
    assert info["flops"] == 2_739_760_896
    assert info["config"]["patch_size"] == 16 and info["config"]["top_k"] == 2


def test_info_table(capsys):
    status, out, _ = run_cli(capsys, "info", "--model", "vit", "--size", "12x192")
    assert status == 0 and "vit 12x192/32 @224" in out and "params active" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["info", "--model", "nope"], "invalid choice: 'nope'"),
        (["info", "--model", "vit", "--size", "deit-xl"], "size 'deit-xl'"),
        (["info", "--model", "vit", "--size", "12x100"], "width 100 is not in the paper's grid"),
        (["info", "--model", "vit", "--image-size", "100"], "image_size=100 is not divisible by patch_size=32"),
        (["info", "--model", "mobile-vmoe", "--top-k", "11"], "top_k=11: must be between 1 and num_experts=10"),
        (["info", "--model", "mobile-vmoe", "--moe-layers", "12"], "moe_layers=12: must be between 1 and 11"),
        (["info", "--model", "mobile-vmoe", "--experts", "1"], "num_experts=1: must be at least 2"),
        (["info", "--model", "vit", "--experts", "4"], "--experts: model vit has no such option"),
        (["info"], "required: --model"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, fragment):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


def test_width_not_divisible_by_heads():
    from mobile_moe.errors import UsageError
    from mobile_moe.registry import make_config

    with pytest.raises(UsageError, match="width=100 is not divisible by num_heads=3"):
        make_config("vit", width=100, num_heads=3)


def test_help_and_info_do_not_import_torch():
    code = (
        "import sys; from mobile_moe.cli import main; main(['info', '--model', 'vit', '--json']);"
        "assert 'torch' not in sys.modules, 'info imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    result = subprocess.run([sys.executable, "-m", "mobile_moe.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "info" in result.stdout and "demo" in result.stdout
