"""Answer extraction and comparison for math tasks: GSM8K-style final numbers and MATH-style \\boxed{}.

Rules and their sources:
- GSM8K: the reference answer is the number after ``####`` (openai/grade-school-math). From a
  completion we take the first ``#### <number>`` (lm-eval-harness "strict-match"), else the last number
  in the text ("flexible-extract"); commas, ``$`` and a trailing ``.`` are stripped; comparison is exact
  on rationals (``18`` == ``18.00``).
- MATH: the answer is the content of the last ``\\boxed{...}`` (braces balanced), normalised after
  Hendrycks et al.'s ``is_equiv`` (strip spaces, ``\\left``/``\\right``, ``\\!``, units, ``^\\circ``, ``$``,
  ``dfrac``/``tfrac``→``frac``, ``\\frac12``→``\\frac{1}{2}``, a short ``x =`` prefix), plus a numeric
  check so ``0.5`` equals ``\\frac{1}{2}``.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"


def parse_number(text: str) -> Fraction | None:
    """Return ``text`` as an exact rational (commas, ``$``, ``%``, spaces, trailing ``.`` removed), or None."""
    t = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".").rstrip("%")
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_number(completion: str) -> str | None:
    """Return the first number after ``####`` in ``completion``, else its last number, else None."""
    m = re.search(r"####\s*(" + _NUMBER + ")", completion)
    if m:
        return m.group(1)
    found = re.findall(_NUMBER, completion)
    return found[-1] if found else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Return True if ``a`` and ``b`` parse to the same rational number (False if either does not parse)."""
    if a is None or b is None:
        return False
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


# --- MATH \boxed{} answers --------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces handled), or None.

    ``\\boxed 5`` (no braces) returns ``5``. An unclosed brace returns None.
    """
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    m = re.match(r"\\(?:boxed|fbox)\s*([^{\s$][^$\s]*)", rest)
    if m:  # "\boxed 5"
        return m.group(1)
    start = rest.find("{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[start + 1 : i]
    return None


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt\s*(\d+)", r"\\sqrt{\1}", s)


def normalize_math(answer: str) -> str:
    """Return a canonical string for a MATH answer (rules in the module docstring)."""
    s = answer.strip().replace("\n", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    # a number followed by a unit in \text{...} / \mbox{...}: drop the unit
    s = re.sub(r"(\d)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z ]*\}(\^\d)?\s*$", r"\1", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.replace(" ", "").replace("\\ ", "")
    s = s.rstrip(".")
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:  # "x=5" -> "5"
        s = s.split("=")[1]
    s = _fix_fracs(s)
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)  # ".5" -> "0.5"
    return s


def math_value(s: str) -> Fraction | None:
    """Return the exact value of a normalised simple numeric answer (int, decimal, a/b, \\frac{a}{b}), or None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * Fraction(num, den)
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.split("/")
        return None if int(den) == 0 else Fraction(int(num), int(den))
    if re.fullmatch(r"-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?", s):
        return Fraction(s.replace(",", ""))
    return None


def math_equal(pred: str | None, ref: str | None) -> bool:
    """Return True if two MATH answers are equal after normalisation, or numerically equal."""
    if pred is None or ref is None:
        return False
    a, b = normalize_math(pred), normalize_math(ref)
    if a == b:
        return True
    x, y = math_value(a), math_value(b)
    return x is not None and y is not None and x == y
