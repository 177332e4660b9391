"""A batch script over attention-expert disaggregation: the same script runs under mpiexec
(every rank runs it; LLM(...) returns on rank 0 only) or from a plain python, which starts the
ranks itself as an mpiexec child job and ends them when the script ends.

    mpiexec -n 3 python examples/batch_deploy.py [MODEL_DIR] [--deploy a1e2]
    python examples/batch_deploy.py [MODEL_DIR] [--deploy a1e2]       # starts its 3 ranks

``--deploy``: a preset of conf/deploy (a1e2: 1 attention rank + 2 expert ranks; p1a1e2: and a
prefill rank; colocated2; single) or ``auto`` with ``--world-size N`` (the planner picks).
Without MODEL_DIR it builds a tiny random Mixtral (under mpiexec: rank 0 builds it, every rank
reads it).
"""
import argparse
import os
import tempfile

from megainfer import LLM, SamplingParams


def tiny_model() -> str:
    """A tiny random Mixtral in the temp directory (under mpiexec rank 0 writes it)."""
    from megainfer.engine_core.builder import mpi_world
    from megainfer.tools.make_tiny import make_tiny
    path = os.path.join(tempfile.gettempdir(), "megainfer_tiny_mixtral")
    size, rank = mpi_world()
    if rank == 0:
        make_tiny("mixtral", path, seed=0)
    if size > 1:
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--deploy", default="a1e2")
    ap.add_argument("--world-size", type=int)
    a = ap.parse_args()
    prompts = ["Hello, my name is", "The capital of France is", "The future of AI is"]
    with LLM(a.model or tiny_model(), deploy=a.deploy, world_size=a.world_size) as llm:
        # from here on only rank 0 runs (or this process, which started the ranks)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        for out in outputs:
            print(f"Prompt: {out.prompt!r}  Output: {out.outputs[0].text!r}")
    print(f"{a.deploy}: done, {len(outputs)} outputs", flush=True)


if __name__ == "__main__":
    main()
