"""The README and the guides in docs/ run as written. Every code block carries a marker saying how it is held to
that:

    <!-- readme-test: runs SCENARIO -->  executed, in order with the scenario's other blocks, in a fresh directory
    <!-- readme-test: parses -->          each command parses (mobile-moe's own parser), names a make target of the
                                          Makefile, or runs a script of benchmarks/ (the GPU, a phone, a cluster)
    <!-- readme-test: synopsis -->        every --flag it shows is one its command takes
    <!-- readme-test: text -->            no command: a picture or a citation (never a sh or python block)

so a flag renamed, a command changed or a block added without a marker fails here, not in a newcomer's shell.
docs/formats.md is the formats' reference: its blocks are examples of files, not commands.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from mobile_moe.app.cli import build_parser

REPOSITORY = Path(__file__).resolve().parent.parent
GUIDES = sorted(f"docs/{path.name}" for path in (REPOSITORY / "docs").glob("*.md") if path.name != "formats.md")
DOCUMENTS = ["README.md", *GUIDES]
MARKED = re.compile(r"<!-- readme-test: (?P<kind>runs (?P<scenario>\w+)|parses|synopsis|text) -->\n```(?P<lang>\w*)\n"
                    r"(?P<body>.*?)```", re.S)  # fmt: skip


@dataclass(frozen=True)
class Block:
    document: str
    kind: str  # runs, parses, synopsis, text
    scenario: str | None
    language: str
    body: str


def blocks() -> list[Block]:
    """Every marked block of the README and the guides, in document order."""
    found = []
    for document in DOCUMENTS:
        text = (REPOSITORY / document).read_text()
        found += [Block(document, m["kind"].split()[0], m["scenario"], m["lang"], m["body"])
                  for m in MARKED.finditer(text)]  # fmt: skip
    return found


def commands(body: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in (shlex.join(shlex.split(raw, comments=True)) for raw in joined.splitlines()) if line]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_code_block_says_how_it_is_tested(document):
    text = (REPOSITORY / document).read_text()
    fences = text.count("\n```") // 2 + text.startswith("```")
    marked = [block for block in blocks() if block.document == document]
    assert len(marked) == fences, f"a code block of {document} without a <!-- readme-test: ... --> marker"
    assert not [block for block in marked if block.kind == "text" and block.language in ("sh", "python")]


def test_the_readme_is_a_front_door_and_names_every_guide():
    """At most 250 lines, and every guide of docs/ linked from it."""
    readme = (REPOSITORY / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert [document for document in DOCUMENTS[1:] if f"]({document})" not in readme] == []


def test_every_command_shown_parses_or_names_what_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPOSITORY / "Makefile").read_text(), re.M))
    for block in blocks():
        if block.kind != "parses":
            continue
        for command in commands(block.body):
            words = shlex.split(command)
            if words[0] == "make":
                assert words[1] in targets, command
            elif words[0] == "mobile-moe":
                chosen = next(word for word in words[1:] if not word.startswith("-"))
                build_parser(chosen).parse_args(words[1:])  # a UsageError (one line) names what does not parse
            elif words[0] == ".venv/bin/python":
                assert (REPOSITORY / words[1]).is_file(), command
            else:
                pytest.fail(f"a command this test cannot check: {command}")


def option_actions(words: list[str]) -> list[list[str]]:
    """The option strings of each option the command (and its action, for superclass derive|show) takes, --help
    aside: argparse keeps a parser's sub-parsers in its one _SubParsersAction."""
    command = build_parser(words[0])._subparsers._group_actions[0].choices[words[0]]
    if command._subparsers is not None:
        command = command._subparsers._group_actions[0].choices[words[1]]
    return [action.option_strings for action in command._actions if action.option_strings and action.dest != "help"]


def options_of(words: list[str]) -> set[str]:
    """Every option string the command accepts."""
    return {"-h", "--help", *(option for strings in option_actions(words) for option in strings)}


def test_the_synopsis_shows_only_flags_its_commands_take():
    (synopsis,) = [block for block in blocks() if block.kind == "synopsis"]
    entries = re.split(r"\n(?=mobile-moe )", synopsis.body.strip())
    assert len(entries) >= len(build_parser(None)._subparsers._group_actions[0].choices)
    for entry in entries:
        words = entry.split()[1:3]
        shown = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", entry.split("#")[0]))
        assert shown <= options_of(words), f"{' '.join(words)}: {sorted(shown - options_of(words))} not taken"


def test_the_synopsis_shows_every_flag_its_commands_take():
    """The other way: an option --help lists and the synopsis omits is one a README reader never learns of."""
    (synopsis,) = [block for block in blocks() if block.kind == "synopsis"]
    omitted, entries = [], re.split(r"\n(?=mobile-moe )", synopsis.body.strip())
    flags = {entry.split()[1]: set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", entry)) for entry in entries}
    (library,) = [entry.partition("LIBRARY OPTIONS:")[2] for entry in entries if "LIBRARY OPTIONS:" in entry]
    for entry in entries:
        words = entry.split()[1:3]
        shown = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", entry))
        if "[model flags: info's]" in entry:  # the model flags, written out once on info's line
            shown |= flags["info"] - {"--json"}
        if "[LIBRARY OPTIONS]" in entry:  # libmobile_moe's options, written out once below bench
            shown |= set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", library))
        omitted += [f"{' '.join(words)} {option[-1]}" for option in option_actions(words) if not shows(shown, option)]
    assert not omitted, f"options --help lists that the README synopsis omits: {omitted}"


def shows(shown: set[str], strings: list[str]) -> bool:
    """An option is shown by any of its aliases; an on/off pair (argparse's BooleanOptionalAction: --x and --no-x)
    only by both, since either alone reads as a one-way flag."""
    if any(string.startswith("--no-") for string in strings):
        return set(strings) <= shown
    return bool(shown & set(strings))


# --- the scenarios, run -----------------------------------------------------------------------------------------------


def run_scenario(name: str, where: Path, rewrite=lambda script: script, environment: dict | None = None) -> str:
    """Run the scenario's blocks in order in `where`, the environment's bin directory first on PATH (as `source
    .venv/bin/activate` puts it), with `environment` added; -> everything they printed."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    env |= environment or {}
    printed = []
    scenario = [b for b in blocks() if b.scenario == name]
    assert len({b.document for b in scenario}) == 1, f"scenario {name} spans documents: its blocks run in order"
    for index, block in enumerate(scenario):
        if block.language == "sh":
            argv = ["bash", "-euo", "pipefail", "-c", rewrite(block.body)]
        else:
            script = where / f"block-{index}.py"
            script.write_text(block.body)
            argv = [sys.executable, str(script)]
        result = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"block {index} of {name} failed:\n{output[-4000:]}"
        printed.append(output)
    return "\n".join(printed)


@pytest.mark.slow
def test_the_typical_session_and_the_python_api_run_as_written(tmp_path):
    printed = run_scenario("session", tmp_path)
    assert (tmp_path / "bench" / "results.json").is_file() and (tmp_path / "bench-py" / "results.json").is_file()
    assert '"class": ' in printed and "p50 " in printed


def write_digit_folder(root: Path, classes=(0, 1, 2, 3), train: int = 40, val: int = 20) -> None:
    """ROOT/{train,val}/digit-<d>/*.png: scikit-learn's digits as 64 px RGB files, an image folder of 4 classes."""
    digits = load_digits()
    for digit in classes:
        indices = np.flatnonzero(digits.target == digit)
        for split, chosen in (("train", indices[:train]), ("val", indices[train : train + val])):
            folder = root / split / f"digit-{digit}"
            folder.mkdir(parents=True)
            for i in chosen:
                grey = Image.fromarray((digits.images[i] * 15).astype(np.uint8))
                grey.resize((64, 64), Image.NEAREST).convert("RGB").save(folder / f"{i}.png")


@pytest.mark.slow
def test_your_own_folder_of_photographs_becomes_a_bundle_and_a_bench_report(tmp_path):
    """The own-folder block as written, on a generated folder of real photographs (4 classes of 500x375 JPEGs with
    PNG, grayscale, EXIF-rotated and 3000x2000 files among them), one epoch per training and one bench round."""
    from photos import write_photo_folder

    write_photo_folder(tmp_path / "photos", classes=4, train=16, val=8)

    def quick(script: str) -> str:
        one_epoch = script.replace("--recipe tiny", "--recipe tiny --epochs 1")
        return one_epoch.replace("--out bench-", "--rounds 1 --out bench-")

    printed = run_scenario("folder", tmp_path, quick)
    results = json.loads((tmp_path / "bench-photos" / "results.json").read_text())
    moe = next(run for run in results["runs"] if run["kind"] == "split")
    assert moe["workload"] == "imagefolder:photos (val, stratified, seed 0, 16 of 16)"
    assert "stability over 10 bootstrap resamples" in printed and "then " in printed  # derive's; predict's top-3
    assert "continue with" not in printed and "Traceback" not in printed


@pytest.mark.slow
def test_a_1000_class_timm_deit_becomes_a_benchmarked_mobile_vmoe_on_a_4_class_folder(tmp_path):
    """The transfer blocks as written (the checkpoint file from timm, offline; then the commands), but for one epoch
    per training (the README's 30 take about 15 minutes here)."""
    write_digit_folder(tmp_path / "data")
    # Whatever this machine has cached or set, the block itself keeps the Hub offline: any request it made would go to
    # a closed port, and huggingface_hub would say so ("... thrown while requesting HEAD ...") and retry for ~50 s.
    hub = {"HF_HUB_CACHE": str(tmp_path / "empty-hub-cache"), "HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}
    printed = run_scenario("transfer", tmp_path, lambda script: script.replace("--epochs 30", "--epochs 1"), hub)
    assert "random weights stand in" in printed and (tmp_path / "deit_tiny.safetensors").is_file()
    assert "requesting" not in printed
    assert "a new classifier for the data's 4 classes (the dense run's 1000 classes are not the data's)" in printed
    fine_tuned = json.loads((tmp_path / "runs" / "deit-ft" / "config.json").read_text())
    assert fine_tuned["upcycled"]["new_head"] and fine_tuned["upcycled"]["dense_classes"] == 1000
    assert fine_tuned["data"]["class_names"] == [f"digit-{d}" for d in range(4)]
    moe = json.loads((tmp_path / "runs" / "deit-moe" / "config.json").read_text())
    assert moe["model"]["name"] == "mobile-vmoe" and moe["model"]["num_experts"] == 2
    assert not moe["upcycled"]["new_head"]  # the fine-tuned run has the folder's classes: its classifier is copied
    runs = json.loads((tmp_path / "bench-deit" / "results.json").read_text())["runs"]
    assert [run["kind"] for run in runs] == ["split", "dense"] and all(run["latency_ms"]["p50"] > 0 for run in runs)
