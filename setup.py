"""Build the optional native extensions; everything else is in pyproject.toml.

All are optional: where they cannot be compiled (no C compiler or Python headers) the package
installs without them and uses the tensor-op statistics kernel, which gives the same figures,
the numpy CRC-32C of TensorBoard's records, which gives the same checksums, and tensor ops
for the update ratio's passes, which give the same figures.
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
        Extension(
            "lightning_hooks.measure._cupdate",
            sources=["lightning_hooks/measure/_cupdate.c"],
            depends=["lightning_hooks/measure/_cupdate_passes.h"],
            extra_compile_args=["-O3", *threads],
            extra_link_args=threads,
            optional=True,
        ),
        Extension(
            "lightning_hooks.output._crc32c_native",
            sources=["lightning_hooks/output/_crc32c_native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
