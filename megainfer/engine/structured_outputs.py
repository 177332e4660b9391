"""vLLM's ``StructuredOutputsParams``: which grammar a request's output must follow, checked on
construction (a ``SamplingParamsError`` naming the field). It holds only plain data (it travels
pickled to the ranks that sample); ``grammar.py`` compiles it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from .errors import SamplingParamsError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace", "start_after")


def _fail(name: str, value, why: str) -> None:
    raise SamplingParamsError(f"structured_outputs.{name}={_short(value)}: {why}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex`` (a
    regular expression the whole output matches), ``choice`` (the output is one of these
    strings), ``grammar`` (EBNF, xgrammar's GBNF dialect, root rule ``root``), ``json_object``
    (any JSON object). ``disable_any_whitespace``: JSON without free whitespace between tokens
    (one canonical layout; a weak model cannot wander in spaces). ``start_after`` (megainfer's):
    the output is free until its text contains this marker (a reasoning model's ``</think>``),
    the grammar applies to what follows. ``json`` is kept as canonical
    JSON text (key order kept: it is the output's): equal schemas share one compiled grammar."""

    json: Union[str, dict, bool, None] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = True
    start_after: Optional[str] = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                f"structured_outputs: give exactly one of {', '.join(KINDS)} "
                f"(got {', '.join(given) or 'none'})")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            _fail("regex", self.regex, "must be a non-empty string")
        if self.choice is not None:
            c = self.choice
            if not (isinstance(c, (list, tuple)) and c and all(isinstance(s, str) and s
                                                                for s in c)):
                _fail("choice", c, "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(c))
        if self.grammar is not None and not (isinstance(self.grammar, str)
                                             and self.grammar.strip()):
            _fail("grammar", self.grammar, "must be a non-empty EBNF string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail("json_object", self.json_object, "must be true or false")
        if self.start_after is not None and not (isinstance(self.start_after, str)
                                                 and self.start_after):
            _fail("start_after", self.start_after, "must be a non-empty string or null")
        if not isinstance(self.disable_any_whitespace, bool):
            _fail("disable_any_whitespace", self.disable_any_whitespace, "must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace

    @classmethod
    def of(cls, value: Any) -> Optional["StructuredOutputsParams"]:
        """``value`` as a ``StructuredOutputsParams``: one already, a dict of its fields (a
        jsonl line's, a request body's), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
            if unknown:
                _fail(unknown[0], value[unknown[0]], f"unknown field (known: {', '.join(KINDS)}"
                      f", {', '.join(OPTIONS)})")
            return cls(**value)
        raise SamplingParamsError(f"structured_outputs={_short(value)}: must be a "
                                  f"StructuredOutputsParams or a dict of its fields")


def _schema_text(schema) -> str:
    """A JSON Schema (dict, bool or JSON text) as canonical JSON text; not one: an error."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            _fail("json", schema, f"not JSON text ({e})")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        _fail("json", schema, "a JSON Schema must be an object (or true)")
    _check_schema(schema, "json")
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        _fail("json", schema, f"not JSON data ({e})")


_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _check_schema(node, where: str) -> None:
    """The structural rules of JSON Schema the grammar compiler would otherwise report
    obscurely: ``type`` a known type name (or a list of them), ``properties`` an object of
    schemas, ``required`` a list of strings."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        _fail("json", node, f"{where}: a schema must be an object or a boolean")
    t = node.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) and n in _TYPES for n in names):
            _fail("json", t, f"{where}.type: must be one of {sorted(_TYPES)} or a list of them")
    props = node.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            _fail("json", props, f"{where}.properties: must be an object of schemas")
        for name, sub in props.items():
            _check_schema(sub, f"{where}.properties.{name}")
    req = node.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        _fail("json", req, f"{where}.required: must be a list of property names")
    for k in ("items", "additionalProperties", "not"):
        if isinstance(node.get(k), (dict, bool)):
            _check_schema(node[k], f"{where}.{k}")
    for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if k in node:
            if not isinstance(node[k], list):
                _fail("json", node[k], f"{where}.{k}: must be a list of schemas")
            for i, sub in enumerate(node[k]):
                _check_schema(sub, f"{where}.{k}[{i}]")
    for k in ("$defs", "definitions"):
        if isinstance(node.get(k), dict):
            for name, sub in node[k].items():
                _check_schema(sub, f"{where}.{k}.{name}")
