"""The runtime's rooms (docs/architecture.md, "Runtime rooms"): the base path imports no
feature, the one start-up module plugs them in, every MPI tag is in one table without two
entries of one communicator overlapping, and rank-order arithmetic lives in ``roles``."""
import os
import re

import pytest
from layout_util import imports_of as _imports
from layout_util import py_files
from repo_paths import REPO

from megainfer.config import DeployPlan
from megainfer.runtime import tags
from megainfer.runtime.roles import (assign_role, attention_rank, leader_ranks, prefill_rank_ids,
                                     replica_of, tp_colour)

RUNTIME = os.path.join(REPO, "megainfer", "runtime")
CALIBRATION = os.path.join(REPO, "megainfer", "calibration")  # its MPI ping-pong rides tags too
FEATURES = ("megainfer.runtime.pd", "megainfer.runtime.replan")
BASE = ("pipeline", "replicas", "tp", "eplb", "bounded.py", "control.py", "messages.py",
        "rank_parts.py", "roles.py", "tags.py", "trace.py", "trace_metrics.py", "wiring.py")


def _files(entry):
    path = os.path.join(RUNTIME, entry)
    if entry.endswith(".py"):
        return [path]
    return [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]


@pytest.mark.parametrize("entry", BASE)
def test_the_base_path_imports_no_feature(entry):
    for path in _files(entry):
        bad = [m for m in _imports(path) if m.startswith(FEATURES)]
        assert not bad, f"{path} imports {bad}"


def test_features_plug_in_at_startup_only():
    users = []
    for root, _, files in os.walk(RUNTIME):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, RUNTIME)
            for m in _imports(path):
                for feat in FEATURES:
                    mine = rel.startswith(feat.rsplit(".", 1)[1] + os.sep)
                    if m.startswith(feat) and not mine:
                        users.append(rel)
    assert sorted(set(users)) == ["startup.py"]


def test_no_two_tags_of_one_communicator_overlap():
    by_comm = {}
    for t in tags.TAGS:
        by_comm.setdefault(t.comm, []).append(t)
    for comm, ts in by_comm.items():
        ts = sorted(ts, key=lambda t: t.value)
        for a, b in zip(ts, ts[1:]):
            assert a.value + a.span <= b.value, f"{comm}: {a} overlaps {b}"
    assert all(t.value + t.span <= tags.MPI_TAG_UB_MIN for t in tags.TAGS)


def test_no_tag_is_defined_outside_the_table():
    for root in (RUNTIME, CALIBRATION):
        for path in py_files(root):
            if os.path.basename(path) != "tags.py":
                src = open(path).read()
                assert "TAG_" not in src.replace("MPI.TAG_UB", ""), path
                assert not re.search(r"\btag=\d", src), f"{path}: a literal tag, not tags.TAGS'"


def test_rank_order_lives_in_roles():
    plan = DeployPlan(mode="disaggregated", attention_replicas=2, attention_tp=2, expert_ranks=1,
                      prefill_replicas=2, prefill_tp=2)
    roles = [assign_role(plan, r, plan.world_size) for r in range(plan.world_size)]
    assert [replica_of(plan, r) for r in range(4)] == [0, 0, 1, 1]
    assert leader_ranks(plan) == [0, 2] and attention_rank(plan, 1, 1) == 3
    assert prefill_rank_ids(plan) == [5, 7]
    assert [(r.prefill_index, r.tp_rank, r.leader_rank) for r in roles[5:]] == [
        (0, 0, 5), (0, 1, 5), (1, 0, 7), (1, 1, 7)]
    assert roles[6].label == "[prefill 0 tp1]" and roles[1].leader_rank == 0
    colours = [tp_colour(plan, r) for r in roles]
    assert colours[0] == colours[1] != colours[2] == colours[3]
    assert len(set(colours)) == 2 + 1 + 2  # two replicas, one expert rank, two prefill replicas


@pytest.mark.parametrize("package", ["pipeline", "replicas", "tp", "eplb", "pd", "replan"])
def test_a_package_surface_names_no_module_of_its_own(package):
    """``from megainfer.runtime.<package> import <module>`` must give the module (a test patching
    one must reach it), so the surface (``__all__``) never takes a module's name."""
    import importlib
    pkg = importlib.import_module(f"megainfer.runtime.{package}")
    modules = {f[:-3] for f in os.listdir(os.path.join(RUNTIME, package)) if f.endswith(".py")}
    assert pkg.__all__ and not set(pkg.__all__) & modules


# the integrator's files, written before the vocabulary's names: their spans move to it at merge
SPAN_LITERALS_PENDING: set = set()


def _tracer_calls(path):
    import ast
    for node in ast.walk(ast.parse(open(path).read())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("span", "add") and "tracer" in ast.unparse(node.func.value)):
            yield node


def test_span_lanes_and_names_come_from_the_trace_vocabulary():
    """The runtime names its lanes and spans through ``megainfer.perfmodel.trace`` (the one
    vocabulary the readers and the simulators match on), never as string literals."""
    import ast
    literal = (ast.Constant, ast.JoinedStr)
    for path in py_files(RUNTIME):
        if os.path.relpath(path, RUNTIME) in SPAN_LITERALS_PENDING:
            continue
        for call in _tracer_calls(path):
            assert not any(isinstance(a, literal) for a in call.args[:2]), (
                f"{path}:{call.lineno}: {ast.unparse(call)[:80]}")
