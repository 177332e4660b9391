"""A chat request's ``tools`` and ``tool_choice`` (OpenAI's and vLLM's semantics): which
output format to read calls from and, for ``required`` and a named function, the grammar that
makes the model call (vLLM's: a JSON list of ``{"name", "parameters"}`` objects, or the named
function's arguments), each function's ``parameters`` checked as a JSON Schema."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from megainfer.config import ServeConfig
from megainfer.engine import SamplingParamsError, StructuredOutputsParams

from .errors import APIError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read: ``fmt`` a ``tool_parsers`` format (None: no calls),
    ``name`` the named function, ``grammar`` what constrains the output (None: nothing)."""

    fmt: Optional[str] = None
    name: Optional[str] = None
    grammar: Optional[StructuredOutputsParams] = None


def _params_schema(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def tool_plan(tools: Optional[list[Tool]], choice: Optional[ToolChoice],
              cfg: ServeConfig, parallel: bool = True) -> ToolPlan:
    """The plan of a request; a 400 naming ``tools`` or ``tool_choice`` when they do not fit
    (a choice without tools, an unknown function, ``auto`` on a server without a parser).
    ``parallel`` false (``parallel_tool_calls``): ``required`` makes exactly one call."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice: needs tools", 400, "tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be distinct", 400, "tools")
    for i, t in enumerate(tools):  # each schema checked now, naming the tool
        try:
            StructuredOutputsParams(json=_params_schema(t.function))
        except SamplingParamsError as e:
            raise APIError(f"tools[{i}].function.parameters: {e}", 400,
                           f"tools.{i}.function.parameters") from e
    auto = cfg.enable_auto_tool_choice and cfg.tool_call_parser is not None
    if choice is None:
        choice = "auto" if auto else "none"
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not auto:
            raise APIError('tool_choice="auto": needs serve.enable_auto_tool_choice=true and '
                           'serve.tool_call_parser', 400, "tool_choice")
        return ToolPlan(cfg.tool_call_parser)
    if choice == "required":
        items = [{"type": "object", "properties": {
            "name": {"const": t.function.name}, "parameters": _params_schema(t.function)},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("json_list", grammar=StructuredOutputsParams(json=schema))
    name = choice.function.name
    if name not in names:
        raise APIError(f"tool_choice.function.name={name!r}: not one of the tools "
                       f"({', '.join(names)})", 400, "tool_choice")
    schema = _params_schema(tools[names.index(name)].function)
    return ToolPlan("arguments", name, StructuredOutputsParams(json=schema))


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
