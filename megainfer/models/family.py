"""What differs between families at load time: checkpoint names. Architecture differences
(bias, q/k norm, shared expert, renormalisation) are flags on ``ModelConfig``."""
from __future__ import annotations

import re
from dataclasses import dataclass

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Family:
    name: str
    renames: tuple[tuple[str, str], ...]  # checkpoint substring -> in-memory substring
    expert_parts: dict  # per-expert checkpoint projection name -> gate | up | down

    def canonical(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def parse_expert(self, name: str):
        """(layer, expert, part) for a per-expert tensor; (layer, None, fused) for a fused one."""
        m = _PER_EXPERT.match(name)
        if m and m.group(3) in self.expert_parts:
            return int(m.group(1)), int(m.group(2)), self.expert_parts[m.group(3)]
        m = _FUSED.match(name)
        if m:
            return int(m.group(1)), None, m.group(2)
        return None
