"""Online serving with Ray Serve: request batching around ``run_async``, over HTTP on 127.0.0.1.

    pip install -e '.[ray]'
    python examples/ray_serve.py

Requests that arrive together (up to ``max_batch_size``, waiting at most ``batch_wait_timeout_s``)
are stacked and run as one batch; each reply says how many requests shared its batch. Here Ray
starts a local 2-CPU cluster; ``serve run`` or a cluster's Serve config deploy the same app.
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray
from ray import serve

import engine.ray
import engine.ray.serve
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp


def main() -> None:
    bundle = Path(tempfile.mkdtemp(prefix="engine-serve-")) / "mlp.cgb"
    weights = mlp_weights(seed=0)
    build_mlp(weights=weights).save(bundle)

    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    app = engine.ray.serve.app(
        engine.ray.put_bundle(bundle),
        max_batch_size=16, batch_wait_timeout_s=0.01,
        ray_actor_options={"num_cpus": 1},               # CPU placement
        # ray_actor_options={"num_gpus": 1},             # GPU placement: cuda:N from ray.get_gpu_ids()
    )                                                    # (needs the engine CUDA plugin and cuda kernels)
    serve.run(app, name="mlp", route_prefix="/mlp")

    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)

    def ask(i: int) -> dict:
        body = json.dumps({"inputs": {"x": [x[i].tolist()]}}).encode()
        request = urllib.request.Request("http://127.0.0.1:8000/mlp", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as reply:
            return json.loads(reply.read())

    with ThreadPoolExecutor(8) as pool:          # 8 concurrent clients
        replies = list(pool.map(ask, range(len(x))))
    probs = np.array([r["outputs"]["probs"][0] for r in replies], np.float32)
    assert np.allclose(probs, reference_mlp(x, weights), atol=1e-6)
    print("batch sizes seen:", sorted({r["batch_requests"] for r in replies}))
    print("replica counters:", json.loads(urllib.request.urlopen("http://127.0.0.1:8000/mlp").read()))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
