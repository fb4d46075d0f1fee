"""``python -m services.sampler --config configs/cartpole.yaml``: wire settings to the Sampler."""

import importlib.util
from typing import Any

from shared.service import run_main
from shared.settings import Settings

TORCH_MISSING = ("sampler.inference='torch' needs PyTorch, which is not installed here: pip install 'flywheel[train]' "
                 "(in a checkout: pip install -e '.[train]'), or set sampler.inference auto (no torch needed)")
"""The one line a sampler that needs torch and lacks it stops with (the torch-free sampler image has none)."""


def installation_problem(settings: Settings) -> str | None:
    """What this installation lacks for ``settings``: torch, only for ``sampler.inference: torch`` (auto, numpy and
    onnx run without it: numpy for the MLP, onnxruntime with a graph built without torch for the CNNs)."""
    if settings.sampler.inference != "torch":
        return None
    try:
        found = importlib.util.find_spec("torch") is not None
    except ValueError:  # sys.modules["torch"] is None: imports of torch are refused in this process
        found = False
    return None if found else TORCH_MISSING


def build(settings: Settings) -> tuple[Any, None]:
    """Runs after the settings validated: gymnasium and the service are imported only now (the sampler
    imports torch only for ``sampler.inference: torch``: the MLP runs in numpy, shared/rl/policy_np.py, and CNNs
    in onnxruntime, shared/rl/policy_onnx.py)."""
    from services.sampler.service import Sampler

    return Sampler(settings), None


def main() -> None:
    run_main("sampler", build, problem=installation_problem)


if __name__ == "__main__":
    main()
