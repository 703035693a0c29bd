"""Build the optional native statistics kernel; everything else is in pyproject.toml.

Optional: where it cannot be compiled (no C compiler or Python headers) the package installs
without it and uses the tensor-op statistics kernel, which gives the same figures.
"""

import sys

from setuptools import Extension, setup

threads = [] if sys.platform == "win32" else ["-pthread"]

setup(
    ext_modules=[
        Extension(
            "lightning_hooks.measure._cstats",
            sources=["lightning_hooks/measure/_cstats.c"],
            depends=["lightning_hooks/measure/_cstats_passes.h"],
            extra_compile_args=["-O3", *threads],
            extra_link_args=threads,
            optional=True,
        ),
    ]
)
