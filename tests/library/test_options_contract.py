"""One options contract: mobile_moe/library/options.py's table is what every layer says of libmobile_moe's options
(the C header's struct, the library's generated defaults and bounds, the runner's and the example app's flags,
bench's and predict's flags, the Java Options, the Python binding's struct, the guide's table), and a front end left
at its defaults runs what mm_default_options gives an app."""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import needs_build

from mobile_moe.app.cli import build_parser
from mobile_moe.library import options as table
from mobile_moe.library.build import SOURCE_DIR

REPOSITORY = Path(__file__).resolve().parents[2]


def header_fields() -> list[tuple[str, str]]:
    """(C type, name) of each mm_options field, as include/mobile_moe.h declares them."""
    header = (SOURCE_DIR / "include" / "mobile_moe.h").read_text()
    body = re.search(r"typedef struct mm_options \{(.*?)\} mm_options;", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return [(kind.replace(" ", ""), name) for kind, name in re.findall(r"([\w ]+\*?)\s*\b(\w+);", body)]


def test_the_headers_struct_is_the_tables_fields_in_its_order():
    expected = [("size_t", "struct_size")] + [(option.c_type.replace(" ", ""), option.name) for option in table.OPTIONS]
    assert header_fields() == expected


def test_the_librarys_defaults_and_bounds_are_generated_from_the_table():
    regenerate = f"python -m mobile_moe.library.options --cpp-header > {table.CPP_HEADER}"
    assert (REPOSITORY / table.CPP_HEADER).read_text() == table.cpp_header(), f"the table changed: {regenerate}"


def test_the_guides_table_is_the_tables():
    guide = (REPOSITORY / "docs" / "app-library.md").read_text()
    shown = guide.split("<!-- options-table: python -m mobile_moe.library.options --markdown -->\n")[1]
    assert shown.split("<!-- end options-table -->")[0] == table.markdown_table()


def test_the_python_bindings_struct_is_the_tables():
    from mobile_moe.library.binding import Options

    kinds = {"int": ctypes.c_int, "float": ctypes.c_float, "path": ctypes.c_char_p}
    assert Options._fields_ == [("struct_size", ctypes.c_size_t)] + [(o.name, kinds[o.kind]) for o in table.OPTIONS]


@pytest.mark.parametrize("command", ["bench", "predict"])
def test_bench_and_predict_take_every_option_with_the_librarys_default_and_meaning(command):
    parser = build_parser(command)._subparsers._group_actions[0].choices[command]
    actions = {action.option_strings[0]: action for action in parser._actions if action.option_strings}
    for option in table.OPTIONS:
        action = actions[option.flag]
        assert (action.dest, action.default) == (option.name, option.default)
        assert action.help.startswith(option.meaning)


def test_the_java_options_have_a_setter_per_option_and_no_bounds_of_their_own():
    java = (SOURCE_DIR / "java" / "org" / "mobilemoe" / "MobileMoe.java").read_text()
    options_class = java.split("public static final class Options {")[1].split("\n  }\n")[0]
    setters = re.findall(r"public Options (\w+)\(", options_class)
    assert list(dict.fromkeys(setters)) == [option.java_setter for option in table.OPTIONS]  # prefetch(boolean): 2.1's
    assert "throw " not in options_class  # the bounds are the library's to check


def test_the_example_app_takes_every_option_by_its_flag():
    app = (SOURCE_DIR / "examples" / "app_example.c").read_text()
    for option in table.OPTIONS:
        assert f'strcmp(argv[i], "{option.flag}")' in app and f"options.{option.name} =" in app


@needs_build
def test_the_runners_help_names_every_option_and_its_defaults_are_the_librarys(runner, bundle):
    usage = subprocess.run([str(runner), "--help"], capture_output=True, text=True)
    assert usage.returncode == 2
    for option in table.OPTIONS:
        assert f"[{option.flag} " in usage.stderr, option.flag
    report = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1", "--iterations", "1"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    resolved = json.loads(report.stdout)
    assert (resolved["threads"], resolved["park_experts"], resolved["cache_margin"]) == (1, -1, 0.0)
    assert resolved["cache_experts"] == resolved["top_k"]  # -1: the bundle's top_k


@needs_build
@pytest.mark.parametrize("option", table.OPTIONS, ids=lambda option: option.name)
def test_the_library_refuses_what_the_table_refuses_in_a_line_naming_the_option(runner, bundle, option):
    """Just past each bound, the library itself (the runner passes the value on unchecked) refuses it."""
    if option.kind == "path":
        pytest.skip("a path has no numeric bound (an unusable folder is refused: test_device_bench_native)")
    for value in (option.low - 1, option.high + 1):
        text = str(int(value)) if option.kind == "int" else repr(float(value))
        result = subprocess.run([str(runner), "--bundle", str(bundle), "--random", "1", option.flag, text],
                                capture_output=True, text=True)  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert f"options.{option.name} {text.removesuffix('.0')} is out of range ({option.bounds()})" in result.stderr
