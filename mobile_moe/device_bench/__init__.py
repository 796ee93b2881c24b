"""device_bench: measure bundles' latency and memory on the host and on phones.

A measurement is always a *runner* process that loads one bundle the way an app would and prints one JSON object:
libmobile_moe's native runner (also cross-compiled for ARM64 and Android, driven under qemu or over adb), or a Python
worker around export's load_bundle (libmobile_moe through its Python binding, ONNX Runtime) or Core ML (macOS).
cli.py repeats runs in rounds, aggregates them (results.py) and writes results.json, report.md and plots (report.py).
"""
