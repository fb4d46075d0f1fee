"""``python -m services.sampler --config configs/cartpole.yaml``: wire settings to the Sampler."""

import asyncio

from shared.service import entrypoint


def main() -> None:
    settings = entrypoint("sampler")  # validates config before torch/gymnasium are imported
    import torch

    from services.sampler.service import Sampler
    from shared.service import serve

    torch.set_num_threads(settings.sampler.torch_threads)
    async def amain() -> None:
        await serve(Sampler(settings), settings)  # aiokafka clients need the running loop

    asyncio.run(amain())


if __name__ == "__main__":
    main()
