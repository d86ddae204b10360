"""The regression corpus: minimised failing cases under ``tests/fuzz_corpus``.

An entry is ``<kind>-<n>.json``: the case description (seed, form, mutations), regenerated from
the in-process seeds, and what was found (kind, exception type, place, message) when it was
written. Cases that edit raw archive bytes also keep the bytes as ``<kind>-<n>.cgb``: their byte
offsets depend on the seed's compiled kernels, which differ between compilers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["entries", "corpus_key", "existing_signatures", "write_entry", "replay_case"]


def entries(corpus: Path) -> list[Path]:
    return sorted(corpus.glob("*.json")) if corpus.is_dir() else []


def corpus_key(found: dict[str, Any]) -> str:
    """What makes two entries the same bug, stable across edits of the engine: the kind, the
    exception type, the file and function (no line number) and the message's words (no numbers
    or quoted values)."""
    where = re.sub(r":\d+ in ", " in ", found.get("where") or "")
    words = re.sub(r"[^A-Za-z]+", " ", re.sub(r"'[^']*'|\"[^\"]*\"", "", found.get("message") or ""))[:60]
    return f"{found.get('kind')}|{found.get('error_type')}|{where}|{words}"


def existing_signatures(corpus: Path) -> set[str]:
    return {corpus_key(json.loads(path.read_text()).get("found", {})) for path in entries(corpus)}


def _slug(kind: str, error_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{kind}-{error_type}".lower()).strip("-")


def write_entry(corpus: Path, case: dict[str, Any], result: dict[str, Any], run_seed: int, worker: Any) -> Path:
    """Write one entry (and its bytes for raw-byte cases); returns the JSON file's path."""
    corpus.mkdir(parents=True, exist_ok=True)
    stem = _slug(result["kind"], result["error_type"] if result["kind"] == "exception" else "")
    n = 1
    while (corpus / f"{stem}-{n}.json").exists():
        n += 1
    path = corpus / f"{stem}-{n}.json"
    doc: dict[str, Any] = {"case": case, "found": {k: result[k] for k in ("kind", "error_type", "where", "message",
                                                                          "phase", "expect")},
                           "run_seed": run_seed}
    if any(m["op"] == "raw" for m in case["muts"]):
        data = worker.bundle_bytes(case)
        if data is not None:
            path.with_suffix(".cgb").write_bytes(data)
            doc["file"] = path.with_suffix(".cgb").name
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=True) + "\n")
    return path


def replay_case(path: Path) -> dict[str, Any]:
    """The case an entry describes, pointing at its stored bytes when it has them."""
    doc = json.loads(path.read_text())
    case = dict(doc["case"])
    if doc.get("file"):
        case["file"] = str(path.parent / doc["file"])
    return case
