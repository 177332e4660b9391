"""The live planner's decisions in a child process (``python -m megainfer.serve.planner_child``),
so that its simulations take neither the GIL of the process that serves (under ``mpiexec`` rank
0 runs the engine core on a thread beside the frontend) nor its CPU priority: the child runs at
``nice`` +10 with one thread and without the MPI launch's environment. The parent sends the
``LivePlanner`` with its evaluator once, then one ``ServedWindow`` per decision, and gets back
``(decision, better_unreachable, current)``, pickled over the child's stdin and stdout (a pipe
between two processes of this program, nothing read from elsewhere). The child ends when its
stdin closes: when the server exits, however it exits. docs/replan.md, "The live planner"."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

NICE = 10  # the child's priority below the serving ranks'
KEEP = 64  # decisions the child's planner keeps in its own log
_MPI_ENV = ("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


class PlannerGone(RuntimeError):
    """The planner's child process ended or answered nothing."""


class PlannerHere:
    """Decisions on the caller's thread (tests, or a planner that must share the process)."""

    def __init__(self, planner, evaluate):
        self.planner, self.evaluate = planner, evaluate

    def decide(self, window):
        d = self.planner.decide(window)
        del self.planner.log[:-KEEP]
        return d, self.evaluate.better_unreachable, self.planner.current


class PlannerChild:
    """Decisions in a child process holding ``planner`` (and its evaluator ``evaluate``)."""

    def __init__(self, planner, evaluate, nice: int = NICE):
        env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV)}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "megainfer.serve.planner_child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        os.setpriority(os.PRIO_PROCESS, self.proc.pid,
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
        self.lock = threading.Lock()
        self._send((planner, evaluate))

    def _send(self, obj) -> None:
        try:
            pickle.dump(obj, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise PlannerGone(f"the planner's process (pid {self.proc.pid}) is gone: {e}") \
                from None

    def decide(self, window):
        with self.lock:
            self._send(window)
            try:
                status, *rest = pickle.load(self.proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                raise PlannerGone(f"the planner's process (pid {self.proc.pid}) ended, exit "
                                  f"code {self.proc.poll()}") from None
        if status == "error":
            raise RuntimeError(rest[0])
        return tuple(rest)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main() -> None:
    out, sys.stdout = sys.stdout.buffer, sys.stderr  # the pipe carries answers only
    src = sys.stdin.buffer
    try:
        planner, evaluate = pickle.load(src)
    except EOFError:
        return
    here = PlannerHere(planner, evaluate)
    while True:
        try:
            window = pickle.load(src)
        except EOFError:
            return
        try:
            answer = ("ok", *here.decide(window))
        except Exception as e:  # noqa: BLE001 - the parent logs it and decides again later
            answer = ("error", f"{type(e).__name__}: {e}")
        pickle.dump(answer, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


if __name__ == "__main__":
    main()
