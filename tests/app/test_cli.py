"""The `mobile-moe` console script: info output, lazy command discovery, and one-line errors with exit status 2."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys

import pytest

from mobile_moe.app.cli import main


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


@pytest.mark.parametrize("model", ["vit", "mobile-vmoe"])
def test_info_table_says_what_the_json_says(model, capsys):
    """The table's rows, whole: the model line, then each count's exact value as --json gives it."""
    argv = ("info", "--model", model, "--size", "12x192")
    status, out, _ = run_cli(capsys, *argv)
    counts = json.loads(run_cli(capsys, *argv, "--json")[1])
    assert status == 0
    title, *rows = out.splitlines()
    assert title == f"{model} 12x192/32 @224, 1000 classes" + (", E=10 k=1 L=2 (per image)" if model != "vit" else "")
    exact = dict(re.fullmatch(r"  (\S.*?) {2,}[\d.]+ [kMG]?\s*\(([\d,]+)\b.*", row).groups() for row in rows)
    assert exact == {
        "params total": f"{counts['params_total']:,}",
        "params active": f"{counts['params_active']:,}",
        "FLOPs": f"{counts['flops']:,}",
    }


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["info", "--model", "nope"], "invalid choice: 'nope'"),
        (["info", "--model", "vit", "--size", "deit-xl"], "size 'deit-xl'"),
        (["info", "--model", "vit", "--size", "12x100"], "width 100 splits into no heads of 64, 32, 16, 8"),
        (["info", "--model", "vit", "--image-size", "100"], "image_size=100 is not divisible by patch_size=32"),
        (["info", "--model", "mobile-vmoe", "--top-k", "11"], "top_k=11: must be between 1 and num_experts=10"),
        (["info", "--model", "mobile-vmoe", "--moe-layers", "12"], "moe_layers=12: must be between 1 and 11"),
        (["info", "--model", "mobile-vmoe", "--experts", "1"], "num_experts=1: must be at least 2"),
        # a refusal of a value the command line left out names the flag whose default it is
        (["info", "--model", "mobile-vmoe", "--size", "2x64"], "; 2 is the default of --moe-layers: give --moe-layers"),
        (["info", "--model", "vit", "--patch", "9"], "multiple of 9; 224 is the default of --image-size"),
        (["info", "--model", "vit", "--experts", "4"], "--experts: model vit has no such option"),
        (["info", "--model", "soft-moe", "--top-k", "2"], "--top-k: model soft-moe has no such option"),
        (["info", "--model", "vmoe", "--model-kwargs", "capacity_ratio=big"], "capacity_ratio=big: expected float"),
        (["info", "--model", "vmoe", "--model-kwargs", "eval_capacity_ratio=Infinity"], "must be a finite number"),
        (["info", "--model", "vmoe", "--model-kwargs", "top_k=2"], "top_k: not an option of vmoe (use --top-k)"),
        (["info", "--model", "vmoe", "--model-kwargs", "moe_placement=first"], "moe_placement='first': choose one"),
        (["info", "--model", "widenet", "--moe-layers", "2"], "every WideNet block shares the one MoE layer"),
        (["info", "--model", "hard-moe", "--top-k", "2"], "sends each image to exactly one expert"),
        (["info"], "required: --model"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["export", "runs/x", "--format", "executorch", "--out", "b", "--quantize", "int4"], "'int4' is no scheme"),
        # precision flags are refused before the run (runs/x does not exist) is read
        (["export", "runs/x", "--format", "coreml", "--out", "b", "--coreml-compression", "int4"], "is no method"),
        (["export", "runs/x", "--format", "onnx", "--out", "b", "--coreml-compression", "linear4"], "Core ML only"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, fragment):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--model", "vmoe", "--super-classes", "random"], "--super-classes guides a per-image router"),
        (["--model", "soft-moe", "--router-loss", "0", "--balance-loss", "0.01"], "it needs no balancing loss"),
        (["--model", "widenet", "--balance-loss", "0.01"], "--model-kwargs aux_loss_weight=W"),
        (["--model", "widenet", "--init-from", "runs/dense"], "blocks share ONE attention and MoE layer"),
    ],
)
def test_train_refuses_flags_a_per_token_model_would_ignore(capsys, tmp_path, flags, fragment):
    common = ["--size", "2x64", "--patch", "8", "--image-size", "32", "--experts", "2", "--data", "digits"]
    status, out, err = run_cli(capsys, "train", *flags, *common, "--out", str(tmp_path / "run"))
    assert status == 2 and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_resume_compares_model_kwargs_even_without_model(capsys, tmp_path, one_thread):
    run = str(tmp_path / "run")
    flags = ["--size", "2x64", "--patch", "8", "--image-size", "32", "--experts", "2", "--data", "digits"]
    flags += ["--recipe", "tiny", "--epochs", "1", "--batch-size", "64", "--device", "cpu", "--workers", "0"]
    status, _, err = run_cli(capsys, "train", "--model", "vmoe", *flags, "--quiet", "--out", run)
    assert status == 0, err
    argv = ["train", "--out", run, "--resume", "--epochs", "2", "--model-kwargs", "capacity_ratio=2"]
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and "--model-kwargs capacity_ratio=2.0 differs from the run's 1.05" in err, err


def test_vmoe_info_is_the_papers_per_token_model(capsys):
    """Fig. 3e of Mobile V-MoEs: per-token routing on DeiT-Ti, E=10, k=2, L=2 may touch about 11.05M parameters."""
    argv = ["info", "--model", "vmoe", "--size", "deit-ti", "--experts", "10", "--top-k", "2", "--moe-layers", "2"]
    status, out, _ = run_cli(capsys, *argv, "--json")
    info = json.loads(out)
    assert status == 0 and info["routing"] == "token"
    assert round(info["params_total"] / 1e6, 2) == 11.05 and info["params_active"] == info["params_total"]
    mobile = json.loads(run_cli(capsys, "info", "--model", "mobile-vmoe", "--size", "deit-ti", "--top-k", "2",
                                "--json")[1])  # fmt: skip
    assert round(mobile["params_active"] / 1e6, 2) == 6.31  # "vs 6.31M for ours"


@pytest.mark.parametrize("size, heads", [("6x192", 3), ("6x64", 2), ("6x48", 3), ("4x128", 2), ("2x24", 3)])
def test_any_width_that_splits_into_heads_is_a_size(size, heads):
    """The paper's grid keeps its heads; another width gets heads of the widest of 64, 32, 16, 8 channels that
    divides it (reproduce --scale tiny trains widths 48, 24, 16)."""
    from mobile_moe.models.config import parse_size

    depth, width = map(int, size.split("x"))
    assert parse_size(size) == {"depth": depth, "width": width, "num_heads": heads}


def test_width_not_divisible_by_heads():
    from mobile_moe.errors import UsageError
    from mobile_moe.models.registry import make_config

    with pytest.raises(UsageError, match="width=100 is not divisible by num_heads=3"):
        make_config("vit", width=100, num_heads=3)


@pytest.mark.parametrize("argv", [["--help"], ["info", "--model", "vit", "--json"]] + [
    [*command.split(), "--help"] for command in
    ["train", "import", "evaluate", "superclass derive", "export", "predict", "reproduce", "demo", "pack"]
])  # fmt: skip
def test_help_and_info_import_neither_torch_nor_scikit_learn(argv):
    """--help and info answer at once (torch alone takes over a second to import), and succeed. bench's help does not
    yet: its settings check their values with the runners, which load torch."""
    code = (
        f"import sys; from mobile_moe.app.cli import main\ntry: status = main({argv!r})\n"
        "except SystemExit as done: status = done.code\n"
        "print(status, sorted({'torch', 'sklearn'} & set(sys.modules)), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert result.stderr.strip().splitlines()[-1] in ("0 []", "None []"), result.stderr
    assert result.stdout.strip()


def test_a_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    code = "import os, sys; os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]); from mobile_moe.app.cli import main; "
    code += "sys.exit(main(['info', '--model', 'vit']))"
    result = subprocess.run([sys.executable, "-c", code, str(gone)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "the working directory cannot be used" in result.stderr and "cd to an existing directory" in result.stderr


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out == f"mobile-moe {version('mobile-moe')}\n"


def _main_running(monkeypatch, run) -> None:
    import argparse

    from mobile_moe.app import cli

    parser = argparse.ArgumentParser()
    parser.set_defaults(run=run)
    monkeypatch.setattr(cli, "build_parser", lambda chosen: parser)


def test_a_library_failing_while_sigterm_unwinds_it_still_ends_as_terminated(monkeypatch, capsys):
    """torch.export's tracer can assert on its own clean-up when SIGTERM lands mid-trace: still a clean stop."""
    from mobile_moe.app.cli import main
    from mobile_moe.utils.interrupts import Terminated

    def run(args):
        try:
            raise Terminated()
        except Terminated:
            raise AssertionError("Trying to pop empty mode stack") from None

    _main_running(monkeypatch, run)
    assert main([]) == 143
    assert capsys.readouterr().err == "mobile-moe: terminated\n"


def test_an_error_with_no_interrupt_behind_it_is_not_hidden(monkeypatch):
    from mobile_moe.app.cli import main

    def run(args):
        raise AssertionError("a real bug")

    _main_running(monkeypatch, run)
    with pytest.raises(AssertionError, match="a real bug"):
        main([])


def test_built_in_digits_at_the_default_image_size_are_noted_as_upsampled():
    from mobile_moe.training.cli import upsampling_note

    assert upsampling_note("digits", 224) == (
        "note: digits's images are 8 px, upsampled to the model's 224 px because --image-size was not given; the demo "
        "trains digits at --image-size 32 --patch 8"
    )
    for spec, size in (("digits", 32), ("digits-pairs:seed=1", 64), ("imagefolder:data", 224)):
        assert upsampling_note(spec, size) is None


def test_a_run_without_recipe_says_so_once_its_inputs_pass_their_checks(capsys, tmp_path, one_thread):
    flags = ["--model", "vit", "--size", "2x32", "--patch", "8", "--data", "digits", "--epochs", "1"]
    status, _, err = run_cli(capsys, "train", *flags, "--image-size", "0", "--out", str(tmp_path / "bad"))
    assert status == 2 and err.count("\n") == 1, err  # a refusal stays one line: the note comes after the checks
    run = str(tmp_path / "run")
    status, out, err = run_cli(capsys, "train", *flags, "--image-size", "16", "--workers", "0", "--out", run)
    assert status == 0, err
    assert "note: no --recipe: the deit recipe, ImageNet's schedule (1 epoch of batch 1024); --recipe tiny trains " \
           "in minutes on a CPU" in err.splitlines()  # fmt: skip
    assert out.splitlines()[0].startswith("training vit on digits")


@pytest.mark.parametrize(
    ("step", "steps_run", "expected"),
    [(0, 0, None), (0, 1, (2.0, 2)), (4, 0, (0.75, 5))],
    ids=["the process's first step: warm-up", "a later epoch's first step", "this epoch's later steps"],
)
def test_the_estimate_times_a_step_after_the_processs_first(step, steps_run, expected):
    from mobile_moe.training import engine

    said = []
    ctx = engine.EpochContext(None, None, None, None, estimate=lambda *args: said.append(args), steps_run=steps_run)
    engine.say_estimate(ctx, step, epoch_start=8.0, first_step_done=10.0, now=13.0)
    assert said == ([] if expected is None else [expected])
    assert (ctx.estimate is None) == (expected is not None)  # said once a run


@pytest.mark.parametrize(
    "argv, expected",
    [
        # a flag's prefix is a typo, not the flag: argparse's allow_abbrev would have trained 3 epochs
        (
            ["info", "--model", "vit", "--siz", "6x64"],
            "unrecognized arguments: --siz 6x64 (see `mobile-moe info --help`)",
        ),
        (["info", "--model", "vit", "--bogus"], "(see `mobile-moe info --help`)"),
        (["infoo"], "invalid choice: 'infoo'"),
    ],
)
def test_a_bad_flag_points_to_its_commands_help(capsys, argv, expected):
    from mobile_moe.app.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


TOO_LONG = "x" * 300  # a path component longer than any Linux file system's 255 bytes


@pytest.mark.parametrize(
    "argv",
    [
        ["evaluate", f"{TOO_LONG}/run"],
        ["train", "--model", "vit", "--data", f"imagefolder:{TOO_LONG}", "--out", "OUT"],
        ["superclass", "derive", "--confusion", f"{TOO_LONG}.npy", "-E", "3", "--out", "OUT.json"],
        ["train", "--model", "vit", "--data", "digits", "--init-from", TOO_LONG, "--out", "OUT"],
        ["pack", f"fashion-mnist:{TOO_LONG}", "--out", "OUT"],
    ],
    ids=["run", "data-folder", "confusion", "init-from", "idx-folder"],
)
def test_an_input_path_the_file_system_refuses_is_one_line(argv, tmp_path, capsys):
    """pathlib, numpy, torch and the data readers raise ENAMETOOLONG from wherever they first look: one line, nothing
    written."""
    argv = [str(tmp_path / "out") + arg.removeprefix("OUT") if arg.startswith("OUT") else arg for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot use {TOO_LONG}" in err and "give a shorter path" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_an_input_this_user_may_not_read_is_one_line(monkeypatch, tmp_path, capsys):
    """EACCES (a test run as root never meets it for real) names the path and says to check its permissions."""
    from mobile_moe.training import run_dir

    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(run_dir, "read_config", denied)
    assert main(["evaluate", str(tmp_path / "run")]) == 2
    assert f"cannot use {tmp_path / 'run'}: Permission denied: " in capsys.readouterr().err


def test_a_mistyped_run_or_a_run_given_for_a_bundle_is_told_what_to_pass(tmp_path, capsys):
    """A run path one letter off, in any folder of it, names the near run; a run passed where a bundle belongs says to
    export it first."""
    run = tmp_path / "runs" / "moe"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (tmp_path / "image.png").write_bytes(b"")
    assert main(["evaluate", str(tmp_path / "runs" / "mo")]) == 2
    assert f"does not exist; did you mean {run}?" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "rnus" / "mo")]) == 2
    assert f"does not exist; did you mean {run}?" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "runs" / "elsewhere")]) == 2
    assert "train one with `mobile-moe train --out" in capsys.readouterr().err  # nothing near: as before
    assert main(["predict", str(run), str(tmp_path / "image.png")]) == 2
    refused = capsys.readouterr().err
    assert f"{run} is a training run, not a bundle; export it first: `mobile-moe export {run}" in refused


def test_a_command_run_as_the_process_ends_it_whatever_threads_it_left():
    """_end_process ends the process as the interpreter's exit would: a running non-daemon thread is joined (its line
    printed), an idle ThreadPoolExecutor's workers are told to end (inductor's compile pool, after a cold-cache
    `train --compile`: joining its workers without the threading module's exit hooks waited forever), the atexit
    functions run, and the status is the command's."""
    code = """if True:
        import atexit, concurrent.futures, threading, time
        from mobile_moe.app import cli
        pool = concurrent.futures.ThreadPoolExecutor(1)  # held, as inductor holds its pool: its worker idles
        pool.submit(lambda: None).result()
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
        atexit.register(lambda: print("atexit ran", flush=True))
        cli._end_process(3)
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["thread done", "atexit ran"]
