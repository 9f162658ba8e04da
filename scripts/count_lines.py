#!/usr/bin/env python3
"""Count code lines: no blank lines, no comments, no docstrings (Python via tokenize; C++/CUDA by stripping comments).

Usage: python scripts/count_lines.py [ROOT]   -> one line per file, then totals for the package's Python and csrc/.
"""
import io
import pathlib
import re
import sys
import tokenize


def python_code_lines(text: str) -> int:
    lines: set[int] = set()
    prev = tokenize.INDENT
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = tok.type
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                    tokenize.ENCODING, tokenize.ENDMARKER):
            if kind in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                prev = kind
            continue
        # A string that starts a statement is a docstring (or a bare string): not code.
        if kind == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            prev = None
            continue
        prev = kind
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def cpp_code_lines(text: str) -> int:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return sum(1 for line in text.splitlines() if line.split("//", 1)[0].strip())


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    py = {p: python_code_lines(p.read_text()) for p in sorted((root / "afd_ext").rglob("*.py"))}
    cc = {p: cpp_code_lines(p.read_text()) for p in sorted((root / "csrc").rglob("*"))
          if p.suffix in (".cpp", ".cu", ".h", ".cuh")}
    for group in (py, cc):
        for p, n in group.items():
            print(f"{n:6d}  {p.relative_to(root)}")
    print(f"{sum(py.values()):6d}  TOTAL package Python (afd_ext/)")
    print(f"{sum(cc.values()):6d}  TOTAL C++/CUDA (csrc/)")


if __name__ == "__main__":
    main()
