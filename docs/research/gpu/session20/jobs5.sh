set -x
cd "$(dirname "$0")/../.."
export PYTHONPATH=/root/site:$PWD:$PWD/protos:$PWD/clients/python SEER_MODEL_DIR=/root/model PYTHONUNBUFFERED=1
L=/root/logs
rm -rf /root/old && mkdir -p /root/old && cp -r services protos clients bench /root/old/ && cp .dev/run/old/*.py /root/old/services/worker/engines/reference/
SEER_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine > $L/t_engine.log 2>&1
echo "tests rc $?" >> $L/t_engine.log
timeout 100 python3 .dev/run/prof_step.py /root/model 32 > $L/prof32_rms.log 2>&1
for arm in new old new old; do
  if [ $arm = old ]; then P=/root/site:/root/old:/root/old/protos; else P=$PYTHONPATH; fi
  PYTHONPATH=$P timeout 60 python3 .dev/run/steptime.py /root/model 32 $arm >> $L/steptime_rms.log 2>&1
done
touch $L/done
