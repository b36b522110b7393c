"""A bound on what a target_modules regex may cost to match (PEFT matches it with re.fullmatch
against every module path of the base, and so does the store).

Python's re backtracks: a quantifier over a group that can match the same text in more than
one way (`(.|.)*`, `(a*)*`) takes time exponential in the subject's length, and k quantifiers
in a row that can each take any length (`.*.*.*`) take time ~ n^k on a failing subject. The
subjects here are the base's module paths (`model.layers.31.self_attn.q_proj`, about 35
characters, ~7 a layer), so a pattern is accepted when its parse tree has:
- no quantifier over a group holding another quantifier, an alternation of more than single
  characters (single-character alternations are character classes), or a backreference;
- no backreferences or conditionals anywhere;
- at most MAX_DEGREE variable-length quantifiers along any one path through the pattern.
Then matching is polynomial of degree MAX_DEGREE at most: a few hundred module paths take
well under a second whatever the pattern. Ordinary PEFT patterns
(`.*\\.(q_proj|v_proj)`, `model\\.layers\\.(0|1|2)\\..*_proj`) have degree 1 or 2.
"""
from __future__ import annotations

try:                                        # Python 3.11+
    from re import _constants as _sre, _parser as _sre_parse
except ImportError:                         # pragma: no cover - Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

MAX_DEGREE = 4
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT} | (
    {_sre.POSSESSIVE_REPEAT} if hasattr(_sre, "POSSESSIVE_REPEAT") else set())
_REFS = {_sre.GROUPREF, _sre.GROUPREF_EXISTS} | (
    {_sre.GROUPREF_IGNORE} if hasattr(_sre, "GROUPREF_IGNORE") else set())


class TooCostly(ValueError):
    """The pattern may take too long to match; the message says why."""


def check_cost(pattern: str) -> None:
    """Raise TooCostly if `pattern` may backtrack past the bound above (re.error if it does not
    parse)."""
    degree = _degree(_sre_parse.parse(pattern), inside_repeat=False)
    if degree > MAX_DEGREE:
        raise TooCostly(f"{degree} variable-length quantifiers in a row (at most "
                        f"{MAX_DEGREE})")


def _children(op, av) -> list:
    """The sub-patterns of one parsed item."""
    if op in _REPEATS:
        return [av[2]]
    if op is _sre.SUBPATTERN:
        return [av[3]]
    if op is _sre.BRANCH:
        return list(av[1])
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if getattr(_sre, "ATOMIC_GROUP", None) is op:
        return [av]
    return []


def _degree(items, inside_repeat: bool) -> int:
    """The most variable-length quantifiers along one path through `items` (a sequence)."""
    total = 0
    for op, av in items:
        if op in _REFS:
            raise TooCostly("backreferences are not accepted")
        if op in _REPEATS:
            lo, hi, body = av
            if inside_repeat:
                raise TooCostly("a quantifier inside a quantified group")
            if _has_branch(body):
                raise TooCostly("a quantifier over an alternation")
            total += (lo != hi) + _degree(body, inside_repeat=True)
        elif op is _sre.BRANCH:
            total += max(_degree(b, inside_repeat) for b in av[1])
        else:
            total += sum(_degree(sub, inside_repeat) for sub in _children(op, av))
    return total


def _has_branch(items) -> bool:
    return any(op is _sre.BRANCH or any(_has_branch(sub) for sub in _children(op, av))
               for op, av in items)
