"""The conformance suite's tests (run with ``python -m engine.testing KIND``; see docs/conformance.md)."""
