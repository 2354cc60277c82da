"""agent/auth.py: the coordinator pin file (TLS_PIN) and the pin check in caller_problem."""

from __future__ import annotations

import os

import pytest

from agent import auth

pytestmark = pytest.mark.unit

A, B = "a" * 64, "b" * 64


def test_pins_parse_with_comments_and_refuse_anything_else():
    assert auth.parse_pins(f"# the coordinator\nsha256:{A}\n{B}  # the next one\n") == {A, B}
    for text, why in (("", "no certificate fingerprint"), ("# only a comment\n", "no certificate fingerprint"),
                      (f"md5:{A}\n", "line 1: not a sha256"), ("sha256:abc\n", "line 1: not a sha256")):
        with pytest.raises(ValueError, match=why):
            auth.parse_pins(text)


def test_a_changed_file_applies_and_a_broken_one_keeps_the_previous_pins(tmp_path):
    path = tmp_path / "coordinator.pin"
    path.write_text(f"sha256:{A}\n")
    problems = []
    pins = auth.PinFile(str(path), problem=problems.append)
    assert pins.pins() == {A}
    path.write_text(f"sha256:{B}\n")
    os.utime(path, ns=(1, 1))  # a changed stamp even within the same clock tick
    assert pins.pins() == {B}
    path.write_text("garbage\n")
    assert pins.pins() == {B} and len(problems) == 1 and "still accepting the previous pins" in problems[0]
    assert pins.pins() == {B} and len(problems) == 1  # reported once per change


def test_a_missing_pin_file_stops_the_agent_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"No such file or directory \(install this node's bundle"):
        auth.PinFile(str(tmp_path / "coordinator.pin"))


def test_the_pin_check_names_the_certificate_and_the_fix():
    context = {"transport_security_type": [b"ssl"], "x509_subject_alternative_name": [b"dsv41-coordinator"],
               "x509_pem_cert": []}
    assert auth.caller_problem(context, "dsv41-coordinator") is None  # no pins configured: name only
    why = auth.caller_problem(context, "dsv41-coordinator", frozenset({A}))
    assert "is not the one this node's bundle pins" in why and "dsv41ctl pki bundle NODE" in why
    assert "only dsv41-coordinator may call" in auth.caller_problem(
        {**context, "x509_subject_alternative_name": [b"spark3"]}, "dsv41-coordinator", frozenset({A}))
