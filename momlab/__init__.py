"""momlab: a workbench for memory optimization methods (MOMs) in training.

The public API (see docs/ARCHITECTURE.md for the module chain):
models, moms, build, measure, Measurement, OutOfMemory, apply, tiny,
max_batch_size, max_model_size, sweep, estimate, gpus.
"""

from momlab.errors import OutOfMemory
from momlab.record import Measurement
from momlab.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = ["OutOfMemory", "Measurement", "format_bytes", "parse_bytes", "__version__"]
