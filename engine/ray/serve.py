"""A Ray Serve deployment around ``run_async``, with request batching (``serve.batch``).

Requests arriving together are stacked along their first dimension (every graph input's first
dimension must be a symbol: the rows), run as one ``run_async`` call, and the outputs are split
back per request. The run happens on one worker thread of the replica, so the replica's event loop
keeps accepting (and batching) requests while a batch computes.

HTTP: ``POST`` a JSON object ``{"inputs": {"x": [[...], ...]}}`` (rows of each input; numbers are
converted to the input's dtype); the reply is ``{"outputs": {"probs": [[...], ...]},
"batch_requests": n, "batch_rows": r}``, where ``n`` is how many requests shared the batch that
served this one. ``GET`` returns this replica's counters (``requests``, ``batches``,
``largest_batch``). A request that cannot feed the graph gets ``400`` and a one-line message; it
never reaches (or spoils) a batch. Python callers use ``handle.predict.remote({"x": array})``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np
from attrs import define, frozen
from ray import serve

from engine.errors import EngineError, InputError
from engine.ray.placement import Placement, current_placement
from engine.ray.source import BundleSource, load_graph
from engine.runtime.compiled_graph import CompiledGraph

__all__ = ["GraphServer", "Reply", "ServerStats", "app"]


@frozen
class Reply:
    """One request's outputs (by output name) and the size of the batch that served it."""

    outputs: dict[str, np.ndarray]
    batch_requests: int
    batch_rows: int


@define
class ServerStats:
    """Counters of one replica (changed only on its event loop)."""

    requests: int = 0
    batches: int = 0
    largest_batch: int = 0


class GraphServer:
    """The deployment's class: ``serve.deployment(GraphServer).bind(bundle, ...)``, or ``app(bundle)``.

    ``bundle``: an ``ObjectRef`` from ``engine.ray.put_bundle`` or a path readable on every node.
    ``max_batch_size`` requests (not rows) at most per batch, waiting at most
    ``batch_wait_timeout_s`` for a batch to fill. ``device`` overrides the placement from Ray's
    resources (``ray_actor_options={"num_gpus": 1}`` gives ``cuda:N`` where the CUDA plugin is
    installed).
    """

    def __init__(self, bundle: BundleSource, *, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.005,
                 device: str | None = None, dispatch_policy: str | None = None):
        self.placement: Placement = current_placement(device)
        self.graph: CompiledGraph = load_graph(bundle, self.placement.device, dispatch_policy=dispatch_policy)
        meta = self.graph.meta
        self.input_names = tuple(meta.input_names) or tuple(f"input{i}" for i in range(len(meta.inputs)))
        self.output_names = tuple(meta.output_names) or tuple(f"output{i}" for i in range(len(meta.outputs)))
        for name, sig in zip(self.input_names, meta.inputs):
            if not sig.shape or sig.shape[0].is_constant:
                raise InputError(f"GraphServer batches requests along the first dimension, but input {name!r} "
                                 f"has shape {sig.shape_str()}: its first dimension must be a symbol")
        self._signatures = dict(zip(self.input_names, meta.inputs))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-serve")
        self.stats = ServerStats()
        batcher: Any = self.run_batch  # serve.batch's wrapper: its typing hides the setters
        batcher.set_max_batch_size(max_batch_size)
        batcher.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if request.method == "GET":
            return {"requests": self.stats.requests, "batches": self.stats.batches,
                    "largest_batch": self.stats.largest_batch, "placement": self.placement.device or "cpu"}
        try:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("inputs"), dict):
                raise InputError('expected a JSON object {"inputs": {"<input name>": [rows...]}}')
            inputs = self.decode(body["inputs"], cast=True)
        except (EngineError, ValueError) as exc:
            return JSONResponse({"error": " ".join(str(exc).split())}, status_code=400)
        reply = await self.run_batch(inputs)
        return {"outputs": {k: v.tolist() for k, v in reply.outputs.items()},
                "batch_requests": reply.batch_requests, "batch_rows": reply.batch_rows}

    async def predict(self, inputs: Mapping[str, Any]) -> Reply:
        """For ``DeploymentHandle`` callers: numpy arrays in (exact dtypes), a ``Reply`` out."""
        return await self.run_batch(self.decode(inputs, cast=False))

    def decode(self, inputs: Mapping[str, Any], *, cast: bool) -> dict[str, np.ndarray]:
        """Check one request against the signatures (names, dtype, rank, constant dimensions)."""
        unknown = sorted(set(inputs) - set(self.input_names))
        if unknown:
            raise InputError(f"unknown input {unknown[0]!r}; the graph's inputs are {', '.join(self.input_names)}")
        out: dict[str, np.ndarray] = {}
        rows = None
        for name, sig in self._signatures.items():
            if name not in inputs:
                raise InputError(f"input {name!r} is missing; the graph's inputs are {', '.join(self.input_names)}")
            dtype = np.dtype(sig.dtype.numpy)
            array = np.asarray(inputs[name], dtype=dtype) if cast else np.asarray(inputs[name])
            if array.dtype != dtype:
                raise InputError(f"input {name!r}: expected dtype {dtype}, got {array.dtype}")
            if array.ndim != len(sig.shape):
                raise InputError(f"input {name!r}: expected shape {sig.shape_str()}, got {list(array.shape)}")
            for axis, (e, n) in enumerate(zip(sig.shape, array.shape)):
                if e.is_constant and e.constant != n:
                    raise InputError(f"input {name!r}: dimension {axis} must be {e.constant}, got {n} "
                                     f"(shape {sig.shape_str()})")
            if rows is not None and array.shape[0] != rows:
                raise InputError(f"input {name!r} has {array.shape[0]} rows, the other inputs {rows}")
            rows = array.shape[0]
            out[name] = np.ascontiguousarray(array)
        return out

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[Reply]:
        counts = [r[self.input_names[0]].shape[0] for r in requests]
        stacked = [np.concatenate([r[name] for r in requests]) for name in self.input_names]
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self._run, stacked)
        stats = self.stats
        stats.requests += len(requests)
        stats.batches += 1
        stats.largest_batch = max(stats.largest_batch, len(requests))
        bounds = np.cumsum([0] + counts)
        total = int(bounds[-1])
        return [Reply({n: r[a:b] for n, r in zip(self.output_names, results)}, len(requests), total)
                for a, b in zip(bounds[:-1], bounds[1:])]

    def _run(self, stacked: list[np.ndarray]) -> list[np.ndarray]:
        # Copied out of the engine's output storage so that each reply owns plain arrays.
        return [np.array(t.numpy()) for t in self.graph.run_async(stacked)]


def app(bundle: BundleSource, *, name: str = "engine-graph", num_replicas: int = 1,
        ray_actor_options: Mapping[str, Any] | None = None, max_ongoing_requests: int | None = None,
        **options: Any) -> Any:
    """A bound Serve application for ``serve.run``; ``options`` go to ``GraphServer``.

    ``max_ongoing_requests`` (how many requests Serve lets into one replica at once) defaults to
    twice ``max_batch_size``: Serve's own default (5) would cap every batch at 5 requests.
    """
    batch = int(options.get("max_batch_size", 32))
    deployment: Any = serve.deployment(GraphServer, name=name, num_replicas=num_replicas,
                                       max_ongoing_requests=max_ongoing_requests or 2 * batch,
                                       ray_actor_options=dict(ray_actor_options or {"num_cpus": 1}))
    return deployment.bind(bundle, **options)
