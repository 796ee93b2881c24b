"""The benchmark as a typed library: BenchSettings in, the results.json object out (docs/formats.md, results.json).

    from mobile_moe.device_bench.bench import BenchSettings, benchmark
    from mobile_moe.device_bench.round_settings import RoundSettings

    settings = BenchSettings(RoundSettings(iterations=50, threads=1), runtime="native", rounds=3, data="digits")
    results = benchmark(["bundles/moe", "bundles/dense"], settings, out="bench/")

Each (bundle, round) is one fresh runner process, so cold loads are cold and each process's memory high-water mark
is its own. Every runner (the native C++ runner on the host or over adb, the Python worker around export's runtime,
Core ML) is a RoundRunner, picked by `choose_runner(runtime, device, runner)`; whatever it returns goes through
results.validate_round before anything reads it. Rounds are separated by a pause (heat, background work), and
results.json keeps the median across rounds with a flag when they disagree. `mobile-moe bench` (cli.py) is this
library behind argparse.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mobile_moe.device_bench import arm64
from mobile_moe.device_bench import results as results_module
from mobile_moe.device_bench.android import AndroidRunner
from mobile_moe.device_bench.coreml_worker import CoreMLWorker
from mobile_moe.device_bench.native_runner import NativeRunner, check_runner
from mobile_moe.device_bench.python_worker import PythonWorker
from mobile_moe.device_bench.report import PLOTS, REPORT, write_report
from mobile_moe.device_bench.round_report import RoundJson, RoundReport
from mobile_moe.device_bench.round_settings import RoundSettings
from mobile_moe.device_bench.workload import ORDERS, make_workload, random_seed, write_raw
from mobile_moe.errors import UsageError
from mobile_moe.export.manifest import bundle_identity, read_manifest, same_bundle
from mobile_moe.export.manifest_schema import Manifest
from mobile_moe.formats.versions import check_version
from mobile_moe.library import options as library_options
from mobile_moe.utils import jsonio
from mobile_moe.utils.atomic import atomic_path, check_output_folder, check_writable, scratch_folder, within
from mobile_moe.utils.foreign_files import read_foreign

RUNTIMES = ("executorch", "onnxruntime", "native", "coreml")
DEFAULT_RUNTIME = {"executorch": "native", "onnx": "onnxruntime", "coreml": "coreml"}  # by bundle backend
BACKEND_OF_RUNTIME = {"executorch": "executorch", "native": "executorch", "onnxruntime": "onnx", "coreml": "coreml"}
MAX_PAUSE_S = 3600
MAX_RESULTS_BYTES = 1 << 30  # a results.json of 1000 rounds of many bundles is megabytes
MAX_ROUNDS = 1000  # fresh processes per bundle: each keeps its report in memory for the median


class RoundRunner(Protocol):
    """Runs one round (one fresh process) on one bundle and returns what it measured."""

    @property
    def name(self) -> str:
        """Which runner this is, for error messages ("native runner", "onnxruntime worker", ...)."""
        ...

    def run_round(self, bundle: Path, images: Path, settings: RoundSettings) -> RoundJson: ...


DEVICES = ("host", "android[:SERIAL]", "arm64-emulated")
REMOTE = ("android", "arm64-emulated")  # devices the native runner is pushed to (mobile_moe/device_bench/remote.py)


def parse_device(device: str) -> tuple[str, str | None]:
    """("host", None), ("android", SERIAL or None) or ("arm64-emulated", None)."""
    name, _, serial = device.partition(":")
    if name not in ("host", *REMOTE) or (name != "android" and serial):
        raise UsageError(f"--device {device!r}: use {', '.join(DEVICES)}")
    return name, serial or None


def is_emulated(device: str) -> bool:
    """Whether a device's timings and memory are an emulator's (not comparable to a phone's)."""
    return parse_device(device)[0] == "arm64-emulated"


def choose_runner(runtime: str, device: str = "host", runner: str | Path | None = None) -> RoundRunner:
    """The one place that maps (runtime, device) to a runner. `runner`: a native runner binary for the device (an
    Android arm64 build for a phone, a linux-arm64 one for arm64-emulated); None builds one for this host, or for
    arm64-emulated, when the native runtime needs it."""
    place, serial = parse_device(device)
    if place in REMOTE and runtime != "native":
        raise UsageError(f"--device {place} runs the native runner only: add --runtime native")
    if place == "android":
        if runner is None:
            raise UsageError(
                "--device android needs --runner PATH: an Android arm64 build (libmobile_moe's build_android.sh)"
            )
        return AndroidRunner(serial, Path(runner))
    if place == "arm64-emulated":
        arm64.require()  # the toolchain, qemu and the wheel, before any round
        return arm64.EmulatedArm64Runner(Path(runner) if runner is not None else None)
    if runtime == "native":
        return NativeRunner(Path(runner) if runner is not None else None)
    if runtime == "coreml":
        return CoreMLWorker()  # refuses off macOS
    return PythonWorker(runtime)


@dataclass(frozen=True)
class BenchSettings:
    """A whole bench's settings; `round` holds what each runner process is told (iterations, threads, ...)."""

    round: RoundSettings = field(default_factory=RoundSettings)
    runtime: str | None = None  # one of RUNTIMES; None: each bundle's default (native for ExecuTorch, ...)
    device: str = "host"  # "host", "android[:SERIAL]" (the native runner over adb) or "arm64-emulated" (qemu-user)
    runner: str | Path | None = None  # native runner binary for the device; None: build one (required on android)
    rounds: int = 3  # fresh processes per bundle; results keep the median and flag disagreement
    pause_s: float = 2.0  # between rounds, so heat and background work settle
    data: str = "random"  # images: random[:SEED] or a data spec (digits, cifar10:ROOT, ...)
    images: int = 32  # images in the routing workload
    order: str = "stratified"  # how a data spec's val images are drawn (workload.ORDERS); random images ignore it
    seed: int = 0  # the draw's seed

    def __post_init__(self) -> None:
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise UsageError(f"--rounds {self.rounds}: must be from 1 to {MAX_ROUNDS}")
        if not 0 <= self.pause_s <= MAX_PAUSE_S:
            raise UsageError(f"--pause {self.pause_s}: seconds between rounds, from 0 to {MAX_PAUSE_S}")
        if self.images < 1:
            raise UsageError(f"--images {self.images}: must be at least 1")
        random_seed(self.data)  # a bad random:SEED now; a data spec is checked when it is opened
        if self.order not in ORDERS:
            raise UsageError(f"--order {self.order}: choose one of {', '.join(ORDERS)}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed {self.seed}: must be from 0 to {2**32 - 1}")
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise UsageError(f"--runtime {self.runtime!r}: choose one of {', '.join(RUNTIMES)}")
        place, _ = parse_device(self.device)
        if self.runner is not None:
            check_runner(self.runner)
        if self.runtime is not None or place in REMOTE:
            choose_runner(self.runtime or "native", self.device, self.runner)  # its refusals, before anything runs
        self._check_native_only_flags()

    def _check_native_only_flags(self) -> None:
        """libmobile_moe's options beyond those every runtime takes are refused with another runtime named, which
        would ignore them."""
        if self.runtime in (None, "native", "executorch"):
            return
        given = library_options.library_only(self.round.library_options())
        if given:
            flag = library_options.OPTION[given[0]].flag
            raise UsageError(f"{flag} is libmobile_moe's; --runtime {self.runtime} has none: leave it out")

    def as_json(self) -> dict:
        """results.json's "settings": the per-round knobs and the workload."""
        workload = {"data": self.data, "images": self.images, "order": self.order, "seed": self.seed}
        return {**dataclasses.asdict(self.round), **workload, "pause_s": self.pause_s}


def choose_runtime(requested: str | None, manifest: Manifest, bundle: str) -> str:
    backend = manifest.backend
    runtime = requested or DEFAULT_RUNTIME.get(backend)
    if runtime is None or BACKEND_OF_RUNTIME[runtime] != backend:
        article = "an" if backend[0] in "aeiou" else "a"
        fitting = sorted(name for name, of in BACKEND_OF_RUNTIME.items() if of == backend)
        raise UsageError(
            f"{bundle} is {article} {backend} bundle; --runtime {requested} cannot run it: use --runtime "
            f"{' or '.join(fitting)}, or leave --runtime out"
        )
    return runtime


def host_description() -> str:
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def measure_round(
    bundle: str, runtime: str, runner: RoundRunner, settings: BenchSettings, images: Path, index: int, log,
    identity: tuple[int, int] | None,
) -> RoundReport:  # fmt: skip
    """One round of one bundle: a fresh runner process, its report validated. The runner reads the bundle again each
    round: a round that ran on another bundle than the one whose manifest the bench read (`identity`: see
    manifest.bundle_identity), exported over it since, is refused."""
    with same_bundle(bundle, identity):
        report = results_module.validate_round(runner.run_round(Path(bundle), images, settings.round), runner.name)
    log(f"{bundle} [{runtime}, {settings.device}] round {index + 1}: p50 {report.latency_ms.p50:.2f} ms")
    return report


HOST_REFERENCE = "executorch"  # the runtime an emulated run's answers are checked against: export's, on this host


def parity_with_host(bundle: str, emulated: RoundReport, images: Path, settings: BenchSettings) -> dict:
    """An emulated round's logits, classes and experts against export's own runtime on this host, on the same images
    and with the same routing settings (cache-aware routing picks by the cache): the parity figure of an emulated
    run, whose timings are the emulator's."""
    once = dataclasses.replace(settings.round, iterations=1, warmup=0, switch_repeats=0)
    worker = PythonWorker(HOST_REFERENCE)
    host = results_module.validate_round(worker.run_round(Path(bundle), images, once), worker.name)
    return results_module.host_parity(emulated, host, reference=f"{HOST_REFERENCE} (Python, this host)")


def as_given(report: RoundReport) -> dict:
    """A validated round as the runner gave it (its own extra keys included, no defaults added), for results.json."""
    return report.model_dump(mode="json", exclude_unset=True)


BENCH_FILES = frozenset({"results.json", REPORT, *PLOTS})  # everything a bench writes in its --out


def bench_files(out: Path) -> set[str] | None:
    """The files a bench writes, when `out` holds an earlier bench (a results.json of ours, of results.VERSION); else
    None. The one reader of a results.json: an earlier bench's of another format version, or of none, is refused in
    one line (it is not replaced by a bench that cannot read it)."""
    path = out / "results.json"
    try:
        results = json.loads(read_foreign(path, limit=MAX_RESULTS_BYTES, what="results.json"))
    except ValueError:  # none, unreadable or not JSON (UsageError and json's errors are ValueErrors)
        return None
    if isinstance(results, dict) and ("version" in results or "runs" in results):  # a bench's: its version first
        check_version(results, results_module.VERSION, where=str(path), what="a bench's results",
                      fix=f"move {out} away, or choose another --out")  # fmt: skip
    try:
        results_module.validate_results(results)
    except ValueError:  # not ours
        return None
    return set(BENCH_FILES)


def earlier_bench(out: Path) -> bool:
    """True when `out` holds an earlier bench, which a new one replaces as a whole; False when it is new or empty.
    Anything else is refused (atomic.check_output_folder): a bench never writes over, or removes, files it did not
    make."""
    return check_output_folder(out, ours=bench_files, kind="mobile-moe bench's output")


def write_results(results: dict, folder: Path) -> None:
    """results.json, report.md and the plots, into `folder`: the temporary directory the bench claimed for its --out
    (atomic_path), which replaces --out as a whole: a reader sees the earlier bench or this one, never a mixture, and
    an interrupted bench leaves the earlier one."""
    (folder / "results.json").write_text(jsonio.dumps(results, indent=1), encoding="utf-8")
    write_report(results, folder)


def _workloads(manifests: dict[str, Manifest], settings: BenchSettings, log: Callable[[str], None]) -> dict:
    """Each bundle's images; a data split holding fewer than --images is benched whole, and the log says so
    (results.json's settings keep the count asked for, each run its own)."""
    workloads = {name: make_workload(settings.data, manifest, settings.images, bundle=name, order=settings.order,
                                     seed=settings.seed)
                 for name, manifest in manifests.items()}  # fmt: skip
    for name, workload in workloads.items():
        if len(workload.images) < settings.images:
            log(
                f"{name}: --images {settings.images}, but the val split of {settings.data} has {len(workload.images)}"
                ": benching those"
            )
    return workloads


def _check_out_outside_bundles(out: str | Path, bundles: list[str]) -> None:
    """UsageError if --out is inside a bundle: a bundle holds only what export wrote, and its next export would refuse
    the bench's folder as a file of someone else's."""
    for bundle in bundles:
        if within(out, bundle) and not within(bundle, out):  # --out the bundle itself: earlier_bench refuses it
            raise UsageError(f"--out {out} is inside the bundle {bundle}; choose a folder outside it")


def _rounds(
    names: list[str], runtimes: dict[str, str], runners: dict[str, RoundRunner], settings: BenchSettings,
    images: dict[str, Path], log: Callable[[str], None], identities: dict[str, tuple[int, int] | None],
) -> dict[str, list[RoundReport]]:  # fmt: skip
    """Every bundle's rounds. They interleave the bundles (round 1 of each, then round 2 of each, ...): a host that
    drifts during the bench (heat, other work) then hits every bundle alike, and the ratios between bundles stay
    honest."""
    rounds: dict[str, list[RoundReport]] = {name: [] for name in names}
    for index in range(settings.rounds):
        if index:
            time.sleep(settings.pause_s)
        for name in names:
            runner = runners[runtimes[name]]
            rounds[name].append(
                measure_round(name, runtimes[name], runner, settings, images[name], index, log, identities[name])
            )
    return rounds


def benchmark(
    bundles: Sequence[str | Path], settings: BenchSettings, out: str | Path, log: Callable[[str], None] = print
) -> dict:
    """Measure every bundle; writes results.json, report.md and plots to `out` and returns the results.json object.
    Every bundle and the output directory are checked before the first round runs."""
    if isinstance(bundles, str | Path):  # a str is a Sequence too: of characters
        raise TypeError("bundles: a list of bundle directories, not one path")
    names = [str(bundle) for bundle in bundles]  # results.json names bundles as the caller did
    if not names:
        raise UsageError("no bundle to benchmark: pass at least one bundle directory")
    check_writable(out, directory=True)  # before measuring, not after
    if earlier_bench(Path(out)):
        log(f"replacing the earlier bench in {out}")
    identities = {name: bundle_identity(name) for name in names}  # what each round must still find there
    manifests = {name: read_manifest(name, verify_files=True) for name in names}  # all checked before any is run
    _check_out_outside_bundles(out, names)
    runtimes = {name: choose_runtime(settings.runtime, manifests[name], name) for name in names}
    runners = {runtime: choose_runner(runtime, settings.device, settings.runner) for runtime in set(runtimes.values())}
    workloads = _workloads(manifests, settings, log)
    # --out claimed before the first round: a second bench writing there is refused now, not after measuring.
    with atomic_path(Path(out), directory=True) as folder, scratch_folder("mobile-moe-bench") as scratch:
        images = {name: write_raw(workloads[name], Path(scratch) / f"images-{i}.f32") for i, name in enumerate(names)}
        rounds = _rounds(names, runtimes, runners, settings, images, log, identities)
        emulated = is_emulated(settings.device)
        parity = {name: parity_with_host(name, rounds[name][0], images[name], settings) for name in names if emulated}
        records = [
            results_module.run_record(
                name, manifests[name], runtimes[name], settings.device, rounds[name], workloads[name].source
            )
            | {"emulated": emulated, "raw_first_round": as_given(rounds[name][0])}
            | {"options": library_options.describe(settings.round.library_options())}
            | ({"host_parity": parity[name]} if emulated else {})
            for name in names
        ]
        results = {"version": results_module.VERSION, "runs": records, "host": host_description(),
                   "rounds": settings.rounds, "settings": settings.as_json()}  # fmt: skip
        results_module.validate_results(results)
        write_results(results, folder)
    return results


def bench_bundles(
    bundles: Sequence[str | Path],
    out: str | Path,
    *,
    runtime: str | None = None,
    iterations: int = 20,
    warmup: int = 3,
    threads: int = 1,
    rounds: int = 1,
    data: str = "random",
    images: int = 16,
    log: Callable[[str], None] = print,
) -> dict:
    """For `mobile-moe demo` and notebooks: benchmark bundles on this host with short defaults (a half-second pause
    between rounds); writes results.json, report.md and plots to `out` and returns the results.json object."""
    round_settings = RoundSettings(iterations=iterations, warmup=warmup, threads=threads)
    settings = BenchSettings(round_settings, runtime=runtime, rounds=rounds, pause_s=0.5, data=data, images=images)
    return benchmark(bundles, settings, out, log)
