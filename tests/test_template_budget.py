"""Hostile chat templates (the CVE-2024-34359 class and its relatives): every way of making
a large value from small arguments is refused before the value exists. Each case must fail
with an error naming the limit, while Python's traced memory stays within a few MB and the
render within seconds. Before these checks, `'x'.ljust(10**10)` in a template took one chat
request from 4.4 to over 7.2 GiB in 2 s."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from localserve.errors import LocalserveError
from localserve.text.chat_template import ChatTemplate

BIG = "'x' * 900000"  # allowed alone: under the 1,000,000-character cap

HOSTILE = [
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x'.rjust(10**10) }}",
    "{{ 'x'.center(10**10) }}",
    "{{ 'x'.zfill(10**10) }}",
    "{{ '\\t'.expandtabs(10**10) }}",
    "{{ '{:>4000000000}'.format('x') }}",
    "{{ '{:.999999999f}'.format(1.0) }}",
    "{{ '{0:>900000}{0:>900000}{0:>900000}'.format('x') }}",
    "{{ '{x:>4000000000}'.format_map({'x': 1}) }}",
    "{{ '%4000000000s' % 'x' }}",
    "{{ '%.999999999f' % 1.0 }}",
    "{{ '%*s' % (10**9, 'x') }}",
    "{{ '%4000000000s'|format('x') }}",
    "{{ (" + BIG + ").replace('', " + BIG + ") }}",
    "{{ (" + BIG + ")|replace('', 'yy') }}",
    "{{ 'x'|center(10**10) }}",
    "{{ 'a\\nb'|indent(10**10) }}",
    "{{ ('a\\n' * 1000)|indent(" + BIG + ") }}",
    "{{ range(100000)|map('string')|join(" + BIG + ") }}",
    "{{ (" + BIG + ").join(range(100000)|map('string')) }}",
    "{{ range(100000)|map(attribute='a', default=" + BIG + ")|join }}",
    "{{ range(100000)|map(attribute='a', default=" + BIG + ")|list }}",
    "{% for x in range(100000)|map(attribute='a', default=" + BIG + ")|batch(100000) %}{{ x }}{% endfor %}",
    "{{ dict.fromkeys(range(100000), " + BIG + ") }}",
    "{{ [[" + BIG + "]] * 100000 }}",
    "{{ (1).to_bytes(10**10, 'big') }}",
    "{{ ('x' * 1000)|wordwrap(1, wrapstring=" + BIG + ") }}",
    "{{ range(10)|batch(10**9, 'x')|list }}",
    "{{ range(10)|slice(10**9)|list }}",
    "{{ {'a': 1}|tojson(indent=10**9) }}",
    "{% set s %}{% for i in range(100000) %}{{ " + BIG + " }}{% endfor %}{% endset %}",
    "{% macro m() %}{% for i in range(100000) %}xxxxxxxxxx{% endfor %}{% endmacro %}"
    "{% for i in range(1000) %}{% set _ = m() %}{% endfor %}",
    "{% filter upper %}{% for i in range(100000) %}{{ " + BIG + " }}{% endfor %}{% endfilter %}",
]


@pytest.mark.parametrize("source", HOSTILE)
def test_hostile_template_is_refused_before_it_allocates(source: str) -> None:
    template = ChatTemplate(source)
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(LocalserveError, match=r"limit|may not") as error:
            template.render([{"role": "user", "content": "hi"}])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(error.value)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced"
    assert time.monotonic() - start < 10


def test_render_time_is_bounded() -> None:
    template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            max_steps=10**12, max_render_seconds=0.5)
    start = time.monotonic()
    with pytest.raises(LocalserveError, match=r"longer than its limit of 0.5 s \(max_render_seconds\)"):
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ 'x'.ljust(5) }}|", "x    |"),
    ("{{ '{:>6}'.format('ab') }}", "    ab"),
    ("{{ '{x}-{y:.2f}'.format_map({'x': 1, 'y': 2.5}) }}", "1-2.50"),
    ("{{ '%5s|%.3f' % ('ab', 1.0) }}", "   ab|1.000"),
    ("{{ '%(a)s'|format(a='z') }}", "z"),
    ("{{ 'a,b'.replace(',', ', ') }}", "a, b"),
    ("{{ ', '.join(['a', 'b']) }}", "a, b"),
    ("{{ [{'n': 'a'}, {'n': 'b'}]|join('+', attribute='n') }}", "a+b"),
    ("{{ 'a\\nb'|indent(2) }}", "a\n  b"),
    ("{{ {'a': [1]}|tojson(indent=2) }}", '{\n  "a": [\n    1\n  ]\n}'),
    ("{{ range(5)|batch(2, 0)|list }}", "[[0, 1], [2, 3], [4, 0]]"),
    ("{{ range(4)|slice(2)|list }}", "[[0, 1], [2, 3]]"),
    ("{% macro m(x) %}<{{ x }}>{% endmacro %}{% set s %}{{ m('a') }}b{% endset %}{{ s }}", "<a>b"),
    ("{{ (1).to_bytes(2, 'big')|length }}", "2"),
])
def test_ordinary_uses_still_work(source: str, expected: str) -> None:
    assert ChatTemplate(source).render([{"role": "user", "content": "hi"}]) == expected
