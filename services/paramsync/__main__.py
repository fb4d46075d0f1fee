"""``python -m services.paramsync --config configs/cartpole.yaml``: wire settings to Paramsync."""

import asyncio

from shared.service import entrypoint


def main() -> None:
    settings = entrypoint("paramsync")  # validates config before torch/gymnasium are imported
    import torch

    from services.paramsync.service import Paramsync
    from shared.service import serve

    torch.set_num_threads(1)
    async def amain() -> None:
        await serve(Paramsync(settings), settings)  # aiokafka clients need the running loop

    asyncio.run(amain())


if __name__ == "__main__":
    main()
