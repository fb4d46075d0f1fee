"""``python -m services.sampler --config configs/cartpole.yaml``: wire settings to the Sampler."""

from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: torch and gymnasium are imported only now."""
    import torch

    from services.sampler.service import Sampler

    torch.set_num_threads(settings.sampler.torch_threads)
    return Sampler(settings), None


def main() -> None:
    run_main("sampler", build)


if __name__ == "__main__":
    main()
