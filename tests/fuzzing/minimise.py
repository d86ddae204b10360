"""Shrinking a failing case while it fails the same way (same kind, exception type and place).

First fewer mutations (each one alone, then each one left out), then smaller values inside each
mutation (``mutators.shrink_mutation``: half the digits, a shorter string, a smaller bomb).
"""

from __future__ import annotations

from typing import Any

__all__ = ["minimise"]

#: Replays one failing case may cost at most (each is one load in the worker).
BUDGET = 40


def minimise(worker: Any, case: dict[str, Any], result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The smallest variant of ``case`` found that fails with ``result``'s signature."""
    from fuzzing.runner import _native_override

    if not case.get("muts"):
        return case, result
    target = _key(result)
    budget = [BUDGET]
    best = (_strip(case), result)

    def fails(candidate: dict[str, Any]) -> dict[str, Any] | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        got_case, got = worker.run({"case": candidate})
        got = _native_override(candidate, got)
        return got if got["cls"] == "FAILURE" and _key(got) == target else None

    best = _fewer_mutations(best, fails)
    return _smaller_values(best, fails)


def _key(result: dict[str, Any]) -> str:
    """What must stay the same while shrinking. For verdicts on the whole bundle (accepted,
    refused-valid, wrong-output) the kind alone: their ``where`` names the mutations, which shrink."""
    from fuzzing.runner import signature

    if result["kind"] in ("accepted", "refused-valid", "wrong-output"):
        return result["kind"]
    return signature(result)


def _strip(case: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in case.items() if k in ("seed", "form", "muts", "file")}


def _fewer_mutations(best, fails):
    case, result = best
    muts = case["muts"]
    if len(muts) <= 1:
        return best
    for m in muts:
        got = fails({**case, "muts": [m]})
        if got is not None:
            return {**case, "muts": [m]}, got
    for i in range(len(muts)):
        rest = muts[:i] + muts[i + 1:]
        got = fails({**case, "muts": rest})
        if got is not None:
            return _fewer_mutations(({**case, "muts": rest}, got), fails)
    return best


def _smaller_values(best, fails):
    from fuzzing.mutators import shrink_mutation

    case, result = best
    progress = True
    while progress:
        progress = False
        for i, m in enumerate(case["muts"]):
            for smaller in shrink_mutation(m):
                candidate = {**case, "muts": case["muts"][:i] + [smaller] + case["muts"][i + 1:]}
                got = fails(candidate)
                if got is not None:
                    case, result, progress = candidate, got, True
                    break
            if progress:
                break
    return case, result
