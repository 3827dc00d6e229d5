"""torch-precompile: capture a whole PyTorch computation once, load it anywhere at once.

    python_code, cache = precompile(fn, model, x)     # build time
    run = precompile.load(python_code, cache)         # any later process
    result = run(model, x)
"""

__version__ = "0.7.0"

from torch_precompile.api import precompile
from torch_precompile.errors import PrecompileError

__all__ = ["PrecompileError", "__version__", "precompile"]
