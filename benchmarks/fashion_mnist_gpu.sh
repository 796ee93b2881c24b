#!/bin/bash
# Issue 35's GPU rows: reproduce fig3e (E = 5), fig3b and fig1 on all of Fashion-MNIST at --scale tiny-gpu, 3 seeds,
# side by side on one GPU (each figure on its own cores), fig3e first killed after 45 s and started again (a sweep
# resumes after a kill). Results: benchmarks/fashion_mnist_gpu.results.md.
#
#   DATA=fashion-mnist:DIR WORK=/tmp/fm OUT=DIR bash benchmarks/fashion_mnist_gpu.sh   # DATA: Debian's by default
#
# On the device machine: `make gpu-venv OFFLINE=1 PYTHON=python3` first (its torch, our wheels from .whl/), the IDX
# files carried in an ignored folder (DATA=fashion-mnist:.gpu-data/fashion-mnist). OUT receives results.tgz: every
# figure's table, CSV, plot and log, and each run's config and metrics (not its checkpoints).
set -u
DATA=${DATA:-fashion-mnist}
W=${WORK:-/tmp/fm}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
.venv/bin/python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
mkdir -p "$W"
pin() { if taskset -c "$1" true 2>/dev/null; then echo "taskset -c $1"; fi; }  # each figure its own cores, if any
R=".venv/bin/mobile-moe reproduce --data $DATA --scale tiny-gpu --seeds 3 --device cuda"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 10 > "$W/gpu-utilization.log" &
SMI=$!
( timeout -s INT 45 $(pin 8-12) $R fig3e --experts 5 --jobs 5 --out "$W/fig3e" > "$W/fig3e-killed.md" 2> "$W/fig3e-killed.log"
  echo "fig3e killed: rc $? at $(( $(date +%s) - T0 )) s" >> "$W/times.log"
  timeout 420 $(pin 8-12) $R fig3e --experts 5 --jobs 5 --out "$W/fig3e" > "$W/fig3e.md" 2> "$W/fig3e.log"
  echo "fig3e: rc $? at $(( $(date +%s) - T0 )) s" >> "$W/times.log" ) &
( timeout 420 $(pin 13-15) $R fig3b --jobs 3 --out "$W/fig3b" > "$W/fig3b.md" 2> "$W/fig3b.log"
  echo "fig3b: rc $? at $(( $(date +%s) - T0 )) s" >> "$W/times.log" ) &
( timeout 430 $(pin 0-7) $R fig1 --jobs 8 --out "$W/fig1" > "$W/fig1.md" 2> "$W/fig1.log"
  echo "fig1: rc $? at $(( $(date +%s) - T0 )) s" >> "$W/times.log" ) &
sleep 5; while [ "$(jobs -r | wc -l)" -gt 1 ]; do sleep 5; done
kill $SMI
cat "$W/times.log"; tail -n 3 "$W"/fig3e-killed.log "$W"/fig3e.log "$W"/fig3b.log "$W"/fig1.log
tar czf "$OUT/results.tgz" --exclude='*.pt' -C "$(dirname "$W")" "$(basename "$W")"
echo "total $(( $(date +%s) - T0 )) s"
