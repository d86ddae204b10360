"""Running compiled graphs on Ray: batch inference with Ray Data, serving with Ray Serve.

Imported only when used (``pip install engine[ray]``); the core never imports ray. ::

    import ray, engine.ray
    ref = engine.ray.put_bundle("mlp.cgb")                  # once: the bundle in the object store
    ds = ds.map_batches(engine.ray.GraphPredictor, fn_constructor_args=(ref,),
                        concurrency=2, batch_format="numpy")

Serving (``engine.ray.serve``, which imports Ray Serve): ``serve.run(engine.ray.serve.app(ref))``.
See docs/ray.md: the one-copy path, placement, sizes and measured figures.
"""

from engine.ray.batches import ColumnError, GraphPredictor
from engine.ray.placement import Placement, choose_placement, current_placement
from engine.ray.source import BundleSource, bundle_buffer, load_graph, put_bundle

__all__ = ["BundleSource", "ColumnError", "GraphPredictor", "Placement", "bundle_buffer", "choose_placement",
           "current_placement", "load_graph", "put_bundle"]
