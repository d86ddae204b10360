"""The worker process: builds the seeds once, then runs cases sent by the parent over a pipe.

A crash (a signal) or a hang kills only this process; the parent notices, records the case and
starts a new worker. The worker announces each case before running it, so the parent always
knows which case a crash or hang belongs to.
"""

from __future__ import annotations

import gc
import random
import resource
import sys
from pathlib import Path
from typing import Any

from engine.plugins import Registry
from engine.settings import Settings

__all__ = ["worker_main", "make_registry", "case_rng"]

#: Address-space cap of a worker: a request for terabytes fails at once instead of swapping.
ADDRESS_SPACE_LIMIT = 8 * 2**30


def make_registry(cache_dir: Path) -> Registry:
    """A private registry: the CPU plugin plus the test-only ``hostdev`` kind, no dispatch cache."""
    import engine_cpu.plugin

    from support import HostKindBackend

    registry = Registry(Settings(cache_dir=cache_dir, dispatch_cache=False), autoload=False)
    registry.register_plugin(engine_cpu.plugin, name="cpu", distribution="engine-cpu")
    registry.register_backend(HostKindBackend(registry.backend("cpu")), distribution="tests")
    return registry


def case_rng(seed: int, index: int) -> random.Random:
    """The generator of case ``index`` of run ``seed``: any case can be regenerated alone."""
    return random.Random(f"fuzz:{seed}:{index}")


def _prepare(cache_dir: Path):
    import engine
    from fuzzing.seeds import build_seeds
    from engine.bundle.writer import bundle_to_bytes

    registry = make_registry(cache_dir)
    seeds = build_seeds(registry)
    for seed in seeds.values():
        graph = engine.load_compiled_graph(bundle_to_bytes(seed.members, engine_version="0.1.0"), registry=registry)
        seed.expected.extend(o.numpy() for o in graph.run_async(seed.make_inputs()))
        graph.close()
    return registry, seeds


def _zip_bytes(case: dict[str, Any], seeds: Any) -> bytes | None:
    from fuzzing.craft import write_zip
    from fuzzing.mutators import apply_case

    draft, _ = apply_case(case, seeds)
    if draft.form == "dir":
        return None
    return draft.raw if draft.raw is not None else write_zip(draft.entries, comment=draft.comment)


def worker_main(conn: Any, run_seed: int, cache_dir: str, tests_dir: str, workdir: str) -> None:
    """Serve ``{"index": i}`` (generate case i) and ``{"case": desc}`` (replay) until ``None``."""
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = ADDRESS_SPACE_LIMIT if hard == resource.RLIM_INFINITY else min(ADDRESS_SPACE_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    from fuzzing.classify import run_case
    from fuzzing.mutators import generate_case

    registry, seeds = _prepare(Path(cache_dir))
    trees: dict[str, Any] = {}
    served = 0
    conn.send({"ready": True})
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if "bytes" in msg:
            conn.send({"bytes": _zip_bytes(msg["bytes"], seeds)})
            continue
        case = msg.get("case") or generate_case(case_rng(run_seed, msg["index"]), seeds, trees)
        conn.send({"started": case})
        result = run_case(case, seeds, registry, Path(workdir))
        conn.send({"result": result.to_json()})
        served += 1
        if served % 200 == 0:  # cycles (graphs, tracebacks) are collected now and then, not per case
            gc.collect()
