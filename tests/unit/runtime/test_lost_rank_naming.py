"""One wording of a lost rank: ``control.silent_peer`` finds the silent peer anywhere in an
error's chain and ``RankLostError.naming`` words it, for the runtime's engine and a child job's
rank 0 alike."""
import pickle

from megainfer.comm.errors import CommTimeoutError
from megainfer.engine.failures import EngineDeadError, RankLostError
from megainfer.engine_core.child_main import wire_error
from megainfer.engine_core.messages import RankInfo
from megainfer.runtime.control import RankFailure, silent_peer

ROLES = {0: "[attn dp0 tp0]", 1: "[expert 0]", 2: "[expert 1]"}


def _chained(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("the step failed") from e
    except RuntimeError as outer:
        return outer


def test_a_silent_peer_deep_in_the_chain_is_named_with_its_role():
    late = CommTimeoutError("recv", 2, layer=1, micro_batch=0, iteration=7, waited_s=3.0)
    err = silent_peer(_chained(late), ROLES.get)
    assert isinstance(err, RankLostError) and (err.rank, err.role) == (2, "[expert 1]")
    assert str(err).startswith("rank 2 [expert 1] stopped answering: recv from/to peer rank 2")
    failure = RankFailure("[attn dp0 tp0]", 1, "the step's go", 4.0)
    assert str(silent_peer(failure, ROLES.get)).startswith("rank 1 [expert 0] stopped answering")


def test_no_peer_to_blame_is_none_and_an_unknown_role_is_left_out():
    assert silent_peer(_chained(ValueError("bad")), ROLES.get) is None
    assert silent_peer(RankFailure("me", None, "start", 1.0), ROLES.get) is None
    err = silent_peer(RankFailure("me", 9, "start", 1.0), ROLES.get)
    assert str(err).startswith("rank 9 stopped answering") and err.role is None


def test_a_child_jobs_rank0_sends_the_same_wording_and_it_pickles():
    ranks = {r: RankInfo(r, 100 + r, role) for r, role in ROLES.items()}
    err = wire_error(_chained(RankFailure("[attn dp0 tp0]", 1, "go", 4.0)), ranks)
    assert (err.rank, err.role) == (1, "[expert 0]")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.rank, back.role) == (RankLostError, str(err), 1,
                                                             "[expert 0]")
    other = wire_error(ValueError("boom"), ranks)
    assert type(other) is EngineDeadError and "ValueError: boom" in str(other)
    assert RankLostError.naming(0, "[attn dp0 tp0]", "hangs").args == ("rank 0 [attn dp0 tp0] "
                                                                       "hangs",)
