"""Walkthrough: build the example MLP classifier, ship it as a bundle, serve it.

The model itself (C kernels with two matmul candidates, an in-place bias+ReLU, a softmax with a
scratch workspace) is defined in ``engine/demo/mlp.py`` so that ``engine demo`` has it after a plain
install; read that file to see ``GraphBuilder`` used the way a compiler would use it.

    python examples/mlp_classifier.py [OUTPUT_DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

import engine
from engine.demo.mlp import build_mlp, mlp_weights, reference_mlp


def main(folder: Path) -> None:
    weights = mlp_weights(seed=0)

    # 1. Build: sources are compiled by the CPU plugin and shipped with their .so files.
    bundle = folder / "mlp.cgb"
    build_mlp(weights=weights).save(bundle)

    # 2. Tune ahead of time for the batch sizes you will serve, and keep the table in the bundle.
    graph = engine.load_compiled_graph(bundle)
    graph.tune(batch=[1, 2, 4, 8, 16, 32, 64])
    graph.save(folder / "mlp-tuned.cgb", save_dispatch_table=True)

    # 3. Serve: a production process loads the tuned bundle and refuses to stall on an untuned shape.
    served = engine.load_compiled_graph(folder / "mlp-tuned.cgb", dispatch_policy="error")
    print(served)
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    (probs,) = served.run_async([x])
    assert np.allclose(probs.numpy(), reference_mlp(x, weights), atol=1e-6)
    print("predicted classes:", probs.numpy().argmax(axis=1).tolist())
    print("runs:", served.run_stats())

    # 4. The lowest latency at one shape: capture, then replay on static buffers.
    with served.capture(x) as captured:
        out = captured(x * 0.5)
        assert np.allclose(out.numpy(), reference_mlp(x * 0.5, weights), atol=1e-6)
    print(f"bundles written to {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="engine-example-")))
