"""What one chat-template render may spend, and the checks that hold it to that *before*
anything is allocated.

A template is code from whoever published the model. Python builds a string or list in
one C call (``'x'.ljust(10**10)``, ``'{:>4000000000}'.format(x)``, ``s.replace('', s)``),
so a size checked after the call comes too late: the memory is gone. Each way of making a
large value from small inputs is therefore bounded from its arguments first:

- widths and fills: ``ljust``, ``rjust``, ``center``, ``zfill``, ``expandtabs``, the
  ``center`` and ``indent`` filters, ``int.to_bytes``;
- formatting: every ``str.format`` field's width and precision, printf-style ``%`` and the
  ``format`` filter;
- repetition: ``*`` on strings, lists and tuples, counted by what the repeated items print
  as (a list holding one long string many times prints as all of them), ``batch``'s fill,
  ``dict.fromkeys``;
- joining and replacing: ``join`` (method and filter) and ``replace`` (method and filter),
  ``wordwrap``'s wrap string, ``tojson``'s indent.

Every value a call, filter or operator returns is then measured the same way, so no value
whose text is larger than the budget exists to be printed. The budget is the render's
character cap (ChatTemplate's ``max_output_chars`` plus twice its inputs), its step count
(loop iterations and calls) and a wall-clock deadline.
"""

from __future__ import annotations

import contextvars
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from jinja2.filters import make_attrgetter
from jinja2.utils import Namespace

from ..errors import LocalserveError

# Integers past this size only come from templates computing something absurd (`2 ** 10**9`),
# and big-int arithmetic on them can take minutes.
MAX_INT_BITS = 1 << 16
# Items `slice` may cut a sequence into, and `batch`'s batch size: chat templates use
# neither, and each empty slice is a list.
MAX_PIECES = 10_000
# tojson's indent: HF templates use 2 or 4.
MAX_JSON_INDENT = 64
# Text a render may write into macros and block captures, as a multiple of its output cap:
# a macro's text is captured and then printed, and macros nest a few levels at most.
CAPTURE_FACTOR = 4


class Limits:
    """What the render in progress may still spend. One per render call, found through a
    context variable so a shared environment serves concurrent renders (threads, asyncio)."""

    __slots__ = ("steps_left", "max_chars", "captured_left", "deadline", "seconds")

    def __init__(self, steps: int, max_chars: int, seconds: float) -> None:
        self.steps_left = steps
        self.max_chars = max_chars
        # Text written into captures ({% set %} blocks, macros, {% filter %}) is built in
        # memory before anything prints it, out of reach of the output cap.
        self.captured_left = CAPTURE_FACTOR * max_chars
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise LocalserveError(
                "the chat template ran too long (more loop iterations and calls than its limit, "
                "max_steps); it loops without end or is hostile")
        if time.monotonic() > self.deadline:
            raise LocalserveError(
                f"the chat template ran longer than its limit of {self.seconds:g} s "
                "(max_render_seconds); it loops without end or is hostile")

    def capture(self, text: str) -> str:
        self.captured_left -= len(text)
        if self.captured_left < 0:
            raise LocalserveError(
                f"the chat template captured more than {CAPTURE_FACTOR * self.max_chars:,} characters in "
                f"macros and blocks ({CAPTURE_FACTOR}x its output limit); it is broken or hostile")
        return text

    def check(self, size: int, what: str) -> None:
        """Refuse to make ``what`` if it would print as more than the cap."""
        if size > self.max_chars:
            raise LocalserveError(
                f"the chat template would build {what} of {size:,} characters, over its limit of "
                f"{self.max_chars:,} (max_output_chars plus twice the conversation); it is broken "
                "or hostile")


LIMITS: contextvars.ContextVar[Limits | None] = contextvars.ContextVar(
    "localserve_chat_template_limits", default=None)


def limits() -> Limits:
    current = LIMITS.get()
    if current is None:  # only ChatTemplate.render runs templates, and it always sets them
        raise LocalserveError("chat templates can only be rendered through ChatTemplate.render")
    return current


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def too_big_integer() -> NoReturn:
    raise LocalserveError(f"the chat template would build an integer of more than {MAX_INT_BITS:,} bits; "
                          "it is broken or hostile")


# -- measuring ------------------------------------------------------------------------------

def text_size(value: Any, cap: int) -> int:
    """About how many characters ``value`` prints as, counted until past ``cap``: a string
    its length, a container the sum of its items (each item as often as it appears)."""
    total = 0
    pending = [value]
    while pending and total <= cap:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            pending.extend(item)
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, Namespace):
            attrs = item._Namespace__attrs  # type: ignore[attr-defined]  # jinja keeps them here
            total += 2 + 4 * len(attrs)
            pending.extend(attrs.values())
        elif isinstance(item, (bytes, bytearray)):
            total += len(item)
        elif is_int(item):
            total += item.bit_length() // 3 + 1
        else:
            total += 8  # floats, None, bools; other objects print as a short repr
    return total


def checked(value: Any, what: str = "a value") -> Any:
    """``value``, unless it prints as more than the render's cap."""
    budget = limits()
    budget.check(text_size(value, budget.max_chars), what)
    if is_int(value) and value.bit_length() > MAX_INT_BITS:
        too_big_integer()
    return value


# -- bounds from arguments, before the call -------------------------------------------------

def _int_arg(args: tuple, kwargs: Mapping[str, Any], index: int, name: str, default: int) -> int:
    value = args[index] if len(args) > index else kwargs.get(name, default)
    return value if is_int(value) else default  # anything else: Python's own TypeError follows


def _replace_size(text: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(text)
    most = len(text) + 1 if old == "" else len(text) // len(old)
    if is_int(count) and 0 <= count < most:
        most = count
    return len(text) + most * max(len(new) - len(old), 0)


def _join_size(separator: str, parts: list[str]) -> int:
    return sum(map(len, parts)) + len(separator) * max(len(parts) - 1, 0)


def check_str_method(name: str, text: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Bound the result of ``text.<name>(*args, **kwargs)`` before it is made."""
    budget = limits()
    if name in ("ljust", "rjust", "center", "zfill"):
        budget.check(_int_arg(args, kwargs, 0, "width", 0), f"a string padded by {name}()")
    elif name == "expandtabs":
        budget.check(len(text) * max(_int_arg(args, kwargs, 0, "tabsize", 8), 1), "a string by expandtabs()")
    elif name == "replace":
        old = args[0] if args else kwargs.get("old")
        new = args[1] if len(args) > 1 else kwargs.get("new")
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        budget.check(_replace_size(text, old, new, count), "a string by replace()")


def check_int_method(name: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
    if name == "to_bytes":
        limits().check(_int_arg(args, kwargs, 0, "length", 1), "bytes by to_bytes()")


def joined(separator: str, items: Any, what: str) -> str:
    """``separator.join`` over ``items`` as strings, refused as soon as the total passes the
    cap (so only one oversized item is ever held)."""
    budget = limits()
    parts: list[str] = []
    size = 0
    for item in items:
        part = item if isinstance(item, str) else str(checked(item))
        size += len(part) + (len(separator) if parts else 0)
        budget.check(size, what)
        parts.append(part)
    return separator.join(parts)


def check_repetition(sequence: Any, count: Any) -> None:
    """``sequence * count`` for a string, list or tuple, by what the result prints as."""
    if isinstance(sequence, (str, list, tuple)) and is_int(count) and count > 0:
        budget = limits()
        budget.check(text_size(sequence, budget.max_chars // count + 1) * count, "a repeated string or list")


# Format specs: [[fill]align][sign][z][#][0][width][grouping][.precision][type].
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?[a-zA-Z%]?", re.S)
# printf: %[(key)][flags][width][.precision][length]type
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?P<width>\*|\d*)(?:\.(?P<precision>\*|\d*))?[hlL]?(?P<type>.)",
                           re.S)


def check_format_spec(spec: str) -> None:
    """One ``str.format`` field's width and precision, before it is formatted."""
    match = _FORMAT_SPEC.fullmatch(spec)
    if match is None:
        return  # not a standard spec: the value's own __format__ refuses or handles it
    budget = limits()
    budget.check(int(match["width"] or 0), "a formatted field")
    budget.check(int(match["precision"] or 0), "a formatted field's digits")


def check_printf(template: str) -> None:
    """Every ``%`` field's width and precision in a printf-style template."""
    budget = limits()
    total = len(template)
    for field in _PRINTF_FIELD.finditer(template):
        if "*" in (field["width"], field["precision"]):
            raise LocalserveError("the chat template uses a '*' width in %-formatting, which chat "
                                  "templates may not (it takes the width from the data)")
        total += int(field["width"] or 0) + int(field["precision"] or 0)
    budget.check(total, "a %-formatted string")


# -- filters ----------------------------------------------------------------------------------

def guarded_filters(filters: Mapping[str, Callable[..., Any]],
                    tojson: Callable[..., str]) -> dict[str, Callable[..., Any]]:
    """jinja's filters with the checks above in front of those that build from their
    arguments, and every filter's result measured (``map``, ``sort`` and friends can
    gather many references to one long string)."""
    guarded = {name: _measured(function) for name, function in filters.items()}
    original = dict(filters)

    def center(value: Any, width: int = 80) -> str:
        limits().check(width if is_int(width) else 0, "a string padded by center")
        return original["center"](value, width)

    def indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
        text = str(checked(s))
        unit = len(width) if isinstance(width, str) else width if is_int(width) else 0
        limits().check(len(text) + unit * (text.count("\n") + 2), "a string by indent")
        return original["indent"](text, width, first, blank)

    def format_(value: Any, *args: Any, **kwargs: Any) -> str:
        template = str(checked(value))
        check_printf(template)
        return checked(original["format"](template, *args, **kwargs))

    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> str:
        text = str(checked(s))
        limits().check(_replace_size(text, old, new, -1 if count is None else count), "a string by replace")
        return original["replace"](eval_ctx, text, old, new, count)

    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        return joined(str(d), value, "a string by join")

    def wordwrap(environment: Any, s: Any, width: int = 79, break_long_words: bool = True,
                 wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
        text = str(checked(s))
        wrap = environment.newline_sequence if wrapstring is None else str(wrapstring)
        limits().check(len(text) * (1 + len(wrap)), "a string by wordwrap")
        return original["wordwrap"](environment, text, width, break_long_words, wrapstring, break_on_hyphens)

    def batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
        _check_pieces(linecount, "batch")
        if fill_with is not None:
            check_repetition([fill_with], linecount)
        return original["batch"](value, linecount, fill_with)

    def slice_(eval_ctx: Any, value: Any, slices: int, fill_with: Any = None) -> Any:
        _check_pieces(slices, "slice")
        return original["slice"](eval_ctx, value, slices, fill_with)

    def tojson_(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
                separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        size = len(indent) if isinstance(indent, str) else indent if is_int(indent) else 0
        if size > MAX_JSON_INDENT:
            raise LocalserveError(f"the chat template asks tojson for an indent of {size}, over the "
                                  f"limit of {MAX_JSON_INDENT}")
        return tojson(checked(value), ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

    for name, function in (("center", center), ("indent", indent), ("format", format_), ("tojson", tojson_),
                           ("batch", batch)):
        guarded[name] = _measured(function)
    # Filters that take the evaluation context or environment first keep jinja's marker.
    for name, function in (("replace", replace), ("join", join), ("wordwrap", wordwrap), ("slice", slice_)):
        measured = _measured(function)
        measured.jinja_pass_arg = original[name].jinja_pass_arg  # type: ignore[attr-defined]
        guarded[name] = measured
    return guarded


def _check_pieces(count: Any, name: str) -> None:
    if is_int(count) and count > MAX_PIECES:
        raise LocalserveError(f"the chat template asks {name} for {count:,} pieces, over the limit of "
                              f"{MAX_PIECES:,}")


def _measured(function: Callable[..., Any]) -> Callable[..., Any]:
    def filter_(*args: Any, **kwargs: Any) -> Any:
        return checked(function(*args, **kwargs), "a filter's result")

    filter_.__name__ = getattr(function, "__name__", "filter")
    if hasattr(function, "jinja_pass_arg"):
        filter_.jinja_pass_arg = function.jinja_pass_arg  # type: ignore[attr-defined]
    return filter_
