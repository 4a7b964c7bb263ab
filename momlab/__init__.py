"""momlab: a workbench for memory optimization methods (MOMs) in training.

The public API (../shared/API.md; docs/ARCHITECTURE.md for the module chain).
Some functions share their module's name (`measure`, `sweep`, `estimate`,
`moms`): the package attribute is the function; inside momlab, import from
the module path (`from momlab.measure import measure`), never `from momlab
import measure`.
"""

__version__ = "0.1.0"

from momlab.catalog import models, tiny  # noqa: E402
from momlab.errors import OutOfMemory  # noqa: E402
from momlab.measure import measure  # noqa: E402
from momlab.record import Measurement  # noqa: E402
from momlab.units import format_bytes, parse_bytes  # noqa: E402
from momlab.workload import Workload, build  # noqa: E402

__all__ = [
    "OutOfMemory", "Measurement", "Workload", "build", "format_bytes", "measure", "models", "parse_bytes", "tiny",
    "__version__",
]
