"""Builds the C extension vattn._C with the system C compiler (no CUDA toolkit needed)."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vattn._C",
            sources=["cext/vattn_ext.c"],
            depends=["cext/dlpack.h"],
            include_dirs=["cext"],
            libraries=["dl"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
        )
    ]
)
