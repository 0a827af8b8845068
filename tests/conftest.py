import pytest

from pyro_cvi.datasets import data_dir


@pytest.fixture(scope="session")
def shared_data():
    """The benchmark data folder; tests that need it are skipped when it is absent."""
    try:
        return data_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
