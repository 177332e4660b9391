"""megainfer: attention-expert disaggregated MoE inference (MegaScale-Infer design)."""
import os
import warnings

from setuptools import find_packages, setup

# Each editable install of a package_dir layout (kernels/ -> megainfer.kernels, ...) ends with
# setuptools' information-only notice "Editable installation. Please be careful with folders in
# your working directory with the same name as your package": here the one such folder is this
# project's own megainfer/, the same source, so the notice says nothing and is silenced.
warnings.filterwarnings("ignore", message="Editable installation", category=UserWarning)

HERE = os.path.dirname(os.path.abspath(__file__))
core = find_packages(include=["megainfer", "megainfer.*"])
# conf/ holds only YAML, but Python sees each config group folder (conf/model, conf/deploy, ...)
# as an importable package: list them as packages of their own (setuptools otherwise warns once
# per folder that it "would be ignored"), each carrying its YAML as package data.
conf_groups = sorted(d for d in os.listdir(os.path.join(HERE, "conf"))
                     if os.path.isdir(os.path.join(HERE, "conf", d)) and d.isidentifier()
                     and not d.startswith("_"))
# megainfer-serve and megainfer-bench-serve (docs/serve.md); dev includes them so CI tests them
# uvloop and httptools: uvicorn's fast event loop and HTTP parser (what uvicorn[standard] adds)
SERVE = ["fastapi==0.165.0", "uvicorn==0.54.0", "uvloop==0.23.0", "httptools==0.9.0",
         "prometheus-client==0.26.0", "httpx==0.28.1"]
setup(
    name="megainfer",
    version="0.1.0",
    description="Serve Mixture-of-Experts LLMs with attention-expert disaggregation",
    python_requires=">=3.10",
    # kernels/ and launch/ live at the top level but install under the megainfer namespace.
    packages=core + ["megainfer.kernels", "megainfer.launch", "megainfer.conf"]
    + [f"megainfer.conf.{g}" for g in conf_groups],
    package_dir={"megainfer.kernels": "kernels", "megainfer.launch": "launch", "megainfer.conf": "conf"},
    package_data={"megainfer.conf": ["*.yaml"], "megainfer.kernels": ["*.json"],
                  **{f"megainfer.conf.{g}": ["*.yaml"] for g in conf_groups}},
    include_package_data=True,
    install_requires=[
        "torch==2.13.0",
        "triton==3.7.1",
        "mpi4py==4.1.2",
        "mpich==5.0.2",
        "hydra-core==1.3.8",
        "omegaconf>=2.3,<2.4",
        "safetensors>=0.4",
        "numpy>=2.0",
        "tqdm>=4.66",
        "tokenizers==0.23.3",
        "jinja2>=3.1.6",  # chat templates (LLM.chat, "messages" input lines), sandboxed
        "huggingface_hub==2.4.0",  # model ids from the local HF cache (no download at run time)
        # structured outputs (JSON schema, regex, choice, EBNF; tool calls): the grammar engine,
        # compiled grammars and token bitmasks (megainfer/engine/grammar.py); offline too
        "xgrammar==0.2.8",
    ],
    extras_require={
        "plot": ["matplotlib>=3.8"],  # timeline.png of traced runs, megainfer-timeline
        "serve": SERVE,
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "transformers==5.24.0", "matplotlib>=3.8",
                "openai==3.57.0", "schemathesis==4.32.5"] + SERVE,
        "nccl": ["nvidia-nccl-cu12"],
        "deepspeed": ["deepspeed==0.19.8"],
    },
    entry_points={
        "console_scripts": [
            "megainfer-launch=megainfer.launch.main:main",
            "megainfer-plan=megainfer.launch.plan:main",
            "megainfer-timeline=megainfer.tools.timeline:main",
            "megainfer-serve=megainfer.launch.serve:main",
            "megainfer-bench-serve=megainfer.bench.serve_load:main",
        ]
    },
)
