"""A schema fuzzer (schemathesis, pinned in ``dev``) against a live megainfer-serve (single mode,
the API key set): a few hundred generated requests, valid and invalid per ``/openapi.json``,
and none may get a 5xx, an undeclared status or content type, or no answer within its bound.
A schema-valid request the server refuses is allowed (a 400 for what the schema cannot say:
an empty prompt, a token id beyond the vocabulary, n over serve.max_n). The longer run is in
docs/serve.md, "Fuzzing"."""
import os
import re
import subprocess

import pytest

from serve_util import BIN, CHAT_TEMPLATE, ThreadServer

KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=300,
          block_size=4)
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "ignored_auth")


def fuzz_command(url: str, key: str, examples: int, seed: int) -> list[str]:
    return [os.path.join(BIN, "st"), "run", f"{url}/openapi.json", "-H",
            f"Authorization: Bearer {key}", "--checks", CHECKS, "-n", str(examples),
            "--seed", str(seed), "--request-timeout", "20", "--max-response-time", "20",
            "--generation-deterministic"]


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "st")), reason="needs schemathesis")
def test_a_schema_fuzzer_finds_no_5xx_and_no_undeclared_status(tiny_ckpts, tmp_path):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=KW, api_key="k",
                     chat_template=CHAT_TEMPLATE, max_n=4)
    try:
        run = subprocess.run(fuzz_command(s.url, "k", 20, 1), capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)  # its files stay out of the tree
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert counts and int(counts.group(1)) >= 300, run.stdout[-3000:]  # a few hundred
        assert s.thread.is_alive()
    finally:
        s.close()
