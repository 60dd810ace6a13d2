# Waits up to $1 seconds for the jobs, then copies the logs to $OUT.
end=$((SECONDS + $1))
while [ ! -e /root/logs/done ] && [ $SECONDS -lt $end ]; do sleep 5; done
cp /root/logs/*.log /root/logs/*.txt $OUT/ 2>/dev/null; ls -la /root/logs; tail -n 5 /root/logs/*.log
