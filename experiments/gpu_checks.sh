#!/usr/bin/env bash
# The GPU checks of issue 17, item 7, as one script for a lent CUDA machine (never part of CI or the test suite):
#   1. every test whose name says CUDA (sync budget of every strategy x cache on CUDA in float32 and bfloat16, the first forward's
#      health flag, the recorder's CUDA path, cached decodes with rows sitting out, host_tensor, device/dtype
#      resolution);
#   2. the three fixture folders through experiments/parity.py on CUDA in float32 and bfloat16, each compared
#      with its reference (the counts are figures to note: draws and exact ties differ on a GPU, bfloat16 is not
#      expected to match float32 fixtures);
#   3. experiments/bench_overhead.py on CUDA in float32 and bfloat16 (host syncs and ops a step, wall ms a step);
#   4. experiments/bench_trace.py's recording overhead on CUDA in float32 and bfloat16 (the recorder's CUDA path
#      under load);
#   5. (stage cpu-recording) the same recording overhead with the model on the host's CPU, torch on 2 threads as on
#      the CI machines: a quieter machine than a shared VM for the <= 1% wall question (PAIRS pairs, default 20);
#   6. (stage cpu-overhead) experiments/bench_overhead.py with the model on the host's CPU (float32, batch 1, both
#      models): whether item 1's CPU figures are the 2-core VM's or the loop's (on the VM a 2 ms sleep before each
#      forward alone reproduces the loop's cold cost, bench_overhead.py --between).
# Each stage has its own time limit so that one slow stage cannot eat the others' time.
#
#     bash experiments/gpu_checks.sh OUT_DIR
#     STAGES="overhead recording" DTYPES=float32 bash experiments/gpu_checks.sh OUT_DIR   # a subset
#     STAGES="tests overhead cpu-overhead" ...            # stages 5 and 6 run only when named
#     OVERHEAD_DTYPES=bfloat16 OVERHEAD_BATCHES=1 ...      # the overhead bench in fewer settings
#
# Needs torch with CUDA and the package installed (pip install -e . --no-deps where the other dependencies are).
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
stages=${STAGES:-tests overhead recording}
dtypes=${DTYPES:-float32 bfloat16}
ovh_dtypes=${OVERHEAD_DTYPES:-$dtypes}
ovh_batches=${OVERHEAD_BATCHES:-1 8}
want() { [[ " $stages " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."

stage() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

stage environment
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
git rev-parse --short HEAD 2>/dev/null || true

if want tests; then
stage "CUDA tests and parity (in parallel)"
timeout 200 $py -m pytest -q -p no:cacheprovider tests -k "cuda or CUDA" >"$out/pytest_cuda.log" 2>&1 &
for dtype in $dtypes; do
  for f in refparity dreamparity d2cparity; do
    ( timeout 200 $py experiments/parity.py tests/fixtures/$f "$out/parity_${f}_$dtype.json" --device cuda \
          --dtype $dtype >/dev/null 2>"$out/parity_${f}_$dtype.err" \
      && $py tests/fixtures/compare.py tests/fixtures/$f "$out/parity_${f}_$dtype.json" \
          >"$out/compare_${f}_$dtype.log" 2>&1 ) &
  done
done
wait
tail -3 "$out/pytest_cuda.log"
for dtype in $dtypes; do
  for f in refparity dreamparity d2cparity; do
    echo "$f $dtype: $(tail -1 "$out/compare_${f}_$dtype.log" 2>/dev/null || echo "parity failed: $(tail -1 "$out/parity_${f}_$dtype.err")")"
  done
done
fi

if want overhead; then
for dtype in $ovh_dtypes; do
stage "overhead bench, CUDA $dtype"
if [[ " $ovh_batches " == *" 1 "* ]]; then
timeout 150 $py experiments/bench_overhead.py --device cuda --dtype $dtype --model both --batches 1 --prompts 2 \
    --repeats 2 2>&1 | tee "$out/bench_overhead_b1_$dtype.log"
fi
if [[ " $ovh_batches " == *" 8 "* ]]; then
timeout 80 $py experiments/bench_overhead.py --device cuda --dtype $dtype --model both --batches 8 --prompts 8 \
    --repeats 1 2>&1 | tee "$out/bench_overhead_b8_$dtype.log"
fi
done
fi

if want recording; then
for dtype in $dtypes; do
stage "recording overhead, CUDA $dtype"
timeout 70 $py experiments/bench_trace.py --skip sizes,replay,real,writer --pairs 15 --overhead-runs 1:2,8:8 \
    --override device=cuda --override dtype=$dtype 2>&1 | tee "$out/bench_trace_$dtype.log"
done
fi
if want cpu-recording; then
stage "recording overhead, the host's CPU (float32, torch on 2 threads)"
OMP_NUM_THREADS=2 timeout ${CPU_RECORDING_LIMIT:-200} $py experiments/bench_trace.py --skip sizes,replay,real,writer \
    --pairs ${PAIRS:-20} --overhead-runs 1:2,8:8 --override device=cpu --override dtype=float32 2>&1 \
    | tee "$out/bench_trace_cpu.log"
fi
if want cpu-overhead; then
stage "overhead bench, the host's CPU (float32, batch 1)"
timeout ${CPU_OVERHEAD_LIMIT:-240} $py experiments/bench_overhead.py --device cpu --dtype float32 --model both \
    --batches 1 --prompts ${CPU_OVERHEAD_PROMPTS:-2} --repeats 2 2>&1 | tee "$out/bench_overhead_cpu.log"
fi
stage done
