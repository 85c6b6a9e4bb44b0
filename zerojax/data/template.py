"""The tokenizer's own chat template, rendered as transformers' `apply_chat_template` renders it.

A Hugging Face tokenizer directory keeps its template beside tokenizer.json: `chat_template.jinja`
(transformers 4.43+ writes it; it wins), else `chat_template` in tokenizer_config.json (a string,
or a list of named templates of which "default" is used). The environment is transformers' own
(`transformers.utils.chat_template_utils._cached_compile_jinja_template`): a jinja2
ImmutableSandboxedEnvironment (templates come from the Hub: untrusted code) with trim_blocks and
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a JSON `tojson` that does not
escape HTML, and the `{% generation %}` block, whose rendered spans are the assistant's text.
The template sees `messages`, `add_generation_prompt` and the tokenizer's named special tokens
(bos_token, eos_token, ...: transformers' `special_tokens_map`).
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path

from zerojax.errors import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused a conversation (its `raise_exception`, or a jinja error while rendering)."""


def tokenizer_config(tokenizer_dir: Path) -> dict:
    path = tokenizer_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not JSON ({err})") from None


def special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json, as strings (AddedToken dicts by content)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def template_text(tokenizer_dir: Path, config: dict) -> tuple[str, str] | None:
    """(the chat template, the file it is in), or None when the tokenizer has none."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    where = str(tokenizer_dir / "tokenizer_config.json")
    value = config.get("chat_template")
    if isinstance(value, list):  # the older saved form of several templates: [{"name", "template"}, ...]
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}.get("default")
    return (value, where) if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template: `render(messages, add_generation_prompt)` -> (text, the spans
    [start, end) of text its `{% generation %}` blocks wrote)."""

    def __init__(self, source: str, where: str, specials: dict[str, str]):
        self.source, self.where, self.specials = source, where, specials
        self.has_generation = re.search(r"\{\%-?\s*generation\s*-?\%\}", source) is not None
        self._tracking: ContextVar = ContextVar("zerojax_generation_spans", default=None)
        try:
            self.compiled = environment(self._tracking).from_string(source)
        except Exception as err:  # noqa: BLE001 - any jinja syntax error is the template file's
            raise ConfigError(f"{where}: the chat template does not compile ({type(err).__name__}: {err})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = self._tracking.set((blocks, spans))
        try:
            for block in self.compiled.generate(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt, **self.specials):
                blocks.append(block)
        except Exception as err:  # noqa: BLE001 - raise_exception's TemplateError, or the template's own bug
            raise TemplateError(str(err) or type(err).__name__) from None
        finally:
            self._tracking.reset(token)
        return "".join(blocks), spans


def load_template(tokenizer_dir: Path, config: dict) -> ChatTemplate | None:
    """The chat template beside a tokenizer.json (None when there is none); `config` its
    tokenizer_config.json."""
    found = template_text(tokenizer_dir, config)
    return None if found is None else ChatTemplate(*found, special_tokens(config))


def environment(tracking: ContextVar):
    """transformers' chat-template environment; `tracking` holds (rendered blocks, spans) while a
    render records where its `{% generation %}` blocks are."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation(tracking), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_namespace())
    return env


# The pieces of that environment, transformers' own. jinja2 is imported where it is used (its
# classes made inside functions), so importing zerojax.data does not load it.


def _generation(tracking: ContextVar):
    """The `{% generation %}` extension, noting its spans in what `tracking` holds."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body, noting where it lands."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _span(self, context, caller):
            text = caller()
            if (tracked := tracking.get()) is not None:
                blocks, spans = tracked
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    return Generation


def _namespace():
    """The `namespace` class templates see."""
    import jinja2

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no way to CPython's internals)."""

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
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    return Namespace


class _Dict:
    """The `dict` templates see: a call and `fromkeys`, nothing of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson`: JSON that does not escape HTML."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
