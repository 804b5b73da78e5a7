"""`python -m functrain.main --config=configs/gpt.py`: the trainer's command line.

The trainer lives in `functrain.trainer` (its entry point: `functrain.trainer.main`); this module
keeps the command short. Its names load on first use, so a process that imports this module as its
`__main__` (a spawned worker: the tokenizing pool's) loads neither torch nor absl.
"""

__all__ = ["check_config", "export_hf", "main", "run", "train"]


def __getattr__(name: str):
    if name in __all__:
        from functrain.trainer import main as trainer_main

        return getattr(trainer_main, name)
    raise AttributeError(f"module 'functrain.main' has no attribute {name!r}")


if __name__ == "__main__":
    from functrain.trainer.main import run

    run()
