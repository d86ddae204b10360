"""Offline batch inference with Ray Data: one bundle in the object store, a pool of actors.

    pip install -e '.[ray]'
    python examples/ray_batch_inference.py [ROWS]

The bundle is put into Ray's object store once (``engine.ray.put_bundle``); every actor on a node
maps the same bytes and uses the weights in place (one copy per node). Each actor loads the graph
once and runs one ``run_async`` per batch; rows keep their ids (``keep=["id"]``) and their order
(``preserve_order``). Here Ray starts a local 2-CPU cluster; on a cluster, ``ray.init()`` joins it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
from ray.data.extensions import ArrowTensorArray

import engine
import engine.ray
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp


def main(rows: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="engine-ray-"))
    bundle = folder / "mlp.cgb"
    weights = mlp_weights(seed=0)
    build_mlp(weights=weights).save(bundle)

    ray.init(num_cpus=2, include_dashboard=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = True

    # Rows: an id column and a tensor column "x" (float32[64] per row), 500 rows per block.
    x = np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32)
    ds = ray.data.from_arrow([pa.table({"id": np.arange(s, min(s + 500, rows)),
                                        "x": ArrowTensorArray.from_numpy(x[s:s + 500])})
                              for s in range(0, rows, 500)])

    ref = engine.ray.put_bundle(bundle)  # once; a path readable on every node works too
    predictions = ds.map_batches(
        engine.ray.GraphPredictor,
        fn_constructor_args=(ref,),
        fn_constructor_kwargs={"keep": ["id"]},        # graph input "x" reads column "x"; output "probs"
        compute=ray.data.ActorPoolStrategy(size=2),    # two actors, each loads the graph once
        batch_size=500,
        batch_format="numpy",
        num_cpus=1,                                    # CPU placement: the graph runs on cpu
        # GPU placement (where the engine CUDA plugin is installed and the bundle has cuda kernels):
        # num_gpus=1,                                  # -> each actor runs on cuda:N, N from ray.get_gpu_ids()
    )
    out = predictions.take_batch(rows + 1)

    assert len(out["id"]) == rows and (out["id"] == np.arange(rows)).all()
    assert np.allclose(out["probs"], reference_mlp(x, weights), atol=1e-6)
    print(f"{rows} rows, 2 actors: classes of the first rows {out['probs'][:8].argmax(axis=1).tolist()}")
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
