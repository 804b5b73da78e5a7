"""`python -m functrain.main --config=configs/gpt.py`: the trainer's command line.

The trainer lives in `functrain.trainer` (its entry point: `functrain.trainer.main`); this module
keeps the command short.
"""

from functrain.trainer.main import check_config, export_hf, main, run, train

__all__ = ["check_config", "export_hf", "main", "run", "train"]

if __name__ == "__main__":
    run()
