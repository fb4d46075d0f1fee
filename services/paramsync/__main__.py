"""``python -m services.paramsync --config configs/cartpole.yaml``: wire settings to Paramsync."""

from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: torch and gymnasium are imported only now."""
    import torch

    from services.paramsync.service import Paramsync

    torch.set_num_threads(1)
    return Paramsync(settings), None


def main() -> None:
    run_main("paramsync", build)


if __name__ == "__main__":
    main()
