"""Two gloo processes under torchrun on CPU end with the same weights as one process with the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from mobile_moe.app.cli import main
from mobile_moe.training.run_dir import load_run

ARGS = ["train", "--model", "mobile-vmoe", "--size", "3x64", "--patch", "4", "--image-size", "16", "--experts", "3",
        "--moe-layers", "1", "--data", "synthetic:classes=6,super=3,per_class=30", "--super-classes", "truth",
        "--recipe", "tiny", "--epochs", "2", "--batch-size", "16", "--device", "cpu", "--quiet",
        "--set", "crop_scale=1"]  # no random augmentation: each process would draw its own  # fmt: skip


@pytest.mark.slow  # two torchrun processes: in CI's slow set, which keeps `make test` within 5 minutes
def test_two_gloo_processes_equal_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "mobile_moe", *ARGS, "--out", str(tmp_path / "ddp")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main([*ARGS, "--out", str(tmp_path / "single")]) == 0
    ddp, single = load_run(tmp_path / "ddp", "last"), load_run(tmp_path / "single", "last")
    assert ddp.checkpoint["epoch"] == single.checkpoint["epoch"] == 2
    width = single.config["model"]["width"]
    for key, value in single.model.state_dict().items():
        got = ddp.model.state_dict()[key]
        if key.endswith("qkv.bias"):
            # The key bias cannot change attention (softmax is shift-invariant), so its true gradient is 0 and what
            # it gets is summation-order rounding noise, which Adam normalises into lr-sized steps: loose check.
            key_bias = slice(width, 2 * width)
            torch.testing.assert_close(got[key_bias], value[key_bias], rtol=0, atol=1e-3)
            got, value = torch.cat([got[:width], got[2 * width :]]), torch.cat([value[:width], value[2 * width :]])
        # atol 1e-5: where an element's true gradient is about 0, Adam normalises the summation order's rounding into
        # steps far above float32's last bit: 2.2e-6 (one element of an expert's fc2) under ATEN_CPU_CAPABILITY=default,
        # 1.3e-6 on torch 2.11. Ranks that read the same shard (a sampler given the wrong rank) miss by 1e-3 to 1e-2.
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=key)
    assert ddp.checkpoint["metrics"]["val_top1"] == single.checkpoint["metrics"]["val_top1"]


@pytest.mark.slow
@pytest.mark.parametrize(("probe", "status"), [([], 0), (["--interrupt-after-epoch", "1"], 130)])
def test_each_process_group_is_destroyed_after_the_runs_ddp_module_is_gone(tmp_path, probe, status):
    """A DDP module alive when the group is destroyed keeps its Reducer, whose destructor then destroys the gloo group
    holding the GIL and joins its threads, one of which can be waiting for the GIL: with torch 2.11 on a busy machine,
    3 of 12 finished two-process runs never ended. So the run's frames let go of it first, also on Ctrl-C. The two
    ranks are started as torchrun starts them, but without torchrun, which would stop one rank (SIGTERM) as soon as
    the other ended with its 130, wherever it was."""
    with socket.socket() as probe_port:  # a free port for rank 0's rendezvous
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    command = [sys.executable, "tests/training/ddp_teardown.py", *probe, *ARGS, "--out", str(tmp_path / "ddp")]
    processes = [subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(),
                                                "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                                  stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
                 for rank in (0, 1)]  # fmt: skip
    try:
        errors = [process.communicate(timeout=300)[1] for process in processes]
    finally:
        for process in processes:
            process.kill()  # a rank that hung (no-op for one that ended)
    for rank, (process, error) in enumerate(zip(processes, errors, strict=True)):
        assert process.returncode == status, error[-3000:]
        assert f"rank {rank}: DDP modules alive at destroy_process_group: 0" in error, error[-3000:]


# --- torchrun's variables: what torchrun would not set is one line, before anything is written -------------------

TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH = "launch with torchrun (torchrun --nproc_per_node N -m mobile_moe train ...), which sets these variables"
SMALL = ["train", "--model", "vit", "--size", "2x32", "--patch", "8", "--image-size", "16", "--data", "digits",
         "--recipe", "tiny", "--epochs", "1"]  # fmt: skip


@pytest.fixture
def torchrun_env(monkeypatch):
    """Set torchrun's variables as given, the others unset (as in a plain shell)."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def setenv(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return setenv


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not what torchrun sets: WORLD_SIZE is the number of processes, "
                                ">= 1; {launch}, or unset WORLD_SIZE to train in one process"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not what torchrun sets"),  # was a ZeroDivisionError
        ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2' is not what torchrun sets"),
        ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE='99999"),  # more digits than int() reads
        ({"RANK": "x"}, "RANK='x' is not what torchrun sets: RANK is this process's index, 0 <= RANK < WORLD_SIZE; "
                        "{launch}, or unset RANK to train in one process"),
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not what torchrun sets: LOCAL_RANK is this process's index on "
                                "its machine, >= 0; {launch}, or unset LOCAL_RANK"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not what torchrun sets"),
        # DistributedSampler's "Invalid rank 1" traceback
        ({"RANK": "1"}, "RANK=1 with WORLD_SIZE unset: torchrun sets 0 <= RANK < WORLD_SIZE; {launch}, or unset RANK "
                        "to train in one process"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
         "RANK=2 with WORLD_SIZE=2: torchrun sets 0 <= RANK < WORLD_SIZE; {launch}, or unset WORLD_SIZE and RANK"),
        # torch's rendezvous traceback ("environment variable RANK expected, but not set")
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT, RANK are not set, which init_process_group's "
                              "env:// rendezvous reads; {launch}, or unset WORLD_SIZE to train in one process"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": ""},
         "WORLD_SIZE=2 but MASTER_PORT is not set, which init_process_group's env:// rendezvous reads"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "port"},
         "MASTER_PORT='port' is not what torchrun sets: MASTER_PORT is rank 0's TCP port, 1 to 65535; {launch}, or "
         "unset WORLD_SIZE"),
    ],
)  # fmt: skip
def test_a_torchrun_variable_torchrun_would_not_set_is_one_line_and_nothing_is_written(
    tmp_path, capsys, torchrun_env, variables, message
):
    """From a red team: each was a traceback (int(), a division by zero, torch's sampler or rendezvous)."""
    from mobile_moe.errors import UsageError
    from mobile_moe.training import distributed

    torchrun_env(variables)
    message = message.format(launch=LAUNCH)
    with pytest.raises(UsageError) as caught:
        distributed.setup("cpu")
    assert message in str(caught.value) and "\n" not in str(caught.value) and len(str(caught.value)) < 400
    out = tmp_path / "run"
    assert main([*SMALL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "variables",
    [{}, {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, {"WORLD_SIZE": "", "RANK": "", "LOCAL_RANK": ""},
     {"LOCAL_RANK": "3"}],
)  # fmt: skip
def test_one_process_as_torchrun_or_a_plain_shell_describes_it(torchrun_env, variables):
    from mobile_moe.training import distributed

    torchrun_env(variables)
    assert distributed.setup("cpu") == distributed.Placement(0, 1, torch.device("cpu"))


def test_a_local_rank_beyond_the_visible_cuda_devices_is_one_line(torchrun_env, monkeypatch):
    """cuda:LOCAL_RANK is the process's device: one that torch does not see would fail in the first copy to it."""
    from mobile_moe.errors import UsageError
    from mobile_moe.training import distributed

    torchrun_env({"LOCAL_RANK": "1"})
    monkeypatch.setattr(distributed, "resolve_device", lambda choice, local_rank: torch.device("cuda", local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"^LOCAL_RANK=1 but torch sees 1 CUDA device: torchrun sets LOCAL_RANK < "):
        distributed.setup("cuda")
