#!/usr/bin/env bash
# The GPU checks (docs/results.md: bench_gpu_overlap, gpu_memory, gpu_offload, gpu_eager_ops), in one command for a lent GPU machine (its python3 has a CUDA
# torch; lynx's other dependencies are there except highspy, carried as a wheel in .whl/):
#
#   bash benchmarks/gpu_session.sh OUTDIR [steps...]     steps: env tests overlap memory profile nccl pipeline eager offload fp8 netns
#
# Each step has its own time limit and writes its log to OUTDIR; a failing step does not stop the others.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUTDIR [steps...]}
shift
steps=${*:-env tests overlap memory profile nccl pipeline eager offload fp8}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
lynx() { python3 -m lynx "$@"; }

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  case " $steps " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  timeout "$limit" bash -c "$*" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  echo "=== $name: rc $rc, $((SECONDS - t0)) s"
}

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.nccl.version())'
  nproc; uptime
}

profile_vs_model() {  # a GPT and a LLaMA layer on the GPU against the analytic model of the H100 preset
  local db="$out/profiles.sqlite"
  lynx profile --model gpt-1.3b --micro-batch 4 --seq-len 2048 --dtype bf16 --device cuda --repeats 20 --db "$db"
  lynx profile calibrate 1 --db "$db" --hardware h100-80g-nvlink --no-save
  lynx profile --model llama3-8b --micro-batch 1 --seq-len 4096 --dtype bf16 --device cuda --repeats 20 --db "$db"
  lynx profile calibrate 2 --db "$db" --hardware h100-80g-nvlink --no-save
  lynx profile calibrate 1 --db "$db" --hardware h100-80g-nvlink --no-save --json >"$out/calibrate-gpt.json"
  lynx profile calibrate 2 --db "$db" --hardware h100-80g-nvlink --no-save --json >"$out/calibrate-llama.json"
}

nccl_probe() {  # can two processes share one GPU over NCCL? (NCCL >= 2.5 refuses: "Duplicate GPU detected")
  cat >/tmp/nccl_probe.py <<'EOF'
import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
def w(r, port):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    x = torch.ones(4, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
    print("rank", r, "all_reduce ok", x.tolist()); dist.destroy_process_group()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
try:
    mp.spawn(w, args=(port,), nprocs=2, join=True)
except Exception as e:
    print("NCCL with two ranks on one GPU failed:", str(e).strip().splitlines()[-1][:300])
EOF
  NCCL_DEBUG=WARN python3 /tmp/nccl_probe.py 2>&1 | grep -E "Duplicate|failed|ok" | head -5
}

pipeline_cpu() {  # the pipeline runtime's CPU tests under this machine's torch (its private API use is pinned)
  python3 -m pytest -q -n 8 -p no:cacheprovider tests/unit/test_runtime_torch_pipelining.py \
    tests/unit/test_schedule_torch.py tests/integration/test_runtime_pipeline.py
}

netns_probe() {  # can the namespace testbed run here (ip netns, veth, tc tbf)?
  python3 -c 'from tests.harness.testbed import unavailable; print("testbed:", unavailable() or "available")'
  which ip tc
}

export -f netns_probe env_info profile_vs_model nccl_probe pipeline_cpu lynx
export out
step env 60 env_info
step tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_runtime_gpu.py \
  tests/integration/test_runtime_pipeline_gpu.py tests/integration/test_runtime_offload.py
step overlap 120 python3 benchmarks/bench_gpu_overlap.py
step memory 180 python3 benchmarks/gpu_memory.py --out "$out/gpu_memory.json"
step profile 240 profile_vs_model
step nccl 90 nccl_probe
step pipeline 420 pipeline_cpu
step netns 60 netns_probe
step eager 300 python3 benchmarks/gpu_eager_ops.py --out "$out/gpu_eager_ops.json"
step offload 300 python3 benchmarks/gpu_offload.py --out "$out/gpu_offload.json"
# FP8 (issue 33): FP8 GEMM rates by shape vs lynx, TE saved bytes and the allocator after an FP8 forward (skips
# cleanly without an FP8 GPU or without transformer_engine)
step fp8 240 python3 benchmarks/gpu_fp8.py --out "$out/gpu_fp8.json"
