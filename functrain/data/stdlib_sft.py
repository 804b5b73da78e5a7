"""A supervised set every Python has: the standard library's functions, (signature -> docstring summary).

Internals: docs/internals.md "functrain.data.stdlib_sft".

Example:
    >>> path = builtin_source("stdlib:messages", "runs/sft/data")   # runs/sft/data/stdlib-sft/messages.jsonl
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

from functrain.data.documents import stdlib_files
from functrain.data.errors import DataError
from functrain.data.token_files import atomic_write

__all__ = ["BUILTIN", "MAX_SIGNATURE", "MAX_SUMMARY", "builtin_format", "builtin_source", "stdlib_pairs"]

BUILTIN = {
    "stdlib:messages": "messages",
    "stdlib:prompt_completion": "prompt_completion",
    "stdlib:preference": "preference",
}
"""The built-in supervised sources and their formats ("stdlib:preference": the question of "stdlib:messages",
its function's summary chosen, the summary of a function half the list away rejected)."""

MAX_SUMMARY, MAX_SIGNATURE = 160, 80  # the longest docstring summary and signature kept (characters)


def builtin_format(path: str) -> str | None:
    """The format of a built-in source name, or None for any other path."""
    return BUILTIN.get(path)


def _summary(doc: str) -> str | None:
    """The docstring's first paragraph on one line, or None when too long or empty."""
    first = doc.strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in first.splitlines()).strip()
    return text if text and len(text) <= MAX_SUMMARY else None


def _functions(tree: ast.Module):
    """(qualified name within the module, def node) of public functions and methods of public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


def stdlib_pairs(root: str | Path | None = None) -> list[dict]:
    """Every (module, name, signature, summary) of the stdlib's documented public functions, in order.

    Args:
      root: the stdlib directory (default this Python's).

    Returns:
      [{"module", "name", "signature", "summary"}], in file order then source order.

    Example:
      >>> next(p for p in stdlib_pairs() if p["module"] == "json" and p["name"] == "dumps")["summary"][:9]
      'Serialize'
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_files(root):
        rel = path.relative_to(root).with_suffix("").as_posix()
        parts = rel.split("/")
        if (
            "test" in parts
            or parts[0] in ("idlelib", "lib2to3", "turtledemo")
            or any(x.startswith("_") for x in parts if x != "__init__")
        ):
            continue
        module = rel.removesuffix("/__init__").replace("/", ".")
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for name, node in _functions(tree):
            doc = ast.get_docstring(node)
            summary = _summary(doc) if doc else None
            args = ast.unparse(node.args)
            if summary and len(args) <= MAX_SIGNATURE:
                out.append(
                    {
                        "module": module,
                        "name": name,
                        "signature": f"{name.rpartition('.')[2]}({args})",
                        "summary": summary,
                    }
                )
    return out


def _record(pair: dict, fmt: str, other: dict | None = None) -> dict:
    """One function as a record of `fmt` (`other`: the function whose summary a preference record rejects)."""
    if fmt in ("messages", "preference"):
        owner = pair["name"].rpartition(".")[0]
        qualified = ".".join(x for x in (pair["module"], owner) if x)
        question = {"role": "user", "content": f"What does {qualified}.{pair['signature']} do?"}
        answers = [{"role": "assistant", "content": p["summary"]} for p in (pair, other or pair)]
        if fmt == "preference":
            return {"prompt": [question], "chosen": answers[:1], "rejected": answers[1:]}
        return {"messages": [question, answers[0]]}
    return {"prompt": f'def {pair["signature"]}:\n    """', "completion": pair["summary"] + '"""'}


def builtin_source(path: str, cache_dir: str | os.PathLike) -> str:
    """The jsonl file of a built-in source (written once into `cache_dir`), or `path` itself for any other.

    Args:
      path: the config's `data.path`.
      cache_dir: the run's data cache.

    Returns:
      A path `functrain.data.sft` reads.

    Raises:
      DataError: the stdlib holds no documented function (one line).

    Example:
      >>> builtin_source("stdlib:prompt_completion", "runs/sft/data")
      'runs/sft/data/stdlib-sft-py3.11.9/prompt_completion.jsonl'
    """
    fmt = builtin_format(path)
    if fmt is None:
        return path
    out = Path(cache_dir) / f"stdlib-sft-py{sys.version.split()[0]}" / f"{fmt}.jsonl"
    if not out.exists():
        pairs = stdlib_pairs()
        if not pairs:
            raise DataError(
                f"data.path={path!r}: this Python's standard library has no documented function to learn "
                "from; point data.path at your own jsonl"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        half = len(pairs) // 2
        text = "".join(json.dumps(_record(p, fmt, pairs[(i + half) % len(pairs)])) + "\n" for i, p in enumerate(pairs))
        atomic_write(out, lambda f: f.write(text.encode()))
    return str(out)
