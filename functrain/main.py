"""`python -m functrain.main --config=configs/gpt.py`: the trainer's command line.

The trainer lives in `functrain.trainer` (its entry point: `functrain.trainer.main`); this module
keeps the command short. Its names load on first use, so a process that imports this module as its
`__main__` (a spawned worker: the tokenizing pool's) loads neither torch nor absl.
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.trainer.main import check_config, export_hf, main, run, train

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)

if __name__ == "__main__":
    from functrain.trainer.main import run

    run()
