"""Chat templates: turn a conversation into the prompt text a model was trained on.

A chat template is Jinja2 source shipped with the checkpoint (`tokenizer_config.json`,
`chat_template.jinja`), so it is code written by whoever published the model, and the
messages it renders come from API requests. Rendering therefore runs in jinja2's immutable
sandbox with the helpers Hugging Face's `apply_chat_template` offers (so Hub templates give
the same text as in transformers), plus limits that stop a hostile or buggy template from
reaching Python internals, hanging, or filling memory. Every failure, at construction or
at render, is a `LocalserveError` whose message says what went wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from jinja2.utils import Namespace

from ..errors import LocalserveError
from ..json_files import read_json
from .template_budget import (LIMITS, MAX_INT_BITS, Limits, check_format_spec, check_int_method, check_printf,
                              check_repetition, check_str_method, checked, guarded_filters, is_int, joined, limits,
                              too_big_integer)

__all__ = ["ChatTemplate", "NoChatTemplateError", "DEFAULT_MAX_OUTPUT_CHARS", "DEFAULT_MAX_RENDER_SECONDS", "DEFAULT_MAX_STEPS"]

# Template-made text a render may produce beyond twice its inputs' size (see ChatTemplate).
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000
# Wall-clock time one render may take; real templates take milliseconds.
DEFAULT_MAX_RENDER_SECONDS = 5.0
# Loop iterations plus calls one render may make. Real templates need a few per message
# (thousands for long chats with tools); a million is far above that, yet a template that
# spends it all (recursing macros are the slowest at some microseconds a call) stops in seconds.
DEFAULT_MAX_STEPS = 1_000_000
# The longest template accepted (characters; a file may hold 4 bytes for each); real ones are at most ~30,000.
MAX_TEMPLATE_CHARS = 256 << 10
# Request data nested deeper than this is a mistake or an attack (or a cycle).
_MAX_DATA_DEPTH = 64
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# jinja2 before 3.1.6 has known sandbox escapes (through the `attr` filter and str.format).
_MIN_JINJA = (3, 1, 6)


def _jinja_version() -> tuple[int, ...]:
    try:
        text = version("jinja2")
    except PackageNotFoundError:  # a vendored or source copy: trust its own attribute
        text = getattr(jinja2, "__version__", "0")
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


# ---------------------------------------------------------------------------------------------
# The sandbox
# ---------------------------------------------------------------------------------------------

class _MeteredIterable:
    """A `for` loop's iterable that charges one step per item.

    It keeps `len()` of what it wraps so `loop.length` and `loop.last` do not force the whole
    sequence to be read first; jinja falls back to reading it when `len()` raises TypeError.
    """

    __slots__ = ("_inner", "_limits")

    def __init__(self, inner: Any, limits: Limits) -> None:
        self._inner = inner
        self._limits = limits

    def __iter__(self) -> Iterator[Any]:
        limits = self._limits
        for item in self._inner:
            limits.step()
            yield item

    def __len__(self) -> int:
        return len(self._inner)


class _MeteringCodeGenerator(CodeGenerator):
    """Compiles templates so every `for` loop is metered and every `~` result size-checked.

    These are the two ways around the other limits: nested loops that print nothing never
    reach the output cap, and repeated `s ~ s` doubles a string without an operator the
    sandbox can intercept.
    """

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        # Rewrite the tree once before code is written: `for x in ITER` becomes
        # `for x in environment.metered_iter(ITER)`.
        for loop in list(node.find_all(nodes.For)):
            metered = nodes.Call(nodes.EnvironmentAttribute("metered_iter"), [loop.iter], [],
                                 None, None)
            metered.set_lineno(loop.iter.lineno or loop.lineno)
            metered.set_environment(self.environment)
            loop.iter = metered
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_size(")
        super().visit_Concat(node, frame)
        self.write(")")

    def visit_Output(self, node: nodes.Output, frame: Frame) -> None:
        self._buffered = frame.buffer is not None
        super().visit_Output(node, frame)

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        if self._buffered:
            self.write("environment.captured(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        if self._buffered:
            self.write(")")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        text = super()._output_const_repr(group)
        return f"environment.captured({text})" if self._buffered else text


class _BoundedFormatter(SandboxedFormatter):
    """jinja's sandboxed `str.format`, with each field's width and precision checked before
    it is formatted and the whole result kept under the cap."""

    def vformat(self, format_string: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> str:
        check_format_spec(format_spec)
        text = super().format_field(value, format_spec)
        self._size += len(text)
        limits().check(self._size, "a formatted string")
        return text


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox (no Python internals, no mutating list/dict/set methods),
    made stricter and bounded (template_budget.py):

    - reading an unsafe attribute raises at once, where jinja returns an undefined value that
      only fails when used (so `{{ ''.__class__ }}` would print nothing instead of failing);
    - each call and loop iteration spends a step of the render's budget, and time;
    - calls, operators and filters that build from their arguments are bounded before they
      run, and every result they return is measured.
    """

    code_generator_class = _MeteringCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any,
             **kwargs: Any) -> Any:
        # Positional-only so template keyword arguments named `context` or `obj` pass through.
        limits().step()
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and len(args) == 1 and not kwargs:
                return joined(owner, args[0], "a string by join()")
            check_str_method(name, owner, args, kwargs)
        elif is_int(owner):
            check_int_method(name, args, kwargs)
        return checked(super().call(context, obj, *args, **kwargs), "a call's result")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        # Check before computing where the result itself is the danger (a gigabyte string,
        # a billion-digit integer); `+` can only double a size, so its result is checked.
        if operator == "**":
            if (is_int(left) and is_int(right) and right > 0 and abs(left) > 1
                    and abs(left).bit_length() * right > MAX_INT_BITS):
                too_big_integer()
        elif operator == "*":
            check_repetition(left, right)
            check_repetition(right, left)
            if is_int(left) and is_int(right) and abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                too_big_integer()
        elif operator == "%" and isinstance(left, str):
            check_printf(left)
        return checked(super().call_binop(context, operator, left, right), "an operator's result")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if super().wrap_str_format(value) is None:  # not a str's format or format_map
            return None
        template, is_format_map = str(value.__self__), value.__name__ == "format_map"
        formatter = _BoundedFormatter(self)

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return formatter.vformat(template, args, kwargs)

        return bounded_format

    @staticmethod
    def checked_size(value: Any) -> Any:
        return checked(value, "a string")

    @staticmethod
    def captured(text: str) -> str:
        return limits().capture(text)

    def metered_iter(self, iterable: Any) -> _MeteredIterable:
        return _MeteredIterable(iterable, limits())


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks.
    Serving has no use for the marks, but templates using the tag must still compile: the
    body renders as if the tag were not there."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _check_namespace_name(name: Any) -> None:
    # Underscore names are what the sandbox refuses to read back, and the ones that could
    # shadow Namespace's own internals; refuse them on the way in with a clear message.
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not store {name!r} on a namespace "
                            "(names starting with '_' are reserved)")


class _GuardedNamespace(Namespace):
    """`namespace()` for templates, refusing underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # `self` comes from args like jinja's own Namespace, so `namespace(self=1)` still works.
        initial = dict(*args[1:], **kwargs)
        for name in initial:
            _check_namespace_name(name)
        Namespace.__init__(args[0], initial)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


class _DictFactory:
    """The `dict` global. HF templates call `dict(...)` and `dict.fromkeys(...)`; giving them
    these two instead of the `dict` type leaves nothing of the type itself to explore."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        keys = list(keys)
        check_repetition([value], len(keys))  # the value prints once per key
        return dict.fromkeys(keys, value)


def _raise_exception(message: Any) -> NoReturn:
    # Templates call this to refuse a conversation ("roles must alternate"), so the error is
    # the request's fault and its text is the template's own message.
    raise LocalserveError(f"the chat template rejected the conversation: {message}")


def _strftime_now(format: str) -> str:
    # Templates print today's date into system prompts (Llama 3.1); local time, as in HF.
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change tool schemas the
    # model was trained on; HF's filter is plain json.dumps with non-ASCII kept, so is this.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _build_environment() -> _SandboxEnvironment:
    # trim_blocks/lstrip_blocks are what HF renders with; templates' whitespace assumes them.
    env = _SandboxEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                              extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters.update(guarded_filters(env.filters, _tojson))
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictFactory(), namespace=_GuardedNamespace)
    # lipsum(n) writes n paragraphs in one call, out of reach of every limit; no chat
    # template uses it.
    env.globals.pop("lipsum", None)
    return env


_ENV = _build_environment()


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

class _Counter:
    __slots__ = ("chars",)

    def __init__(self) -> None:
        self.chars = 0


def _plain(value: Any, where: str, counter: _Counter, depth: int = 0) -> Any:
    """A copy of `value` made only of JSON types, counting its characters.

    The template sees nothing else: exact str/int/float/bool/None, lists and dicts. Subclasses
    (str enums, numpy scalars, markup strings) are reduced to their base type, since their extra
    methods are reachable from the template and the sandbox cannot know which are harmless.
    """
    if depth > _MAX_DATA_DEPTH:
        raise LocalserveError(f"{where} is nested more than {_MAX_DATA_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        counter.chars += len(value)
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key, where, counter, depth + 1): _plain(item, where, counter, depth + 1)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, where, counter, depth + 1) for item in value]
    raise LocalserveError(f"{where} holds a {type(value).__name__}; chat templates take only "
                          "JSON values (strings, numbers, booleans, null, lists, objects)")


def _plain_dicts(items: Any, what: str, counter: _Counter) -> list[dict[str, Any]]:
    if not isinstance(items, (list, tuple)):
        raise LocalserveError(f"{what} must be a list of objects, got {type(items).__name__}")
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise LocalserveError(f"{what}[{index}] must be an object, got {type(item).__name__}")
        out.append(_plain(item, f"{what}[{index}]", counter))
    return out


def _template_line(exc: BaseException) -> int | None:
    # jinja rewrites tracebacks so frames inside the template carry its file name
    # ("<template>" for templates made from strings) and its own line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _compile(source: Any, name: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise LocalserveError(f"the {name} chat template must be a string, "
                              f"got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:  # compiling 4 MB of template took 2.4 GiB and 15 s
        raise LocalserveError(f"the {name} chat template is {len(source):,} characters, over the limit of "
                              f"{MAX_TEMPLATE_CHARS:,} (the largest real ones are ~30,000)")
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise LocalserveError(
            f"the {name} chat template does not compile (line {exc.lineno}): {exc.message}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - anything else (deep nesting, ...) is the template's fault too
        raise LocalserveError(
            f"the {name} chat template does not compile: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# ChatTemplate
# ---------------------------------------------------------------------------------------------

class NoChatTemplateError(LocalserveError):
    """The model ships no chat template (as opposed to a broken one): prompts are completed
    as plain text."""


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    `template` is the default template; `tool_use_template`, when given, replaces it for
    renders that pass `tools` (HF's named "tool_use" template). `special_tokens` holds the other
    named tokens (`unk_token`, `pad_token`, ...); like `bos_token` and `eos_token` they are
    template variables, left undefined when None.

    Limits: a render may make `max_steps` loop iterations and calls, take
    `max_render_seconds`, and produce at most `max_output_chars` plus twice the characters
    of its inputs (messages, tools, documents, extra variables), so long conversations fit
    while a runaway template stops early. No value it builds may be larger than that either,
    checked before the value is made (template_budget.py).
    """

    def __init__(self, template: str, *, bos_token: str | None = None,
                 eos_token: str | None = None,
                 special_tokens: Mapping[str, str | None] | None = None,
                 tool_use_template: str | None = None,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
                 max_steps: int = DEFAULT_MAX_STEPS,
                 max_render_seconds: float = DEFAULT_MAX_RENDER_SECONDS) -> None:
        if _jinja_version() < _MIN_JINJA:
            raise LocalserveError(
                f"chat templates need jinja2 >= {'.'.join(map(str, _MIN_JINJA))} (older versions "
                "have sandbox escapes); run `pip install -U jinja2`")
        tokens: dict[str, str] = {}
        named = dict(special_tokens or {})
        for key, value in (("bos_token", bos_token), ("eos_token", eos_token)):
            if value is not None:
                named[key] = value
        for key, value in named.items():
            if value is None:
                continue  # undefined in the template, as transformers leaves unset tokens
            if not isinstance(key, str) or not isinstance(value, str):
                raise LocalserveError(f"special token {key!r} must be a string, got {value!r}")
            tokens[key] = value
        self.special_tokens: dict[str, str] = tokens
        self.max_output_chars = int(max_output_chars)
        self.max_steps = int(max_steps)
        self.max_render_seconds = float(max_render_seconds)
        self.source = template
        self.tool_use_source = tool_use_template
        self._default = _compile(template, "default")
        self._tool_use = (None if tool_use_template is None
                          else _compile(tool_use_template, "tool_use"))

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any], *,
                              templates: Mapping[str, str] | None = None, source: str | None = None,
                              **options: Any) -> ChatTemplate:
        """From the contents of an HF `tokenizer_config.json`.

        `chat_template` there is one string or a list of `{"name", "template"}` entries, of
        which "default" is used and "tool_use" (if present) serves renders with tools. Tokens
        are strings or serialized AddedTokens (`{"content": ...}`). `templates` (name to
        source, from separate `.jinja` files) take precedence over the config's entries;
        `source` (a Modelfile's TEMPLATE) replaces them all. `options` go to the
        constructor (`max_output_chars`, `max_steps`).
        """
        if not isinstance(config, Mapping):
            raise LocalserveError("tokenizer_config.json must hold a JSON object")
        named = _named_templates(config.get("chat_template"))
        named.update(templates or {})
        if source is not None:
            named = {"default": source}
        if not named:
            raise NoChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); send plain prompts instead of chat messages")
        if "default" not in named:
            raise LocalserveError(
                f"the model's chat templates ({', '.join(sorted(named))}) include no 'default' one")
        tokens = {key: _token_text(config.get(key), key) for key in SPECIAL_TOKEN_NAMES}
        return cls(named["default"], bos_token=tokens.pop("bos_token"),
                   eos_token=tokens.pop("eos_token"), special_tokens=tokens,
                   tool_use_template=named.get("tool_use"), **options)

    @classmethod
    def from_dir(cls, path: str | Path, **options: Any) -> ChatTemplate:
        """From a checkpoint or tokenizer folder, as transformers finds templates there:
        `tokenizer_config.json`, overridden by `chat_template.jinja` (the default template)
        and `additional_chat_templates/tool_use.jinja` (the one for tools) when present; an image-text
        processor's `chat_template.json` when neither holds a default template. `source`
        in `options` replaces them (with the folder's special tokens)."""
        folder = Path(path)
        config: Any = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            config = read_json(config_file)
        templates = {}
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = _template_file(folder / "chat_template.jinja")
        processor_file = folder / "chat_template.json"
        if ("default" not in templates and not (isinstance(config, dict) and config.get("chat_template"))
                and processor_file.is_file()):
            # An image-text model's processor template, used when the tokenizer has none.
            processor = read_json(processor_file)
            if isinstance(processor, dict) and isinstance(processor.get("chat_template"), str):
                templates["default"] = processor["chat_template"]
        for name in ("default", "tool_use"):  # the named templates rendering uses; others are never read
            if (file := folder / "additional_chat_templates" / f"{name}.jinja").is_file():
                templates.setdefault(name, _template_file(file))
        return cls.from_tokenizer_config(config, templates=templates, **options)

    # -- rendering ------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, keep_null_content: bool = False,
               **extra: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts with "role", "content", ...).

        `tools` are JSON-schema function specs, `documents` RAG documents, `extra` further
        template variables (`enable_thinking=False`, ...; they may override special tokens).
        Keys whose value is None are dropped from each message first, as transformers does,
        since templates test for missing keys rather than for null (`tool_calls: null`);
        with `keep_null_content`, a null content stays (for templates that test `is none`).
        """
        counter = _Counter()
        chat = _plain_dicts(messages, "messages", counter)
        if not chat:
            raise LocalserveError("cannot render a chat template for an empty conversation")
        chat = [{key: value for key, value in message.items()
                 if value is not None or (keep_null_content and key == "content")}
                for message in chat]
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(_plain(dict(extra), "template variables", counter))
        # tools and documents are always passed (None when absent), as transformers does, so
        # templates' `tools is not none` tests behave the same.
        variables.update(
            messages=chat,
            tools=None if tools is None else _plain_dicts(tools, "tools", counter),
            documents=None if documents is None else _plain_dicts(documents, "documents", counter),
            add_generation_prompt=bool(add_generation_prompt),
        )
        template = self._tool_use if tools is not None and self._tool_use is not None \
            else self._default
        limits = Limits(self.max_steps, self.max_output_chars + 2 * counter.chars, self.max_render_seconds)
        token = LIMITS.set(limits)
        try:
            return self._generate(template, variables, limits.max_chars)
        finally:
            LIMITS.reset(token)

    @staticmethod
    def _generate(template: jinja2.Template, variables: dict[str, Any], max_chars: int) -> str:
        # Stream the output so a template printing in a loop is stopped at the cap, instead of
        # after building the whole string.
        pieces: list[str] = []
        size = 0
        stream = template.generate(variables)
        try:
            for piece in stream:
                size += len(piece)
                if size > max_chars:
                    raise LocalserveError(
                        f"the chat template's output passed {max_chars} characters, far more "
                        "than the conversation needs; it loops without end or is hostile")
                pieces.append(piece)
        except LocalserveError:
            raise
        except SecurityError as exc:
            raise LocalserveError(
                f"the chat template tried to reach Python internals{_at(exc)} and was "
                f"stopped: {exc}") from exc
        except RecursionError as exc:
            raise LocalserveError(
                f"the chat template recursed too deeply{_at(exc)}") from exc
        except MemoryError as exc:
            raise LocalserveError(f"the chat template ran out of memory{_at(exc)}") from exc
        except jinja2.TemplateError as exc:
            raise LocalserveError(f"the chat template failed{_at(exc)}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - template code is input; its errors are the input's
            raise LocalserveError(
                f"the chat template failed{_at(exc)}: {type(exc).__name__}: {exc}") from exc
        finally:
            stream.close()
        text = "".join(pieces)
        try:  # a template can print a lone surrogate ("\ud800"), which no tokenizer or response can carry
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LocalserveError(f"the chat template wrote text that is not valid Unicode (a lone surrogate at "
                                  f"character {exc.start:,})") from None
        return text


def _at(exc: BaseException) -> str:
    line = _template_line(exc)
    return "" if line is None else f" at line {line}"


def _template_file(path: Path) -> str:
    """A .jinja file's text, refused before it is read when it is too large to be one."""
    try:
        if (size := path.stat().st_size) > 4 * MAX_TEMPLATE_CHARS:
            raise LocalserveError(f"{path}: {size:,} bytes, over the limit of a chat template")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LocalserveError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise LocalserveError(f"{path}: cannot be read ({exc.strerror})") from None


def _named_templates(raw: Any) -> dict[str, str]:
    """`chat_template` from tokenizer_config.json as {name: source}."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, Mapping):  # not what HF writes, but an obvious spelling of the same
        items = list(raw.items())
    elif isinstance(raw, list):
        items = []
        for entry in raw:
            if not isinstance(entry, Mapping) or "name" not in entry or "template" not in entry:
                raise LocalserveError('chat_template entries in tokenizer_config.json must be '
                                      '{"name": ..., "template": ...} objects')
            items.append((entry["name"], entry["template"]))
    else:
        raise LocalserveError("chat_template in tokenizer_config.json must be a string or a list, "
                              f"got {type(raw).__name__}")
    named: dict[str, str] = {}
    for name, source in items:
        if not isinstance(name, str) or not isinstance(source, str):
            raise LocalserveError(f"chat template {name!r} in tokenizer_config.json must have a "
                                  "string name and template")
        named[name] = source
    return named


def _token_text(value: Any, key: str) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise LocalserveError(f"{key} in tokenizer_config.json must be a string or an object with "
                          f'"content", got {value!r}')
