"""`python -m services.worker` as its own process: health, reflection, a chunk, SIGTERM -> exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from seer.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bad_config_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.worker", "--engine", "tpu"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "engine" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "services.worker"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SEER_WORKER_NO_SUCH_KEY": "1"})
    assert proc.returncode == 2 and "SEER_WORKER_NO_SUCH_KEY" in proc.stderr


def test_process_serves_and_stops_gracefully(model_dir: Path, tmp_path: Path,
                                             prompts: list[tuple[int, ...]]) -> None:
    port_file = tmp_path / "port"
    metrics_port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SEER_WORKER_NUM_KV_PAGES": "128"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker", "--port", "0", "--port-file", str(port_file),
         "--model-dir", str(model_dir), "--worker-id", "proc-w", "--speculation", "false", "--grace-seconds", "5",
         "--metrics-port", str(metrics_port)],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "log", "w"), env=env,  # noqa: SIM115
    )
    try:
        deadline = time.monotonic() + 180
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / "log").read_text()[-2000:]
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.2)
        addr = f"127.0.0.1:{port_file.read_text().strip()}"
        with grpc.insecure_channel(addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            st = health.Check(health_pb2.HealthCheckRequest(service="seer.v1.WorkerService"), timeout=10)
            assert st.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            req = worker_pb2.RunChunkRequest(request_id="p1", group_id="g", prompt_token_ids=prompts[3],
                                             max_new_tokens=3, max_tokens=3,
                                             sampling=common_pb2.SamplingParams(temperature=0.0))
            msgs = list(stub.RunChunk(req, timeout=60))
            assert msgs[-1].WhichOneof("event") == "done"
            assert sum(len(m.tokens.token_ids) for m in msgs[:-1]) >= 1
            stats = stub.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(), timeout=10)
            assert stats.worker_id == "proc-w" and stats.total_kv_pages == 128
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        for name in ("seer_worker_in_flight_chunks", "seer_worker_generated_tokens_total",
                     "seer_worker_tokens_per_second", "seer_worker_free_kv_pages",
                     'seer_worker_chunks_total{finish="length"}'):
            assert name in body, name
        generated = [ln for ln in body.splitlines() if ln.startswith("seer_worker_generated_tokens_total")]
        assert float(generated[0].split()[-1]) >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
