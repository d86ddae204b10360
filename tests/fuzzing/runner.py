"""The parent side: worker processes, per-case timeouts, crash recovery, counts, minimising, corpus.

Case ``i`` of run ``seed`` is generated from ``random.Random(f"fuzz:{seed}:{i}")`` in the worker, so
a run is deterministic for its seed whatever the number of workers, and any case can be replayed
alone. A worker that dies (a signal) or overruns the per-case timeout is replaced; the case is
recorded as a crash or a hang.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["FuzzConfig", "FuzzReport", "Worker", "run_fuzz", "TESTS_DIR"]

TESTS_DIR = Path(__file__).resolve().parent.parent
_MUST_NOT_HAPPEN = "FAILURE"


@attrs.frozen
class FuzzConfig:
    cases: int = 5000
    seed: int = 0
    jobs: int = 1
    #: Seconds one case may take (a mutated C source is compiled at load; the seeds are compiled
    #: before the first case).
    timeout: float = 15.0
    #: Where minimised failing cases are written (``None``: not written).
    corpus: Path | None = None
    minimise: bool = True
    #: At most this many distinct failures are minimised.
    minimise_limit: int = 40
    cache_dir: Path | None = None
    verbose: bool = False


@attrs.define
class FuzzReport:
    counts: collections.Counter = attrs.field(factory=collections.Counter)
    #: Failure signature -> (first case, its result), in order of discovery.
    failures: dict[str, tuple[dict[str, Any], dict[str, Any]]] = attrs.field(factory=dict)
    failure_count: int = 0
    native_trust: int = 0
    #: The first native-trust cases (case, result), to show what the rule let through.
    native_examples: list[tuple[dict[str, Any], dict[str, Any]]] = attrs.field(factory=list)
    seconds: float = 0.0
    written: list[str] = attrs.field(factory=list)

    def summary(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        lines = [f"{sum(self.counts.values())} cases in {self.seconds:.0f}s: {counts}"]
        for case, result in self.native_examples:
            lines.append(f"  native-trust {result['kind'] or result['error_type']}: {result['message'][:100]!r} "
                         f"[{'; '.join(_short(m) for m in case.get('muts', []))[:200]}]")
        for sig, (case, result) in self.failures.items():
            muts = "; ".join(_short(m) for m in case.get("muts", []))
            lines.append(f"  FAILURE {result['kind']}: {result['error_type']} at {result['where'] or '?'}: "
                         f"{result['message'][:160]!r} [seed {case.get('seed')} {case.get('form')}: {muts}]")
        return "\n".join(lines)


def _short(m: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in m.items() if k != "op"}, ensure_ascii=True)
    return f"{m['op']} {text[:140]}"


class _Hang(Exception):
    """The worker did not answer within the per-case timeout."""


class Worker:
    """One worker process and its pipe; ``run`` survives the worker crashing or hanging."""

    def __init__(self, config: FuzzConfig, cache_dir: Path):
        self.config, self.cache_dir = config, cache_dir
        # Cases write their bundles here (on a RAM file system when there is one); the parent
        # owns it, so what a killed worker leaves behind is removed by stop().
        shm = Path("/dev/shm")
        ram = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        self.workdir = Path(tempfile.mkdtemp(prefix="fuzz-worker-", dir=ram))
        self.process: Any = None
        self.conn: Any = None
        #: The last case this worker finished: (index, case), for crashes that come late.
        self.previous: tuple[int | None, dict[str, Any]] | None = None
        #: A crash after ``previous`` returned (at exit of its kernels, say): (index, case, result).
        self.late: tuple[int | None, dict[str, Any], dict[str, Any]] | None = None

    def start(self) -> None:
        from fuzzing.worker import worker_main

        self.workdir.mkdir(parents=True, exist_ok=True)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, daemon=True,
                                   args=(child, self.config.seed, str(self.cache_dir), str(TESTS_DIR),
                                         str(self.workdir)))
        self.process.start()
        child.close()
        try:
            ready = self.conn.poll(300) and self.conn.recv().get("ready")
        except (EOFError, ConnectionError):
            ready = False
        if not ready:
            raise RuntimeError(f"fuzz worker did not start ({_exit_text(self.process.exitcode)})")

    def stop(self) -> None:
        """End the worker and remove its work directory."""
        if self.process is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.join()
        self.process = None

    def bundle_bytes(self, case: dict[str, Any]) -> bytes | None:
        """The zip bytes a (zip or memory form) case loads, for the corpus."""
        if self.process is None:
            self.start()
        try:
            self.conn.send({"bytes": case})
        except ConnectionError:
            self._kill()
            self.start()
            self.conn.send({"bytes": case})
        if not self.conn.poll(self.config.timeout):
            self._kill()
            return None
        return self.conn.recv().get("bytes")

    def _take(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Hand ``msg`` to the worker; the case it started, or None when it was already dead."""
        try:
            self.conn.send(msg)
            if not self.conn.poll(self.config.timeout):
                raise _Hang
            return self.conn.recv()["started"]
        except (EOFError, ConnectionError):
            return None

    def run(self, msg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(case, result) for one request; a crash or hang restarts the worker.

        A worker found dead before it takes the request crashed after its previous case returned
        (a corrupted heap freed later): that crash is recorded in ``late`` for the previous case,
        and the request goes to a new worker.
        """
        if self.process is None:
            self.start()
        case = msg.get("case")
        try:
            started = self._take(msg)
            if started is None:
                self.process.join(5)
                if self.previous is not None:
                    index, previous = self.previous
                    self.late = (index, previous, _dead("crash", "worker died after the case returned "
                                                                 f"({_exit_text(self.process.exitcode)})"))
                self._kill()
                self.start()
                started = self._take(msg)
                if started is None:
                    raise EOFError
            case = started
            self.previous = (msg.get("index"), case)
            if not self.conn.poll(self.config.timeout):
                raise _Hang
            result = self.conn.recv()["result"]
        except _Hang:
            self._kill()
            return case or {}, _dead("hang", f"no result within {self.config.timeout:.0f}s")
        except (EOFError, ConnectionError):
            self.process.join(5)
            code = self.process.exitcode
            self._kill()
            return case or {}, _dead("crash", f"worker died: {_exit_text(code)}")
        if result.get("restart"):
            self._kill()
        return case, result


def _exit_text(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _dead(kind: str, message: str) -> dict[str, Any]:
    return {"cls": "FAILURE", "kind": kind, "phase": "", "error_type": kind, "message": message, "where": "",
            "expect": "", "native": False, "restart": True}


def _native_override(case: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """A crash or hang after a native-trust mutation is trusted by design, not a failure."""
    if result["kind"] in ("crash", "hang") and case.get("muts"):
        from fuzzing.mutators import is_native

        if is_native(case["muts"]):
            return {**result, "cls": "native-trust", "native": True}
    return result


def signature(result: dict[str, Any]) -> str:
    return f"{result['kind']}|{result['error_type']}|{result['where']}"


def run_fuzz(config: FuzzConfig) -> FuzzReport:
    """Run ``config.cases`` cases; minimise and store the failures when asked."""
    report = FuzzReport()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-cache-") as tmp:
        cache_dir = config.cache_dir or Path(tmp)
        workers = [Worker(config, cache_dir) for _ in range(max(config.jobs, 1))]
        try:
            _run_cases(config, workers, report)
            if config.minimise and report.failures:
                _minimise_all(config, workers[0], report)
        finally:
            for w in workers:
                w.stop()
    report.seconds = time.monotonic() - start
    return report


def _run_cases(config: FuzzConfig, workers: list[Worker], report: FuzzReport) -> None:
    lock = threading.Lock()
    next_index = iter(range(config.cases))
    results: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def serve(worker: Worker) -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            case, result = worker.run({"index": index})
            result = _native_override(case, result)
            with lock:
                results[index] = (case, result)
                if worker.late is not None:
                    late_index, late_case, late_result = worker.late
                    worker.late = None
                    if late_index is not None:
                        results[late_index] = (late_case, _native_override(late_case, late_result))
                if config.verbose and result["cls"] in (_MUST_NOT_HAPPEN, "skip"):
                    print(f"case {index}: {result['kind']} {result['error_type']} {result['message'][:200]!r}",
                          flush=True)

    threads = [threading.Thread(target=serve, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index in sorted(results):  # in case order: the report does not depend on scheduling
        case, result = results[index]
        report.counts[result["cls"]] += 1
        if result["cls"] == _MUST_NOT_HAPPEN:
            report.failure_count += 1
            report.failures.setdefault(signature(result), ({**case, "index": index}, result))
        elif result["cls"] == "native-trust":
            report.native_trust += 1
            if len(report.native_examples) < 10:
                report.native_examples.append(({**case, "index": index}, result))


def _minimise_all(config: FuzzConfig, worker: Worker, report: FuzzReport) -> None:
    from fuzzing.minimise import minimise
    from fuzzing.corpus import corpus_key, existing_signatures, write_entry

    known = existing_signatures(config.corpus) if config.corpus else set()
    for n, (sig, (case, result)) in enumerate(list(report.failures.items())):
        if n >= config.minimise_limit:
            break
        small, small_result = minimise(worker, case, result)
        report.failures[sig] = (small, small_result)
        small_sig = corpus_key(small_result)
        if config.corpus and small_sig not in known:
            report.written.append(str(write_entry(config.corpus, small, small_result, config.seed, worker)))
            known.add(small_sig)
