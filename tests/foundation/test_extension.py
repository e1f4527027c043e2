"""The C++ extension is built at install time and registers its ops with torch.library."""
import torch


def test_extension_loads_and_registers_ops():
    import hyper_parallel._C  # noqa: F401 - loading registers torch.ops.hyper_parallel.*

    info = torch.ops.hyper_parallel.engine_info()
    assert info.startswith("hyper_parallel C++ engine")
