"""The offline job's input handling: bad lines as error records (or refused with io.strict),
"messages" lines through the chat template, an output that cannot be written."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from megainfer.launch.inputs import BadLine, InputFileError, job_requests
from megainfer.launch.job import run_offline_job
from megainfer.launch.main import single_generator
from megainfer.config.offline_job import OutputFileError, check_output_path
from megainfer.engine.job_doors import settings_from_config

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

GOOD = [
    {"id": "a", "prompt": "hello"},
    {"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 2}},
    {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
]
BAD = [  # (line, id of its error record (None: the line number), reason fragment)
    ('{"id": "x", "prompt": "a"', None, "not valid JSON"),
    ("[1, 2]", None, "must be a JSON object, got list"),
    ('{"id": "k", "promt": "a"}', "k", "unknown key 'promt'"),
    ('{"id": "n"}', "n", "give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"),
    ('{"id": "b", "prompt": "a", "prompt_token_ids": [1]}', "b", "(got prompt, prompt_token_ids)"),
    ('{"id": "a", "prompt": "again"}', None, "duplicate id 'a' (first on line 1)"),
    ('{"id": "s", "prompt": "a", "sampling": {"top_p": 0}}', "s", "sampling.top_p=0"),
    ('{"id": "t", "prompt": "a", "sampling": {"temp": 1}}', "t", "sampling: "),
    ('{"id": "m", "messages": "hi"}', "m", "'messages' must be a non-empty list"),
    ('{"id": "r", "messages": [{"content": "hi"}]}', "r", "messages: messages[0]: 'role'"),
    ('{"id": true, "prompt": "a"}', None, "'id' must be a string or an integer"),
]


def _settings(*overrides):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, 1)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts, tmp_path_factory):
    d = tmp_path_factory.mktemp("chatjob") / "ckpt"
    shutil.copytree(tiny_ckpts[("mixtral", "base")], d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                         "bos_token": "<s>"}))
    return str(d)


def _write_input(path):
    lines = [json.dumps(g) for g in GOOD] + [b for b, _, _ in BAD]
    path.write_text("\n".join(lines) + "\n")
    return {len(GOOD) + 1 + i: (rid, msg) for i, (_, rid, msg) in enumerate(BAD)}


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_bad_lines_become_error_records(ckpt, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out" / "gen.jsonl"
    bad = _write_input(inp)
    s = _settings(f"model.path={ckpt}", f"io.input={inp}", f"io.output={out}",
                  "sampling.max_tokens=3", "sampling.ignore_eos=true")
    reqs = job_requests(s)
    chat = next(r for r in reqs if r.request_id == "chat")
    assert chat.prompt is None and chat.prompt_token_ids == list(b"<s><user>hi<assistant>")
    summary = run_offline_job(reqs, single_generator(s), str(out), progress=False)
    assert (summary.requests, summary.errors) == (len(GOOD), len(BAD))
    recs = _records(out)
    errors = [r for r in recs if r["finish_reason"] == "error"]
    assert len(errors) == len(BAD) and len(recs) == len(GOOD) + len(BAD)
    for rec, (lineno, (rid, msg)) in zip(errors, sorted(bad.items())):
        assert rec["id"] == (lineno if rid is None else rid)
        assert rec["error"].startswith(f"{inp}:{lineno}: ") and msg in rec["error"], rec
    good = {r["id"]: r for r in recs if r["finish_reason"] != "error"}
    assert sorted(good, key=str) == [2, "a", "chat"] and len(good[2]["token_ids"]) == 2
    # resume: everything is done, error records included
    again = run_offline_job(job_requests(s), single_generator(s), str(out), progress=False)
    assert again.skipped == len(GOOD) + len(BAD) and again.requests == again.errors == 0


def test_resume_after_fixing_a_bad_line_runs_it_exactly_once(ckpt, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "gen.jsonl"
    good = ['{"id": "a", "prompt": "hello"}', '{"id": "b", "prompt_token_ids": [5, 6]}']
    inp.write_text("\n".join(good + ['{"id": "k", "promt": "fixed later"}', '[1]']) + "\n")
    s = _settings(f"model.path={ckpt}", f"io.input={inp}", f"io.output={out}",
                  "sampling.max_tokens=3", "sampling.ignore_eos=true")
    first = run_offline_job(job_requests(s), single_generator(s), str(out), progress=False)
    assert (first.new, first.retried, first.skipped, first.requests, first.errors) == (4, 0, 0, 2, 2)
    inp.write_text("\n".join(good + ['{"id": "k", "prompt": "fixed"}', '[1]']) + "\n")
    gen = single_generator(s)
    asked = []
    stream = gen.generate_stream
    gen.generate_stream = lambda reqs: (asked.extend(r.request_id for r in reqs), stream(reqs))[1]
    again = run_offline_job(job_requests(s), gen, str(out), progress=False)
    assert asked == ["k"]  # the fixed line alone; the still-bad line 4 keeps its record
    assert (again.new, again.retried, again.skipped, again.requests, again.errors) == (0, 1, 3, 1, 0)
    assert "4: 0 new, 1 retried, 3 skipped" in again.table()
    recs = _records(out)
    assert sorted(str(r["id"]) for r in recs) == ["4", "a", "b", "k"]  # one line per id
    k = next(r for r in recs if r["id"] == "k")
    assert k["finish_reason"] == "length" and len(k["token_ids"]) == 3
    third = run_offline_job(job_requests(s), single_generator(s), str(out), progress=False)
    assert (third.new, third.retried, third.skipped) == (0, 0, 4) and len(_records(out)) == 4


def test_strict_refuses_the_file_listing_every_bad_line(ckpt, tmp_path):
    inp = tmp_path / "in.jsonl"
    bad = _write_input(inp)
    s = _settings(f"model.path={ckpt}", f"io.input={inp}", "io.strict=true")
    with pytest.raises(InputFileError) as info:
        job_requests(s)
    msg = str(info.value)
    assert f"{len(BAD)} bad line(s)" in msg and "io.strict=true" in msg
    for lineno, (_, reason) in bad.items():
        assert f"{inp}:{lineno}: " in msg and reason in msg
    assert f"{inp}:1:" not in msg


def test_messages_without_a_template_and_non_utf8(tiny_ckpts, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": 1, "messages": [{"role": "user", "content": "hi"}]}\n'
                    b'{"id": 2, "prompt": "\xff"}\n{"id": 3, "prompt": "fine"}\n')
    s = _settings(f"model.path={tiny_ckpts[('mixtral', 'base')]}", f"io.input={inp}")
    reqs = job_requests(s)
    assert [type(r) for r in reqs] == [BadLine, BadLine, type(reqs[2])] and reqs[2].prompt == "fine"
    assert "has no chat template" in reqs[0].error and reqs[0].request_id == 1
    assert f"{inp}:2: not UTF-8" in reqs[1].error and reqs[1].request_id == 2
    s = _settings(f"io.input={inp}")  # the dummy preset: no checkpoint, no template
    assert "has no chat template" in job_requests(s)[0].error


def test_unwritable_output_is_refused_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    cases = [(tmp_path / "dir", "is a directory"),
             (tmp_path / "file" / "sub" / "out.jsonl", "is a file, not a directory")]
    for path, msg in cases:
        with pytest.raises(OutputFileError, match=msg):
            _settings(f"io.output={path}")
    check_output_path(str(tmp_path / "new" / "deeper" / "out.jsonl"))  # creatable: fine
    assert not (tmp_path / "new").exists()  # and nothing was created by the check
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # as a user without permission
    with pytest.raises(OutputFileError, match="no permission to write in"):
        check_output_path(str(tmp_path / "new" / "out.jsonl"))
    (tmp_path / "old.jsonl").write_text("")
    with pytest.raises(OutputFileError, match="no permission to write it"):
        check_output_path(str(tmp_path / "old.jsonl"))
    monkeypatch.undo()

    class NoWork:
        def generate_stream(self, reqs):
            raise AssertionError("the generator must not be asked")
    with pytest.raises(OutputFileError, match="cannot write it"):
        run_offline_job([], NoWork(), str(tmp_path / "dir"), progress=False)


def test_console_unwritable_output_is_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    r = subprocess.run([sys.executable, "-m", "megainfer.launch.main", f"io.output={tmp_path}/f/o.jsonl",
                        f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and "OutputFileError" in r.stderr and "Traceback" not in r.stderr


def test_structured_outputs_per_line(ckpt, tmp_path):
    """A line's ``sampling.structured_outputs`` holds its output to its grammar; a bad spec or
    one that does not compile is that line's error record, naming the field."""
    import re

    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]},
                                               "v": {"type": "boolean"}},
              "required": ["k", "v"], "additionalProperties": False}
    lines = [{"id": "j", "prompt": "a", "sampling": {"structured_outputs": {"json": schema}}},
             {"id": "r", "prompt": "b", "sampling": {"structured_outputs": {"regex": "[0-9]{4}"}}},
             {"id": "bad", "prompt": "c", "sampling": {"structured_outputs": {"json": 3}}},
             {"id": "nc", "prompt": "d", "sampling": {"structured_outputs": {
                 "grammar": "root ::= missing"}}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "gen.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    s = _settings(f"model.path={ckpt}", f"io.input={inp}", f"io.output={out}",
                  "sampling.max_tokens=40", "sampling.temperature=1.0")
    run_offline_job(job_requests(s), single_generator(s), str(out), progress=False)
    recs = {r["id"]: r for r in _records(out)}
    assert json.loads(recs["j"]["text"])["k"] in ("x", "y")
    assert re.fullmatch("[0-9]{4}", recs["r"]["text"])
    assert recs["bad"]["finish_reason"] == "error"
    assert "sampling.structured_outputs.json" in recs["bad"]["error"]
    assert recs["nc"]["finish_reason"] == "error"
    assert "structured_outputs.grammar: does not compile" in recs["nc"]["error"]
