#!/usr/bin/env bash
# Issue 6's measurements, for a session with the lent GPU machine. Build and stage here with
# `../shared/gpu/stage && strip .gpu/bin/*` (unstripped, the release binaries with debug info
# come to about 690 MiB, over the 64 MiB a device run carries; stripped, about 41 MiB), then run
# on the GPU machine (carry [".gpu"]):
#     bash benches/gpu_issue6.sh
# It runs the seven out-of-core rows of docs/benchmarks.md (L=32, H=8192, 4 GiB of bf16 weights)
# with 10 steps each, writes each run's output and a Chrome trace of its copies and waits to
# $OUT, then the peers (PyTorch hand-written prefetch, Accelerate cpu_offload and disk_offload)
# on the same machine.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/strata-issue6}
mkdir -p "$OUT"
# NVRTC and cuBLAS of the machine's CUDA install (the driver is found without this).
for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
bin=.gpu/bin/example-out_of_core
if [ ! -x "$bin" ]; then
    echo "no $bin: run ../shared/gpu/stage first and carry .gpu" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv | tee "$OUT/machine.txt"
: > "$OUT/out_of_core.txt"
fail=0
row() {
    local name=$1
    shift
    echo "== $name: $bin --layers 32 --hidden 8192 --steps 10 $*" | tee -a "$OUT/out_of_core.txt"
    "$bin" --layers 32 --hidden 8192 --steps 10 --trace "$OUT/$name.json" "$@" 2>&1 \
        | tee -a "$OUT/out_of_core.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
}
row forward-2048-1g --mode forward --rows 2048 --device-budget 1GiB
row forward-16384-1g --mode forward --rows 16384 --device-budget 1GiB
row forward-2048-2g --mode forward --rows 2048 --device-budget 2GiB
row forward-2048-1g-nohints --mode forward --rows 2048 --device-budget 1GiB --hints off
row train-4096-1g --mode train --optimizer device-sgd --rows 4096 --device-budget 1GiB
row train-4096-1g-keep0 --mode train --optimizer device-sgd --rows 4096 --device-budget 1GiB \
    --keep 0
row train-4096-1g-nohints --mode train --optimizer device-sgd --rows 4096 --device-budget 1GiB \
    --hints off
echo "== peers" | tee "$OUT/peers.txt"
PYTHONUNBUFFERED=1 DISK=/tmp python3 benches/peers/offload_peers.py 2>&1 | tee -a "$OUT/peers.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
exit $fail
