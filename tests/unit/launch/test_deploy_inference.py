"""deploy.*: counts inferred from the world size; a plan that cannot fit names an override that would."""
import pytest
from hydra import compose, initialize_config_module

from megainfer.config import ConfigError
from megainfer.engine.job_doors import settings_from_config


def plan(*overrides, world):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    d = settings_from_config(cfg, world).deploy
    return d.mode, d.attention_replicas, d.attention_tp, d.expert_ranks, d.micro_batches


GOOD = [  # (overrides, world, (mode, replicas, tp, experts, micro_batches))
    ([], 1, ("single", 1, 1, 0, 1)),
    (["deploy.mode=disaggregated"], 3, ("disaggregated", 1, 1, 2, 2)),
    (["deploy.mode=colocated"], 3, ("colocated", 3, 1, 0, 2)),
    (["deploy.mode=colocated", "deploy.micro_batches=1"], 2, ("colocated", 2, 1, 0, 1)),
    (["deploy.mode=disaggregated"], 4, ("disaggregated", 1, 1, 3, 2)),
    (["deploy.mode=disaggregated", "deploy.attention_replicas=2", "deploy.attention_tp=2"], 7,
     ("disaggregated", 2, 2, 3, 2)),
    (["deploy.mode=disaggregated", "deploy.expert_ranks=2", "deploy.attention_tp=2"], 6,
     ("disaggregated", 2, 2, 2, 2)),
    (["deploy.mode=disaggregated", "deploy.expert_ranks=1"], 4, ("disaggregated", 3, 1, 1, 2)),
    (["deploy.mode=disaggregated", "deploy.attention_replicas=2"], 6, ("disaggregated", 2, 1, 4, 2)),
    # auto with every count given: the planner has nothing to choose but m (pinned here too)
    (["deploy.attention_replicas=2", "deploy.attention_tp=1", "deploy.expert_ranks=4",
      "deploy.micro_batches=2"], 6, ("disaggregated", 2, 1, 4, 2)),
    (["deploy.mode=single"], 1, ("single", 1, 1, 0, 2)),
    # presets keep their behaviour
    (["deploy=a1e2"], 3, ("disaggregated", 1, 1, 2, 2)),
    (["deploy=a2e4"], 6, ("disaggregated", 2, 1, 4, 2)),
    (["deploy=colocated2"], 2, ("colocated", 2, 1, 0, 1)),
    (["deploy=single"], 1, ("single", 1, 1, 0, 1)),
]


@pytest.mark.parametrize("overrides,world,want", GOOD)
def test_counts_are_inferred(overrides, world, want):
    assert plan(*overrides, world=world) == want


BAD = [  # (overrides, world, fragments of the message)
    (["deploy=colocated2"], 3, ["world size 3 does not match", "use deploy.attention_replicas=3"]),
    (["deploy=a2e4"], 3, ["world size 3", "it needs 6 ranks", "deploy.expert_ranks=1",
                          "mpirun -n 6"]),
    (["deploy=a2e4"], 1, ["world size 1 does not match", "deploy=single"]),
    (["deploy=a1e2"], 4, ["deploy.expert_ranks=3", "deploy.attention_replicas=2"]),
    (["deploy.mode=disaggregated", "deploy.attention_replicas=3"], 3,
     ["leave no rank for the experts", "deploy.attention_replicas=2", "deploy.mode=colocated"]),
    (["deploy.mode=disaggregated", "deploy.expert_ranks=3", "deploy.attention_tp=2"], 6,
     ["3 attention ranks, not a multiple of attention_tp=2", "deploy.expert_ranks=4"]),
    (["deploy.mode=disaggregated", "deploy.expert_ranks=6"], 6,
     ["leave no rank for attention", "deploy.expert_ranks=5"]),
    (["deploy.mode=colocated", "deploy.attention_tp=2"], 2, ["attention_tp=1"]),
    (["deploy.mode=colocated", "deploy.expert_ranks=2"], 4, ["deploy.expert_ranks=0"]),
    (["deploy=single"], 2, ["single mode runs one process", "deploy.mode=colocated"]),
    (["deploy.mode=disaggregated", "deploy.attention_replicas=0"], 3,
     ["deploy.attention_replicas=0", "must be an integer >= 1"]),
]


@pytest.mark.parametrize("overrides,world,msgs", BAD)
def test_misfit_names_an_override_that_fits(overrides, world, msgs):
    with pytest.raises(ConfigError) as info:
        plan(*overrides, world=world)
    for m in msgs:
        assert m in str(info.value), str(info.value)


def test_named_overrides_do_fit():
    """Each override a refusal suggests really resolves (on the same world size)."""
    import re
    for overrides, world, _ in BAD[:7]:
        with pytest.raises(ConfigError) as info:
            plan(*overrides, world=world)
        for fix in re.findall(r"(deploy\.\w+=\w+(?: deploy\.\w+=\w+)*)", str(info.value).split("; use ")[1]):
            if fix == "deploy.mode=single" and world != 1:
                continue
            plan(*overrides, *fix.split(), world=world)
