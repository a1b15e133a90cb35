"""JSON Schema regexes are ECMA-262 (not Python's ``re``): what is accepted and refused,
and that the forms written for the backends and for Python match the same strings."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess

import pytest

from engine.structured_output import StructuredOutputsParams, ecma_regex

ECMA_VALID = [
    r"^(?<year>[0-9]{4})-(?<month>\d\d)$",  # named groups: Python's re refuses them
    r"\k<y>(?<y>a)",  # a backreference (valid; no backend enforces it)
    r"[\w-]+",
    r"[\d-z]",  # Annex B: a class escape as a range end makes "-" a member
    r"\-\_\ \/",  # identity escapes of punctuation
    r"a{",  # Annex B: a brace that starts no quantifier is itself
    r"x{,3}",
    r"]",
    r"\u{1F600}\uD83D\uDE00",
    r"\p{L}+\P{Lu}",
    r"(?i:abc)(?-i:d)",  # ES2025 modifiers
    r"[^]",
    r"\cJ\0\x41\u0041",
    r"(?=a)a(?!b)(?<=a)(?<!b)",
    r"a*?b+?c??d{2,3}?",
]
ECMA_INVALID = [
    (r"(?P<year>\d{4})", "(?P<name>"),  # Python's named group
    (r"(?i)abc", "inline flags"),
    (r"a++", "nothing to repeat"),  # possessive
    (r"(?>a)", "atomic"),
    (r"\Z", r"\Z"),
    (r"\A", r"\A"),
    (r"\1", "does not exist"),
    (r"\01", "octal"),
    (r"[z-a]", "out of order"),
    (r"(a", "unterminated"),
    (r"a)", "unmatched"),
    (r"{1}", "nothing to repeat"),
    (r"\k<nope>(?<n>a)", "undefined group"),
    (r"(?#comment)", "invalid group"),
    (r"\x4", "two hex digits"),
]


@pytest.mark.parametrize("pattern", ECMA_VALID)
def test_ecma_valid_patterns_are_accepted(pattern):
    ecma_regex.check(pattern)
    assert ecma_regex.is_valid(pattern)


@pytest.mark.parametrize("pattern, message", ECMA_INVALID)
def test_ecma_invalid_patterns_are_refused(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ecma_regex.check(pattern)
    assert not ecma_regex.is_valid(pattern)


def test_features_no_backend_enforces():
    assert ecma_regex.features(r"(?=a)a") == {ecma_regex.LOOK_AROUND}
    assert ecma_regex.features(r"(a)\1") == {ecma_regex.BACKREFERENCE}
    assert ecma_regex.features(r"\bx") == {ecma_regex.WORD_BOUNDARY}
    assert ecma_regex.features(r"(?<y>a)[\w-]") == set()
    assert ecma_regex.uses_properties(r"[\p{L}0-9]") and not ecma_regex.uses_properties("p{L}")


def test_backend_form():
    assert ecma_regex.to_backend(r"(?<y>\d{4})-(?<m>\d\d)") == "(?:[0-9]{4})-(?:[0-9][0-9])"
    assert ecma_regex.to_backend(r"a{") == r"a\{"
    assert ecma_regex.to_backend(r"\uD83D\uDE00") == r"\u{1F600}"
    assert ecma_regex.to_backend(r"(?i:ab)") == "(?:[Aa][Bb])"
    assert ecma_regex.to_backend(".") == r"[^\u{A}\u{D}\u{2028}\u{2029}]"
    assert ecma_regex.to_backend(r"\p{L}") == r"\p{L}"
    assert ecma_regex.to_backend(r"[^\p{L}]") == r"\P{L}"


_STRINGS = ["", "a", "ab", "aB", "2024-05", "2024-5", "x-y_z", "a\n", "\u2028", "é", "😀",
            "{", "a{", "]", "-", "  ", "AB12", "a-b-c", "\t", "_", "ab ab", "1.5"]
_PATTERNS = [
    r"^(?<y>[0-9]{4})-(?<m>[0-9]{2})$", r"^[\w-]+$", r"[\d-z]", r"a{", r"^.$", r"^\s+$",
    r"(?i:^ab$)", r"^[^a-z]*$", r"\-\_", r"^(a|b)+$", r"[^]", r"^\u{1F600}$", r"^\D\W$",
    r"^[\S]+$", r"^$",
]


@pytest.mark.parametrize("pattern", _PATTERNS)
def test_python_form_matches_what_ecma_matches(pattern):
    """The Python form against hand-written ECMA-262 expectations for ASCII-safe cases,
    and consistent with the backend form read back by the ECMA parser."""
    python = re.compile(ecma_regex.to_python(pattern))
    again = re.compile(ecma_regex.to_python(ecma_regex.to_backend(pattern)))
    for text in _STRINGS:
        assert bool(python.search(text)) == bool(again.search(text)), (pattern, text)


def test_ecma_meaning_not_python_meaning():
    py = lambda p, s: re.search(ecma_regex.to_python(p), s) is not None
    assert not py(r"^\w$", "é")  # ECMA \w is ASCII; Python's is Unicode
    assert not py(r"^\d$", "\u0663")  # ECMA \d is ASCII
    assert not py(r"^a$", "a\n")  # ECMA $ is the end; Python's also matches before "\n"
    assert not py(r"^.$", "\u2028")  # ECMA . excludes line terminators
    assert py(r"^(?<y>\d)$", "7")


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node (a real ECMA-262 engine)")
def test_agrees_with_a_javascript_engine():
    """Random patterns: whatever V8 accepts with the u flag is accepted here, whatever
    it refuses in both modes is refused, and matches agree on random strings."""
    rng = random.Random(0)
    tokens = ["a", "b", "Z", "0", "-", "_", " ", ".", "^", "$", "|", "*", "+", "?", "{2}",
              "{1,3}", "{", "}", "(", ")", "(?:", "(?<n>", "[", "]", "[^", r"\d", r"\w",
              r"\s", r"\D", r"\W", r"\-", r"\.", r"\/", r"\n", r"\x41", r"\u0041", r"\cJ",
              r"\0", r"\A", r"\Z", r"\_", "é", ","]
    patterns = sorted({"".join(rng.choice(tokens) for _ in range(rng.randint(1, 6)))
                       for _ in range(1500)})
    strings = ["".join(rng.choice("abZ09-_ .\n\té,{}[]") for _ in range(rng.randint(0, 5)))
               for _ in range(40)]
    script = (
        "const d=JSON.parse(require('fs').readFileSync(0,'utf8'));"
        "process.stdout.write(JSON.stringify(d.p.map(p=>{let u=true,nu=true,r=null;"
        "try{r=new RegExp(p,'u')}catch(e){u=false}"
        "try{const q=new RegExp(p);if(!r)r=q}catch(e){nu=false}"
        "return {u,nu,m:r&&u?d.s.map(s=>r.test(s)):null}})))"
    )
    out = subprocess.run(["node", "-e", script], input=json.dumps({"p": patterns, "s": strings}),
                         capture_output=True, text=True, check=True, timeout=60).stdout
    for pattern, verdict in zip(patterns, json.loads(out)):
        mine = ecma_regex.is_valid(pattern)
        if verdict["u"]:
            assert mine, pattern
        elif not verdict["nu"]:
            assert not mine, pattern
        if verdict["m"] is not None and not ecma_regex.features(pattern):
            python = re.compile(ecma_regex.to_python(pattern))
            for text, expected in zip(strings, verdict["m"]):
                assert bool(python.search(text)) == expected, (pattern, text)


# -- where JSON Schema regexes are checked ---------------------------------------------------
def test_schema_patterns_are_checked_as_ecma():
    # Python's re refuses (?<name>...): the metaschema's format: regex no longer does.
    StructuredOutputsParams(json={"type": "string", "pattern": r"^(?<y>\d{4})$"})
    StructuredOutputsParams(json={"type": "object",
                                  "patternProperties": {r"^(?<k>x-)": {"type": "string"}}})
    with pytest.raises(ValueError, match="not an ECMA-262 regex.*invalid group"):
        StructuredOutputsParams(json={"type": "string", "pattern": r"(?P<y>\d)"})
    with pytest.raises(ValueError, match=r"patternProperties.*ECMA-262"):
        StructuredOutputsParams(json={"type": "object", "patternProperties": {r"\Z": {}}})


def test_regex_constraints_are_checked_as_ecma():
    assert StructuredOutputsParams(regex=r"(?<y>\d{4})-(?<m>\d{2})").regex
    with pytest.raises(ValueError, match="not an ECMA-262 regular expression"):
        StructuredOutputsParams(regex=r"(?P<y>\d{4})")
    with pytest.raises(ValueError, match="not an ECMA-262 regular expression"):
        StructuredOutputsParams(regex=r"(?i)yes")
    with pytest.raises(ValueError, match="look-around, which no structured-output backend"):
        StructuredOutputsParams(regex=r"a(?=b)")


def test_schema_patterns_to_python_for_jsonschema():
    import jsonschema

    schema = {"type": "string", "pattern": r"^(?<y>\d{4})$"}
    checked = ecma_regex.schema_patterns_to_python(schema)
    jsonschema.validate("2024", checked)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("20245", checked)
