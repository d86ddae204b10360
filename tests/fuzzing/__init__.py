"""A structure-aware fuzzer of bundles (project issue 12).

Valid seed bundles are built in-process (``seeds``), mutated by a catalogue of operators
(``mutators``) that re-hash the manifest so that a mutation reaches every validator, written in
zip, in-memory or directory form (``craft``), loaded and run in a worker process (``worker``) and
classified (``classify``). The parent (``runner``) survives crashes and hangs of the worker,
minimises failing cases (``minimise``) and keeps them as a regression corpus under
``tests/fuzz_corpus``. See ``docs/fuzzing.md``.
"""

from fuzzing.runner import FuzzConfig, FuzzReport, run_fuzz

__all__ = ["FuzzConfig", "FuzzReport", "run_fuzz"]
