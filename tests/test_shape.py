"""The code's shape held to its limits (bench/shape.py, part of `make lint`): no product module over 600 lines
(the warm launcher excepted), no function over 80, no import circle, no import hidden in a function unless a
comment says it is for start-up time, no changelog-style comment. The measuring itself is checked on small
sources, so a limit cannot pass by measuring nothing."""

from __future__ import annotations

import ast

from bench.shape import circles, comments, imports, measure, over_limits


def test_the_product_code_keeps_to_its_limits() -> None:
    shape = measure()
    assert len(shape.modules) > 20 and shape.functions
    assert over_limits(shape) == []


def test_a_circle_of_imports_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_are_told_apart() -> None:
    source = "import os\n\ndef f():\n    from dagster import asset\n    return asset\n"
    found = [(target, function is not None) for target, _, function in imports(ast.parse(source), "m", False)]
    assert ("os", False) in found and ("dagster", True) in found


def test_changelog_comments_are_found() -> None:
    source = "x = 1  # found by review in 3f2a9c1d\ny = 2  # a float: 1.23457e8\n"
    assert [n for n, _ in comments(source)] == [1, 2]
    from bench.shape import CHANGELOG

    assert [bool(CHANGELOG.search(text)) for _, text in comments(source)] == [True, False]
