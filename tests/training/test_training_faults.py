"""Training under faults: killed at any moment and resumed, resumed with the same or other flags, bad numbers,
damaged checkpoints and images, outputs that cannot be written. Each is one line on stderr and status 2, or a run
directory that ends exactly as an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import one_torch_thread

from mobile_moe.app.cli import main
from mobile_moe.data.image_files import UnreadableImage
from mobile_moe.errors import UsageError
from mobile_moe.training import train as train_module
from mobile_moe.training.cli import RESUME_HELP, flag_of, model_differences
from mobile_moe.training.recipes import MAY_CHANGE_ON_RESUME
from mobile_moe.training.run_dir import METRICS, load_run, read_metrics, run_lock, save_checkpoint, write_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
SYNTHETIC = "synthetic:classes=6,super=3,per_class=30,noise=0.05"
MODEL = ["--model", "vit", "--size", "1x64", "--patch", "4", "--image-size", "16"]
RECIPE = ["--data", SYNTHETIC, "--recipe", "tiny", "--batch-size", "32", "--quiet"]
# wall-clock: the only fields two runs may disagree on
VARYING = ("time", "images_per_s", "steady_images_per_s", "epoch_time_s", "input_wait", "epoch_parts")
RUN_FILES = ["best.pt", "checkpoint.pt", "config.json", "metrics.jsonl"]


def train_argv(out: Path, epochs: int = 3, *extra: str) -> list[str]:
    return ["train", *MODEL, *RECIPE, "--epochs", str(epochs), "--out", str(out), *extra]


def cli(capsys, argv: list[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    if status == 2:  # one line says what failed; a warning said before the run started may precede it
        errors = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
        assert len(errors) == 1 and "Traceback" not in err, err
    return status, err


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in VARYING} for row in read_metrics(run_dir)]


def assert_same_run(got: Path, expected: Path) -> None:
    """The run directory an uninterrupted run writes: the same files, rows, best epoch and weights."""
    assert sorted(p.name for p in got.iterdir()) == RUN_FILES  # no temporaries left
    assert rows(got) == rows(expected)
    assert [row["epoch"] for row in read_metrics(got)] == list(range(1, len(read_metrics(expected)) + 1))
    assert json.loads((got / "config.json").read_text()) == json.loads((expected / "config.json").read_text())
    for which in ("best", "last"):
        a, b = load_run(got, which), load_run(expected, which)
        assert a.checkpoint["epoch"] == b.checkpoint["epoch"], which
        assert a.checkpoint["best_epoch"] == b.checkpoint["best_epoch"], which
        for key, value in b.model.state_dict().items():
            assert torch.equal(a.model.state_dict()[key], value), (which, key)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- killed at every write, in process: deterministic kill points ----------------------------------------------------


class Killed(BaseException):
    """Stands in for SIGKILL between two writes (a kill in the middle of one is the stale temporary planted below)."""


# A fake validation top-1 per epoch, so that the best epoch (2) is neither the first nor the last.
FAKE_TOP1 = {0: 0.5, 1: 0.8, 2: 0.6, 3: 0.7}


@pytest.fixture
def fake_scores(monkeypatch):
    epoch = {"now": 0}
    real_seed, real_evaluate = train_module.seed_epoch, train_module.evaluate

    def seed_epoch(seed, e, rank):
        epoch["now"] = e
        real_seed(seed, e, rank)

    def evaluate(*args, **kwargs):
        return {**real_evaluate(*args, **kwargs), "top1": FAKE_TOP1[epoch["now"]]}

    monkeypatch.setattr(train_module, "seed_epoch", seed_epoch)
    monkeypatch.setattr(train_module, "evaluate", evaluate)


def kill_after_write(monkeypatch, n: int) -> list[str]:
    """Raise Killed right after the n-th write of checkpoint.pt, best.pt or metrics.jsonl; -> names written."""
    written: list[str] = []
    real_save, real_metrics = save_checkpoint, write_metrics

    def count(name: str) -> None:
        written.append(name)
        if len(written) == n:
            raise Killed

    def save(checkpoint, path):
        real_save(checkpoint, path)
        count(Path(path).name)

    def counted_write_metrics(run_dir, metrics):
        real_metrics(run_dir, metrics)
        count(METRICS)

    monkeypatch.setattr("mobile_moe.training.run_dir.save_checkpoint", save)
    monkeypatch.setattr("mobile_moe.training.run_dir.write_metrics", counted_write_metrics)
    return written


def test_a_kill_after_any_write_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch, capsys, fake_scores):
    whole = tmp_path / "whole"
    assert main(train_argv(whole)) == 0
    assert load_run(whole).checkpoint["epoch"] == 2  # the best epoch, not the last
    # epoch 1: checkpoint, best, metrics; epoch 2: checkpoint, best, metrics; epoch 3: checkpoint, metrics
    writes = 8
    for n in range(1, writes + 1):
        out = tmp_path / f"killed-after-{n}"
        with monkeypatch.context() as patch:
            written = kill_after_write(patch, n)
            with pytest.raises(Killed):
                main(train_argv(out))
        for name in RUN_FILES:  # what a kill in the middle of the next write leaves
            (out / f".{name}.tmp-{dead_pid()}-x1y2").write_bytes(b"half")
        assert main(train_argv(out, 3, "--resume")) == 0, (n, written, capsys.readouterr().err)
        assert_same_run(out, whole)


def test_resume_restores_a_stale_best_and_lost_rows_of_a_finished_run(tmp_path, fake_scores):
    whole, damaged = tmp_path / "whole", tmp_path / "damaged"
    assert main(train_argv(whole, 2)) == 0
    assert main(train_argv(damaged, 2)) == 0
    # as if killed after checkpoint.pt of epoch 2 (the best): best.pt still epoch 1, metrics.jsonl one row behind
    best_of_epoch_1 = tmp_path / "one"
    assert main(train_argv(best_of_epoch_1, 1)) == 0
    (damaged / "best.pt").write_bytes((best_of_epoch_1 / "best.pt").read_bytes())
    write_metrics(damaged, read_metrics(damaged)[:1])
    assert main(train_argv(damaged, 2, "--resume")) == 0  # nothing left to train: only the repair
    assert_same_run(damaged, whole)


# --- killed for real (SIGKILL) at seeded random moments ------------------------------------------------------------


def kill_at_random(out: Path, rng: random.Random, *extra: str) -> int:
    """Start the CLI, wait for the k-th new checkpoint.pt (k seeded), SIGKILL it after a seeded delay (between the
    epoch's writes or in the next epoch); -> exit status (-9 when killed, 0 when it finished first)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "mobile_moe", *train_argv(out, 4, *extra)]
    child = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    last, changes, wanted = out / "checkpoint.pt", 0, rng.randint(1, 2)

    def stamp():
        try:
            info = last.stat()
            return info.st_ino, info.st_mtime_ns
        except FileNotFoundError:
            return None

    seen = stamp()
    deadline = time.monotonic() + 120
    while child.poll() is None and time.monotonic() < deadline:
        now = stamp()
        if now != seen:
            seen, changes = now, changes + 1
            if changes == wanted:
                time.sleep(rng.choice([0.0, rng.uniform(0, 0.01), rng.uniform(0.01, 0.5)]))
                child.send_signal(signal.SIGKILL)
                break
        time.sleep(0.001)
    _, err = child.communicate(timeout=120)
    assert child.returncode in (0, -signal.SIGKILL), err
    return child.returncode


def killed_and_resumed(tmp_path: Path, capsys, seed: int, kills: int) -> None:
    rng = random.Random(seed)
    whole, out = tmp_path / "whole", tmp_path / f"killed-{seed}"
    assert main(train_argv(whole, 4)) == 0
    statuses = [kill_at_random(out, rng, *(["--resume"] if attempt else [])) for attempt in range(kills)]
    # the same command with --resume appended, as a job scheduler reruns it
    assert cli(capsys, train_argv(out, 4, "--resume"))[0] == 0, statuses
    assert_same_run(out, whole)


# The slow set: each kill starts the CLI (torch's import, seconds). The fast set kills the run after each of its writes
# in-process (test_a_kill_after_any_write_resumes_to_the_uninterrupted_run).
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_sigkill_many_times_then_resume_equals_the_uninterrupted_run(tmp_path, capsys, seed):
    killed_and_resumed(tmp_path, capsys, seed=seed, kills=4)


# --- --resume: the run's own flags, and what may change ------------------------------------------------------------


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    with one_torch_thread():
        assert main(train_argv(out, 1)) == 0
    return out


def copy_run(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "8x64"], "--size 8x64 differs from the run's 1x64"),
        (["--patch", "8"], "--patch 8 differs from the run's 4"),
        (["--num-classes", "7"], "--num-classes 7 differs from the run's 6"),
        (["--lr", "1e-3"], "--lr 0.001 differs from the run's 0.002"),
        (["--batch-size", "16"], "--batch-size 16 differs from the run's 32"),
        (["--seed", "1"], "--seed 1 differs from the run's 0"),
        (["--set", "mixup_alpha=0.5"], "--set mixup_alpha=0.5 differs from the run's 0.0"),
        (["--recipe", "deit"], "--recipe deit differs from the run's recipe (base_lr 0.0005 vs the run's 0.002"),
        (["--data", "digits"], "--data digits differs from the run's synthetic"),
        (["--super-classes", "random"], "--super-classes random differs from the run's none"),
        (["--experts", "3"], "--experts 3 differs from the run's vit, which has no such option"),
    ],
)
def test_resume_refuses_a_flag_that_differs_from_the_run(tmp_path, capsys, one_epoch, extra, message):
    out = copy_run(one_epoch, tmp_path / "run")
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    status, err = cli(capsys, train_argv(out, 2, "--resume", *extra))
    assert status == 2 and message in err, err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_resume_accepts_the_same_command_and_the_flags_that_may_change(tmp_path, capsys, one_epoch):
    out = copy_run(one_epoch, tmp_path / "run")
    may_change = ["--device", "cpu", "--workers", "0", "--set", "eval_batch_size=64", "--lr", "2e-3"]
    assert cli(capsys, train_argv(out, 2, "--resume", *may_change))[0] == 0
    assert [row["epoch"] for row in read_metrics(out)] == [1, 2]
    assert load_run(out).config["recipe"]["eval_batch_size"] == 64
    assert cli(capsys, ["train", "--out", str(out), "--resume", "--quiet"])[0] == 0  # done: nothing to do
    status, err = cli(capsys, train_argv(out, 1, "--resume"))
    assert status == 2 and "already trained 2 epochs; give --epochs 2 or more" in err
    assert load_run(out).config["recipe"]["epochs"] == 2 and len(read_metrics(out)) == 2


def test_resume_help_and_refusal_name_every_field_that_may_change(tmp_path, capsys, one_epoch):
    flags = [flag_of(field) for field in MAY_CHANGE_ON_RESUME]
    assert flags == ["--epochs", "--device", "--workers", "--compile", "--no-cuda-graphs", "--set eval_batch_size"]
    status, err = cli(capsys, train_argv(copy_run(one_epoch, tmp_path / "run"), 2, "--resume", "--seed", "1"))
    changeable = "--epochs, --device, --workers, --compile, --no-cuda-graphs and --set eval_batch_size"
    assert status == 2 and f"(only {changeable} may change)" in err
    assert all(flag in RESUME_HELP for flag in [*flags, "--quiet"])


def test_a_failed_start_is_started_afresh_by_resume_or_by_the_same_command(tmp_path, capsys):
    for retry in (["--resume"], []):
        out = tmp_path / f"failed{len(retry)}"
        status, err = cli(capsys, train_argv(out, 1, "--lr", "1e6"))  # the loss goes NaN in epoch 1
        assert status == 2 and "no checkpoint was written yet" in err
        assert sorted(p.name for p in out.iterdir()) == ["config.json"]
        (out / "notes.txt").write_text("mine")
        assert cli(capsys, train_argv(out, 1, *retry))[0] == 0
        assert sorted(p.name for p in out.iterdir()) == [*RUN_FILES, "notes.txt"]  # never deletes what it did not write
        assert load_run(out).config["recipe"]["base_lr"] == 2e-3
    status, err = cli(capsys, ["train", "--out", str(tmp_path / "nothing"), "--resume"])
    assert status == 2 and "holds no run to resume" in err


# --- bad input: one line, status 2, before any work -----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (["--lr", "inf"], "argument --lr: 'inf' is not a finite number"),
        (["--router-loss=-inf"], "argument --router-loss: '-inf' is not a finite number"),
        (["--set", "base_lr=nan"], "base_lr='nan': expected a finite number"),
        (["--set", "warmup_epochs=inf"], "warmup_epochs='inf': expected a finite number"),
        (["--set", "randaugment_magnitude=31"], "randaugment_magnitude=31: must be from 0 to 30"),  # an IndexError
        (["--set", "randaugment_magnitude=-1"], "randaugment_magnitude=-1: must be from 0 to 30"),  # the strongest
    ],
)
def test_non_finite_numbers_are_refused_where_they_are_typed(tmp_path, capsys, extra, message):
    status, err = cli(capsys, train_argv(tmp_path / "run", 1, *extra))
    assert status == 2 and message in err
    assert not (tmp_path / "run").exists()


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("opened the data before checking --out")

    monkeypatch.setattr(train_module, "open_data", no_work)
    (tmp_path / "file").write_text("keep me")
    for argv in (train_argv(tmp_path / "file", 1), ["train", "--out", str(tmp_path / "file"), "--resume"]):
        status, err = cli(capsys, argv)
        assert status == 2 and "exists and is not a directory" in err
    assert (tmp_path / "file").read_text() == "keep me"


def test_evaluate_refuses_an_unwritable_confusion_file_before_any_work(capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("loaded the run before checking --confusion")

    monkeypatch.setattr("mobile_moe.training.run_dir.load_run", no_work)
    status, err = cli(capsys, ["evaluate", "some-run", "--confusion", "/proc/x/confusion.npy"])
    assert status == 2 and "cannot write /proc/x/confusion.npy" in err


class Unsafe:
    """A class that the weights-only unpickler refuses."""


@pytest.mark.parametrize("damage", ["garbage", "truncated", "unsafe-global"])
def test_an_unreadable_checkpoint_is_one_line_without_torchs_unsafe_advice(tmp_path, capsys, one_epoch, damage):
    out = copy_run(one_epoch, tmp_path / "run")
    best = out / "best.pt"
    if damage == "garbage":
        best.write_bytes(b"not a checkpoint at all")
    elif damage == "truncated":
        best.write_bytes(best.read_bytes()[:1000])
    else:
        torch.save({"model": {}, "config": {}, "payload": Unsafe()}, best)
    status, err = cli(capsys, ["evaluate", str(out)])
    assert status == 2
    assert f"cannot read checkpoint {best}: not a mobile-moe checkpoint or corrupted" in err
    assert "weights_only=True and is never unpickled unsafely" in err
    assert "weights_only=False" not in err and "weights_only` set to `False" not in err and len(err) < 400, err


@pytest.mark.parametrize(("key", "value"), [("epoch", None), ("epoch", -1), ("best_top1", 7.5), ("best_epoch", "1")])
def test_training_metadata_out_of_range_is_one_line_for_every_reader(tmp_path, capsys, one_epoch, key, value):
    out = copy_run(one_epoch, tmp_path / "run")
    for name in ("best.pt", "checkpoint.pt"):
        state = torch.load(out / name, weights_only=True)
        torch.save({**state, key: value}, out / name)
    argvs = (["evaluate", str(out)], train_argv(out, 2, "--resume"),
             ["train", "--model", "vit", "--init-from", str(out), *RECIPE, "--epochs", "1", "--out",
              str(tmp_path / "fine-tuned")])  # fmt: skip
    for argv in argvs:
        status, err = cli(capsys, argv)
        assert status == 2 and f"its {key} {value!r} is out of range" in err and err.count("\n") == 1, err


def test_a_run_being_written_is_refused_to_a_second_command_which_names_the_holder(tmp_path, capsys, one_epoch):
    out = copy_run(one_epoch, tmp_path / "run")
    before = {name: (out / name).read_bytes() for name in RUN_FILES}
    with run_lock(out):  # as a train or resume in progress holds it
        for argv in (train_argv(out, 2, "--resume"), train_argv(tmp_path / "run")):
            status, err = cli(capsys, argv)
            assert status == 2 and f"{out} is being written by another mobile-moe command (pid {os.getpid()}" in err
        status, err = cli(capsys, train_argv(tmp_path / "new"))
        assert status == 0  # another directory is not held
    assert {name: (out / name).read_bytes() for name in RUN_FILES} == before
    assert cli(capsys, train_argv(out, 2, "--resume"))[0] == 0  # released


def test_a_refused_first_start_leaves_no_directory_behind(tmp_path, capsys):
    status, _ = cli(capsys, ["train", *MODEL, "--data", "no-such-data", "--out", str(tmp_path / "run")])
    assert status == 2 and not (tmp_path / "run").exists()


def test_weights_that_do_not_fit_the_config_are_a_usage_error(tmp_path, capsys, one_epoch):
    out = copy_run(one_epoch, tmp_path / "run")
    for name in ("best.pt", "checkpoint.pt"):
        state = torch.load(out / name, weights_only=True)
        state["model"] = {}
        torch.save(state, out / name)
    status, err = cli(capsys, ["evaluate", str(out)])
    assert status == 2 and "best.pt: its weights do not fit its vit config" in err and "20 missing" in err
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    assert status == 2 and "checkpoint.pt: its weights do not fit" in err


def forged(run: Path, change) -> None:
    """Both checkpoints of `run` with change(state) applied, as an edited or damaged file would hold them."""
    for name in ("best.pt", "checkpoint.pt"):
        state = torch.load(run / name, weights_only=True)
        change(state)
        torch.save(state, run / name)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("sparse", "weight head.fc.bias is a sparse_coo tensor, which no model holds"),
        ("complex", "weight head.fc.bias is a complex tensor, which no model holds"),
        ("long key", "1 unexpected (e.g. blocks.999999"),  # shown cut short, on one line
        ("escape key", "1 unexpected (e.g. 'head.\\x1b[31mred')"),
    ],
)
def test_weights_of_a_kind_no_model_holds_are_one_line(tmp_path, capsys, one_epoch, damage, message):
    out = copy_run(one_epoch, tmp_path / "run")
    changes = {
        "sparse": lambda model: model.update({"head.fc.bias": model["head.fc.bias"].to_sparse()}),
        "complex": lambda model: model.update({"head.fc.bias": model["head.fc.bias"].to(torch.complex64)}),
        "long key": lambda model: model.update({"blocks." + "9" * 5000 + ".mlp.fc1.weight": torch.zeros(1)}),
        "escape key": lambda model: model.update({"head.\x1b[31mred": torch.zeros(1)}),
    }
    forged(out, lambda state: changes[damage](state["model"]))
    status, err = cli(capsys, ["evaluate", str(out)])
    assert status == 2 and message in err and err.count("\n") == 1 and len(err) < 400 and "\x1b" not in err, err


# Tensors a red team put in place of a weight (`blocks.0.mlp.fc1.weight`, (F, D) float32), each made from that weight:
# torch's own checks crashed on the first four, and load_state_dict copied the last four into the float32 model
# (a float64 of 1e300 as an infinity).
FORGED_WEIGHTS = {
    "meta": (lambda w: torch.empty(w.shape, device="meta"), "is a tensor on the meta device, which no model holds"),
    "float8": (lambda w: w.to(torch.float8_e4m3fn), "is a float8_e4m3fn tensor, which no model holds"),
    "nested": (lambda w: torch.nested.nested_tensor([w[0], w[1, :3]]), "is a nested tensor, which no model holds"),
    "jagged": (lambda w: torch.nested.nested_tensor([w[0], w[1, :3]], layout=torch.jagged), "is a nested tensor"),
    "sparse csr": (lambda w: w.to_sparse_csr(), "is a sparse_csr tensor, which no model holds"),
    "quantized": (lambda w: torch.quantize_per_tensor(w, 0.1, 0, torch.qint8), "is a qint8 tensor, which no model"),
    "float64 beyond float32": (lambda w: torch.full(w.shape, 1e300, dtype=torch.float64), "is a float64 tensor"),
    "int64": (lambda w: w.round().long(), "is an int64 tensor, which no model holds"),
    "uint64": (lambda w: torch.ones(w.shape, dtype=torch.uint64), "is a uint64 tensor, which no model holds"),
    "bool": (lambda w: w > 0, "is a bool tensor, which no model holds"),
}


def forged_weight(kind: str, weight: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # "The PyTorch API of nested tensors is in prototype stage", ...
        warnings.simplefilter("ignore", UserWarning)
        return FORGED_WEIGHTS[kind][0](weight)


@pytest.mark.parametrize("kind", FORGED_WEIGHTS)
def test_a_weight_of_a_kind_no_model_holds_is_one_line_naming_it(tmp_path, capsys, one_epoch, kind):
    """From a red team: each forged tensor crashed evaluate inside torch (a traceback, or 120 lines of dispatcher
    dump) or was loaded silently. checkpoint.check_finite_weights refuses it, by name, before any torch op reads it."""
    out = copy_run(one_epoch, tmp_path / "run")
    key = "blocks.0.mlp.fc1.weight"
    forged(out, lambda state: state["model"].update({key: forged_weight(kind, state["model"][key])}))
    status, err = cli(capsys, ["evaluate", str(out)])
    message = f"best.pt: weight {key} {FORGED_WEIGHTS[kind][1]}"
    assert status == 2 and message in err and err.count("\n") == 1 and "again" in err, err
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    assert status == 2 and f"checkpoint.pt: weight {key} {FORGED_WEIGHTS[kind][1]}" in err, err


@pytest.mark.parametrize("kind", FORGED_WEIGHTS)
def test_check_finite_weights_refuses_a_forged_weight_under_any_key(tmp_path, kind):
    """The check itself (load_checkpoint's): the forged tensor under an escaped key is named, shown on one line."""
    from mobile_moe.models.checkpoint import check_finite_weights, load_checkpoint

    key = "blocks.0.\x1b[31mfc1.weight"
    tensor = forged_weight(kind, torch.randn(8, 4))
    with pytest.raises(UsageError) as caught:
        check_finite_weights({"ok": torch.zeros(2), key: tensor}, "x.pt")
    message = str(caught.value)
    assert f"x.pt: weight 'blocks.0.\\x1b[31mfc1.weight' {FORGED_WEIGHTS[kind][1]}" in message, message
    assert "\x1b" not in message and "\n" not in message
    torch.save({"version": 1, "model": {key: tensor}, "config": {}}, tmp_path / "x.pt")
    with pytest.raises(UsageError, match="x.pt: weight 'blocks.0."):
        load_checkpoint(tmp_path / "x.pt")


@pytest.mark.parametrize("name", ["vit", "mobile-vmoe", "hard-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_checkpoints_of_each_kind_still_load(tmp_path, name, dtype):
    """Every entry of a model's state dict is float32 (a Hard MoE's cluster buffers too; no model holds an integer,
    bool or quantized entry); a checkpoint saved in a half precision loads into it as well."""
    from conftest import tiny_model

    from mobile_moe.models.checkpoint import checkpoint_dict, load_checkpoint, model_from_checkpoint

    model = tiny_model(name)
    assert {value.dtype for value in model.state_dict().values()} == {torch.float32}
    checkpoint = checkpoint_dict(model)
    checkpoint["model"] = {key: value.to(dtype) for key, value in checkpoint["model"].items()}
    save_checkpoint(checkpoint, tmp_path / "best.pt")
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "best.pt"), tmp_path / "best.pt")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[key].to(dtype).float()), key


@pytest.mark.parametrize("moment", ["smaller", "larger", "sparse"])
def test_resume_refuses_adamw_moments_that_are_not_their_parameters_shape(tmp_path, capsys, one_epoch, moment):
    """torch's fused AdamW reads a moment at its parameter's size: a smaller one corrupted memory (a segfault), a
    larger one trained on silently."""
    out = copy_run(one_epoch, tmp_path / "run")
    shapes = {"smaller": (2,), "larger": (3, 32, 97)}

    def damage(state):
        entry = state["optimizer"]["state"][0]
        tensor = torch.zeros(shapes.get(moment, entry["exp_avg"].shape))
        entry["exp_avg"] = tensor.to_sparse() if moment == "sparse" else tensor

    forged(out, damage)
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    refusal = "its optimizer or scheduler state does not fit the model (ValueError: parameter 0's exp_avg); the file"
    assert status == 2 and refusal in err and err.count("\n") == 1, err


def test_resume_refuses_a_run_whose_commit_point_was_removed(tmp_path, capsys, one_epoch):
    """best.pt and metrics.jsonl without checkpoint.pt (written first, so only a removal leaves them): a resume
    would start over and replace them."""
    out = copy_run(one_epoch, tmp_path / "run")
    (out / "checkpoint.pt").unlink()
    kept = {name: (out / name).read_bytes() for name in ("best.pt", "metrics.jsonl")}
    status, err = cli(capsys, ["train", "--out", str(out), "--resume", "--epochs", "2"])
    assert status == 2 and "holds finished epochs (best.pt, metrics.jsonl) but not their checkpoint.pt" in err
    assert {name: (out / name).read_bytes() for name in kept} == kept


AFRESH = "resume from a good copy of the run, or start it afresh into a new --out"


@pytest.mark.parametrize(
    ("history", "message"),
    [
        (5, "is 5, not a list of metrics rows"),
        ("ab", "is 'ab', not a list of metrics rows"),  # was iterated: rows "a" and "b", exit 0
        ([torch.tensor(1.0)], "row 1: a row is a Tensor, not a JSON object"),
        ([{"epoch": "1"}], "row 1: a row's epoch is '1', not an integer >= 1"),
        ([{"epoch": 1, "val_top1": torch.tensor(0.5)}], "row 1: epoch 1's val_top1 is a Tensor, not a number"),
        ([{"epoch": 1, "expert_load": [0.5, "x"]}], "row 1: epoch 1's expert_load holds 'x', not only numbers"),
        ([{"epoch": 1, "expert_load": 0.5}], "row 1: epoch 1's expert_load is 0.5, not a list of numbers"),
        ([{"epoch": 1, "note": {"x": torch.zeros(1)}}], "row 1: epoch 1's note is a dict, not a JSON value"),
    ],
)
def test_resume_refuses_a_damaged_history_in_one_line_and_writes_nothing(tmp_path, capsys, one_epoch, history, message):
    """From a red team: each crashed the resume (TypeError) or wrote the damage into metrics.jsonl. The history is
    checked as metrics.jsonl's rows are (run_dir.metrics_row_problem) before anything is loaded or written."""
    out = copy_run(one_epoch, tmp_path / "run")
    forged(out, lambda state: state.update(history=history))
    before = {name: (out / name).read_bytes() for name in RUN_FILES}
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    refusal = f"{out / 'checkpoint.pt'}: its history {message}; the file was damaged or edited: {AFRESH}"
    assert status == 2 and refusal in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert {name: (out / name).read_bytes() for name in RUN_FILES} == before


@pytest.mark.parametrize("entry", ["history", "best_epoch", "data", "recipe"])
def test_a_checkpoint_without_an_entry_of_its_training_state_is_not_resumed(tmp_path, capsys, one_epoch, entry):
    """Every checkpoint.pt of the run format holds its history (what metrics.jsonl is rewritten from), best epoch,
    data and recipe: one without is damaged, refused in one line, and nothing is written."""
    out = copy_run(one_epoch, tmp_path / "run")
    forged(out, lambda state: state.pop(entry))
    before = {name: (out / name).read_bytes() for name in RUN_FILES}
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    assert status == 2 and f"checkpoint.pt holds no training state ({entry} missing;" in err, err
    assert {name: (out / name).read_bytes() for name in RUN_FILES} == before


def test_a_damaged_metrics_row_is_refused_by_its_readers_and_restored_by_resume(tmp_path, capsys, one_epoch):
    out = copy_run(one_epoch, tmp_path / "run")
    good = (out / METRICS).read_text()
    (out / METRICS).write_text('{"epoch": 1, "val_top1": [0.5]}\n')
    with pytest.raises(UsageError, match=r"line 1: epoch 1's val_top1 is a list, not a number\); it is rewritten"):
        read_metrics(out)
    assert cli(capsys, train_argv(out, 1, "--resume"))[0] == 0  # nothing left to train: only the repair
    assert (out / METRICS).read_text() == good


def test_an_epoch_is_not_written_into_a_run_folder_removed_while_training(tmp_path):
    """The run's files would come back without config.json, a folder no command can read, and training said done."""
    from mobile_moe.training.run_dir import commit_epoch

    with pytest.raises(UsageError, match="lost its config.json while training"):
        commit_epoch(tmp_path / "removed", {"epoch": 3, "best_epoch": 3, "history": []})
    assert not (tmp_path / "removed").exists()


def test_resume_refuses_a_config_json_edited_away_from_the_checkpoint(tmp_path, capsys, one_epoch):
    out = copy_run(one_epoch, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    config["model"].update(width=96, num_heads=3)
    (out / "config.json").write_text(json.dumps(config))
    status, err = cli(capsys, ["train", "--out", str(out), "--resume", "--epochs", "2"])
    assert status == 2 and "config.json no longer matches checkpoint.pt" in err and "width=96" in err
    with pytest.raises(UsageError, match="no longer matches"):
        train_module.resume_training(out, verbose=False)


def test_a_resume_names_a_forged_value_of_config_json_escaped(tmp_path, capsys, one_epoch):
    """From a red team: the refusal of a flag that differs from the run quoted config.json's data spec as it was, so
    an escape code in it reached the terminal."""
    out = copy_run(one_epoch, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    config["data"]["spec"] = SYNTHETIC + "\x1b[31m"
    (out / "config.json").write_text(json.dumps(config))
    status, err = cli(capsys, train_argv(out, 2, "--resume"))
    assert status == 2 and "\x1b" not in err and "differs from the run's" in err and "\\x1b[31m" in err, err


def test_results_without_a_checkpoint_are_not_offered_to_resume(tmp_path, capsys, one_epoch):
    """A folder holding a best.pt but no checkpoint.pt: the refusal said "continue it with --resume", which a resume
    with model flags then refused again with the same words."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "best.pt").write_bytes((one_epoch / "best.pt").read_bytes())
    for extra in ((), ("--resume",)):
        status, err = cli(capsys, train_argv(tmp_path / "out", 2, *extra))
        assert status == 2 and "holds finished epochs (best.pt) but not their checkpoint.pt" in err, err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["best.pt"]


def image_folder(root: Path, damage: str) -> Path:
    import io
    import struct
    import zlib

    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (20, 20), (40 * i, 200 if name == "a" else 0, 90)).save(folder / f"{i}.png")
    broken = root / "train" / "a" / "2.png"
    if damage == "corrupt":
        broken.write_bytes(b"\x89PNG\r\n\x1a\n but not an image")
    else:  # a valid PNG header claiming 20000 x 20000 pixels: PIL refuses it as a decompression bomb
        buffer = io.BytesIO()
        Image.new("L", (4, 4)).save(buffer, "PNG")
        data = bytearray(buffer.getvalue())
        header = bytearray(data[16:29])
        header[0:8] = struct.pack(">II", 20000, 20000)
        data[16:29] = header
        data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(header)))
        broken.write_bytes(bytes(data))
    return broken


@pytest.mark.parametrize(
    "damage, workers, message",
    [
        ("corrupt", "0", "not an image PIL can decode"),
        ("bomb", "0", "too large to decode safely"),
        # Raised in a DataLoader worker process. Slow: torch then waits 5 s per worker to join them.
        pytest.param("corrupt", "2", "not an image PIL can decode", marks=pytest.mark.slow),
    ],
)
def test_a_broken_image_in_an_imagefolder_names_the_file(tmp_path, capsys, damage, workers, message):
    broken = image_folder(tmp_path / "images", damage)
    argv = ["train", *MODEL, "--data", f"imagefolder:{tmp_path / 'images'}", "--recipe", "tiny", "--batch-size",
            "8", "--epochs", "1", "--workers", workers, "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    status, err = cli(capsys, argv)
    assert status == 2 and str(broken) in err and message in err, err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_broken_image_met_in_a_dataloader_worker_is_still_one_line():
    """torch re-raises a worker's exception as type(error)("Caught ... Original Traceback ..."); fast stand-in for
    the slow workers=2 case above, through torch's own wrapper."""
    from torch._utils import ExceptionWrapper

    try:
        raise UnreadableImage("cannot read image /data/x.png: not an image PIL can decode; replace or remove it")
    except UnreadableImage:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(UnreadableImage) as raised:
        wrapped.reraise()
    assert str(raised.value) == "cannot read image /data/x.png: not an image PIL can decode; replace or remove it"


def test_a_config_json_that_is_not_a_runs_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.json").write_text('{"my": "project settings"}')
    status, err = cli(capsys, train_argv(out, 1))
    assert status == 2 and "not a mobile-moe run" in err
    assert (out / "config.json").read_text() == '{"my": "project settings"}'


# A file of another format version: what it states ("none": no version, as a file written before the formats were
# versioned) -> (that value, what the refusal says after the file's name, up to the fix).
OTHER_VERSIONS = {
    "none": (None, "is {what} of format version 0 (it states none); "),
    "0": (0, "is {what} of format version 0; "),
    "2": (2, "is {what} of format version 2 (written by a newer mobile-moe); "),
    "string": ("1", 'states format version "1", not an integer; '),
    "true": (True, "states format version true, not an integer; "),
}


def version_refusal(path: Path, version: str, what: str, fix: str) -> str:
    """The one line that refuses `path`, a file stating OTHER_VERSIONS[version]."""
    newer = "upgrade mobile-moe, or " if version == "2" else ""
    return f"{path} {OTHER_VERSIONS[version][1].format(what=what)}this mobile-moe reads version 1: {newer}{fix}"


def stating(version: str):
    """A change that makes a record state OTHER_VERSIONS[version] (or no version)."""

    def change(record: dict) -> None:
        record.pop("version", None)
        if OTHER_VERSIONS[version][0] is not None:
            record["version"] = OTHER_VERSIONS[version][0]

    return change


def assert_refused(capsys, argv: list[str], refusal: str) -> None:
    """The command's whole stderr is the one line of `refusal`, and its status 2."""
    status, err = cli(capsys, argv)
    assert status == 2 and err.endswith(f": error: {refusal}\n") and err.count("\n") == 1, err


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_a_run_of_another_format_version_is_refused_by_every_reader_in_one_line(tmp_path, capsys, one_epoch, version):
    """config.json states the run's format version; a run of another one (or none) is refused by read_config, the
    one check every reader of a run goes through, and nothing of it is written."""
    from mobile_moe.training.run_dir import read_config

    out = copy_run(one_epoch, tmp_path / "run")
    config = json.loads((out / "config.json").read_text())
    assert config["version"] == 1 and next(iter(config)) == "version"
    stating(version)(config)
    (out / "config.json").write_text(json.dumps(config))
    refusal = version_refusal(out / "config.json", version, "a run", "train it again into a new --out")
    with pytest.raises(UsageError) as caught:
        read_config(out)
    assert str(caught.value) == refusal
    before = {name: (out / name).read_bytes() for name in RUN_FILES}
    export = ["export", str(out), "--format", "onnx", "--out", str(tmp_path / "bundle")]
    for argv in (["evaluate", str(out)], train_argv(out, 2, "--resume"), export):
        assert_refused(capsys, argv, refusal)
    assert {name: (out / name).read_bytes() for name in RUN_FILES} == before


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_a_checkpoint_of_another_format_version_is_refused_in_one_line(tmp_path, capsys, one_epoch, version):
    """Each checkpoint states the version it was written with, checked where it is loaded (load_checkpoint)."""
    from mobile_moe.models.checkpoint import load_checkpoint

    out = copy_run(one_epoch, tmp_path / "run")
    assert torch.load(out / "best.pt", weights_only=True)["version"] == 1
    forged(out, stating(version))
    again = "train or import the run again into a new --out"
    refusal = version_refusal(out / "best.pt", version, "a checkpoint", again)
    with pytest.raises(UsageError) as caught:
        load_checkpoint(out / "best.pt")
    assert str(caught.value) == refusal
    assert_refused(capsys, ["evaluate", str(out)], refusal)


def test_a_preset_size_with_an_explicit_patch_resumes_as_started():
    import argparse

    given = argparse.Namespace(model="vit", size="deit-ti", patch_size=8, image_size=None, num_classes=None,
                               pool=None, num_experts=None, top_k=None, moe_layers=None)  # fmt: skip
    run_model = {"name": "vit", "depth": 12, "width": 192, "num_heads": 3, "patch_size": 8}
    assert model_differences(given, run_model) == []
    assert model_differences(argparse.Namespace(**{**vars(given), "patch_size": None}), run_model)  # 16 vs 8


def test_a_batch_that_does_not_split_into_routing_groups_is_refused_before_any_work(tmp_path, capsys):
    argv = ["train", "--model", "vmoe", "--size", "2x64", "--patch", "4", "--image-size", "16", "--experts", "4",
            "--model-kwargs", "routing_group_images=3", *RECIPE, "--batch-size", "16", "--epochs", "1",
            "--out", str(tmp_path / "run")]  # fmt: skip
    status, err = cli(capsys, argv)
    assert status == 2 and "do not split into routing groups of routing_group_images=3" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("free", [4096, 10**9])
def test_a_checkpoint_that_fills_the_disk_says_the_disk_is_full(tmp_path, monkeypatch, free):
    """torch's zip writer says "[enforce fail at inline_container.cc] unexpected pos" when the disk fills: with the
    file system out of space, the line says so, as every full disk is said; otherwise torch's own reason."""
    import shutil

    from mobile_moe.models import checkpoint
    from mobile_moe.utils import atomic

    def filling_save(obj, file):
        Path(file).write_bytes(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", filling_save)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, free))
    want = "No space left on device; free some space" if free < 2**20 else "enforce fail at inline_container"
    with pytest.raises(UsageError, match=rf"cannot write (checkpoint )?{tmp_path / 'best.pt'}: .*{want}"):
        checkpoint.save_checkpoint({"epoch": 1}, tmp_path / "best.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_resume_that_would_change_the_workers_draws_is_refused_by_name():
    """With --input-pipeline workers each worker draws its own augmentations: another --workers on resume would train
    other crops than the run's (max weight difference 3.4e-3 seen), so it is refused; without random augmentation,
    or with the device pipeline (draws keyed by seed, epoch, rank and step), it is no change to the draws."""
    from mobile_moe.training import recipes
    from mobile_moe.training.train import check_same_draws

    started = recipes.deit().replace(input_pipeline="workers", workers=4)
    with pytest.raises(UsageError, match="--workers 2 differs from the run's 4: with --input-pipeline workers"):
        check_same_draws(started, started.replace(workers=2))
    check_same_draws(started, started.replace(epochs=400))
    check_same_draws(started.replace(input_pipeline="device"), started.replace(input_pipeline="device", workers=2))
    check_same_draws(recipes.tiny().replace(workers=4), recipes.tiny().replace(workers=0))  # nothing drawn


class _KilledInTheWorker(torch.utils.data.Dataset):
    """Item 1 kills the worker process that reads it, as the kernel's out-of-memory killer would."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        if index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(1)


def test_a_dataloader_worker_killed_by_a_signal_is_named_with_what_to_do():
    """torch's own error for a killed worker, caught from a real DataLoader, becomes our sentence (train adds the
    checkpoint kept and --resume); any other RuntimeError is not ours to reword."""
    from mobile_moe.training.loader_failures import worker_failure

    loader = torch.utils.data.DataLoader(_KilledInTheWorker(), num_workers=1, batch_size=1)
    with pytest.raises(RuntimeError) as caught:
        list(loader)
    said = worker_failure(caught.value)
    assert said is not None and "DataLoader worker (pid" in said and "killed from outside" in said
    assert "\n" not in said
    assert worker_failure(RuntimeError("CUDA out of memory")) is None
