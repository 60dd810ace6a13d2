"""`python -m services.worker [--flags]`: one engine behind WorkerService, registered with the scheduler."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

from services.common import config
from services.common.grpcutil import bracket_ipv6
from services.common.log import get_logger, kv, setup_logging
from services.common.ports import is_wildcard_host
from services.common.server import StopSignal, announce_port, serve_until_signal, start_server
from services.worker.config import WorkerConfig
from services.worker.factory import build_worker
from services.worker.registration import Registrar
from services.worker.server import add_servicer

# The exit status of a worker whose SGLang subprocess failed (not 2: the config was fine).
EXIT_SGLANG_FAILED = 3


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (children first level by level), from /proc: psutil is not a
    worker dependency, and this runs inside a signal handler."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) >= 2:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class EarlyStop:
    """SIGINT / SIGTERM before StopSignal exists (while the engine builds): recorded, then their
    previous action (SIGINT's KeyboardInterrupt, SIGTERM's default exit), so a signal while a model
    loads still ends the process at once. The record is what the SIGQUIT handler asks: a Ctrl-C
    reaches SGLang's children too, and their watchdog's SIGQUIT must read as the stop, not as a
    failure, even before the engine is built. Main thread only (signal.signal's rule).

    The handler only assigns a bool (no lock: see StopSignal)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            # Ignored before us (a shell starts a background job with SIGINT ignored): the signal
            # stops nothing, so it must not be recorded, or a later SGLang SIGQUIT reads as the stop.
            return
        self.requested = True
        if callable(previous):
            previous(signum, frame)  # SIGINT: Python's default raises KeyboardInterrupt
        else:
            signal.signal(signum, signal.SIG_DFL)  # SIGTERM's default action: end the process now
            os.kill(os.getpid(), signum)


def install_sglang_failure_handler(log: logging.Logger | None = None,
                                   stopping: Callable[[], bool] | None = None,
                                   on_failure: Callable[[], object] | None = None) -> None:
    """SGLang's subprocesses (scheduler, detokenizer, its watchdog) signal a failure by sending
    SIGQUIT to this process (managers/scheduler.py:6361-6370, utils/watchdog.py:211-222), but
    SGLang 0.5.23 installs its SIGQUIT handler only when the Engine is built on the main thread
    (entrypoints/engine.py:1968-1993), and the worker builds it on its sglang-loop thread. SIGQUIT's
    default action then killed the worker with a core dump and no log line, its SGLang children
    left running. Installed on the main thread before the engine is built: it logs, kills the
    process tree and exits with EXIT_SGLANG_FAILED (the orchestrator restarts the worker; the
    scheduler notices the closed streams and missed heartbeats).

    `stopping`: whether the worker's stop was requested (StopSignal.requested). A Ctrl-C or a
    cgroup-wide SIGTERM reaches SGLang's children too; they exit non-zero and SGLang's watchdog
    SIGQUITs the worker while it drains. That is the stop, not a failure: the handler leaves it to
    the stop path (drain, on_stop, exit 0) instead of exiting 3. It must answer from the start
    (EarlyStop before the engine is built, StopSignal after): a Ctrl-C during a model load exited 3.

    `on_failure`: runs before the exit 3, best effort. main passes FailureNotifier.fire, which runs
    Registrar.drain_now (one draining heartbeat with a short deadline, so the scheduler stops
    placing chunks here before it times us out) on the notifier's own thread and waits for it for
    at most 1 s."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sglang_failure_handler: signal handlers can only be set on the main thread")
    logger = log or logging.getLogger("services.worker")

    def on_sigquit(signum: int, frame: FrameType | None) -> None:
        if stopping is not None and stopping():
            logger.info("SIGQUIT from an SGLang subprocess while the worker stops (the stop signal reached it "
                        "too); leaving it to the stop path")
            return
        try:
            logger.error("SGLang subprocess failed (SIGQUIT from a child); killing the process tree and exiting",
                         extra=kv(exit_code=EXIT_SGLANG_FAILED))
            if on_failure is not None:
                try:
                    on_failure()
                except Exception:  # best effort: the exit must happen
                    logger.exception("telling the scheduler before the exit failed")
            for child in reversed(_descendants(os.getpid())):  # the deepest first: none respawns
                with contextlib.suppress(OSError):  # exited meanwhile
                    os.kill(child, signal.SIGKILL)
        finally:
            # os._exit: no atexit or thread joins that could hang behind a dead engine.
            os._exit(EXIT_SGLANG_FAILED)

    signal.signal(signal.SIGQUIT, on_sigquit)


class FailureNotifier:
    """Runs `notify` once, on its own thread, when a signal handler asks (fire), and lets the
    handler wait for it for a bounded time.

    The thread is started up front, not in the handler: Thread.start takes threading's
    non-reentrant _active_limbo_lock, and a SIGQUIT that landed while the main thread was inside a
    Thread.start (holding it) deadlocked the handler, so the worker never exited. fire() only
    writes a byte to a pipe (no Python lock) and polls a bool (an Event's wait takes its lock too)."""

    _POLL_S = 0.02

    def __init__(self, notify: Callable[[], object], name: str = "failure-notice") -> None:
        self._notify = notify
        # Set when `notify` ran (returned or raised), not when the thread ends: close() ends an
        # unfired thread too, and that must not read as a delivered notice.
        self._notified = False
        # Set by close() before the write end is closed: fire() must not write to an fd number
        # the process may since have reused for another file.
        self._closed = False
        self._read_fd, self._write_fd = os.pipe()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not os.read(self._read_fd, 1):
                return  # the write end closed: never fired
        except OSError:  # the read end closed under us: never fired
            return
        try:
            self._notify()
        except Exception:  # best effort: the handler exits anyway
            logging.getLogger("services.worker").exception("telling the scheduler before the exit failed")
        finally:
            self._notified = True

    def close(self) -> None:
        """Ends the thread if it never fired (its read sees the write end closed) and frees the pipe.
        A fire() after it returns False without writing."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._write_fd)
        self._thread.join(1.0)
        with contextlib.suppress(OSError):
            os.close(self._read_fd)

    def fire(self, timeout: float = 1.0) -> bool:
        """Signal-safe. Whether `notify` ran within `timeout` seconds; False at once after close()."""
        if self._closed:
            return False
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"!")
        deadline = time.monotonic() + timeout
        while not self._notified and time.monotonic() < deadline:
            time.sleep(self._POLL_S)
        return self._notified


def advertised_address(host: str, port: int, advertise_address: str = "", hostname: str | None = None) -> str:
    """The host:port the scheduler dials for this worker: `advertise_address` when set, else the
    bind `host` with the bound `port`, the machine's `hostname` (socket.gethostname()) for a
    wildcard host (services.common.ports.is_wildcard_host, or "": no other host can dial those, so
    the address names the machine; advertised as given, "[::]:port", the scheduler dialled its own
    machine); an IPv6 literal bracketed."""
    if advertise_address:
        return bracket_ipv6(advertise_address)
    if not host.strip() or is_wildcard_host(host):
        host = hostname if hostname is not None else socket.gethostname()
    return bracket_ipv6(f"{host}:{port}")


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging("worker")
    log = get_logger("services.worker")
    cfg = config.load_or_exit(WorkerConfig, "worker", argv, prog="python -m services.worker")
    sized = cfg.sized_for_batch()
    if sized.max_workers != cfg.max_workers:
        log.info("handler threads raised to hold a RunChunk stream per batch slot",
                 extra=kv(max_batch_size=cfg.max_batch_size, max_workers=sized.max_workers))
        cfg = sized
    worker_id = cfg.worker_id or f"worker-{socket.gethostname()}-{cfg.port or 'auto'}"
    # Set once the StopSignal exists (after the engine is built); `early` answers before it.
    stop: StopSignal | None = None
    registrar: Registrar | None = None
    early = EarlyStop()

    def stopping() -> bool:
        return early.requested or (stop is not None and stop.requested)

    def drain_now() -> None:
        if registrar is not None:  # read when fired: the registrar exists once the server is up
            registrar.drain_now()

    if cfg.engine == "sglang":
        # On the notifier's thread, waited for a bounded time: the SIGQUIT handler runs on the main
        # thread between two bytecodes of whatever it interrupted, which may hold a lock the RPC
        # needs; the exit must not wait on it. Before the subprocesses exist.
        notifier = FailureNotifier(drain_now)
        install_sglang_failure_handler(log, stopping=stopping, on_failure=notifier.fire)
    try:
        worker = build_worker(cfg, worker_id).start()
    except (OSError, ValueError) as e:
        # A missing model directory or a bad engine setting: one line, exit 2, not a traceback.
        log.error("cannot start the engine: %s", e)
        return 2
    except KeyboardInterrupt:
        if not early.requested:
            raise
        log.info("stop requested while the engine was being built: exiting")
        return 0
    # After the engine is built, before the port opens: a signal while the model loads (minutes for
    # a large one) still ends the process at once, as there is nothing to drain yet.
    stop = StopSignal()

    def on_stop() -> None:
        if registrar is not None:
            registrar.stop()
        worker.close()
        shutdown = getattr(worker.engine, "shutdown", None)  # SGLang runs subprocesses
        if callable(shutdown):
            shutdown()

    running = start_server("worker", cfg, add_servicer(worker, cfg.drain_timeout_seconds, cfg.stream_limit()),
                           on_stop=on_stop)
    # A broken engine (every chunk and a canary failed) turns the gRPC health NOT_SERVING, so an
    # orchestrator's liveness probe restarts the process. Meanwhile the scheduler hears it from the
    # registrar's heartbeat (sent at the change): it places nothing on a broken engine, and its
    # failed chunks quarantine a failing one.
    worker.on_engine_health(running.set_serving)
    if not cfg.worker_id and not cfg.port:
        worker.worker_id = f"worker-{socket.gethostname()}-{running.port}"
    announce_port(cfg.port_file or None, running.port)
    advertise = advertised_address(cfg.host, running.port, cfg.advertise_address)
    if cfg.scheduler_address:
        registrar = Registrar(worker, cfg.scheduler_address, advertise, max_streams=cfg.stream_limit()).start()
        # The drain (serve_until_signal -> RunningServer.stop) refuses new chunks: the scheduler
        # hears the worker drains before that (bounded), not after, when a refused chunk makes it
        # drop the worker with all its chunks in flight.
        running.before_stop = registrar.drain_before_stop
    log.info("worker ready", extra=kv(worker_id=worker.worker_id, address=advertise))
    return serve_until_signal(running, stop)


if __name__ == "__main__":
    raise SystemExit(main())
