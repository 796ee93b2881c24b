"""libmobile_moe/README.md runs as written: its build, "link your own app" (pkg-config against the
SDK folder) and "Java on the host" blocks, in order, in a fresh folder, against a real bundle. Markers as in the
project README (tests/test_readme.py): `<!-- readme-test: runs SCENARIO -->`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_build
from test_readme import MARKED

from mobile_moe.library.build import SOURCE_DIR

pytestmark = [pytest.mark.export, needs_build]
README = (SOURCE_DIR / "README.md").read_text()


def scenario(name: str) -> list[str]:
    return [m["body"] for m in MARKED.finditer(README) if m["scenario"] == name]


def run_blocks(name: str, where: Path, bundle: Path) -> str:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # as `source .venv/bin/activate`
    env = {**os.environ, "PATH": path, "BUNDLE": str(bundle)}
    printed = []
    for body in scenario(name):
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=where, env=env, capture_output=True,
                                text=True, timeout=900)  # fmt: skip
        assert result.returncode == 0, f"{name}: {body[:200]}\n{result.stderr[-2000:]}"
        printed.append(result.stdout)
    return "".join(printed)


def test_every_code_block_says_how_it_is_tested():
    assert len(list(MARKED.finditer(README))) == README.count("\n```") // 2


def test_the_sdk_the_pkg_config_app_and_the_java_binding_run_as_written(bundle, tmp_path):
    if shutil.which("javac") is None:
        pytest.skip("no JDK here (javac; on a fresh machine `apt-get install openjdk-17-jdk-headless`)")
    printed = run_blocks("sdk", tmp_path, bundle)
    answers = [line for line in printed.splitlines() if "mobile-moe libmobile_moe 2." in line]
    assert len(answers) == 2, printed  # the C app's line and the Java app's


@pytest.mark.slow  # a whole CMake build of the library and the runner
def test_the_cmake_build_runs_as_written(bundle, tmp_path):
    (tmp_path / "libmobile_moe").symlink_to(SOURCE_DIR)  # the block runs from the repository's root
    run_blocks("cmake", tmp_path, bundle)
    assert (tmp_path / "installed" / "include" / "mobile_moe.h").is_file()
