"""Chat templates: the checkpoint's Jinja template, rendered in a sandbox as Hugging Face does.

The template comes from the checkpoint directory: ``chat_template.jinja``, else the
``chat_template`` key of ``tokenizer_config.json`` (a string, or named templates: ``default``).
A template is untrusted code: it renders in Jinja's ``ImmutableSandboxedEnvironment`` with
transformers' ``apply_chat_template`` settings and helpers, sees only plain JSON data, and an
unsafe attribute is refused at once. Anything that goes wrong (no template, a syntax error, a
sandbox violation, ``raise_exception``, malformed messages) is a ``ChatTemplateError``. The
rendered text holds the template's special tokens, so ``encode_chat`` adds none again.
docs/engine.md, "Python API"."""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import RequestError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(RequestError):
    """No chat template, or the template or the messages failed to render (a ``ValueError``)."""


def _tokenizer_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: cannot read ({e})") from e
    if not isinstance(d, dict):
        raise ChatTemplateError(f"{path}: must be a JSON object")
    return d


def load_chat_template(model_dir: Optional[str]) -> Optional[str]:
    """The checkpoint's chat template, or None when it has none (or there is no directory)."""
    if not model_dir:
        return None
    jinja = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    t = _tokenizer_config(model_dir).get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    if t is not None and not isinstance(t, str):
        raise ChatTemplateError(f"{os.path.join(model_dir, TOKENIZER_CONFIG)}: chat_template "
                                "must be a string or a list of named templates")
    return t


def load_special_tokens(model_dir: Optional[str]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... from ``tokenizer_config.json`` (strings or AddedToken
    dicts), for the template to use."""
    if not model_dir:
        return {}
    d = _tokenizer_config(model_dir)
    out = {}
    for k in SPECIAL_TOKEN_KEYS:
        v = d.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


@lru_cache(maxsize=16)
def _compile(template: str):

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): the body as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return call.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing underscore-prefixed attributes (no route to internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"namespace attribute {name!r}: underscore-prefixed names are refused")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class Sandbox(ImmutableSandboxedEnvironment):
        """An unsafe attribute is an error at once (Jinja's default renders it as an empty
        Undefined and fails only when it is used further)."""

        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(),
                       namespace=Namespace)
    return env.from_string(template)


def _plain(value: Any, where: str) -> Any:
    """JSON data only (exact str/int/float/bool/None, dicts, lists): nothing with methods the
    sandbox does not know about reaches the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: {type(value).__name__} is not JSON data")


def check_messages(messages: Any) -> list[dict]:
    """One conversation: a non-empty list of {"role": str, "content": ...} objects."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list of {\"role\", \"content\"} "
                                f"objects, got {type(messages).__name__}"
                                + (" (empty)" if isinstance(messages, (list, tuple)) else ""))
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}]: must be an object with 'role' and 'content', "
                                    f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: 'role' must be a string")
        if "content" not in m:
            raise ChatTemplateError(f"messages[{i}]: lacks 'content'")
    return _plain(list(messages), "messages")


def render_chat(template: Optional[str], messages: Sequence[Mapping],
                add_generation_prompt: bool = True, **special_tokens: str) -> str:
    """Render one conversation with ``template`` (bos_token, eos_token, ... as keywords)."""
    if template is None:
        raise ChatTemplateError("the checkpoint has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json); pass chat_template=")
    msgs = check_messages(messages)
    try:
        return _compile(template).render(messages=msgs,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         **_plain(special_tokens, "special_tokens"))
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {e}") from e
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: syntax error on line {e.lineno}: "
                                f"{e.message}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text, adding no special tokens (the template wrote them)."""
    tok = getattr(tokenizer, "tok", None)  # HFTokenizer: the tokenizers.Tokenizer inside
    if tok is not None and hasattr(tok, "encode"):
        return list(tok.encode(text, add_special_tokens=False).ids)
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the keyword adds none (the byte fallback)
        return list(tokenizer.encode(text))


class ChatRenderer:
    """A checkpoint's template and special tokens, loaded once: ``render(messages) -> text``."""

    def __init__(self, model_dir: Optional[str], chat_template: Optional[str] = None):
        self.template = (chat_template if chat_template is not None
                         else load_chat_template(model_dir))
        self.special = load_special_tokens(model_dir)

    def render(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        """``variables``: more template variables (``tools``, a request's
        ``chat_template_kwargs``), JSON data only."""
        return render_chat(self.template, messages, add_generation_prompt,
                           **{**self.special, **variables})
