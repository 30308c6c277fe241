#!/bin/bash
# One lent-GPU session as one prepared script (the device tool's `run`, timeout_s 600):
#   bash benchmarks/gpu_session.sh        # from the repository root, carrying .whl (pydantic, PuLP, highspy)
# The GPU machine's python3 (3.12) has torch, transformers, networkx, typer and rich but not pydantic, PuLP or
# highspy; fetch them here first (git ignores .whl): python3 -m pip download --no-deps --only-binary=:all:
#   --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
#   -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions pulp==3.3.2 highspy
# 1. benchmarks/gpu_check.py (predicted vs measured peak and time, roofline calibration, memory-safe, offload);
# 2. the tests that take a CUDA path;  3. benchmarks/compiled.py on CUDA (issue #24), in the time left.
# Every log lands in $OUT; each stage has its own timeout so one hang still leaves the others' figures
# (GPU_CHECK_S, TESTS_S, and TOTAL_S for the whole script, in seconds).
set -u
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HOME=/tmp/gpu_home; mkdir -p "$HOME"
t0=$(date +%s); left() { echo $(( ${1} - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
timeout "${GPU_CHECK_S:-300}" python3 benchmarks/gpu_check.py >"$OUT/gpu_check.log" 2>&1
echo "== gpu_check rc $? after $(( $(date +%s) - t0 )) s"
grep -v "^remat: training steps" "$OUT/gpu_check.log" | tail -c 6000
# -v names each failure as it happens, so a stage cut short by its timeout still says which tests failed
timeout "${TESTS_S:-170}" python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 8 --tb=short -rfE \
  tests/test_cuda.py tests/test_compiled.py tests/test_meta.py tests/test_spec.py tests/test_cli_faults.py \
  "tests/test_distributed.py::test_unmodelled_fsdp2_options_are_refused" >"$OUT/tests.log" 2>&1
echo "== tests rc $? after $(( $(date +%s) - t0 )) s"; grep -E "(FAILED|ERROR) tests/" "$OUT/tests.log" | sort -u | head -40
tail -3 "$OUT/tests.log"
budget=$(left "${TOTAL_S:-560}")
if [ "$budget" -gt 60 ]; then
  timeout "$budget" python3 benchmarks/compiled.py examples/gpt2.py --device cuda --budgets 0.3,0.5 --repeats 5 \
    >"$OUT/compiled.log" 2>&1
  echo "== compiled rc $? after $(( $(date +%s) - t0 )) s"; tail -c 3000 "$OUT/compiled.log"
fi
