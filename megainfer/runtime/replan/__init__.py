"""Online re-planning of the attention:expert split (``replan.enabled``, docs/replan.md): the
phases and rank 0's decisions, what they are measured from, and the switch itself.
``REPLAN`` is the feature ``runtime/startup.py`` plugs in."""
from megainfer.runtime.replan.decider import Decision, JobState, Measurements, decide
from megainfer.runtime.replan.measure import ExpertReporter
from megainfer.runtime.replan.requests import migrate
from megainfer.runtime.replan.runner import REPLAN, ReplanController, run_replanning
from megainfer.runtime.replan.switch import check_replan
from megainfer.runtime.replan.weights import move_expert_weights, new_placement

__all__ = ["Decision", "ExpertReporter", "JobState", "Measurements", "REPLAN", "ReplanController",
           "check_replan", "decide", "migrate", "move_expert_weights", "new_placement",
           "run_replanning"]
