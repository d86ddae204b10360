"""Per-rule results of one suite run: the terminal summary and the ``--engine-report`` JSON file.

A test declares the rules it checks (``@pytest.mark.conformance``); a failure is charged to the
rule its message names (``rule <id>: ...``), or to every declared rule when the message names
none (an unexpected exception). A rule passes when at least one of its tests passed and none
failed; skipped rules keep the skip reasons, which name the missing capability.

The JSON file is rewritten after every test and names the test in progress (``running``), so a
backend that crashes the process still leaves the results so far and the test that crashed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs

from engine.testing.rules import RULES

__all__ = ["TestResult", "RunReport", "failed_rule"]

_RULE_IN_MESSAGE = re.compile(r"rule ([a-z_]+\.[a-z_]+):")


def failed_rule(message: str) -> str | None:
    """The rule id a failure message names, or ``None``."""
    match = _RULE_IN_MESSAGE.search(message)
    return match.group(1) if match else None


@attrs.frozen
class TestResult:
    __test__ = False  # not a pytest test class

    test: str
    outcome: str  # "passed", "failed", "skipped"
    rules: tuple[str, ...]
    message: str = ""


@attrs.define
class RunReport:
    """Collects ``TestResult``s and summarises them by rule."""

    target: dict[str, Any]
    results: list[TestResult] = attrs.field(factory=list)
    #: The test in progress (None between tests): after a crash, the one that crashed.
    running: str | None = None

    def add(self, result: TestResult) -> None:
        self.results.append(result)

    def by_rule(self) -> dict[str, dict[str, Any]]:
        summary: dict[str, dict[str, Any]] = {r.id: {"status": "not run", "tests": [], "messages": []} for r in RULES}
        for res in self.results:
            charged = res.rules
            if res.outcome == "failed":
                named = failed_rule(res.message)
                if named is not None and named in summary:
                    charged = (named,)
            for rule_id in charged:
                entry = summary.setdefault(rule_id, {"status": "not run", "tests": [], "messages": []})
                entry["tests"].append(res.test)
                if res.message and res.outcome != "passed":
                    entry["messages"].append(res.message)
                entry["status"] = _merge(entry["status"], res.outcome)
        return summary

    def summary_lines(self) -> list[str]:
        rules = self.by_rule()
        counts: dict[str, list[str]] = {}
        for rule_id, entry in rules.items():
            counts.setdefault(entry["status"], []).append(rule_id)
        lines = [", ".join(f"{len(ids)} {status}" for status, ids in sorted(counts.items()))]
        for rule_id in counts.get("failed", []):
            first = next(iter(rules[rule_id]["messages"]), "")
            lines.append(f"FAILED {rule_id}: {first.splitlines()[0] if first else '(see the test report)'}")
        return lines

    def write(self, path: Path) -> None:
        data = {"target": self.target, "running": self.running, "rules": self.by_rule(),
                "tests": [attrs.asdict(r) for r in self.results]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
        tmp.replace(path)  # readers never see half a file


def _merge(status: str, outcome: str) -> str:
    order = {"not run": 0, "skipped": 1, "passed": 2, "failed": 3}
    return status if order[status] >= order.get(outcome, 0) else outcome
