"""The ONNX importer's tests: this folder on ``sys.path`` for their helper module ``onnx_support``
(only these tests use it, so it lives here, not among the shared helpers in the root's ``tests/``).
The fixtures and hooks every test shares are in the repository's root ``conftest.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
