"""docs/config.md is what ``python -m megainfer.launch.config_doc`` prints: every config key
once, so a key added, removed, renamed or re-defaulted without regenerating the page fails."""
import dataclasses
import os

import pytest

from megainfer.config import DeployPlan, EplbConfig
from megainfer.launch import config_doc
from repo_paths import REPO

DOC = os.path.join(REPO, "docs", "config.md")


def test_config_md_is_current():
    with open(DOC) as f:
        on_disk = f.read()
    assert on_disk == config_doc.render(), (
        "docs/config.md is stale: run `python -m megainfer.launch.config_doc > docs/config.md`")


def test_every_field_of_a_group_is_listed_once():
    text = config_doc.render()
    for group, cls in (("deploy", DeployPlan), ("eplb", EplbConfig)):
        for f in dataclasses.fields(cls):
            assert text.count(f"| `{group}.{f.name}` |") == 1, f"{group}.{f.name}"
    assert text.count("| `cache.memory_gib` |") == 1  # a launcher key of no dataclass


def test_field_comments_read_trailing_and_preceding_comments():
    @dataclasses.dataclass(frozen=True)
    class Demo:
        a: int = 1  # trailing
        # above, line one
        # line two
        b: str = "x"
        c: float = 0.0

    notes = config_doc.field_comments(Demo)
    assert notes == {"a": "trailing", "b": "above, line one line two"}


def test_a_key_without_a_meaning_is_refused(monkeypatch):
    monkeypatch.setattr(config_doc, "field_comments", lambda cls: {})
    real = config_doc.launch_presets

    def no_yaml_notes():
        values, notes, keys = real()
        return values, {g: {} for g in notes}, keys

    monkeypatch.setattr(config_doc, "launch_presets", no_yaml_notes)
    with pytest.raises(ValueError, match="no meaning"):
        config_doc.launch_rows()
