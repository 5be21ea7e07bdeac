#!/usr/bin/env bash
# One device session (1x or 2x H200): environment, GPU tests, benchmarks; logs go to $OUT.
# Usage (repo root, wheels carried in .whl): source .whl/install.sh && bash scripts/gpu_run.sh STEP...
# (the device's .git may be stale: carry .tree-rev, written here by `git describe --always --dirty > .tree-rev`)
# steps: tests bench cli_bench sweep deepep_bench layer_bench one_gpu hf_bench demo gemv_sweep host tune (EPMOE_CAP_<step> caps one step's seconds)
# (tune: scripts/tune_gemm.py, default --paths --resume, merges into epmoe/ops/gemm/tuned/<gpu>.json; the file comes back in $OUT/tuned/, to commit)
# (host: scripts/host_python.py --device cuda, against the checkout EPMOE_HOST_BASE when set;
#  one_gpu: bench_one_gpu.py, in the checkout EPMOE_ONE_GPU_BASE too when set)
# Record the JSON it writes (after fetching $OUT) with scripts/record_results.py --gpu h200 ... (CONTRIBUTING.md).
# Everything but summary.txt ends up in $OUT/out.tgz (EPMOE_PACK=0: leave the files).
set -uo pipefail
OUT=${OUT:-/tmp/epmoe-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${EPMOE_BUDGET_S:-540}
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -m epmoe env
  echo "tree: $(cat .tree-rev 2>/dev/null || echo unknown)"
} >> "$OUT/env.txt" 2>&1  # (appended: one device call may run this script more than once)
# without deep_gemm every fp8 / bf16 GEMM runs on our kernels (or torch) and its deep_gemm tests
# skip: say so first
# (e.g. a PYTHONPATH set after `source .whl/install.sh` drops the wheels' site directory)
python3 -c "import deep_gemm" 2>/dev/null || echo "WARNING: deep_gemm not importable: fp8/bf16 figures and tests are not the real ones" >> "$OUT/summary.txt"
for step in "$@"; do
  t=$(left)
  cap_var="EPMOE_CAP_${step}"; cap=${!cap_var:-$t}; [ "$cap" -lt "$t" ] && t=$cap; [ "$t" -gt 20 ] || { echo "no time left for $step" >> "$OUT/summary.txt"; break; }
  case "$step" in
    tests)
      # EPMOE_TEST_JOBS=N: N pytest-xdist workers on the one GPU, tests handed out as workers free
      # up (the suite is bound by kernel compilation on the host, not by the GPU); tests.txt gets
      # each test's outcome as it ends and failures.txt each traceback, so a capped run keeps both
      jobs=${EPMOE_TEST_JOBS:-1}
      xdist=(); [ "$jobs" -gt 1 ] && xdist=(-n "$jobs")
      EPMOE_FAILLOG="$OUT/failures.txt" EPMOE_TESTLOG="$OUT/tests.txt" setsid timeout $((t - 10)) \
        python3 -m pytest ${EPMOE_TEST_PATHS:-tests} -m "gpu or multi_gpu or device_triton" -q -rfE -p no:cacheprovider \
        --timeout 300 "${xdist[@]}" ${EPMOE_TEST_K:+-k "$EPMOE_TEST_K"} > "$OUT/gpu_tests.log" 2>&1 < /dev/null &
      pid=$!; wait "$pid"; rc=$?
      # a run cut by the cap can leave workers running (Inductor's compile pool), which would slow
      # every later step's host: the run has its own process group, ended here
      kill -- -"$pid" 2>/dev/null
      grep -hE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/gpu_tests.log" >> "$OUT/summary.txt"
      [ -f "$OUT/tests.txt" ] && echo "tests ended: $(cut -d' ' -f1 "$OUT/tests.txt" | sort | uniq -c | xargs)" \
        >> "$OUT/summary.txt"
      echo "tests rc=$rc" >> "$OUT/summary.txt" ;;
    layer_bench)
      timeout $((t - 10)) python3 benchmarks/bench_layer.py --out "$OUT/layer.json" \
        > "$OUT/layer_bench.log" 2>&1
      echo "layer_bench rc=$?" >> "$OUT/summary.txt" ;;
    one_gpu)
      # EPMOE_ONE_GPU_BASE=DIR: the same cases in that checkout too, after this tree's (before /
      # after on one machine; each gets half the time, the base's figures in one_gpu_base.json)
      trees=(.); [ -n "${EPMOE_ONE_GPU_BASE:-}" ] && trees+=("$EPMOE_ONE_GPU_BASE") && t=$((t / 2))
      for tree in "${trees[@]}"; do
        name=one_gpu; [ "$tree" = . ] || name=one_gpu_base
        (cd "$tree" && PYTHONPATH="$PWD${PYTHONPATH#"$OLDPWD"}" timeout $((t - 10)) \
          python3 benchmarks/bench_one_gpu.py --out "$OUT/$name.json" --budget-s $((t - 40)) \
          ${EPMOE_ONE_GPU_ARGS:-} > "$OUT/$name.log" 2>&1)
        echo "$name ($tree) rc=$?" >> "$OUT/summary.txt"
      done ;;
    hf_bench)
      timeout $((t - 10)) python3 benchmarks/bench_hf.py --out "$OUT/hf.json" \
        --budget-s $((t - 40)) ${EPMOE_HF_ARGS:-} > "$OUT/hf_bench.log" 2>&1
      echo "hf_bench rc=$?" >> "$OUT/summary.txt" ;;
    bench)
      timeout $((t - 10)) python3 -m pytest benchmarks -q -p no:cacheprovider --benchmark-enable \
        --benchmark-json "$OUT/bench.json" ${EPMOE_BENCH_K:+-k "$EPMOE_BENCH_K"} \
        > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" >> "$OUT/summary.txt" ;;
    deepep_bench)
      timeout $((t - 10)) python3 benchmarks/bench_deepep.py --out "$OUT/deepep.json" \
        > "$OUT/deepep_bench.log" 2>&1
      echo "deepep_bench rc=$?" >> "$OUT/summary.txt" ;;
    demo)
      timeout $((t - 10)) python3 -m epmoe demo ${EPMOE_DEMO_ARGS:-} > "$OUT/demo.log" 2>&1
      echo "demo rc=$?" >> "$OUT/summary.txt" ;;
    gemv_sweep)
      timeout $((t - 10)) python3 scripts/gemv_sweep.py --out "$OUT/gemv_sweep.jsonl" \
        --budget-s $((t - 60)) ${EPMOE_GEMV_ARGS:-} > "$OUT/gemv_sweep.log" 2>&1
      echo "gemv_sweep rc=$?" >> "$OUT/summary.txt" ;;
    sweep)
      timeout $((t - 10)) python3 scripts/stage_sweep.py --out "$OUT/sweep.jsonl" \
        --budget-s $((t - 60)) ${EPMOE_SWEEP_ONLY:+--only "$EPMOE_SWEEP_ONLY"} ${EPMOE_SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
      echo "sweep rc=$?" >> "$OUT/summary.txt" ;;
    host)
      timeout $((t - 10)) python3 scripts/host_python.py --device cuda \
        ${EPMOE_HOST_BASE:+--against "$EPMOE_HOST_BASE"} ${EPMOE_HOST_ARGS:-} > "$OUT/host.log" 2>&1
      echo "host rc=$?" >> "$OUT/summary.txt" ;;
    tune)
      timeout $((t - 10)) python3 scripts/tune_gemm.py --budget-s $((t - 30)) ${EPMOE_TUNE_ARGS:---paths --resume} \
        > "$OUT/tune.log" 2>&1
      echo "tune rc=$?" >> "$OUT/summary.txt"
      mkdir -p "$OUT/tuned" && cp epmoe/ops/gemm/tuned/*.json "$OUT/tuned/" 2>/dev/null ;;
    cli_bench)
      timeout $((t - 10)) python3 -m epmoe bench --out-dir "$OUT/cli_bench" \
        ${EPMOE_CLI_BENCH_ARGS:-} > "$OUT/cli_bench.log" 2>&1
      echo "cli_bench rc=$?" >> "$OUT/summary.txt" ;;
  esac
done
cat "$OUT/summary.txt" 2>/dev/null
tail -5 "$OUT"/*.log 2>/dev/null
# The device tool returns at most 8 files from $OUT: pack everything but the summary into one.
if [ "${EPMOE_PACK:-1}" = 1 ]; then
  (cd "$OUT" && find . -type f ! -name summary.txt ! -name out.tgz ! -name .packed | sort > .packed \
     && tar czf out.tgz -T .packed && xargs rm -f < .packed && rm -f .packed \
     && find . -mindepth 1 -type d -empty -delete)
fi
