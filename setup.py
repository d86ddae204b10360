"""Build step for the compiled parts of the core: on the path of planning a new dispatch key,
``engine.runtime._planner`` (the memory planner's passes) and ``engine._exprtape`` (size
expressions); on the path of every run, ``engine.runtime._fastrun`` (the native run path,
``engine/runtime/native.py``).

Everything else is declared in ``pyproject.toml``. Both extensions are optional: where no C
compiler is available the install still succeeds, and the core uses its numpy and Python
equivalents (same plans, values and runs, slower; ``docs/memory.md`` §7, ``docs/runtime.md``).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("engine.runtime._planner", ["engine/runtime/_planner.c"], optional=True),
    Extension("engine._exprtape", ["engine/_exprtape.c"], optional=True),
    Extension("engine.runtime._fastrun", ["engine/runtime/_fastrun.c"], optional=True),
])
