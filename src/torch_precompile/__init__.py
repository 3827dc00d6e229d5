"""torch-precompile: capture a whole PyTorch computation once, load it anywhere at once.

    python_code, cache = precompile(fn, model, x)     # build time
    run = precompile.load(python_code, cache)         # any later process
    result = run(model, x)

or, inside your own loop, writing the pair to files:

    with capture(fn, artifact_path="step.py") as cap:
        result = cap(model, x)
    run = precompile.load("step.py")
"""

__version__ = "0.16.0"

from torch_precompile.api import precompile
from torch_precompile.capture_session import capture
from torch_precompile.errors import PrecompileError

load = precompile.load
__all__ = ["PrecompileError", "__version__", "capture", "load", "precompile"]
