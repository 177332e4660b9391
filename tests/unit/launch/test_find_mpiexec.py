"""The one rule for the MPI launcher (``core_client.mpiexec_job.find_mpiexec``, which the
library, perf/ and tests share): ``$MPIEXEC`` first, else the one beside the interpreter, else
PATH; a ``$MPIEXEC`` that is not executable is refused naming it."""
import os
import sys

import pytest

from megainfer.core_client.mpiexec_job import find_mpiexec
from megainfer.engine.failures import CoreStartError


def test_mpiexec_env_wins_and_a_bad_one_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MPIEXEC", str(fake))
    assert find_mpiexec() == str(fake)
    monkeypatch.setenv("MPIEXEC", str(tmp_path / "missing"))
    with pytest.raises(CoreStartError, match="MPIEXEC=.*missing"):
        find_mpiexec()


def test_without_the_env_the_interpreters_own(monkeypatch):
    monkeypatch.delenv("MPIEXEC", raising=False)
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.access(here, os.X_OK):
        pytest.skip("no mpiexec beside the interpreter")
    assert find_mpiexec() == here
