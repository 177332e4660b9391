"""The shared-prefix workload of ``perf/bench/bench_prefix_cache.py`` (and its routing job):
``systems`` system prompts of ``system_len`` tokens, ``per_system`` requests each with a
``suffix_len``-token suffix, shuffled (seeded)."""
import random


def workload(a) -> list[list[int]]:
    g = random.Random(a.seed)
    systems = [[g.randrange(3, 8192) for _ in range(a.system_len)] for _ in range(a.systems)]
    prompts = [s + [g.randrange(3, 8192) for _ in range(a.suffix_len)]
               for s in systems for _ in range(a.per_system)]
    g.shuffle(prompts)
    return prompts
