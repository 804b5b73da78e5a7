"""A tokenizing worker process: `python -m functrain.data.token_worker`, started by
`functrain.data.token_cache` (one per core), never by hand.

It reads one JSON task per line on stdin (a shard to tokenize) and answers on stdout with JSON
lines: `{"bytes": n}` as it reads, then `{"done": marker}` or `{"error": message}`. It imports no
torch: a fresh interpreter with numpy, tokenizers and pyarrow only.
"""

from __future__ import annotations

import json
import sys

from functrain.data.errors import DataError
from functrain.data.token_cache import tokenize_shard


def main() -> None:
    """Serves tasks until stdin closes."""
    out = sys.stdout

    def report(nbytes: int) -> None:
        out.write(json.dumps({"bytes": nbytes}) + "\n")
        out.flush()

    for line in sys.stdin:
        try:
            reply = {"done": tokenize_shard(json.loads(line), report)}
        except DataError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the parent raises it as one line naming the shard
            reply = {"error": f"{json.loads(line)[0]}: tokenizing failed ({type(exc).__name__}: {exc})"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
