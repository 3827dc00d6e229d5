import sys

from torch_precompile.cli import main

sys.exit(main())
