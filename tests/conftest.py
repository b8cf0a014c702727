import numpy as np
import pytest

import aiohixl


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
async def agent():
    async with aiohixl.Agent("test") as a:
        yield a
