"""`mobile-moe reproduce`: each figure's cells at every scale, the sweep (never retrains a finished run, resumes a
short one, refuses a DIR of another sweep), the table/CSV/plot it writes, and the submitit launcher."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import needs_build

from mobile_moe.app.cli import main
from mobile_moe.errors import UsageError
from mobile_moe.evidence.figures import DERIVED, FIGURES, cell_recipes, figure
from mobile_moe.evidence.scales import SCALES, Backbone, scale
from mobile_moe.evidence.sweep import (
    Job,
    SlurmOptions,
    run_local,
    run_side_by_side,
    run_submitit,
    slurm_parameters,
    train_job,
)
from mobile_moe.models.checkpoint import load_checkpoint
from mobile_moe.models.costs import costs


@pytest.mark.parametrize("scale_name", sorted(SCALES))
@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_plans_at_every_scale(name, scale_name):
    fig = figure(name, scale(scale_name), num_classes=100)
    names = [cell.name for cell in fig.cells]
    assert len(names) == len(set(names))
    assert fig.cell(fig.source).role == "dense"
    for cell in fig.cells:
        assert cell.skip is None, cell.skip  # 100 classes: every cell of every figure runs
        assert cell.config.image_size == SCALES[scale_name].image_size
        if cell.role == "moe":
            assert fig.cell(cell.baseline).role == "dense"
    recipes = cell_recipes(fig, scale(scale_name), None, "auto")
    assert {cfg["epochs"] for cfg in recipes.values()} == {SCALES[scale_name].epochs}


def test_paper_scale_is_the_papers_grid_and_recipes():
    fig = figure("fig3a", scale("paper"), num_classes=1000)
    assert len(fig.cells) == 24  # 3 depths x 4 widths, dense and MoE
    for cell in fig.cells:
        cfg = cell.config
        assert (cfg.patch_size, cfg.image_size, cfg.pool) == (32, 224, "cls")
        assert cell.recipe == ("deit" if cfg.width >= 192 else "vit")  # Sec. 3.1
        assert cfg.num_heads == {384: 6, 192: 3, 96: 3, 64: 2}[cfg.width]
        if cell.role == "moe":
            assert (cfg.num_experts, cfg.top_k, cfg.moe_layers) == (10, 1, 2) and cell.super_classes == DERIVED
    ablation = figure("fig3b", scale("paper"), num_classes=1000).cell("deit-ti-dense").config
    assert (ablation.depth, ablation.width, ablation.patch_size) == (12, 192, 16)  # DeiT-Ti/16


def test_cells_that_cannot_run_say_why_instead_of_failing_the_sweep():
    fig3b = figure("fig3b", scale("tiny"), num_classes=10)  # digits: 10 classes
    skipped = {cell.row: cell.skip for cell in fig3b.cells if cell.skip}
    assert set(skipped) == {"E=15", "E=20"}
    assert "the data has 10" in skipped["E=15"]
    shallow = SCALES["tiny"].__class__(**{**vars(SCALES["tiny"]), "ablation": Backbone(4, 64, 2, 8)})
    fig3c = figure("fig3c", shallow, num_classes=10)
    assert {cell.row for cell in fig3c.cells if cell.skip} == {"L=4", "L=5"}  # 4 blocks: the router needs one


def test_fig3d_dense_baselines_match_the_moe_flops():
    """Fig. 3d: each dense model's last L MLPs are k times wider, so it costs what the k-expert MoE costs (the MoE
    adds only its router's D x E product)."""
    fig = figure("fig3d", scale("paper"), num_classes=1000)
    for moe in (cell for cell in fig.cells if cell.role == "moe"):
        dense = fig.cell(moe.baseline)
        width, experts = moe.config.width, moe.config.num_experts
        assert costs(moe.config).flops - costs(dense.config).flops == 2 * width * experts
    k2 = fig.cell("deit-ti-dense-k2").config
    assert costs(k2).params_total == 6_308_776  # vs the k=2 MoE's 6.31M active (Fig. 3e's text)


def test_figures_share_the_runs_of_the_same_model():
    tiny = scale("tiny")
    assert [c.name for c in figure("fig1", tiny, 10).cells] == [c.name for c in figure("fig3a", tiny, 10).cells]
    fig3d, fig3e = figure("fig3d", tiny, 10), figure("fig3e", tiny, 10)
    assert fig3d.cell("deit-ti-moe-E10-k2-L2").config == fig3e.cell("deit-ti-moe-E10-k2-L2").config


@pytest.mark.parametrize("groups", [10, 20])
def test_fig3e_routes_a_row_by_the_datas_own_super_classes(groups):
    """digits-pairs' tens digit (10) or CIFAR-100's coarse labels (20): one more k=2 row, E = the data's groups,
    against the same FLOPs-matched dense model; data without super-classes has no such row."""
    plain, with_coarse = figure("fig3e", scale("tiny"), 100), figure("fig3e", scale("tiny"), 100, groups)
    coarse = with_coarse.cell(f"deit-ti-coarse-E{groups}-k2-L2")
    assert (coarse.row, coarse.super_classes, coarse.num_experts) == ("coarse", "coarse", groups)
    assert coarse.config.top_k == 2 and coarse.baseline == "deit-ti-dense-k2"
    assert [c.name for c in with_coarse.cells if c is not coarse] == [c.name for c in plain.cells]


def test_fig3e_routes_at_fewer_experts_for_data_of_few_classes():
    """Fashion-MNIST's 10 classes at the paper's E=10: every class its own super-class, derived or random alike; at
    --experts 5 every routed row has 5 experts (and its own runs), the coarse row its 5 groups."""
    fig = figure("fig3e", scale("tiny"), 10, 5, experts=5)
    routed = [cell for cell in fig.cells if cell.role == "moe"]
    assert {cell.num_experts for cell in routed} == {5} and all("-E5-" in cell.name for cell in routed)
    assert fig.cell("deit-ti-random-E5-k2-L2").super_classes == "random:0"
    with pytest.raises(UsageError, match="--experts is fig3e's"):
        figure("fig3b", scale("tiny"), 10, experts=5)


# --- the sweep, end to end on digits ----------------------------------------------------------------------------


def reproduce(capsys, out: Path, *extra: str, figure_name: str = "fig3b") -> tuple[int, str, str]:
    argv = ["reproduce", figure_name, "--data", "digits", "--scale", "tiny", "--epochs", "1", "--out", str(out)]
    status = main([*argv, *extra])
    stdout, stderr = capsys.readouterr()
    return status, stdout, stderr


@pytest.fixture(scope="module")
def fig3b_dir(tmp_path_factory):
    """fig3b at the tiny scale, 1 epoch, 1 seed: a dense model, E = 5, 7, 10 (E = 15, 20 need more classes)."""
    out = tmp_path_factory.mktemp("reproduce") / "figs"
    assert main(["reproduce", "fig3b", "--data", "digits", "--scale", "tiny", "--epochs", "1", "--out", str(out)]) == 0
    return out


def test_reproduce_writes_the_table_the_csv_and_the_plot(fig3b_dir):
    table = (fig3b_dir / "fig3b.md").read_text()
    assert "| E=10 | 6x64/8 | 87.12 |" in table  # the paper's router accuracy beside ours
    assert "n/a: 15 super-classes need at least 15 classes; the data has 10" in table
    assert "Caveat: in E=10 E equals the number of classes" in table  # digits: 10 classes into 10 super-classes
    rows = {row["row"]: row for row in csv.DictReader((fig3b_dir / "fig3b.csv").open())}
    assert list(rows) == ["dense", "E=5", "E=7", "E=10", "E=15", "E=20"]
    for name in ("dense", "E=5", "E=7", "E=10"):
        assert rows[name]["status"] == "ok" and 0 <= float(rows[name]["top1_mean"]) <= 100
        assert rows[name]["seeds"] == "1" and rows[name]["top1_std"] == ""  # one seed: no std
    assert rows["E=5"]["num_experts"] == "5" and float(rows["E=5"]["delta_top1"]) == pytest.approx(
        float(rows["E=5"]["top1_mean"]) - float(rows["dense"]["top1_mean"]), abs=1e-3
    )
    assert rows["E=15"]["status"].startswith("n/a") and rows["E=15"]["top1_mean"] == ""
    assert (fig3b_dir / "fig3b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    super_classes = json.loads((fig3b_dir / "super-classes" / "deit-ti-dense-E7.json").read_text())
    assert super_classes["num_super_classes"] == 7 and "deit-ti-dense/seed-0" in super_classes["source"]
    config = json.loads((fig3b_dir / "runs" / "deit-ti-moe-E7-k1-L2" / "seed-0" / "config.json").read_text())
    assert config["super_classes"]["spec"].endswith("deit-ti-dense-E7.json")


def test_a_finished_sweep_is_never_retrained(fig3b_dir, capsys, monkeypatch):
    import mobile_moe.training.train as train_module

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train_module, "train", refuse)
    monkeypatch.setattr(train_module, "resume_training", refuse)
    before = (fig3b_dir / "fig3b.csv").read_text()
    status, stdout, stderr = reproduce(capsys, fig3b_dir)
    assert status == 0 and "training into" not in stderr
    assert (fig3b_dir / "fig3b.csv").read_text() == before  # evaluations are cached with the epochs they saw


def test_a_run_short_of_its_epochs_resumes_where_it_stopped(fig3b_dir, tmp_path):
    """What a killed sweep's unfinished run, or more --epochs, gets: resumed from its checkpoint, not retrained."""
    import shutil

    run = tmp_path / "seed-0"
    shutil.copytree(fig3b_dir / "runs" / "deit-ti-dense" / "seed-0", run)
    first = (run / "metrics.jsonl").read_text()
    config = json.loads((run / "config.json").read_text())
    job = Job("deit-ti-dense", 0, str(run), config["model"], {**config["recipe"], "epochs": 2}, "digits", None)
    assert train_job(job) == "resumed"
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and rows[0] == first.strip()  # epoch 1 kept, epoch 2 added
    assert train_job(job) == "done"


def test_a_dir_of_another_sweep_is_refused_before_any_training(fig3b_dir, capsys, tmp_path):
    """The same DIR at another scale would mix two sweeps' runs in one table."""
    import shutil

    out = tmp_path / "figs"
    shutil.copytree(fig3b_dir / "runs", out / "runs")
    status = main(["reproduce", "fig3b", "--data", "digits", "--scale", "small", "--epochs", "1", "--out", str(out)])
    _, stderr = capsys.readouterr()
    assert status == 2 and "is not this sweep's deit-ti-dense" in stderr and "new --out" in stderr
    assert stderr.count("\n") == 1


def test_fewer_epochs_than_a_run_has_are_refused(fig3b_dir, capsys, tmp_path):
    """A 2-epoch run is not the answer to --epochs 1: refused, not reported under the wrong caption."""
    import shutil

    out = tmp_path / "figs"
    shutil.copytree(fig3b_dir, out)
    run = out / "runs" / "deit-ti-dense" / "seed-0"
    config = json.loads((run / "config.json").read_text())
    train_job(Job("deit-ti-dense", 0, str(run), config["model"], {**config["recipe"], "epochs": 2}, "digits", None))
    status, _, stderr = reproduce(capsys, out)
    assert status == 2 and "has trained 2 epochs, more than --epochs 1" in stderr


def test_a_damaged_run_is_a_failed_row_and_the_sweep_goes_on(fig3b_dir, capsys, tmp_path):
    import shutil

    out = tmp_path / "figs"
    shutil.copytree(fig3b_dir, out)
    (out / "runs" / "deit-ti-moe-E7-k1-L2" / "seed-0" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    status, stdout, stderr = reproduce(capsys, out)
    assert status == 0, stderr
    rows = {row["row"]: row for row in csv.DictReader((out / "fig3b.csv").open())}
    status_e7 = rows["E=7"]["status"]
    assert status_e7.startswith("seed 0: failed") and "move that run directory aside" in status_e7
    assert rows["E=5"]["status"] == "ok" and rows["E=10"]["status"] == "ok"


@pytest.mark.slow  # runs ExecuTorch or whole commands many times: in CI's slow set
def test_score_records_edited_or_replaced_are_evaluated_again_or_refused(fig3b_dir, capsys, tmp_path):
    """A score record is read back through the schema that wrote it: a top-1 that is a string or 7.5 is evaluated
    again (never 750%); what is no regular file is refused in one line (a FIFO would block the read); a finished run
    whose best.pt is gone is a failed row."""
    import os
    import shutil

    out = tmp_path / "figs"
    shutil.copytree(fig3b_dir, out)
    scores = out / "scores"
    for cell, top1 in (("deit-ti-dense", 7.5), ("deit-ti-moe-E5-k1-L2", "0.5")):
        record = json.loads((scores / cell / "seed-0.json").read_text())
        (scores / cell / "seed-0.json").write_text(json.dumps({**record, "top1": top1}))
    assert reproduce(capsys, out)[0] == 0
    assert (out / "fig3b.csv").read_text() == (fig3b_dir / "fig3b.csv").read_text()  # evaluated again, same numbers
    record = scores / "deit-ti-moe-E7-k1-L2" / "seed-0.json"
    record.unlink()
    for make, remove in ((os.mkfifo, os.unlink), (os.mkdir, os.rmdir)):
        make(record)
        status, _, stderr = reproduce(capsys, out)
        assert status == 2 and "not a regular file" in stderr and stderr.count("\n") == 1
        assert record.exists()  # not ours: left where it is
        remove(record)
    # An interrupt between a finished run's checkpoint.pt and its best.pt (the last epoch the best) is repaired from
    # checkpoint.pt, as a resume would; a best.pt of an earlier epoch removed by hand cannot be, and says so.
    from mobile_moe.models.checkpoint import load_checkpoint

    runs = {row: out / "runs" / cell / "seed-0" for row, cell in (("E=10", "deit-ti-moe-E10-k1-L2"),
                                                                  ("E=7", "deit-ti-moe-E7-k1-L2"),
                                                                  ("E=5", "deit-ti-moe-E5-k1-L2"))}  # fmt: skip
    last_best = {row: (lambda state: state["best_epoch"] == state["epoch"])(load_checkpoint(path / "checkpoint.pt"))
                 for row, path in runs.items()}  # fmt: skip
    for path in runs.values():
        (path / "best.pt").unlink()
    status, stdout, _ = reproduce(capsys, out)
    assert status == 0
    rows = {row["row"]: row for row in csv.DictReader((out / "fig3b.csv").open())}
    for row, path in runs.items():
        if last_best[row]:
            assert rows[row]["status"] == "ok" and (path / "best.pt").is_file()
        else:
            assert "best.pt is gone" in rows[row]["status"]
    assert any(last_best.values()), "precondition: some run's last epoch is its best"


def test_slurm_jobs_ask_for_gpus_only_when_given():
    assert "gpus_per_node" not in slurm_parameters(SlurmOptions())
    params = slurm_parameters(SlurmOptions(gpus_per_cell=8, partition="gpu"))
    assert (params["gpus_per_node"], params["tasks_per_node"], params["slurm_partition"]) == (8, 8, "gpu")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "0"], "--seeds 0: must be at least 1"),
        (["--gpus-per-cell", "2"], "for --launcher submitit"),
        (["--data", "nonsense"], "nonsense"),
        (["--data", "synthetic:classes=4,per_class=20", "--scale", "small"], "batches of 256 images but"),
        (["--experts", str(10**20)], "parameters, whose weights need"),  # before the dense cells train, not after
    ],
)
def test_bad_input_is_one_line_and_status_2(flags, message, capsys, tmp_path):
    argv = ["reproduce", "fig3e", "--data", "digits", "--scale", "tiny", "--out", str(tmp_path / "o"), *flags]
    assert main(argv) == 2
    _, stderr = capsys.readouterr()
    assert message in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "o" / "runs").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_the_sweep(capsys, tmp_path):
    argv = ["reproduce", "fig3e", "--data", "digits", "--scale", "tiny", "--device", "cuda", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_reproduce_refuses_to_run_under_torchrun(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["reproduce", "fig3e", "--data", "digits", "--out", str(tmp_path / "o")]) == 2
    assert "without torchrun" in capsys.readouterr().err


@pytest.mark.slow  # starts a process per run: in CI's slow set, which keeps `make test` within 5 minutes
def test_submitit_runs_each_job_in_its_own_process(tmp_path):
    """submitit's local executor (what AutoExecutor picks without Slurm) trains two fig3e cells; the runs are the
    same run directories the local launcher writes."""
    jobs = _two_fig3e_jobs(tmp_path)
    outcomes = run_submitit(jobs, tmp_path / "submitit", SlurmOptions(), log=lambda message: None)
    assert outcomes == {(job.cell, 0): "trained" for job in jobs}
    for job in jobs:
        assert (Path(job.run_dir) / "best.pt").is_file()
    again = run_submitit(jobs[:1], tmp_path / "submitit", SlurmOptions(), log=lambda message: None)
    assert again == {(jobs[0].cell, 0): "done"}


def _two_fig3e_jobs(root: Path) -> list[Job]:
    fig = figure("fig3e", scale("tiny"), num_classes=10)
    recipes = cell_recipes(fig, scale("tiny"), 1, "cpu")
    return [
        Job(name, 0, str(root / "runs" / name / "seed-0"), fig.cell(name).config.to_dict(),
            {**recipes[name], "seed": 0}, "digits", spec)
        for name, spec in (("deit-ti-e2e-token-E10-k2-L2", None), ("deit-ti-random-E10-k2-L2", "random:0"))
    ]  # fmt: skip


@pytest.mark.slow  # starts a process per run: in CI's slow set, which keeps `make test` within 5 minutes
def test_side_by_side_runs_are_the_runs_one_after_another_gives(tmp_path):
    """--jobs 2: two runs in two worker processes at once, each with half the cores' threads; with as many threads,
    one after another in this process trains the same weights, bit for bit."""
    import torch

    from mobile_moe.utils.devices import usable_cores

    side_by_side = _two_fig3e_jobs(tmp_path / "side-by-side")
    outcomes = run_side_by_side(side_by_side, 2, log=lambda message: None)
    assert outcomes == {(job.cell, 0): "trained" for job in side_by_side}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, usable_cores() // 2))
    try:
        in_turn = _two_fig3e_jobs(tmp_path / "in-turn")
        assert run_local(in_turn, log=lambda message: None) == outcomes
    finally:
        torch.set_num_threads(threads)
    for ours, theirs in zip(side_by_side, in_turn, strict=True):
        weights = [load_checkpoint(Path(job.run_dir) / "best.pt")["model"] for job in (ours, theirs)]
        assert weights[0].keys() == weights[1].keys()
        assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    again = run_side_by_side(side_by_side, 2, log=lambda message: None)
    assert again == {(job.cell, 0): "done" for job in side_by_side}


def test_on_slurm_every_job_is_queued_before_any_is_awaited(monkeypatch, tmp_path):
    """The Slurm branch, with a stand-in AutoExecutor: all jobs submitted up front, outcomes read in job order."""
    import submitit

    events = []

    class Handle:
        def __init__(self, job):
            self.job = job

        def results(self):
            events.append(("wait", self.job.cell))
            return [f"trained {self.job.cell}"]

    class SlurmExecutor:
        cluster = "slurm"

        def __init__(self, folder):
            self.parameters = {}

        def update_parameters(self, **parameters):
            self.parameters.update(parameters)

        def submit(self, function, job):
            events.append(("submit", job.cell))
            return Handle(job)

    monkeypatch.setattr(submitit, "AutoExecutor", SlurmExecutor)
    jobs = [Job(name, 0, str(tmp_path / name), {"name": "vit"}, {"epochs": 1}, "digits", None) for name in "ab"]
    outcomes = run_submitit(jobs, tmp_path / "submitit", SlurmOptions(gpus_per_cell=2), log=lambda message: None)
    assert outcomes == {("a", 0): "trained a", ("b", 0): "trained b"}
    assert events == [("submit", "a"), ("submit", "b"), ("wait", "a"), ("wait", "b")]


def test_unknown_scale_and_figure_are_usage_errors():
    with pytest.raises(UsageError, match="choose one of"):
        scale("huge")
    with pytest.raises(UsageError, match="fig3e"):
        figure("fig9", scale("tiny"), 10)


@pytest.mark.slow
@needs_build
def test_bench_adds_measured_cost_to_every_trained_cell(fig3b_dir, capsys, tmp_path):
    import shutil

    out = tmp_path / "figs"
    shutil.copytree(fig3b_dir, out)
    status, stdout, stderr = reproduce(capsys, out, "--bench", "--iterations", "3")
    assert status == 0, stderr
    rows = {row["row"]: row for row in csv.DictReader((out / "fig3b.csv").open())}
    for name in ("dense", "E=5", "E=7", "E=10"):
        assert float(rows[name]["p50_ms"]) > 0 and float(rows[name]["bytes_loaded_per_image"]) > 0
        assert (out / "bundles" / rows[name]["cell"] / "manifest.json").is_file()
    assert rows["E=15"]["p50_ms"] == ""
    assert "p50 ms" in stdout and (out / "fig3b-latency.png").is_file()
