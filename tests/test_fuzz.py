"""The bundle fuzzer in CI (issue 12): the regression corpus, and a fixed-seed run of 5,000 cases.

Both go through worker processes (``tests/fuzzing``), so a crash or a hang of the engine is a
failed test, not a dead test run. See docs/fuzzing.md for what is mutated and how cases are judged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzzing.corpus import entries, replay_case
from fuzzing.runner import FuzzConfig, Worker, _native_override, run_fuzz

CORPUS = Path(__file__).parent / "fuzz_corpus"
#: The CI run: its seed and size are fixed so that a failure reproduces with ./scripts/fuzz.
CI_SEED = 12
CI_CASES = 5000
_PASSING = ("ok", "clean", "native-trust")


@pytest.fixture(scope="module")
def worker(session_cache):
    w = Worker(FuzzConfig(timeout=15.0), session_cache)
    yield w
    w.stop()


@pytest.mark.parametrize("entry", entries(CORPUS), ids=lambda p: p.stem)
def test_corpus_entry_is_refused_cleanly_or_runs(worker, entry):
    """Every failure the fuzzer ever found, minimised: now a clean EngineError or a correct run."""
    case = replay_case(entry)
    _, result = worker.run({"case": case})
    result = _native_override(case, result)
    assert result["cls"] in _PASSING, (
        f"{entry.name}: {result['kind']} {result['error_type']} at {result['where']}: {result['message']}")


@pytest.mark.slow
def test_fuzz_ci_run_has_no_failures(session_cache):
    """5,000 mutated bundles (two workers): no non-engine exception, multi-line or unnamed error,
    crash, hang, wrong output or accepted invalid bundle, native-trust cases aside."""
    report = run_fuzz(FuzzConfig(cases=CI_CASES, seed=CI_SEED, jobs=2, corpus=None, minimise=False,
                                 cache_dir=session_cache))
    print(report.summary())
    assert sum(report.counts.values()) == CI_CASES
    assert report.counts["skip"] < CI_CASES // 50, report.summary()
    assert report.failure_count == 0, report.summary()
