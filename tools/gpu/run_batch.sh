#!/usr/bin/env bash
# One batched call on a lent GPU machine: install the carried light wheels, then run every
# package's GPU script, each bounded in time, writing its stdout/stderr to $OUT/<name>.log.
# Usage (on the device machine, repo root): bash tools/gpu/run_batch.sh gpu_wheels
set -u
wheels="${1:-gpu_wheels}"
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash tools/gpu/prepare.sh "$wheels" > "$out/setup.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$out/setup.log" 2>&1
src=$(ls -d packages/*/src | paste -sd: -)
run() {  # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "== $name: $*" > "$out/$name.log"
    local start=$(date +%s)
    PYTHONPATH="$src" timeout "$secs" "$@" >> "$out/$name.log" 2>&1
    echo "== exit $? after $(( $(date +%s) - start )) s" >> "$out/$name.log"
}
for job in ${GPU_JOBS:-models fsdp lora_tp lora_ipc quant grpo}; do
    case $job in
        models)  run models 150 python3 packages/models/benchmarks/gpu_strict_parity.py ;;
        fsdp)    run fsdp 200 python3 packages/fsdp-mesh/benchmarks/gpu_parity.py ;;
        lora_tp) run lora_tp 120 python3 packages/lora-core/benchmarks/gpu_tp_parity.py ;;
        lora_ipc) run lora_ipc 90 python3 packages/lora-core/benchmarks/gpu_ipc_repack.py ;;
        quant)   run quant 150 python3 packages/quant-convert/benchmarks/gpu_nvfp4_throughput.py ;;
        grpo)    run grpo 600 python3 packages/grpo/benchmarks/gpu_train_step.py ;;
    esac
done
tail -n 3 "$out"/*.log
