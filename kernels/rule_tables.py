"""Measured rule tables of the CPU matmuls: {key: {threads: [(max_rows or None, method), ...]}},
one owner for their form, their check, the table in force (the measured file, or a test's or a
tuner's override) and the lookup a decode step asks ~70 times (memoised per table in force).
``cpu_gemm.py`` (dense and expert weights) holds one ``RuleTables``; ``cpu_qgemm_rules.py``
(stored int8/int4 weights) and ``cpu_moe_rules.py`` (the expert path) one ``KeyedRules`` each
(keys missing from a table take a default's). docs/kernels.md, "CPU matmuls of dense and expert
weights".
"""
from __future__ import annotations

import contextlib
import json
from typing import Callable, Optional

import torch


def check_table(rules: dict, where: str, methods: tuple, error: type) -> dict:
    """One rule table {threads: [[max_rows or None, method], ...]}: thread keys positive
    integers, rows ascending, methods in ``methods``, a None catch-all last (else ``error``
    naming ``where``) -> int thread keys and tuple entries."""
    if not rules:
        raise error(f"{where}: empty table")
    for t, steps in rules.items():
        if not str(t).isdigit() or int(t) < 1:
            raise error(f"{where}: thread key {t!r} must be a positive integer")
        at, last = f"{where}[{t}]", 0
        for i, (rows, method) in enumerate(steps):
            if method not in methods:
                raise error(f"{at}[{i}]: method {method!r} not in {methods}")
            if rows is None and i != len(steps) - 1:
                raise error(f"{at}[{i}]: None must be the last entry")
            if rows is not None and rows <= last:
                raise error(f"{at}[{i}]: max rows {rows} not ascending")
            last = rows or last
        if not steps or steps[-1][0] is not None:
            raise error(f"{at}: the last entry must be [None, method]")
    return {int(t): [tuple(s) for s in steps] for t, steps in rules.items()}


class RuleTables:
    """``load() -> {key: table}`` (checked; called once, at the first lookup); ``resolve(rules)
    -> {key: table}``: a caller's tables as they take effect under ``use``."""

    def __init__(self, load: Callable[[], dict], resolve: Callable[[dict], dict]):
        self.load, self.resolve = load, resolve
        self.measured: Optional[dict] = None
        self.override: Optional[dict] = None
        self.memo: dict = {}  # (key, rows, threads) -> method under the tables in force

    @contextlib.contextmanager
    def use(self, rules: Optional[dict]):
        """Run a block under other tables; None: the measured ones."""
        prev, self.override = self.override, None if rules is None else self.resolve(rules)
        self.memo.clear()
        try:
            yield
        finally:
            self.override = prev
            self.memo.clear()

    def method(self, key: str, rows: int, threads: Optional[int] = None) -> str:
        """The method for ``rows`` rows at ``threads`` (default: torch's): the entry of the
        largest thread key <= threads (the smallest key if none is)."""
        t = torch.get_num_threads() if threads is None else threads
        method = self.memo.get((key, rows, t))
        if method is None:
            if self.override is None and self.measured is None:
                self.measured = self.load()
            rules = (self.override if self.override is not None else self.measured)[key]
            keys = sorted(rules)
            steps = rules[max((k for k in keys if k <= t), default=keys[0])]
            method = self.memo[(key, rows, t)] = next(m for r, m in steps
                                                      if r is None or rows <= r)
        return method


class KeyedRules:
    """Tables for some of ``keys`` (a file's, a caller's), each key missing from them taking
    ``default``'s: the form ``cpu_qgemm_rules.py`` and ``cpu_moe_rules.py`` share. ``path``: the
    measured JSON (``{"rules": {key: table}}``), read at the first lookup; ``error``: raised
    naming a bad entry (``label`` says whose)."""

    def __init__(self, keys: tuple, default: dict, path, methods: tuple, error: type,
                 label: str):
        self.keys, self.default, self.path = keys, default, path
        self.methods, self.error, self.label = methods, error, label
        self.tables = RuleTables(self._load, lambda rules: {**self.check(default),
                                                            **self.check(rules)})

    def check(self, rules: dict) -> dict:
        """{key: {threads: [[max_rows or None, method], ...]}} (keys a subset of ``keys``) ->
        int thread keys and tuple entries."""
        out = {}
        for key, table in rules.items():
            if key not in self.keys:
                raise self.error(f"{self.label}: key {key!r} not in {self.keys}")
            out[key] = check_table(table, f"{self.label}[{key}]", self.methods, self.error)
        return out

    def _load(self) -> dict:
        rules = self.check(self.default)
        if self.path.exists():
            with open(self.path) as f:
                rules.update(self.check(json.load(f)["rules"]))
        return rules

    def use(self, rules: Optional[dict]):
        """Run a block under another table (keys missing from it take ``default``'s); None:
        the measured table."""
        return self.tables.use(rules)

    def method(self, key: str, rows: int, threads: Optional[int] = None) -> str:
        return self.tables.method(key, rows, threads)
