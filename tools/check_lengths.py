#!/usr/bin/env python3
"""The house's length rules (docs/architecture.md): no file in src/ or tools/ over 800 lines, and
no function over 120 lines unless a comment at its top says why it is long ("long because ...").

Run from anywhere: tools/check_lengths.py [ROOT] (ROOT: a tree with src/ and tools/, default this
one; the tests point it at a copy with a planted violation to see that each rule fires).

Functions are found the way the project writes them: the name line starts at column 0, the body
opens with `{` and closes with `}` at column 0 (a heuristic, not a C parser). A function's reason
counts when "long because" (any case) stands in the comment just above it or in its first lines.
"""
import os
import re
import sys

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120
SUFFIXES = (".c", ".h", ".cpp")
# A line that can start a function definition: a name followed by "(" at column 0, not a type,
# a declaration of data or a preprocessor line.
START = re.compile(r"^(?!typedef|struct|enum|union|static const|#)[A-Za-z_][\w \*]*?\b(\w+)\s*\(")
REASON = re.compile(r"long because", re.IGNORECASE)
# How far above the name line and below the opening brace the reason may stand.
REASON_ABOVE, REASON_BELOW = 15, 3


def source_files(root):
    for top in ("src", "tools"):
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)


def long_functions(lines):
    """(name, first line number, length, has a reason) of each function over the limit."""
    found = []
    candidate = None
    start = None
    for i, line in enumerate(lines):
        if start is None:
            m = START.match(line)
            if m:
                candidate = (i, m.group(1))
            if line.startswith("{") and candidate is not None:
                start = (candidate[0], candidate[1], i)
        elif line.startswith("}"):
            first, name, brace = start
            length = i - first + 1
            if length > MAX_FUNCTION_LINES:
                found.append((name, first + 1, length, has_reason(lines, first, brace)))
            start = None
            candidate = None
    return found


def has_reason(lines, first, brace):
    """Whether "long because" stands in the comment just above the function's name line (up to
    REASON_ABOVE lines) or between its name line and REASON_BELOW lines into its body."""
    above = []
    for j in range(first - 1, max(-1, first - REASON_ABOVE - 1), -1):
        text = lines[j].strip()
        if not text or not (text.startswith(("/*", "*", "//")) or text.endswith("*/")):
            break
        above.append(text)
    top = lines[first:brace + REASON_BELOW + 1]
    return any(REASON.search(t) for t in above + top)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    if not os.path.isdir(os.path.join(root, "src")):
        print(f"check_lengths.py: no src/ in {root}")
        return 2
    bad = 0
    reasoned = []
    for path in source_files(root):
        rel = os.path.relpath(path, root)
        with open(path, errors="replace") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if len(lines) > MAX_FILE_LINES:
            print(f"FAIL: {rel} has {len(lines)} lines (more than {MAX_FILE_LINES}): split it by job")
            bad = 1
        for name, line, length, reason in long_functions(lines):
            if reason:
                reasoned.append(f"  {rel}:{line} {name}: {length} lines (says why it is long)")
                continue
            print(f"FAIL: {rel}:{line} {name} has {length} lines (more than {MAX_FUNCTION_LINES}) "
                  f"and no \"long because\" comment at its top")
            bad = 1
    if reasoned:
        print(f"functions over {MAX_FUNCTION_LINES} lines that say why:")
        print("\n".join(reasoned))
    if not bad:
        print(f"OK: no file over {MAX_FILE_LINES} lines and no function over "
              f"{MAX_FUNCTION_LINES} lines without a reason")
    return bad


if __name__ == "__main__":
    sys.exit(main())
