"""``python -m services.sampler --config configs/cartpole.yaml``: wire settings to the Sampler."""

from typing import Any

from shared.service import run_main
from shared.settings import Settings


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: gymnasium and the service are imported only now (the sampler
    never imports torch: its inference is numpy, shared/rl/policy_np.py)."""
    from services.sampler.service import Sampler

    return Sampler(settings), None


def main() -> None:
    run_main("sampler", build)


if __name__ == "__main__":
    main()
