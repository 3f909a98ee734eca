"""docs/reference.md is the schema's: every key of every group, each with the comment its field
carries in trainer/config.py (python -m trainer.compose.reference rewrites the page)."""
from __future__ import annotations

import dataclasses

from trainer import config as schema
from trainer.compose import reference


def test_every_field_has_a_comment():
    _, missing = reference.render()
    assert not missing, f"fields without a comment in trainer/config.py: {missing}"


def test_the_page_is_the_generators_output():
    page, _ = reference.render()
    assert reference.PAGE.read_text() == page, (
        "docs/reference.md is stale: run python -m trainer.compose.reference")


def test_the_page_lists_every_key_of_every_group():
    page, _ = reference.render()
    for group, cls_name in reference.GROUPS.items():
        for spec in dataclasses.fields(getattr(schema, cls_name)):
            assert f"| `{group}.{spec.name}` |" in page


def test_a_comment_is_the_lines_above_a_field_and_its_own():
    source = '''
class A:
    # a header, kept apart by a blank line

    # the first key,
    # in two lines
    first: int = 1  # and its own
    second: int = 2  # only its own
    third: int = 3
'''
    assert reference.field_comments(source) == {"A": {
        "first": "the first key, in two lines and its own", "second": "only its own",
        "third": ""}}
