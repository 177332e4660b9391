"""A vLLM user's batch script runs unchanged but for its import line and model path."""
import os
import subprocess
import sys

from repo_paths import REPO

EXAMPLE = os.path.join(REPO, "examples", "offline_basic.py")


def test_vllm_style_offline_example_runs(tiny_ckpts):
    with open(EXAMPLE) as f:
        src = f.read()
    assert "from megainfer import LLM, SamplingParams" in src
    r = subprocess.run([sys.executable, EXAMPLE, tiny_ckpts[("mixtral", "base")]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("Prompt:    ") == 4 and r.stdout.count("Output:    ") == 4
    assert "'The capital of France is'" in r.stdout
