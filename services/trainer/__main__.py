"""``python -m services.trainer --config configs/cartpole.yaml``: wire settings to the Trainer."""

from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: torch and gymnasium are imported only now."""
    import torch

    from services.trainer.service import Trainer

    torch.set_num_threads(settings.trainer.torch_threads)
    return Trainer(settings), None


def main() -> None:
    run_main("trainer", build)


if __name__ == "__main__":
    main()
