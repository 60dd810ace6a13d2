set -x
cd "$(dirname "$0")/../.."
export PYTHONPATH=/root/site:$PWD:$PWD/protos:$PWD/clients/python SEER_MODEL_DIR=/root/model PYTHONUNBUFFERED=1
L=/root/logs
rm -rf /root/old && mkdir -p /root/old && cp -r services protos clients bench /root/old/ && cp .dev/run/old/*.py /root/old/services/worker/engines/reference/
SEER_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine > $L/t_engine.log 2>&1
echo "tests rc $?" >> $L/t_engine.log
for r in 1 2; do for arm in new old; do for B in 8 32; do
  if [ $arm = old ]; then P=/root/site:/root/old:/root/old/protos; else P=$PYTHONPATH; fi
  PYTHONPATH=$P timeout 120 python3 .dev/run/steptime.py /root/model $B $arm >> $L/steptime.log 2>&1
done; done; done
timeout 120 python3 .dev/run/prof_step.py /root/model 32 > $L/prof32_new.log 2>&1
timeout 600 python3 -m bench.spec --device cuda --prompts 4 --max-tokens 192 --skip-acceptance --skip-index \
  --suite --suite-repeats 2 --threads 1 --repeats 3 > $L/bench_spec.log 2>&1
echo "bench rc $?" >> $L/bench_spec.log
touch $L/done
