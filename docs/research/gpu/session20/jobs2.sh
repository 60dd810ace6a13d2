set -x
cd "$(dirname "$0")/../.."
export PYTHONPATH=/root/site:$PWD:$PWD/protos:$PWD/clients/python SEER_MODEL_DIR=/root/model PYTHONUNBUFFERED=1
L=/root/logs
timeout 200 python3 .dev/run/hostcost.py 0.7 docs/research/gpu/T_h100.json cuda 96 > $L/hostcost.log 2>&1
timeout 1000 python3 -m bench.spec --device cuda --prompts 4 --max-tokens 192 --skip-acceptance --skip-index \
  --skip-engine-throughput --suite --suite-repeats 2 --threads 1 > $L/bench_suite.log 2>&1
echo "bench rc $?" >> $L/bench_suite.log
cp /tmp/bench-spec-suite-*/suite/logs/* $L/ 2>/dev/null
touch $L/done
