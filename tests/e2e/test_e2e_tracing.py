"""OpenTelemetry across the suite: a trainer span's trace continues through the buffer, the
scheduler and the worker (context carried in gRPC metadata); services export to the console
(SEER_TRACING=console) and the trainer side to an in-memory exporter. Health checks are not traced."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import client_interceptor, grpcext
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from seer_client import PromptGroup, Sampling, SeerClient

from services.cli.up import Suite


def console_spans(path: Path) -> list[dict[str, Any]]:
    """Spans a ConsoleSpanExporter printed (pretty JSON objects, one after another)."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    decoder = json.JSONDecoder()
    spans: list[dict[str, Any]] = []
    i = 0
    while True:
        start = text.find("{\n", i)
        if start < 0:
            return spans
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(obj, dict) and "context" in obj:
            spans.append(obj)
        i = end


@pytest.fixture(scope="module")
def traced_suite(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    s = Suite(workers=1, data_dir=tmp_path_factory.mktemp("traced"), model_dir=model_dir, tracing="console",
              policy="seer", chunk_size=8)
    s.start(timeout=300)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    return exp


def services_of(suite: Suite, trace_id: str) -> dict[str, set[str]]:
    """service name -> span names of that trace, from every service's console output."""
    found: dict[str, set[str]] = {}
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for name, s in suite.services.items():
            for span in console_spans(s.stdout_path):
                if span["context"]["trace_id"] == trace_id:
                    found.setdefault(name, set()).add(span["name"])
        if {"buffer", "scheduler", "worker-0"} <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_trace_spans_trainer_buffer_scheduler_worker(traced_suite: Suite, exporter: InMemorySpanExporter) -> None:
    tracer = trace.get_tracer("trainer")
    ch = grpcext.intercept_channel(grpc.insecure_channel(traced_suite.address), client_interceptor())
    with SeerClient(traced_suite.address, channel=ch) as client:
        client.wait_ready()
        batch_id = f"traced-{uuid.uuid4().hex[:8]}"
        group = PromptGroup(prompt="Question: What is 2 plus 3?\nAnswer:", group_size=2, max_tokens=12,
                            prompt_key="t0", sampling=Sampling(temperature=0.0))
        with tracer.start_as_current_span("trainer.rollout") as rollout:
            sub = client.submit_batch(batch_id, [group])
            rollout_trace = f"0x{rollout.get_span_context().trace_id:032x}"
        # Streams through the OTel-intercepted channel come back as plain generators, which the
        # client cannot cancel; read the results on an untraced channel.
        with SeerClient(traced_suite.address) as plain:
            results = plain.collect(batch_id)
        assert len(results) == 2
        with tracer.start_as_current_span("trainer.update_weights") as span:
            update = client.update_weights(sub.policy_version + 1)
            trace_id = f"0x{span.get_span_context().trace_id:032x}"
        assert update.num_workers == 1

    trainer = [s for s in exporter.get_finished_spans() if s.name == "trainer.update_weights"]
    assert trainer, "the trainer span was not recorded"
    # The trainer's UpdateWeights -> buffer -> scheduler SwitchWeights -> worker LoadWeights, one trace.
    found = services_of(traced_suite, trace_id)
    assert any("UpdateWeights" in n for n in found.get("buffer", set())), found
    assert any("SwitchWeights" in n for n in found.get("scheduler", set())), found
    assert any("LoadWeights" in n for n in found.get("worker-0", set())), found

    # The rollout's trace goes on past SubmitBatch: the buffer hands the trainer's context on with
    # every work item (WorkItem.trace_context), so the scheduler's dispatches of this batch and the
    # worker's RunChunk calls they make belong to the trainer's trace.
    rollout_found = services_of(traced_suite, rollout_trace)
    assert any("SubmitBatch" in n for n in rollout_found.get("buffer", set())), rollout_found
    assert "scheduler.dispatch" in rollout_found.get("scheduler", set()), rollout_found
    assert any("RunChunk" in n for n in rollout_found.get("worker-0", set())), rollout_found

    # Every chunk dispatch is a scheduler span whose trace continues into the worker's RunChunk.
    sched = [s for s in console_spans(traced_suite.services["scheduler"].stdout_path)
             if s["name"] == "scheduler.dispatch"]
    assert sched, "no dispatch spans"
    worker_traces = {s["context"]["trace_id"] for s in console_spans(traced_suite.services["worker-0"].stdout_path)
                     if "RunChunk" in s["name"]}
    assert {s["context"]["trace_id"] for s in sched} & worker_traces
    # Health checks are excluded from traces.
    for s in traced_suite.services.values():
        assert not any("grpc.health" in sp["name"] for sp in console_spans(s.stdout_path))
