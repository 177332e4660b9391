"""What a request body asks its output to follow: OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``strict``) or vLLM's ``structured_outputs`` extra body,
as the engine's ``StructuredOutputsParams`` (a 400 naming the field otherwise)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from megainfer.engine import SamplingParamsError, StructuredOutputsParams

from .errors import APIError


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextFormat(_Format):
    type: Literal["text"]


class JsonObjectFormat(_Format):
    type: Literal["json_object"]


class JsonSchemaSpec(_Format):
    """OpenAI's ``json_schema``: ``schema`` is the JSON Schema the output follows; ``strict``
    is accepted either way (the grammar always holds the output to the schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class JsonSchemaFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Union[TextFormat, JsonObjectFormat, JsonSchemaFormat]


def structured_spec(response_format: Optional[ResponseFormat],
                    structured_outputs: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """The body's grammar, or None (plain text); both fields set: a 400."""
    fmt = None if isinstance(response_format, TextFormat) else response_format
    if fmt is not None and structured_outputs is not None:
        raise APIError("response_format and structured_outputs: give at most one", 400,
                       "structured_outputs")
    try:
        if structured_outputs is not None:
            return StructuredOutputsParams.of(structured_outputs)
        if isinstance(fmt, JsonObjectFormat):
            return StructuredOutputsParams(json_object=True)
        if isinstance(fmt, JsonSchemaFormat):
            schema = fmt.json_schema.json_schema
            return StructuredOutputsParams(json=schema if schema is not None else {})
    except SamplingParamsError as e:
        field = "structured_outputs" if structured_outputs is not None else "response_format"
        text = str(e) if field == "structured_outputs" else \
            str(e).replace("structured_outputs.json", "response_format.json_schema.schema", 1)
        raise APIError(text, 400, field) from e
    return None
