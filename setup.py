"""megainfer: attention-expert disaggregated MoE inference (MegaScale-Infer design)."""
from setuptools import find_packages, setup

core = find_packages(include=["megainfer", "megainfer.*"])
setup(
    name="megainfer",
    version="0.1.0",
    description="Serve Mixture-of-Experts LLMs with attention-expert disaggregation",
    python_requires=">=3.10",
    # kernels/ and launch/ live at the top level but install under the megainfer namespace.
    packages=core + ["megainfer.kernels", "megainfer.launch", "megainfer.conf"],
    package_dir={"megainfer.kernels": "kernels", "megainfer.launch": "launch", "megainfer.conf": "conf"},
    package_data={"megainfer.conf": ["*.yaml", "*/*.yaml"], "megainfer.kernels": ["*.json"]},
    include_package_data=True,
    install_requires=[
        "torch==2.13.0",
        "triton==3.7.1",
        "mpi4py==4.1.2",
        "mpich==5.0.2",
        "hydra-core==1.3.8",
        "omegaconf>=2.3,<2.4",
        "einops>=0.8",
        "safetensors>=0.4",
        "numpy>=2.0",
        "tqdm>=4.66",
        "tokenizers==0.23.3",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "transformers==5.24.0", "matplotlib>=3.8"],
        "nccl": ["nvidia-nccl-cu12"],
        "deepspeed": ["deepspeed==0.19.8"],
    },
    entry_points={
        "console_scripts": [
            "megainfer-launch=megainfer.launch.main:main",
            "megainfer-plan=megainfer.launch.plan:main",
        ]
    },
)
