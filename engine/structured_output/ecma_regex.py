"""JSON Schema regexes as JSON Schema defines them: ECMA-262, not Python's ``re``.

``pattern``, ``patternProperties`` and ``format: regex`` are ECMA-262 regular
expressions (JSON Schema 2020-12 core, section 6.4, which also asks for the ``u`` flag).
Python's ``re`` differs: it refuses ``(?<name>...)`` (it wants ``(?P<name>...)``), and
accepts what ECMA-262 lacks (``(?P<name>...)``, ``(?i)``, ``\\Z``, possessive ``a++``).
This module parses the ECMA-262 grammar itself and, from the parse, writes the regex
again in the form the structured-output backends read with ECMA-262 meaning:

- :func:`check` raises ValueError (naming the position) unless the text is an ECMA-262
  pattern. The grammar is the ``u``-flag one, plus the Annex B forms real schemas use
  that mean the same in every engine: identity escapes of punctuation (``\\-``, ``\\_``,
  ``\\ ``), a ``{`` / ``}`` / ``]`` that starts no quantifier or class, and a class escape
  as a range end (``[\\w-]``). Refused: escapes of letters ECMA-262 does not define
  (PCRE's ``\\A \\Z \\z \\h \\Q``...), legacy octal escapes, ``(?P<...>``, inline flags
  ``(?i)`` (ES2025's scoped ``(?i:...)`` is fine), atomic groups, possessive quantifiers,
  backreferences to groups that do not exist.
- :func:`features` names what is valid ECMA-262 but no backend can enforce: look-around,
  backreferences, word boundaries, the ``m`` modifier.
- :func:`to_backend` is the same language in the dialect both backends parse: groups
  non-capturing (xgrammar refuses some named groups), ``\\d \\w \\s .`` and classes as
  explicit code point ranges, escapes as ``\\u{...}``, case-insensitive ``(?i:...)``
  expanded, lazy quantifiers dropped (they match the same strings).
- :func:`to_python` is the same language for Python's ``re`` (tests and checks that
  validate outputs with ``jsonschema``, whose ``pattern`` uses ``re.search``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_SYNTAX_CHARS = frozenset("^$\\.*+?()[]{}|/")
_META = frozenset("\\^$.|?*+()[]{}")  # escaped when written for a backend
# Written as themselves inside a class (Rust-style engines give "&&", "--", "~~" meaning).
_CLASS_SAFE = frozenset(" !\"#%',/:;<=>@_`")
_CONTROL_ESCAPES = {"f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}
_DIGITS = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
]
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_FOLD_LIMIT = 4096  # ranges wider than this are not case-folded code point by code point

# Features of valid ECMA-262 patterns that no structured-output backend enforces.
LOOK_AROUND = "look-around"
PROPERTY_ESCAPE = "Unicode property escape"  # llguidance enforces it, xgrammar does not
BACKREFERENCE = "backreference"
WORD_BOUNDARY = "word boundary"
MULTILINE = "multiline modifier"


class EcmaRegexError(ValueError):
    """Not an ECMA-262 regular expression."""


# -- code point sets ------------------------------------------------------------------------
Ranges = tuple[tuple[int, int], ...]


def _normalize(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


def _without_surrogates(ranges: Ranges) -> Ranges:
    lo_s, hi_s = _SURROGATES
    out = []
    for lo, hi in ranges:
        if hi < lo_s or lo > hi_s:
            out.append((lo, hi))
            continue
        if lo < lo_s:
            out.append((lo, lo_s - 1))
        if hi > hi_s:
            out.append((hi_s + 1, hi))
    return tuple(out)


def _case_fold(ranges: Ranges) -> Ranges:
    """Add every code point's simple upper/lower case partner (for the ``i`` modifier)."""
    extra: list[tuple[int, int]] = list(ranges)
    for lo, hi in ranges:
        if hi - lo > _FOLD_LIMIT:
            continue
        for cp in range(lo, hi + 1):
            ch = chr(cp)
            for other in (ch.lower(), ch.upper()):
                if len(other) == 1 and other != ch:
                    extra.append((ord(other), ord(other)))
    return _normalize(extra)


@dataclass(frozen=True)
class _Set:
    """One character position: code point ranges, plus ``\\p{..}`` escapes we cannot
    expand (kept as text; ``negated`` applies to the whole class then)."""

    ranges: Ranges
    props: tuple[str, ...] = ()
    negated: bool = False


@dataclass(frozen=True)
class _Node:
    kind: str  # alt, seq, set, group, quant, assert, backref, flags
    items: tuple[Any, ...] = ()
    value: Any = None  # set: _Set; quant: (min, max); assert: kind; backref/flags: text
    name: str | None = None  # group: its name (named group) or "" (capturing) or None


@dataclass
class _State:
    text: str
    pos: int = 0
    groups: int = 0  # capturing groups seen so far
    names: set[str] = field(default_factory=set)
    total_groups: int = 0  # capturing groups in the whole pattern (a pre-pass)
    all_names: set[str] = field(default_factory=set)
    backrefs: list[tuple[int, str]] = field(default_factory=list)
    features: set[str] = field(default_factory=set)
    properties: bool = False  # uses \p{..} / \P{..}


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = _State(text)
        self.s.total_groups, self.s.all_names = _count_groups(text)

    # -- helpers --------------------------------------------------------------------------
    def error(self, message: str, pos: int | None = None) -> EcmaRegexError:
        where = self.s.pos if pos is None else pos
        return EcmaRegexError(f"{message} at position {where}")

    def peek(self, k: int = 0) -> str:
        i = self.s.pos + k
        return self.s.text[i] if i < len(self.s.text) else ""

    def eat(self, ch: str) -> bool:
        if self.s.text.startswith(ch, self.s.pos):
            self.s.pos += len(ch)
            return True
        return False

    def at_end(self) -> bool:
        return self.s.pos >= len(self.s.text)

    # -- grammar --------------------------------------------------------------------------
    def parse(self) -> _Node:
        node = self.disjunction(frozenset())
        if not self.at_end():
            raise self.error(f"unmatched {self.peek()!r}")
        for pos, name in self.s.backrefs:
            if name not in self.s.all_names:
                raise self.error(f"backreference to an undefined group name {name!r}", pos)
        return node

    def disjunction(self, flags: frozenset[str]) -> _Node:
        alternatives = [self.alternative(flags)]
        while self.eat("|"):
            alternatives.append(self.alternative(flags))
        return _Node("alt", tuple(alternatives))

    def alternative(self, flags: frozenset[str]) -> _Node:
        terms: list[_Node] = []
        while not self.at_end() and self.peek() not in "|)":
            terms.append(self.term(flags))
        return _Node("seq", tuple(terms))

    def term(self, flags: frozenset[str]) -> _Node:
        start = self.s.pos
        atom, quantifiable = self.atom(flags)
        quantifier = self.quantifier()
        if quantifier is None:
            return atom
        if not quantifiable:
            raise self.error("nothing to repeat", start)
        if self.quantifier_ahead():
            raise self.error("nothing to repeat (possessive or doubled quantifier)")
        return _Node("quant", (atom,), quantifier)

    def quantifier_ahead(self) -> bool:
        ch = self.peek()
        return ch in ("*", "+", "?") or (ch == "{" and self.braced_quantifier(peek=True) is not None)

    def quantifier(self) -> tuple[int, int | None] | None:
        ch = self.peek()
        if ch == "*":
            bounds: tuple[int, int | None] = (0, None)
            self.s.pos += 1
        elif ch == "+":
            bounds = (1, None)
            self.s.pos += 1
        elif ch == "?":
            bounds = (0, 1)
            self.s.pos += 1
        elif ch == "{":
            braced = self.braced_quantifier()
            if braced is None:
                return None
            bounds = braced
        else:
            return None
        self.eat("?")  # lazy: the same strings match
        return bounds

    def braced_quantifier(self, peek: bool = False) -> tuple[int, int | None] | None:
        """``{n}``, ``{n,}``, ``{n,m}`` at the cursor (consumed unless ``peek``), else None."""
        text, i = self.s.text, self.s.pos
        if i >= len(text) or text[i] != "{":
            return None
        j = i + 1
        while j < len(text) and text[j].isdigit() and text[j].isascii():
            j += 1
        if j == i + 1:
            return None
        low = int(text[i + 1 : j])
        high: int | None = low
        if j < len(text) and text[j] == ",":
            k = j + 1
            while k < len(text) and text[k].isdigit() and text[k].isascii():
                k += 1
            high = int(text[j + 1 : k]) if k > j + 1 else None
            j = k
        if j >= len(text) or text[j] != "}":
            return None
        if high is not None and high < low:
            raise self.error("numbers out of order in a {} quantifier", i)
        if not peek:
            self.s.pos = j + 1
        return low, high

    def atom(self, flags: frozenset[str]) -> tuple[_Node, bool]:
        """(node, quantifiable)."""
        ch = self.peek()
        if ch == "^" or ch == "$":
            self.s.pos += 1
            if "m" in flags:
                self.s.features.add(MULTILINE)
            return _Node("assert", value=ch), False
        if ch == "(":
            return self.group(flags)
        if ch == ".":
            self.s.pos += 1
            ranges = ((0, MAX_CODE_POINT),) if "s" in flags else _complement(
                _normalize(_LINE_TERMINATORS))
            return _Node("set", value=_Set(ranges)), True
        if ch == "[":
            return _Node("set", value=self.char_class(flags)), True
        if ch == "\\":
            return self.atom_escape(flags)
        if ch in ("*", "+", "?"):
            raise self.error("nothing to repeat")
        if ch == "{":
            if self.braced_quantifier(peek=True) is not None:
                raise self.error("nothing to repeat")
            self.s.pos += 1  # Annex B: a brace that starts no quantifier is itself
            return self.literal(ord("{"), flags), True
        # Annex B: a lone "]" or "}" is itself.
        return self.literal(self.code_point_at_cursor(), flags), True

    def code_point_at_cursor(self) -> int:
        """The code point at the cursor (a surrogate pair in the text is one)."""
        cp = ord(self.s.text[self.s.pos])
        self.s.pos += 1
        return cp

    def literal(self, cp: int, flags: frozenset[str]) -> _Node:
        ranges: Ranges = ((cp, cp),)
        if "i" in flags:
            ranges = _case_fold(ranges)
        return _Node("set", value=_Set(ranges))

    def group(self, flags: frozenset[str]) -> tuple[_Node, bool]:
        start = self.s.pos
        self.s.pos += 1  # "("
        if self.eat("?"):
            if self.eat(":"):
                inner = self.disjunction(flags)
                self.close_group(start)
                return _Node("group", (inner,)), True
            for marker, kind in (("=", "="), ("!", "!"), ("<=", "<="), ("<!", "<!")):
                if self.eat(marker):
                    self.s.features.add(LOOK_AROUND)
                    inner = self.disjunction(flags)
                    self.close_group(start)
                    # Annex B: a look-ahead may carry a quantifier.
                    return _Node("assert", (inner,), kind), kind in ("=", "!")
            if self.peek() == "<":
                self.s.pos += 1
                name = self.group_name()
                self.s.groups += 1
                self.s.names.add(name)
                inner = self.disjunction(flags)
                self.close_group(start)
                return _Node("group", (inner,), name=name), True
            return self.modifiers(start, flags)
        self.s.groups += 1
        inner = self.disjunction(flags)
        self.close_group(start)
        return _Node("group", (inner,), name=""), True

    def modifiers(self, start: int, flags: frozenset[str]) -> tuple[_Node, bool]:
        """ES2025 ``(?ims-ims:...)``; anything else after ``(?`` is not ECMA-262."""
        text = self.s.text
        j = self.s.pos
        while j < len(text) and text[j] in "ims":
            j += 1
        on, off = text[self.s.pos : j], ""
        if j < len(text) and text[j] == "-":
            k = j + 1
            while k < len(text) and text[k] in "ims":
                k += 1
            off, j = text[j + 1 : k], k
        if j >= len(text) or text[j] != ":" or not (on or off):
            what = text[start : start + 4]
            raise self.error(
                f"invalid group {what!r}: ECMA-262 has (?:...), (?=...), (?!...), (?<=...), "
                "(?<!...), (?<name>...) and (?ims-ims:...), not (?P<name>...), inline flags "
                "such as (?i) or atomic groups",
                start,
            )
        if len(set(on + off)) != len(on + off):
            raise self.error("a flag repeats in a modifier group", start)
        self.s.pos = j + 1
        if "m" in on + off:
            self.s.features.add(MULTILINE)
        inner = self.disjunction(frozenset((flags | set(on)) - set(off)))
        self.close_group(start)
        return _Node("group", (inner,)), True

    def close_group(self, start: int) -> None:
        if not self.eat(")"):
            raise self.error("unterminated group", start)

    def group_name(self) -> str:
        text, i = self.s.text, self.s.pos
        end = text.find(">", i)
        if end < 0:
            raise self.error("unterminated group name")
        name = text[i:end]
        if not name or not name.replace("$", "_").isidentifier():
            raise self.error(f"invalid group name {name!r}")
        self.s.pos = end + 1
        return name

    # -- escapes --------------------------------------------------------------------------
    def atom_escape(self, flags: frozenset[str]) -> tuple[_Node, bool]:
        start = self.s.pos
        self.s.pos += 1  # "\\"
        ch = self.peek()
        if not ch:
            raise self.error("\\ at end of pattern", start)
        if ch in "bB":
            self.s.pos += 1
            self.s.features.add(WORD_BOUNDARY)
            return _Node("assert", value="\\" + ch), False
        if ch.isdigit() and ch != "0":
            j = self.s.pos
            while j < len(self.s.text) and self.s.text[j].isdigit():
                j += 1
            number = int(self.s.text[self.s.pos : j])
            if number > self.s.total_groups:
                raise self.error(
                    f"\\{number} refers to a group that does not exist (legacy octal escapes "
                    "are not ECMA-262 with the u flag)",
                    start,
                )
            self.s.pos = j
            self.s.features.add(BACKREFERENCE)
            return _Node("backref", value=f"\\{number}"), True
        if ch == "k":
            self.s.pos += 1
            if not self.eat("<"):
                raise self.error("\\k must be followed by <name>", start)
            name = self.group_name()
            self.s.backrefs.append((start, name))
            self.s.features.add(BACKREFERENCE)
            return _Node("backref", value=f"\\k<{name}>", name=name), True
        char_set = self.class_escape_set(flags)
        if char_set is not None:
            return _Node("set", value=char_set), True
        cp = self.character_escape(start, in_class=False)
        return self.literal(cp, flags), True

    def class_escape_set(self, flags: frozenset[str]) -> _Set | None:
        """``\\d \\D \\s \\S \\w \\W \\p{..} \\P{..}`` (cursor after the backslash)."""
        ch = self.peek()
        simple = {"d": _DIGITS, "s": _SPACE, "w": _WORD}
        if ch.lower() in simple:
            self.s.pos += 1
            ranges = _normalize(simple[ch.lower()])
            if ch.isupper():
                ranges = _complement(ranges)
            return _Set(ranges)
        if ch in "pP":
            start = self.s.pos - 1
            self.s.pos += 1
            if not self.eat("{"):
                raise self.error(f"\\{ch} must be followed by {{property}}", start)
            end = self.s.text.find("}", self.s.pos)
            body = self.s.text[self.s.pos : end] if end >= 0 else ""
            if end < 0 or not body or not all(c.isalnum() or c in "_=" for c in body):
                raise self.error(f"invalid Unicode property escape \\{ch}{{...}}", start)
            self.s.pos = end + 1
            self.s.properties = True
            return _Set((), (f"\\{ch}{{{body}}}",))
        return None

    def character_escape(self, start: int, in_class: bool) -> int:
        """The code point of a CharacterEscape (cursor after the backslash)."""
        text = self.s.text
        ch = self.peek()
        if ch in _CONTROL_ESCAPES:
            self.s.pos += 1
            return _CONTROL_ESCAPES[ch]
        if ch == "c":
            letter = self.peek(1)
            if letter.isascii() and letter.isalpha():
                self.s.pos += 2
                return ord(letter) % 32
            raise self.error("\\c must be followed by an ASCII letter", start)
        if ch == "0":
            if self.peek(1).isdigit():
                raise self.error("legacy octal escapes are not ECMA-262 with the u flag", start)
            self.s.pos += 1
            return 0
        if ch == "x":
            digits = text[self.s.pos + 1 : self.s.pos + 3]
            if len(digits) == 2 and _is_hex(digits):
                self.s.pos += 3
                return int(digits, 16)
            raise self.error("\\x must be followed by two hex digits", start)
        if ch == "u":
            return self.unicode_escape(start)
        if ch == "-" and in_class:
            self.s.pos += 1
            return ord("-")
        if ch.isascii() and ch.isalnum():
            raise self.error(
                f"\\{ch} is not an ECMA-262 escape (Python/PCRE escapes such as \\A, \\Z, \\z "
                "are not JSON Schema regex syntax)",
                start,
            )
        # Identity escape: a syntax character, "/", or (Annex B) other punctuation.
        return self.code_point_at_cursor()

    def unicode_escape(self, start: int) -> int:
        text = self.s.text
        i = self.s.pos + 1  # after "u"
        if i < len(text) and text[i] == "{":
            end = text.find("}", i)
            digits = text[i + 1 : end] if end >= 0 else ""
            if not digits or not _is_hex(digits) or int(digits, 16) > MAX_CODE_POINT:
                raise self.error("invalid \\u{...} escape", start)
            self.s.pos = end + 1
            return int(digits, 16)
        digits = text[i : i + 4]
        if len(digits) != 4 or not _is_hex(digits):
            raise self.error("\\u must be followed by four hex digits or {hex}", start)
        cp = int(digits, 16)
        self.s.pos = i + 4
        # A surrogate pair written as two escapes is one code point (the u flag).
        if 0xD800 <= cp <= 0xDBFF and text.startswith("\\u", self.s.pos):
            low = text[self.s.pos + 2 : self.s.pos + 6]
            if len(low) == 4 and _is_hex(low) and 0xDC00 <= int(low, 16) <= 0xDFFF:
                self.s.pos += 6
                return 0x10000 + ((cp - 0xD800) << 10) + (int(low, 16) - 0xDC00)
        return cp

    # -- classes --------------------------------------------------------------------------
    def char_class(self, flags: frozenset[str]) -> _Set:
        start = self.s.pos
        self.s.pos += 1  # "["
        negated = self.eat("^")
        ranges: list[tuple[int, int]] = []
        props: list[str] = []
        while True:
            if self.at_end():
                raise self.error("unterminated character class", start)
            if self.eat("]"):
                break
            low = self.class_atom(flags)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                dash = self.s.pos
                self.s.pos += 1
                high = self.class_atom(flags)
                if isinstance(low, int) and isinstance(high, int):
                    if high < low:
                        raise self.error("range out of order in character class", dash)
                    ranges.append((low, high))
                    continue
                # Annex B: a class escape as a range end makes "-" a plain member.
                ranges.append((ord("-"), ord("-")))
                for atom in (low, high):
                    _add_class_atom(atom, ranges, props)
                continue
            _add_class_atom(low, ranges, props)
        result = _normalize(ranges)
        if "i" in flags:
            result = _case_fold(result)
        if props:
            return _Set(result, tuple(props), negated)
        return _Set(_complement(result) if negated else result)

    def class_atom(self, flags: frozenset[str]) -> int | _Set:
        if self.peek() != "\\":
            return self.code_point_at_cursor()
        start = self.s.pos
        self.s.pos += 1
        if self.eat("b"):
            return 0x08
        char_set = self.class_escape_set(flags)
        if char_set is not None:
            return char_set
        if self.peek() == "B" or (self.peek().isdigit() and self.peek() != "0") or self.peek() == "k":
            raise self.error(f"\\{self.peek()} is not allowed in a character class", start)
        return self.character_escape(start, in_class=True)


def _add_class_atom(atom: int | _Set, ranges: list[tuple[int, int]], props: list[str]) -> None:
    if isinstance(atom, int):
        ranges.append((atom, atom))
    else:
        ranges.extend(atom.ranges)
        props.extend(atom.props)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _count_groups(text: str) -> tuple[int, set[str]]:
    """Capturing groups and group names of ``text`` (a light pre-pass: backreferences
    may point forward)."""
    count, names, i, in_class = 0, set(), 0, False
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            if not text.startswith("?", i + 1):
                count += 1
            elif text.startswith("?<", i + 1) and text[i + 3 : i + 4] not in ("=", "!"):
                count += 1
                end = text.find(">", i)
                if end > 0:
                    names.add(text[i + 3 : end])
        i += 1
    return count, names


# -- public API -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedRegex:
    tree: _Node
    features: frozenset[str]
    properties: bool = False  # uses Unicode property escapes (\p{..})


@lru_cache(maxsize=4096)
def parse(pattern: str) -> ParsedRegex:
    """The parse of an ECMA-262 pattern; EcmaRegexError (a ValueError) if it is not one."""
    if not isinstance(pattern, str):
        raise EcmaRegexError(f"a regex must be a string, got {type(pattern).__name__}")
    parser = _Parser(pattern)
    try:
        tree = parser.parse()
    except RecursionError:  # thousands of nested groups: refused, not a crash
        raise EcmaRegexError("groups nested too deeply") from None
    return ParsedRegex(tree, frozenset(parser.s.features), parser.s.properties)


def check(pattern: str) -> None:
    """ValueError unless ``pattern`` is an ECMA-262 regular expression."""
    parse(pattern)


def is_valid(pattern: Any) -> bool:
    """For ``format: regex`` (a format checker): True for non-strings, like jsonschema."""
    if not isinstance(pattern, str):
        return True
    try:
        parse(pattern)
    except EcmaRegexError:
        return False
    return True


def features(pattern: str) -> frozenset[str]:
    """What of a valid pattern no backend enforces (:data:`LOOK_AROUND` ...)."""
    return parse(pattern).features


def enforcement_problem(pattern: str) -> str | None:
    """Why no structured-output backend can enforce ``pattern`` (not ECMA-262, or a
    feature none has, :data:`LOOK_AROUND` ...), or None."""
    try:
        unsupported = features(pattern)
    except ValueError as exc:
        return f"an invalid regex ({exc})"
    return ", ".join(sorted(unsupported)) if unsupported else None


def uses_properties(pattern: str) -> bool:
    """Whether a valid pattern has ``\\p{..}`` / ``\\P{..}`` (beyond xgrammar)."""
    return parse(pattern).properties


@lru_cache(maxsize=4096)
def to_backend(pattern: str) -> str:
    """``pattern`` in the regex dialect xgrammar and llguidance both parse, same language."""
    return _write(pattern, python=False)


@lru_cache(maxsize=4096)
def to_python(pattern: str) -> str:
    """``pattern`` for Python's ``re``, same language (``\\p{..}`` needs ``regex``)."""
    return _write(pattern, python=True)


def _write(pattern: str, python: bool) -> str:
    tree = parse(pattern).tree
    try:
        return _Writer(python=python).write(tree)
    except RecursionError:
        raise EcmaRegexError("groups nested too deeply") from None


class _Writer:
    def __init__(self, python: bool) -> None:
        self.python = python

    def write(self, node: _Node) -> str:
        kind = node.kind
        if kind == "alt":
            return "|".join(self.write(n) for n in node.items)
        if kind == "seq":
            return "".join(self.write(n) for n in node.items)
        if kind == "set":
            return self.char_set(node.value)
        if kind == "group":
            inner = self.write(node.items[0])
            if self.python and node.name:
                return f"(?P<{node.name.replace('$', '_')}>{inner})"
            if self.python and node.name == "":
                return f"({inner})"
            return f"(?:{inner})"
        if kind == "quant":
            low, high = node.value
            inner = self.write(node.items[0])
            if (low, high) == (0, None):
                q = "*"
            elif (low, high) == (1, None):
                q = "+"
            elif (low, high) == (0, 1):
                q = "?"
            elif high is None:
                q = f"{{{low},}}"
            elif low == high:
                q = f"{{{low}}}"
            else:
                q = f"{{{low},{high}}}"
            return inner + q
        if kind == "assert":
            what = node.value
            if what == "^":
                return "^"
            if what == "$":
                return r"\Z" if self.python else "$"
            if what in ("\\b", "\\B"):
                return f"(?a:{what})" if self.python else what
            return f"(?{what}{self.write(node.items[0])})"
        if kind == "backref":
            if self.python and node.name:
                return f"(?P={node.name.replace('$', '_')})"
            return node.value
        raise AssertionError(kind)

    def char_set(self, s: _Set) -> str:
        ranges = _without_surrogates(s.ranges)
        if len(s.props) == 1 and not ranges:
            prop = s.props[0]
            if s.negated:  # [^\p{L}] is \P{L}, [^\P{L}] is \p{L}
                prop = prop[0] + ("P" if prop[1] == "p" else "p") + prop[2:]
            return prop
        if s.props:
            body = "".join(self.range_text(lo, hi) for lo, hi in ranges) + "".join(s.props)
            return f"[{'^' if s.negated else ''}{body}]"
        if not ranges:
            return r"[^\s\S]" if not self.python else r"(?!)"
        if ranges == _without_surrogates(((0, MAX_CODE_POINT),)):
            return r"[\s\S]"
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return self.literal(ranges[0][0])
        outside = _without_surrogates(_complement(ranges))
        if ranges[0][0] == 0 and len(outside) < len(ranges):
            return "[^" + "".join(self.range_text(lo, hi) for lo, hi in outside) + "]"
        return "[" + "".join(self.range_text(lo, hi) for lo, hi in ranges) + "]"

    def range_text(self, lo: int, hi: int) -> str:
        if lo == hi:
            return self.class_char(lo)
        if hi == lo + 1:
            return self.class_char(lo) + self.class_char(hi)
        return f"{self.class_char(lo)}-{self.class_char(hi)}"

    def class_char(self, cp: int) -> str:
        ch = chr(cp)
        if (ch.isascii() and ch.isalnum()) or ch in _CLASS_SAFE:
            return ch
        return self.escape(cp)

    def literal(self, cp: int) -> str:
        ch = chr(cp)
        if ch in _META or (self.python and ch.isascii() and not ch.isalnum() and cp >= 0x20):
            return "\\" + ch
        if 0x20 <= cp < 0x7F:
            return ch
        return self.escape(cp)

    def escape(self, cp: int) -> str:
        if not self.python:
            return f"\\u{{{cp:X}}}"
        if cp <= 0xFF:
            return f"\\x{cp:02x}"
        if cp <= 0xFFFF:
            return f"\\u{cp:04x}"
        return f"\\U{cp:08x}"


def schema_patterns_to_python(schema: Any) -> Any:
    """A copy of a JSON schema whose ``pattern`` / ``patternProperties`` regexes are
    written for Python's ``re`` (so ``jsonschema`` validates with ECMA-262 meaning)."""
    if isinstance(schema, list):
        return [schema_patterns_to_python(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str) and is_valid(value):
            out[key] = to_python(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {
                (to_python(k) if is_valid(k) else k): schema_patterns_to_python(v)
                for k, v in value.items()
            }
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value
        else:
            out[key] = schema_patterns_to_python(value)
    return out
