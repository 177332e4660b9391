"""Every file and code name that docs/*.md and README.md mention exists in the tree.

Paths (backticked, in prose, code blocks, commands): ``dir/file.ext``, ``dir/``, ``dir/module``
from the root or ``megainfer/`` (its kernels/, launch/, conf/ are top-level), or the suffix of
one tracked path; ``name.py`` a tracked basename; ``dir/module.name`` also needs ``name``
there (``rev:path``, git history, is not checked). Backticked names: ``CamelCase``,
``name(...)``, ``A.b`` / ``module.func`` defined (class, def, assignment, field, import) in the
tree's Python, each part where the one before says: a package's __init__ or module, a
module's top level, a class's or its bases' files; after a variable, anywhere. Skipped: config
keys (docs/config.md), builtins, the standard library, ``NOT_OURS`` and ``ARTIFACTS``.
"""
import builtins
import fnmatch
import functools
import os
import re
import subprocess
import sys

from repo_paths import REPO

ARTIFACTS = {  # files a run writes or a checkpoint holds, never tracked
    "trace.json", "timeline.png", "summary.json", "generations.jsonl",  # a run's outputs
    "cpu_calibrated.yaml",  # what `megainfer-plan calibrate` writes
    "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",  # HF's
}
NOT_OURS = {  # not this tree's code; nor is a dotted name whose first part is here
    "torch", "Tensor", "Stream", "Event", "mkl", "to_dense", "topk",  # torch's
    "triton", "cdiv", "vllm", "sglang", "transformers", "openai", "deepspeed",
    "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV2TopkRouter",  # HF's classes
    "Isend", "Irecv", "Iallreduce", "Startall", "Testall", "Test",  # mpi4py's methods
    "DtoHAsync", "sched_yield",  # the CUDA driver's and libc's calls
    "loop.call_soon_threadsafe",  # asyncio's event loop, not replicas/loop.py
    "argmax", "T_a",  # maths: argmax(p / E), the perf model's T_a(b, ctx)
    "chat.completion.chunk",  # an OpenAI object type
    "group.key", "args.iter", "targets.compute_loss_with_traffic",  # placeholders, JSON keys
    "calibrate_bench50m.host_terms",  # a key of that script's output JSON
}
EXTS = r"(?:py|md|yaml|yml|json|jsonl|sh|txt|png|toml|jinja|csv|c|cfg|ini)"
TICKED = re.compile(r"`([^`\n]+)`")
BARE_FILE = re.compile(r"(?<![\w./$:~@-])((?:[\w.-]+/)+[\w*-][\w.*-]*\." + EXTS + r")\b")
SLASHED = re.compile(r"[\w.-]+(?:/[\w.*-]+)+/?")
CALL = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?")
CLASS = re.compile(r"^[ \t]*class\s+(\w+)\s*(?:\(([^)]*)\))?", re.M)
ALIAS = {f"megainfer/{d}/": f"{d}/" for d in ("kernels", "launch", "conf")}  # setup.py's


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(None)
def tracked():
    """(tracked files, their folders, the folders' names)."""
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    files = [f for f in out.stdout.split() if os.path.exists(os.path.join(REPO, f))]
    dirs = {f[:i] for f in files for i, c in enumerate(f) if c == "/"}
    return files, dirs, {os.path.basename(d) for d in dirs}


def defined(text):
    """The names a Python file defines or imports: (at top level, anywhere, as ``self.x``)."""
    top, every, attrs = set(), set(), set()
    for m in re.finditer(r"^([ \t]*)(?:(?:async\s+def|def|class)\s+(\w+)|from\s+[\w.]+\s+import\s+"
                         r"(\([^)]*\)|.*)|import\s+(.*))", text, re.M):
        names = {m.group(2)} if m.group(2) else {
            p.split()[-1].split(".")[0] for p in (m.group(3) or m.group(4)).strip("()").split(",")
            if p.strip()}
        every |= names
        top |= set() if m.group(1) else names
    every |= set(re.findall(r"^[ \t]+(\w+)\s*:\s*[\w\"'\[]", text, re.M))  # dataclass fields
    for line in text.splitlines():
        lhs = re.split(r"(?<![=!<>])=(?!=)", line)
        if len(lhs) > 1 and "(" not in lhs[0]:  # a, b = ... / self.x: int = ... / x[i] = ...
            names = re.findall(r"(?:^|,)\s*(self\.)?(\w+)", lhs[0].split(":")[0])
            every |= {n for _, n in names}
            attrs |= {n for s, n in names if s}
            top |= set() if line[:1].isspace() else {n for _, n in names}
    return top, every, attrs


@functools.lru_cache(None)
def python():
    """{file: defined(its text)}, {class: its files}, {class: its bases}."""
    defs, classes, bases = {}, {}, {}
    for f in tracked()[0]:
        if f.endswith(".py"):
            text = read(f)
            defs[f] = defined(text)
            for m in CLASS.finditer(text):
                classes.setdefault(m.group(1), set()).add(f)
                bases.setdefault(m.group(1), set()).update(re.findall(r"\w+", m.group(2) or ""))
    return defs, classes, bases


def real(p):
    """A path as it is in the tree: megainfer/kernels/x -> kernels/x."""
    for alias, folder in ALIAS.items():
        p = (folder + (p + "/")[len(alias):]).rstrip("/") if (p + "/").startswith(alias) else p
    return p


def path_ok(p):
    files, dirs, _ = tracked()
    p = real(p.removeprefix("./").rstrip("/"))
    for q in (p, "megainfer/" + p):
        if q in files or q in dirs or "*" in q and any(fnmatch.fnmatch(f, q) for f in files):
            return True
    return sum(f.endswith("/" + p) for f in files + sorted(dirs)) == 1


def scope(part, within=None):
    """Where what follows `part` is defined: (folders, top-level files, any-level files) of
    the package, module or class `part` (under `within`'s folders), or None."""
    defs, classes, bases = python()
    if within is None:
        folders = {d for d in tracked()[1] if os.path.basename(d) == part}
        tops = {f for f in defs if f[:-3].rsplit("/", 1)[-1] == part}
    else:
        folders = {real(f"{d}/{part}") for d in within[0]} & tracked()[1]
        tops = {real(f"{d}/{part}.py") for d in within[0]} & set(defs)
    tops |= {f"{d}/__init__.py" for d in folders} & set(defs)
    anys, todo = set(), [part]
    while todo:  # a class's files and its bases'
        c = todo.pop()
        if c in classes and not classes[c] <= anys:
            anys |= classes[c]
            todo += bases[c]
    return (folders, tops, anys) if folders or tops or anys else None


def name_ok(dotted):
    defs = python()[0]
    anywhere = lambda name: any(name in d[1] for d in defs.values()) or scope(name)  # noqa: E731
    first, *rest = dotted.split(".")
    if not anywhere(first):
        return False
    within = None if any(first in d[2] for d in defs.values()) else scope(first)  # model.x
    for part in rest:
        if within is None:  # after a variable or an attribute: anywhere
            if not anywhere(part):
                return False
            continue
        _, tops, anys = within
        if not any(part in defs[f][0] for f in tops) and not any(part in defs[f][1] for f in anys) \
                and not scope(part, within):
            return False
        within = scope(part) if part in python()[1] else scope(part, within)
    return True


def problem(tick, config_keys):
    """Why a backticked span names nothing in the tree, or None."""
    if tick in config_keys or os.path.basename(tick) in ARTIFACTS:
        return None
    if SLASHED.fullmatch(tick):
        if re.search(r"\." + EXTS + "$", tick) or tick.endswith("/") or "*" in tick:
            return None if path_ok(tick) else "no such path"
        if tick.split("/")[0] not in tracked()[2]:
            return None  # a ratio or a pair: G/n, text/plain, fp8_e4m3/token_head
        folder, _, last = tick.rpartition("/")
        module, _, attr = last.partition(".")  # runtime/pd/kv_place.place
        if not path_ok(f"{folder}/{module}.py"):
            return None if path_ok(tick) else "no such path"
        return None if not attr or name_ok(f"{module}.{attr}") else f"no {attr} in {module}"
    if re.fullmatch(r"[\w-]+\." + EXTS, tick):
        return None if any(os.path.basename(f) == tick for f in tracked()[0]) else "no such file"
    m = CALL.fullmatch(tick)
    if not m:
        return None
    name, call = m.groups()
    first = name.split(".")[0]
    if {first, name} & NOT_OURS or hasattr(builtins, first) \
            or first in sys.stdlib_module_names and not scope(first):
        return None
    if call:
        try:
            compile(tick, "", "eval")
        except SyntaxError:
            return None  # notation, not a call: min(0.5 s, comm.timeout_s / 4)
    elif "." not in name and not re.fullmatch(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*", name):
        return None  # a plain word: a role, a value, a field, a constant
    return None if name_ok(name) else "not defined in the tree's Python"


def findings():
    docs = ["README.md"] + [f for f in tracked()[0] if re.fullmatch(r"docs/[^/]+\.md", f)]
    config_keys = set(re.findall(r"^\| `([\w.]+)` \|", read("docs/config.md"), re.M))
    bad = []
    for doc in docs:
        for n, line in enumerate(read(doc).splitlines(), 1):
            for m in TICKED.finditer(line):
                why = problem(m.group(1).strip(), config_keys)
                bad += [f"{doc}:{n}: `{m.group(1)}`: {why}"] if why else []
            words = TICKED.sub(lambda m: m.group() if " " in m.group() else " ", line)
            for m in BARE_FILE.finditer(words):  # prose, code blocks, commands in backticks
                if os.path.basename(m.group(1)) not in ARTIFACTS and not path_ok(m.group(1)):
                    bad.append(f"{doc}:{n}: {m.group(1)}: no such path")
    return bad


def test_docs_name_only_real_files_and_code():
    bad = findings()
    assert not bad, "the docs name what the tree lacks:\n" + "\n".join(bad)


def test_the_check_tells_real_from_stale():
    ok = ["megainfer/launch/serve.py", "runtime/runtime_engine.py", "scheduler.py", "perf/results/*.json",
          "runtime/pd/kv_place.place", "megainfer.kernels.fused_moe", "LLM.generate",
          "engine_core.builder.start_ranks(job)", "tags.STATUS", "torch.compile", "serve.max_n"]
    stale = ["runtime/kv_place", "runtime/microbatch.split_by_tokens", "replan_requests.py",
             "megainfer.config.resolve", "core_client.errors.RankLostError", "JobSpec",
             "LLM.generate_all", "tags.NO_SUCH_TAG", "core_client.start_ranks(job)",
             "core_client.ranks.start_ranks(job)", "replicas/online.py"]
    assert [t for t in ok if problem(t, {"serve.max_n"})] == []
    assert [t for t in stale if not problem(t, set())] == []
