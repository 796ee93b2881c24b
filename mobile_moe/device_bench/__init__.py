"""device_bench: measure bundles' latency and memory on the host and on phones.

A measurement is always a *runner* process that loads one bundle the way an app would and prints one JSON object:
the native C++ runner (native/, ExecuTorch's C++ runtime; also cross-compiled for Android and driven over adb), or a
Python worker around export's bundle runtime (ExecuTorch Python, ONNX Runtime) or Core ML (macOS). cli.py repeats
runs in rounds, aggregates them (results.py) and writes results.json, report.md and plots (report.py).
"""
