"""momlab: a workbench for memory optimization methods (MOMs) in training.

The public API (docs/API.md, kept true by tests/test_api.py; docs/ARCHITECTURE.md for the module chain).
Some functions share their module's name (`measure`, `sweep`, `estimate`):
the package attribute is the function; inside momlab, import from the module
path (`from momlab.measure import measure`), never `from momlab import
measure`. `momlab.moms` is the MOM package and is also callable:
`momlab.moms()` lists the atomic MOMs.
"""

__version__ = "0.1.0"

from momlab import moms  # noqa: E402  (callable: momlab.moms() -> names)
from momlab.catalog import models, tiny  # noqa: E402
from momlab.errors import OutOfMemory  # noqa: E402
from momlab import estimate, gpus  # noqa: E402  (callable modules: momlab.estimate(...), momlab.gpus())
from momlab.measure import measure  # noqa: E402
from momlab.moms import apply  # noqa: E402
from momlab.record import Measurement  # noqa: E402
from momlab.search import Search, max_batch_size, max_model_size  # noqa: E402
from momlab.sweep import sweep  # noqa: E402
from momlab.units import format_bytes, parse_bytes  # noqa: E402
from momlab.usermodel import ConfigModel, UserModel  # noqa: E402
from momlab.workload import Workload, build  # noqa: E402

__all__ = [
    "ConfigModel", "OutOfMemory", "Measurement", "Search", "UserModel", "Workload", "apply", "build", "estimate",
    "format_bytes", "gpus",
    "max_batch_size",
    "max_model_size", "measure", "models", "moms", "parse_bytes", "sweep", "tiny", "__version__",
]
