import pytest

from dsv41 import envfile

pytestmark = pytest.mark.unit


def values(text, environ=None):
    entries, errors = envfile.parse(text, environ or {})
    assert errors == []
    return {e.key: e.value for e in entries}


def test_comments_blank_lines_and_export_prefix():
    got = values("# comment\n\n  A=1\nexport B=two\n   # indented comment\n")
    assert got == {"A": "1", "B": "two"}


def test_double_quoted_value_keeps_spaces_and_escapes():
    got = values('X="--a b  --c"\nY="say \\"hi\\" \\$HOME"\n')
    assert got == {"X": "--a b  --c", "Y": 'say "hi" $HOME'}


def test_single_quotes_are_literal():
    assert values("A='$HOME x'\n", {"HOME": "/h"}) == {"A": "$HOME x"}


def test_expansion_from_file_then_environment_and_default():
    got = values("BASE=/srv\nA=$BASE/x\nB=${BASE}y\nC=$HOME/z\nD=${MISSING:-fallback}\nE=\"$HOME/q r\"\n",
                 {"HOME": "/home/op", "BASE": "/not-used"})
    assert got == {"BASE": "/srv", "A": "/srv/x", "B": "/srvy", "C": "/home/op/z", "D": "fallback",
                   "E": "/home/op/q r"}


def test_trailing_comment_after_whitespace():
    assert values("A=1   # one\nB=a#b\n") == {"A": "1", "B": "a#b"}


def test_colon_equals_and_percent_stay_literal():
    assert values("P=^LL128\nQ=expandable_segments:False\nR=conf:0.1\n") == {
        "P": "^LL128", "Q": "expandable_segments:False", "R": "conf:0.1"}


@pytest.mark.parametrize("text, line, fragment", [
    ("A=1\nthis is not an assignment\n", 2, "expected KEY=VALUE"),
    ('A="open\n', 1, "unterminated double quote"),
    ("A='open\n", 1, "unterminated single quote"),
    ("A=$(whoami)\n", 1, "command substitution"),
    ("A=`id`\n", 1, "not supported"),
    ("A=$NOPE\n", 1, "$NOPE is not defined"),
    ("A=one two\n", 1, "unquoted whitespace"),
    ("A=1\nA=2\n", 2, "defined twice (first on line 1)"),
    ("1A=x\n", 1, "expected KEY=VALUE"),
])
def test_errors_name_the_line(text, line, fragment):
    _, errors = envfile.parse(text, {})
    assert len(errors) == 1
    assert errors[0].line == line
    assert fragment in errors[0].message


def test_all_errors_are_reported_not_just_the_first():
    _, errors = envfile.parse("A=$X\nB='\nC=ok\nD=$(x)\n", {})
    assert [e.line for e in errors] == [1, 2, 4]
