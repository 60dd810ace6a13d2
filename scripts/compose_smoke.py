"""Compose smoke test: the docker-compose stack, end to end, through the public API from the host.

1. Bad config fails at start: a container with an unknown SEER_* variable, and a worker whose model
   directory does not exist, must exit non-zero with a message naming the variable / path.
2. `docker-compose up -d` (health-gated: every service waits for its dependencies' gRPC health).
3. A rollout with the Python client (seer_client) from the host; every response is checked (counts,
   ids, token/logprob shapes, finish reasons, policy version, labels, text); the result stream is
   resumed from a cursor; bad input gets INVALID_ARGUMENT naming the field.
4. The Node.js example (clients/node) runs the same kind of batch from a second language.
5. The buffer is restarted; the finished batch is still there (RocksDB on a named volume).
6. `docker-compose down -v`, always (logs of every service are printed first on failure).

Usage: python scripts/compose_smoke.py [--tag dev] [--keep] [--skip-node]. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "clients" / "python")]

from seer_client import PromptGroup, RolloutResult, Sampling, SeerClient, SeerError  # noqa: E402

SERVICES = ("buffer", "scheduler", "draft", "kvstore", "worker1", "worker2")
PROJECT = "seer-smoke"


class SmokeFailure(AssertionError):
    pass


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise SmokeFailure(msg)


def sh(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600, check_rc: bool = True,
       cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check_rc and proc.returncode != 0:
        raise SmokeFailure(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    def __init__(self, tag: str, port: int) -> None:
        self.tag = tag
        self.port = port
        self.env = {**os.environ, "SEER_IMAGE_TAG": tag, "SEER_BUFFER_HOST_PORT": str(port),
                    "COMPOSE_PROJECT_NAME": PROJECT}
        self.base = ["docker-compose", "-f", str(REPO / "docker-compose.yml"), "-p", PROJECT]

    def compose(self, *args: str, timeout: float = 600, check_rc: bool = True) -> subprocess.CompletedProcess[str]:
        return sh([*self.base, *args], env=self.env, timeout=timeout, check_rc=check_rc)

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        check(bool(cid), f"{service}: no container")
        return cid

    def health(self, service: str) -> str:
        cid = self.container(service)
        return sh(["docker", "inspect", "-f", "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}",
                   cid]).stdout.strip()

    def wait_healthy(self, services: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = {s: self.health(s) for s in services}
            if all(v == "running/healthy" for v in states.values()):
                return
            dead = {s: v for s, v in states.items() if not v.startswith("running")}
            check(not dead, f"containers stopped: {dead}")
            time.sleep(2)
        raise SmokeFailure(f"not healthy after {timeout}s: {states}")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=60, check_rc=False).stdout


def check_bad_config(tag: str) -> dict[str, float]:
    """Wrong values fail at start, naming themselves (not at the first rollout)."""
    out: dict[str, float] = {}
    cases = [
        ("buffer", ["-e", "SEER_BUFFER_CHUNK_SIZEE=5"], "SEER_BUFFER_CHUNK_SIZEE"),
        ("worker", ["-e", "SEER_WORKER_MODEL_DIR=/models/missing"], "/models/missing"),
    ]
    for service, args, needle in cases:
        t = time.monotonic()
        proc = sh(["docker", "run", "--rm", *args, f"seer-{service}:{tag}"], timeout=120, check_rc=False)
        text = proc.stdout + proc.stderr
        check(proc.returncode != 0, f"{service} with {args[1]} started (exit 0); it must refuse")
        check(needle in text,
              f"{service} with {args[1]}: exit {proc.returncode} without naming {needle!r}:\n{text[-2000:]}")
        out[f"bad_config_{service}_s"] = round(time.monotonic() - t, 1)
        print(f"bad config refused: {service} {args[1]} -> exit {proc.returncode}", flush=True)
    return out


def smoke_groups() -> list[PromptGroup]:
    return [
        PromptGroup(prompt="The three primary colors are", group_size=3, max_tokens=24, prompt_key="smoke-colors",
                    sampling=Sampling(temperature=0.8, top_p=0.95, seed=7), labels={"answer": "red"}),
        PromptGroup(prompt="Count from one to ten: one, two,", group_size=2, max_tokens=32, prompt_key="smoke-count",
                    sampling=Sampling(temperature=0.0), labels={"answer": "ten"}),
        PromptGroup(prompt=[504, 3575, 282, 4649, 314], group_size=3, max_tokens=16, prompt_key="smoke-ids",
                    sampling=Sampling(temperature=1.0, top_k=50, seed=11)),
    ]


def check_results(groups: Sequence[PromptGroup], results: Sequence[RolloutResult], version: int) -> None:
    expected = {(gi, si) for gi, g in enumerate(groups) for si in range(g.group_size)}
    got = [(r.group_index, r.sample_index) for r in results]
    check(len(results) == len(expected), f"{len(results)} results for {len(expected)} requests")
    check(set(got) == expected and len(set(got)) == len(got), f"(group, sample) pairs: {sorted(got)}")
    check(len({r.request_id for r in results}) == len(results), "duplicate request ids")
    check([r.cursor for r in results] == list(range(1, len(results) + 1)), "cursors are not 1..N in order")
    for r in results:
        g = groups[r.group_index]
        where = f"result {r.request_id}"
        check(0 < len(r.token_ids) <= g.max_tokens, f"{where}: {len(r.token_ids)} tokens (max {g.max_tokens})")
        check(len(r.logprobs) == len(r.token_ids), f"{where}: {len(r.logprobs)} logprobs for {len(r.token_ids)} tokens")
        check(all(lp <= 1e-4 for lp in r.logprobs), f"{where}: a logprob > 0")
        check(all(0 <= t < 49152 for t in r.token_ids), f"{where}: token id outside the vocabulary")
        check(r.finish_reason in ("stop", "length"), f"{where}: finish_reason {r.finish_reason}")
        if r.finish_reason == "length":
            check(len(r.token_ids) == g.max_tokens, f"{where}: length finish at {len(r.token_ids)} tokens")
        check(r.policy_version == version, f"{where}: policy_version {r.policy_version} != {version}")
        check(r.labels == dict(g.labels), f"{where}: labels {r.labels} != {dict(g.labels)}")
        check(r.num_chunks >= 1, f"{where}: num_chunks {r.num_chunks}")
        check(bool(r.text), f"{where}: no detokenized text")


def python_rollout(address: str) -> dict[str, Any]:
    groups = smoke_groups()
    batch_id = f"smoke-py-{int(time.time())}"
    with SeerClient(address, retry_seconds=60, timeout=60) as client:
        client.wait_ready(60)
        t = time.monotonic()
        sub = client.submit_batch(batch_id, groups)
        check(sub.num_requests == sum(g.group_size for g in groups), f"num_requests {sub.num_requests}")
        check(not sub.already_submitted, "a new batch reported already_submitted")
        check(client.submit_batch(batch_id, groups).already_submitted, "resubmission not idempotent")
        results: list[RolloutResult] = []
        first = None
        for r in client.iter_results(batch_id):
            first = first if first is not None else time.monotonic() - t
            results.append(r)
            print(f"  python result {r.cursor}: group {r.group_index} sample {r.sample_index} "
                  f"{len(r.token_ids)} tokens {r.finish_reason} chunks {r.num_chunks} {r.text[:50]!r}", flush=True)
        seconds = time.monotonic() - t
        check_results(groups, results, sub.policy_version)
        status = client.get_batch(batch_id, include_requests=True)
        check(status.state == "completed", f"GetBatch state {status.state}")
        check(status.num_finished == len(results), f"GetBatch num_finished {status.num_finished}")
        check(status.generated_tokens == sum(len(r.token_ids) for r in results), "GetBatch generated_tokens")
        # Resuming from a cursor returns exactly the rest, identically.
        k = len(results) // 2
        rest = client.collect(batch_id, cursor=k)
        check([(r.request_id, r.token_ids) for r in rest] == [(r.request_id, r.token_ids) for r in results[k:]],
              "StreamResults from a cursor differs from the first stream")
        try:
            bad = PromptGroup(prompt="x", group_size=0, max_tokens=8)
            client.submit_batch(f"{batch_id}-bad", [groups[0], bad])
            raise SmokeFailure("group_size 0 was accepted")
        except SeerError as e:
            check("INVALID_ARGUMENT" in str(e) and "group_size" in str(e), f"bad input: {e}")
    tokens = sum(len(r.token_ids) for r in results)
    # Engine statistics summed over responses: shows speculation and the KV pool at work (not checked:
    # how much of either happens depends on timing).
    stats = {k: round(sum(float(r.stats.get(k, 0)) for r in results), 2)
             for k in ("prefill_tokens", "cached_tokens", "kv_loaded_tokens", "draft_tokens", "accepted_tokens",
                       "steps")}
    return {"batch_id": batch_id, "responses": len(results), "tokens": tokens, "seconds": round(seconds, 2),
            "first_result_s": round(first or 0.0, 2), "tokens_per_s": round(tokens / seconds, 1), "stats": stats}


def node_rollout(port: int) -> dict[str, Any]:
    node_dir = REPO / "clients" / "node"
    check(shutil.which("node") is not None and shutil.which("npm") is not None, "node/npm not installed")
    if not (node_dir / "node_modules" / "@grpc" / "grpc-js").is_dir():
        sh(["npm", "ci", "--no-audit", "--no-fund"], cwd=node_dir, timeout=300)
    proc = sh(["node", "rollout.js", "--address", f"127.0.0.1:{port}", "--groups", "2", "--group-size", "2",
               "--max-tokens", "16"], cwd=node_dir, timeout=600, check_rc=False)
    print("\n".join("  node " + line for line in proc.stdout.splitlines()), flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    check(proc.returncode == 0 and bool(lines), f"node client failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    check(bool(summary.get("ok")), f"node client reported problems: {summary}")
    return summary


def restart_buffer(stack: Stack, address: str, batch_id: str, responses: int) -> float:
    t = time.monotonic()
    stack.compose("restart", "buffer", timeout=120)
    stack.wait_healthy(["buffer"], timeout=120)
    with SeerClient(address, retry_seconds=60) as client:
        status = client.get_batch(batch_id)
        check(status.state == "completed" and status.num_finished == responses,
              f"after a buffer restart: {status.state}, {status.num_finished} finished")
        check(len(client.collect(batch_id)) == responses, "results lost across a buffer restart")
    return time.monotonic() - t


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=os.environ.get("SEER_IMAGE_TAG", "dev"))
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    parser.add_argument("--skip-node", action="store_true")
    parser.add_argument("--up-timeout", type=float, default=420.0)
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    summary: dict[str, Any] = {"ok": False}
    for svc in ("buffer", "scheduler", "draft", "kvstore", "worker"):
        proc = sh(["docker", "image", "inspect", f"seer-{svc}:{args.tag}"], check_rc=False, timeout=60)
        if proc.returncode != 0:
            print(f"image seer-{svc}:{args.tag} missing: run `make images` first", file=sys.stderr)
            print("RESULT " + json.dumps(summary))
            return 2
    port = free_port()
    stack = Stack(args.tag, port)
    address = f"127.0.0.1:{port}"
    stack.compose("down", "-v", "--remove-orphans", timeout=180, check_rc=False)  # leftovers of a killed run
    try:
        summary.update(check_bad_config(args.tag))
        t = time.monotonic()
        stack.compose("up", "-d", timeout=args.up_timeout)
        stack.wait_healthy(SERVICES, timeout=args.up_timeout)
        summary["up_s"] = round(time.monotonic() - t, 1)
        print(f"stack healthy in {summary['up_s']}s", flush=True)
        summary["python"] = python_rollout(address)
        if not args.skip_node:
            summary["node"] = node_rollout(port)
        summary["restart_s"] = round(restart_buffer(stack, address, summary["python"]["batch_id"],
                                                    summary["python"]["responses"]), 1)
        summary["ok"] = True
    except (SmokeFailure, SeerError, subprocess.TimeoutExpired) as e:
        print(f"SMOKE FAILED: {e}", file=sys.stderr)
        print(stack.logs(), file=sys.stderr)
        summary["error"] = str(e)[:500]
    finally:
        if not args.keep:
            stack.compose("down", "-v", "--remove-orphans", timeout=180, check_rc=False)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    print("RESULT " + json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
