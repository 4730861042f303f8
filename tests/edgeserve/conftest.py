import pytest

from gpu_node import model_store


@pytest.fixture(scope="session")
def smollm2_cached():
    return model_store.pull("smollm2", quiet=True)
