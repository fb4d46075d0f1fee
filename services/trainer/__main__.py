"""``python -m services.trainer --config configs/cartpole.yaml``: wire settings to the Trainer."""

from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: torch and gymnasium are imported only now (the trainer sets its torch
    threads itself: ``trainer.torch_threads``, services/trainer/compute.py)."""
    from services.trainer.service import Trainer

    return Trainer(settings), None


def main() -> None:
    run_main("trainer", build)


if __name__ == "__main__":
    main()
