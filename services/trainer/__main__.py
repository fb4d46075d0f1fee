"""``python -m services.trainer --config configs/cartpole.yaml``: wire settings to the Trainer."""

import asyncio

from shared.service import entrypoint


def main() -> None:
    settings = entrypoint("trainer")  # validates config before torch/gymnasium are imported
    import torch

    from services.trainer.service import Trainer
    from shared.service import serve

    torch.set_num_threads(settings.trainer.torch_threads)
    async def amain() -> None:
        await serve(Trainer(settings), settings)  # aiokafka clients need the running loop

    asyncio.run(amain())


if __name__ == "__main__":
    main()
