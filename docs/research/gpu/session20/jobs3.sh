set -x
cd "$(dirname "$0")/../.."
export PYTHONPATH=/root/site:$PWD:$PWD/protos:$PWD/clients/python SEER_MODEL_DIR=/root/model PYTHONUNBUFFERED=1
L=/root/logs
rm -rf /root/old && mkdir -p /root/old && cp -r services protos clients bench .dev /root/old/ && cp .dev/run/old/engine.py .dev/run/old/verifier.py /root/old/services/worker/engines/reference/
for r in 1 2; do for arm in new old; do
  if [ $arm = old ]; then P=/root/site:/root/old:/root/old/protos; else P=$PYTHONPATH; fi
  echo "== $arm run $r" >> $L/hostcost_ab.log
  PYTHONPATH=$P timeout 150 python3 .dev/run/hostcost.py 0.7 docs/research/gpu/T_h100.json cuda 96 >> $L/hostcost_ab.log 2>&1
done; done
SEER_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine > $L/t_engine.log 2>&1
echo "tests rc $?" >> $L/t_engine.log
touch $L/done
