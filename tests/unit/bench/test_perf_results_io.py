"""megainfer/bench/results_io.write_json: makes folders, replaces the old file whole, leaves no temp."""
import json
import os

import pytest


@pytest.fixture(scope="module")
def results_io():
    from megainfer.bench import results_io
    return results_io


def test_write_json_makes_folders_and_replaces(results_io, tmp_path, capsys):
    path = tmp_path / "a" / "b" / "r.json"
    assert results_io.write_json(path, {"x": 1}) == str(path)
    assert json.loads(path.read_text()) == {"x": 1}
    assert f"wrote {path}" in capsys.readouterr().out
    results_io.write_json(path, [1, 2], quiet=True)
    assert json.loads(path.read_text()) == [1, 2]
    assert capsys.readouterr().out == ""
    assert sorted(os.listdir(path.parent)) == ["r.json"]  # no temp file left behind


def test_write_json_failure_keeps_the_previous_file(results_io, tmp_path):
    path = tmp_path / "r.json"
    results_io.write_json(path, {"ok": True}, quiet=True)
    with pytest.raises(TypeError):  # not JSON-serialisable: fails while writing the temp file
        results_io.write_json(path, {"bad": object()}, quiet=True)
    assert json.loads(path.read_text()) == {"ok": True}
    assert sorted(os.listdir(tmp_path)) == ["r.json"]
