import sys

from mmpipe.app.bench.main import main

sys.exit(main())
