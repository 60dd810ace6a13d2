# Device-side jobs of session 20 (run under setsid from call 2; logs in /root/logs).
set -x
cd "$(dirname "$0")/../.."
export PYTHONPATH=/root/site:$PWD:$PWD/protos:$PWD/clients/python SEER_MODEL_DIR=/root/model PYTHONUNBUFFERED=1
L=/root/logs
nvidia-smi --query-gpu=name,memory.used --format=csv > $L/gpu.txt 2>&1
# 1. CUDA correctness of the batched tree draws (the GPU default now) + chi-square with its control.
SEER_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_distribution.py > $L/t_spec.log 2>&1
echo "tests rc $?" >> $L/t_spec.log
# 2. Step time with drafts, old (HEAD) vs new engine, alternated.
rm -rf /root/old && mkdir -p /root/old && cp -r services protos clients bench /root/old/ && cp .dev/run/old/engine.py .dev/run/old/verifier.py /root/old/services/worker/engines/reference/
for r in 1 2; do
  for arm in new old; do
    if [ $arm = old ]; then P=/root/site:/root/old:/root/old/protos; else P=$PYTHONPATH; fi
    echo "== $arm run $r" >> $L/step_mix.log
    PYTHONPATH=$P timeout 120 python3 /root/m/tok/step_mix.py cuda /root/model 8 >> $L/step_mix.log 2>&1
    PYTHONPATH=$P timeout 120 python3 /root/m/tok/step_mix.py cuda /root/model 32 >> $L/step_mix.log 2>&1
  done
done
# 3. bench.spec on the GPU: engine throughput and the whole suite, spec vs no spec, T 0.7 and 1.0.
timeout 900 python3 -m bench.spec --device cuda --prompts 4 --max-tokens 192 --skip-acceptance --skip-index \
  --suite --suite-repeats 2 --threads 1 > $L/bench_spec.log 2>&1
echo "bench rc $?" >> $L/bench_spec.log
touch $L/done
