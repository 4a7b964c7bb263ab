import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models: a second thread only adds synchronization, and on a busy
    2-core machine it makes timings erratic (docs/LOG.md: 16x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
