"""``megainfer-bench-serve``'s traces: Azure and BurstGPT CSV and jsonl read with times from the
first request, bad rows named; synthetic phases at their rates and lengths; and a replay against
a server sends each request at its time, open loop, with results per phase and the timeline."""
import json
import time

import pytest

from megainfer.bench import serve_load as bench
from megainfer.bench import serve_trace as tr
from serve_util import ThreadServer


def test_azure_and_burstgpt_csv_and_jsonl(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:47.1805900,374,44\n"
                     "2023-11-16 18:15:46.6805900,4808,10\n")
    rows = tr.read_trace(str(azure))
    assert [(r.input_len, r.output_len) for r in rows] == [(4808, 10), (374, 44)]
    assert rows[0].at == 0.0 and rows[1].at == pytest.approx(0.5)
    burst = tmp_path / "burst.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n"
                     "7.5,GPT-4,1087,0,1087,Conversation log\n"  # failed: no response
                     "9,GPT-4,20,200,220,API log\n")
    rows = tr.read_trace(str(burst))
    assert [(r.at, r.input_len, r.output_len) for r in rows] == [(0.0, 472, 18), (4.0, 20, 200)]
    js = tmp_path / "t.jsonl"
    js.write_text('{"timestamp": 10, "input_len": 3, "output_len": 2, "phase": "a"}\n\n'
                  '{"timestamp": 12.5, "input_len": 4, "output_len": 1}\n')
    assert tr.read_trace(str(js)) == [tr.TraceRow(0.0, 3, 2, "a"), tr.TraceRow(2.5, 4, 1, "")]


@pytest.mark.parametrize("text,words", [
    ("a,b\n1,2\n", "a CSV header with one of"),
    ("timestamp,input_len,output_len\n1,x,3\n", ":2: input_len='x' is not a token count"),
    ("timestamp,input_len,output_len\nnoon,1,3\n", ":2: timestamp 'noon' is neither"),
    ("timestamp,input_len,output_len\n", "no requests"),
])
def test_bad_trace_files_are_named(tmp_path, text, words):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=words):
        tr.read_trace(str(p))


def test_synthetic_phases_keep_their_rates_and_lengths(tmp_path):
    shape = tr.parse_shape("prompt_heavy_burst:200, decode_heavy_steady:200")
    rows = tr.make_trace(shape, rate=2.0, input_len=100, output_len=40, seed=3)
    assert rows == tr.make_trace(shape, rate=2.0, input_len=100, output_len=40, seed=3)
    burst = [r for r in rows if r.phase == "prompt_heavy_burst"]
    steady = [r for r in rows if r.phase == "decode_heavy_steady"]
    assert all(r.at < 200 for r in burst) and all(200 <= r.at < 400 for r in steady)
    assert len(burst) / 200 == pytest.approx(4.0, rel=0.3)  # 2 x the base rate (bursty)
    assert len(steady) / 200 == pytest.approx(2.0, rel=0.2)
    assert all(300 <= r.input_len <= 500 and 7 <= r.output_len <= 12 for r in burst)
    assert all(18 <= r.input_len <= 32 and 120 <= r.output_len <= 200 for r in steady)
    capped = tr.make_trace(tr.parse_shape("long_context_spike:50"), 1.0, 100, 40, max_len=300)
    assert all(r.input_len + r.output_len <= 300 for r in capped)
    out = tmp_path / "s.jsonl"
    tr.write_trace(rows, str(out))
    assert tr.read_trace(str(out)) == rows
    for bad, words in (("nosuch:5", "is not one of"), ("steady", "give the phase's seconds"),
                       ("steady:0", "must be > 0"), ("", "no phases")):
        with pytest.raises(ValueError, match=words):
            tr.parse_shape(bad)


def test_replay_sends_at_the_traces_times_with_results_per_phase(tiny_ckpts, tmp_path,
                                                                 capsys):
    trace = tmp_path / "t.jsonl"
    rows = [tr.TraceRow(0.0, 6, 4, "first"), tr.TraceRow(0.1, 5, 3, "first"),
            tr.TraceRow(1.2, 8, 5, "second"), tr.TraceRow(1.25, 4, 2, "second")]
    tr.write_trace(rows, str(trace))
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=dict(
        max_model_len=128, max_num_seqs=8, num_blocks=128, block_size=4))
    try:
        t0 = time.monotonic()
        rc = bench.main(["--base-url", s.url, "--model", "tiny", "--trace", str(trace),
                         "--ignore-eos", "--goodput", "ttft:60000", "--save-result",
                         "--result-dir", str(tmp_path), "--result-filename", "r.json",
                         "--metric-percentiles", "50", "--disable-tqdm",
                         "--timeline", str(tmp_path / "timeline.png")])
        took = time.monotonic() - t0
    finally:
        s.close()
    assert rc == 0 and took >= 1.25
    out = capsys.readouterr().out
    assert "p50 TTFT" in out and "second" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["completed"] == 4 and d["total_output_tokens"] == 14
    assert d["phase_of"] == ["first", "first", "second", "second"]
    for sent, row in zip(d["sent_at"], rows):  # open loop: at the trace's times
        assert row.at <= sent < row.at + 0.5
    assert d["phases"]["first"]["completed"] == 2 and d["phases"]["second"]["completed"] == 2
    assert d["phases"]["second"]["total_output_tokens"] == 7
    assert d["replan_switches_s"] == []  # no re-planning server: no switch seen
    pytest.importorskip("matplotlib")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
