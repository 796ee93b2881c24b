"""The wheel carries libmobile_moe, the C library (a component of its own at the repository's top level), inside the
package at mobile_moe/library/libmobile_moe/, where mobile_moe.library.build finds it in an installed copy: the
runner, bench and `mobile-moe sdk` build it on a user's machine. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

LIBRARY = Path(__file__).resolve().parent / "libmobile_moe"
BUILD_FOLDERS = ("build", "build-*", "installed", "__pycache__")  # a developer's CMake builds beside the sources


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "mobile_moe" / "library" / "libmobile_moe"
        for source in sorted(LIBRARY.rglob("*")):
            relative = source.relative_to(LIBRARY)
            folders = map(Path, relative.parts[:-1])
            if source.is_file() and not any(folder.match(pattern) for folder in folders for pattern in BUILD_FOLDERS):
                self.mkpath(str((target / relative).parent))
                self.copy_file(str(source), str(target / relative))


setup(cmdclass={"build_py": BuildWithLibrary})
