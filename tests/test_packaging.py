"""The wheel holds the whole tree: every module under mobile_moe/ (setuptools finds the packages itself) and the C
library's every file (libmobile_moe/, at mobile_moe/library/libmobile_moe/: setup.py), in ONE top-level package, and
it imports from an installed copy outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
NOT_INSTALLED = ("tests/", "benchmarks/")  # the project's own checks and measurements


def tracked() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPOSITORY, capture_output=True, text=True, check=True)
    return names.stdout.splitlines()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the tracked tree (setuptools writes build/ beside the sources it builds)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in tracked():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPOSITORY / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True)  # fmt: skip
    (built,) = out.glob("mobile_moe-*.whl")
    return built


def test_every_module_of_the_tree_is_inside_the_package():
    """A module outside mobile_moe/ (a new top-level folder) would import in a checkout and be absent for a user."""
    outside = [name for name in tracked() if not name.startswith(("mobile_moe/", *NOT_INSTALLED))]
    stray = [name for name in outside if name.endswith(".py") and name != "setup.py"]
    assert stray == []


@pytest.mark.slow
def test_the_wheel_holds_one_package_with_every_module_and_native_source_of_the_tree(wheel):
    inside = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in inside} == {"mobile_moe", "mobile_moe-0.1.0.dist-info"}
    modules = {name for name in tracked() if name.startswith("mobile_moe/") and name.endswith(".py")}
    library = {f"mobile_moe/library/{name}" for name in tracked() if name.startswith("libmobile_moe/")}
    expected = modules | library
    assert len(expected) > 100 and sorted(expected - inside) == []
    packages = {os.path.dirname(name) for name in expected if name.endswith(".py")}
    assert all(f"{package}/__init__.py" in inside for package in packages)


@pytest.mark.slow
def test_the_installed_wheel_imports_and_runs_outside_the_checkout(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    modules = sorted(
        ".".join(Path(name).with_suffix("").parts)
        for name in zipfile.ZipFile(wheel).namelist()
        if name.endswith(".py") and not name.endswith("__main__.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name.removesuffix('.__init__'))\n"
        "    assert module.__file__.startswith(sys.argv[1]), module.__file__\n"
        "from mobile_moe.app.cli import main\n"
        "sys.exit(main(['info', '--model', 'mobile-vmoe', '--size', 'deit-ti', '--json']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"params_active"' in result.stdout
